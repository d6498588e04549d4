"""Activation recompute per repeated block (``Plan(recompute=...)``), on torch's checkpointing.

- ``"full"``: every block runs under torch's non-reentrant activation checkpointing: the
  forward keeps only the block's inputs, and the backward runs the block again to rebuild
  what its gradients need.
- ``"selective"`` (Korthikanti et al. 2022): torch's selective checkpointing
  (``create_selective_checkpoint_contexts``) on each block's attention module, with a policy
  that saves the matrix products and collectives its Linear projections run before the core and
  recomputes the rest: the attention core (QK^T, softmax, dropout, attention x V: SDPA,
  transformers' eager or sdpa functions, ring attention under context parallel, and the reshapes
  and rotary embedding around it) and the output projection after it.
  The rest of the block keeps its activations as without recompute. Only the attention
  module is checkpointed because a policy that saves an op's output keeps it whether or not
  the backward needs it (torch's ``CheckpointPolicy`` notes it): saving every op of a block
  but the core would hold more than no recompute at all.

The blocks and attention modules are the ones ``sk.validate`` found on the whole model
(:class:`~shardkit.planner.model_checks.ModelFacts`); a pipeline stage applies recompute to
those it holds. Which ops are recomputed never changes the result, only memory and time.

Why torch's composable ``torch.distributed._composable.checkpoint`` and not
``checkpoint_wrapper`` (torchtitan's choice): the composable API installs checkpointing as
forward hooks on the block itself, so parameter names stay as they were (the wrapper inserts
``_checkpoint_wrapped_module.`` into every name, and layout rules, ``sk.verify``,
checkpoints and HuggingFace exports all go by name), and FSDP2's hooks, registered after it
on the same block, run outside the checkpointed region (FSDP2 composes with it by design).

>>> from shardkit.models.gpt import build_tiny_gpt
>>> model = recompute(build_tiny_gpt(), "selective")
>>> model._sk_recompute.checkpointed
('layers.0.attn', 'layers.1.attn')
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..families.modules import is_linear
from ..plan import PlanError, UsageError
from ..plan.plan import RECOMPUTE
from ..planner.counters import ATTENTION_CORE, costly
from ..planner.model_checks import recompute_problems, recompute_targets


class _Projections:
    """The selective policy: a matrix product or collective (:func:`~shardkit.planner.counters.costly`)
    inside an attention module's projections before its core is saved, any other op of the attention
    module (the core, the output projection after it, a projection's copies) is recomputed. The core
    is where an :data:`~shardkit.planner.counters.ATTENTION_CORE` operator runs; what the output
    projection computes (under tensor parallel its partial sums and their all-reduce) no backward
    operator reads, so keeping it would hold more than no recompute does. It is not run again
    either: torch's checkpoint stops recomputing once the last tensor the backward reads is rebuilt
    (the output projection's input). ``decisions`` counts what the policy chose in forwards, per op
    (``("recompute" | "save", op name)``)."""

    def __init__(self) -> None:
        self.depth = 0
        self.past_core = False
        self.decisions: Counter = Counter()

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op.overloadpacket in ATTENTION_CORE:
            self.past_core = True
        # a saved view would keep its base alive; a copy is made again from what is kept
        save = self.depth > 0 and not self.past_core and not op.is_view and costly(op)
        self.decisions["save" if save else "recompute", str(op)] += 1
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    def watch(self, attention: nn.Module) -> None:
        """Count the forwards of ``attention``'s projections (its Linear layers): entered first
        (before torch's tensor-parallel input hooks) and left last, so a projection's communication
        is saved with it, never redone; and start each forward of ``attention`` before its core."""

        def start(_m: nn.Module, _args: Any) -> None:
            self.past_core = False

        def enter(_m: nn.Module, _args: Any) -> None:
            self.depth += 1

        def leave(_m: nn.Module, _args: Any, _out: Any) -> None:
            self.depth -= 1

        attention.register_forward_pre_hook(start, prepend=True)
        for projection in attention.modules():
            if is_linear(projection):
                projection.register_forward_pre_hook(enter, prepend=True)
                projection.register_forward_hook(leave, always_call=True)


@dataclass(frozen=True)
class Recompute:
    """What :func:`apply_recompute` installed: the mode, the modules it checkpointed (the blocks
    for ``"full"``, their attention modules for ``"selective"``) and the selective policy."""

    mode: str
    checkpointed: tuple[str, ...]
    policy: _Projections | None = None


def apply_recompute(module: nn.Module, mode: str, blocks: tuple[str, ...],
                    attentions: tuple[str, ...] = ()) -> Recompute:
    """Recompute activations of ``module`` as ``mode`` says: ``"full"`` checkpoints each of the
    ``blocks``; ``"selective"`` checkpoints each of the ``attentions`` (the attention modules in
    the blocks) with torch's selective checkpointing, saving what its Linear projections compute
    and recomputing the rest, so the rest of each block keeps its activations as without
    recompute. Modules ``module`` no longer holds (a pipeline stage) are skipped. Call it after
    tensor and context parallel and before FSDP2 (torchtitan's order): FSDP2's hooks then stay
    outside the checkpointed regions."""
    held = dict(module.named_modules())
    policy = None
    if mode == "full":
        targets = tuple(b for b in blocks if b in held)
        for name in targets:
            checkpoint(held[name])
    else:
        targets = tuple(a for a in attentions if a in held)
        policy = _Projections()
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy.policy)
        for name in targets:
            policy.watch(held[name])
            checkpoint(held[name], context_fn=context_fn)
    if "use_cache" in inspect.signature(module.forward).parameters:
        module.register_forward_pre_hook(_no_kv_cache, with_kwargs=True)
    record = Recompute(mode, targets, policy)
    module._sk_recompute = record
    return record


def _no_kv_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A transformers forward under recompute builds no KV cache (transformers' own rule when it
    checkpoints): a block run twice would append its keys and values to the cache twice."""
    if kwargs.get("use_cache"):
        raise PlanError(f"{type(module).__name__} was called with use_cache=True under activation recompute; a "
                        f"recomputed block would add its keys and values to the cache twice: train with "
                        f"use_cache=False (the default under recompute) or use Plan(recompute='none')")
    kwargs["use_cache"] = False
    return args, kwargs


def recompute(model: nn.Module, mode: str) -> nn.Module:
    """Activation recompute on ``model`` in this process, as ``Plan(recompute=mode)`` applies it
    inside ``sk.shard``; returns the same module. Refused (:class:`PlanError`) as ``sk.validate``
    refuses it: a model with no repeated blocks, or ``"selective"`` on a model with no attention
    shardkit knows.

    >>> import torch
    >>> from shardkit.models.gpt import build_tiny_gpt
    >>> model = recompute(build_tiny_gpt(), "full")
    >>> model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    >>> recompute(torch.nn.Linear(2, 2), "full")
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.PlanError: recompute='full' needs repeated blocks (the children of an nn.ModuleList, such as a transformer's layers), but Linear has none; use recompute='none' or keep the layers in an nn.ModuleList
    """
    if mode not in RECOMPUTE:
        raise UsageError(f"recompute(model, mode): mode must be one of {list(RECOMPUTE)}, got {mode!r}")
    if getattr(model, "_sk_recompute", None) is not None:
        raise UsageError("recompute(model, mode): this model already recomputes; build a fresh model")
    if mode == "none":
        return model
    problems = recompute_problems(model, mode)
    if problems:
        raise PlanError(problems)
    blocks, attentions = recompute_targets(model)
    apply_recompute(model, mode, blocks, attentions)
    return model


@contextmanager
def held_activations() -> Iterator[_Held]:
    """Measure the bytes of tensors made inside the ``with`` block that are still alive when
    asked (``.bytes``): after a forward, the activations it keeps for the backward (plus its
    output), whatever keeps them (autograd's saved tensors, a checkpoint's inputs, a selective
    checkpoint's cache). Counted by storage, so views count once. Written here because torch's
    saved-tensor hooks see only what autograd packs outside a checkpointed region.

    >>> from shardkit.models.gpt import build_tiny_gpt
    >>> model, x = build_tiny_gpt(), torch.zeros(2, 8, dtype=torch.long)
    >>> with held_activations() as held:
    ...     loss = model(x).sum()
    >>> held.bytes > 0
    True
    """
    held = _Held()
    with held:
        yield held


class _Held(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view's storage is its base's: counted where the base was made
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if type(t) is torch.Tensor and t.device.type != "meta":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                known = self.storages.get(ref.cdata)
                if known is None or known[0].expired():  # a new storage where a freed one was
                    self.storages[ref.cdata] = (ref, storage.nbytes())
        return out

    @property
    def bytes(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())


__all__ = ["Recompute", "apply_recompute", "held_activations", "recompute"]
