"""``sk.verify``'s arguments, checked before any process starts: each error names the argument
and what would be valid (:class:`~shardkit.plan.UsageError`)."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..families import family_of
from ..plan import Plan, UsageError
from .world import LocalWorld


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_picklable(**objects: Any) -> None:
    for name, obj in objects.items():
        try:
            pickle.dumps(obj)
        except Exception as exc:
            raise UsageError(f"verify({name}=...): {name} cannot be pickled ({exc}); it is sent to every process, so "
                             f"define it as a top-level function in an importable module (not a lambda or a local "
                             f"function)") from None


def check_steps(steps: Any) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise UsageError(f"verify(steps={steps!r}): steps is the number of optimizer steps to compare, an int >= 1")


def check_optimizer(optimizer: Any, valid: tuple[str, ...]) -> None:
    if optimizer not in valid:
        raise UsageError(f"verify(optimizer={optimizer!r}): unknown optimizer; valid: {', '.join(map(repr, valid))}")


def check_lr(lr: Any) -> None:
    if not is_finite_number(lr) or lr <= 0:
        raise UsageError(f"verify(lr={lr!r}): the learning rate must be a finite number > 0")


def checked_tolerances(overrides: Any, valid: Mapping[str, float]) -> dict[str, float]:
    """The caller's tolerance ``overrides``: a dict of known keys (those of ``valid``) to finite numbers >= 0."""
    overrides = {} if overrides is None else overrides
    if not isinstance(overrides, Mapping):
        raise UsageError(f"verify(tolerances={overrides!r}): tolerances must be a dict such as {{'grad': 1e-4}}")
    unknown = sorted(map(str, set(overrides) - set(valid)))
    if unknown:
        raise UsageError(f"verify(tolerances=...): unknown keys {unknown}; valid: {sorted(valid)}")
    for key, value in overrides.items():
        if not is_finite_number(value) or value < 0:
            raise UsageError(f"verify(tolerances=...): {key!r} is {value!r}; a tolerance is a finite number >= 0")
    return dict(overrides)


def batch_pair(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` as ``(inputs, targets)``: two tensors with the same number of samples (dim 0)."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = f"{type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else type(batch).__name__
        raise UsageError(f"verify(batch=...): batch must be a pair (inputs, targets), got {got}")
    inputs, targets = batch
    for name, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            got = "a 0-d tensor" if isinstance(value, torch.Tensor) else type(value).__name__
            raise UsageError(f"verify(batch=...): {name} must be a tensor whose dim 0 is the batch, got {got}")
    if len(inputs) != len(targets):
        raise UsageError(f"verify(batch=...): inputs hold {len(inputs)} samples (shape {list(inputs.shape)}) but "
                         f"targets {len(targets)} (shape {list(targets.shape)}); both are the whole batch")
    return inputs, targets


def check_token_ids(model: nn.Module, inputs: torch.Tensor) -> None:
    """Token ids, for a model whose family says it takes them: an integer dtype, in the vocabulary
    and no longer than the model's positions."""
    family = family_of(model)
    if not family.takes_token_ids(model):
        return
    what = f"{type(model).__name__} (family {family.name!r})"
    if inputs.dtype.is_floating_point or inputs.dtype.is_complex or inputs.dtype == torch.bool:
        raise UsageError(f"verify(batch=...): inputs have dtype {inputs.dtype}, but {what} takes token ids: pass an "
                         f"integer tensor (torch.long)")
    vocab, positions = family.vocab_size(model), family.max_positions(model)
    low, high = int(inputs.min()), int(inputs.max())
    if vocab is not None and (low < 0 or high >= vocab):
        raise UsageError(f"verify(batch=...): token ids range from {low} to {high}, but {what} has a vocabulary of "
                         f"{vocab}; valid ids: 0 to {vocab - 1}")
    if positions is not None and inputs.dim() >= 2 and inputs.shape[1] > positions:
        raise UsageError(f"verify(batch=...): inputs hold sequences of {inputs.shape[1]} tokens, but {what} has "
                         f"{positions} positions; use sequences of at most {positions} tokens")


def checked_loss(loss_fn: Callable) -> Callable:
    """``loss_fn``, checking that it returns a scalar that depends on the model (in this process only)."""
    def loss(output: Any, targets: Any) -> torch.Tensor:
        value = loss_fn(output, targets)
        name = getattr(loss_fn, "__name__", repr(loss_fn))
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
            got = f"a {value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) \
                else type(value).__name__
            raise UsageError(f"verify(loss_fn={name}): loss_fn returned {got}; it must return a floating-point "
                             f"scalar tensor, the mean loss over the batch")
        if not value.requires_grad:
            raise UsageError(f"verify(loss_fn={name}): the loss does not depend on the model's parameters (it has "
                             f"no gradient); compute it from the model's output")
        return value
    return loss


def world_size_of(plan: Plan, world: LocalWorld | None) -> int:
    if world is not None and not (isinstance(getattr(world, "size", None), int) and callable(getattr(world, "run", None))):
        raise UsageError(f"verify(world=...): give a sk.LocalWorld (or None: a world is started for the run), "
                         f"got {type(world).__name__} {world!r}")
    if world is not None:
        return world.size
    if not plan.mesh.is_resolved:
        raise UsageError("verify needs world= (or a mesh without -1) to know the world size")
    return plan.mesh.size


__all__ = ["batch_pair", "check_lr", "check_optimizer", "check_picklable", "check_steps", "check_token_ids",
           "checked_loss", "checked_tolerances", "is_finite_number", "world_size_of"]
