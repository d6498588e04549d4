"""Loss scaling across shards (``Plan(loss_scale=...)``, the rules in :mod:`shardkit.plan.loss_scale`).

A sharded model whose plan scales (float16) applies the scale in its own ``model.step`` (:meth:`LossScaler.step_model`),
so every loop that steps a sharded model is scaled, ``sk.train``'s, ``sk.verify``'s and a user's own:

1. the loss is multiplied by the scale before the backward (:meth:`LossScaler.scaled` wraps the loss function,
   so a pipeline's last stage scales each micro-batch's loss the same way); ``model.step`` returns it unscaled;
2. :meth:`LossScaler.unscale_` divides every gradient this rank holds by the scale, each DTensor gradient
   (FSDP2, tensor parallel) through its local shard and plain gradients as they are, and notes whether any of
   them holds an inf or nan; ONE all-reduce (MAX) of that flag over the whole world makes every rank see the
   same answer;
3. :meth:`LossScaler.update` reads the flag (the one host read a scaled step needs) and moves the scale by the
   rule; after an overflow it sets every gradient to ``None`` on every rank, so the optimizer's ``step()`` that
   follows changes nothing (torch's optimizers skip a parameter without a gradient: no update, no weight decay,
   no moment or step count moved) and every rank skips the same step (pipeline stages, tensor- and
   data-parallel ranks alike). ``model.loss_scaler.last_skipped`` says so, for a loop that counts or logs it.

Clipping (``sk.clip_grad_norm_``) after ``model.step`` sees the unscaled gradients. Gradients left from an earlier
scaled step (no ``optimizer.zero_grad()`` in between) are refused: they are already unscaled, and a second
backward would add scaled ones to them; accumulate with ``model.step(..., accumulate=k)``.

Why not torch's scalers: ``torch.amp.GradScaler`` checks each rank's own gradients and reduces
nothing across ranks, so under FSDP, where each rank holds different shards, one rank would skip a
step the others take. ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` (FSDP1)
all-reduces the flag over a process group, but passes the gradients to
``_amp_foreach_non_finite_check_and_unscale_`` as they are: on FSDP2/tensor-parallel DTensors that
dispatches to DTensor, which all-reduces the flag over each call's mesh (one more collective per
group of gradients, every step), and refuses a group mixing DTensors with plain tensors ("got mixed
torch.Tensor and DTensor", torch 2.13); its scale's rule is a kernel, not data a checkpoint's
manifest can hold; and both need the user's loop to call them around ``optimizer.step()``. Here the same
kernel runs on local shards only, one collective decides, and ``model.step`` does it all.

>>> import torch
>>> model = torch.nn.Linear(2, 1)
>>> scaler = LossScaler("dynamic", torch.device("cpu"))
>>> loss = scaler.scaled(lambda out, y: (out - y).pow(2).mean())(model(torch.ones(1, 2)), torch.zeros(1, 1))
>>> loss.backward()
>>> overflow = scaler.unscale_(model)
>>> scaler.update(model), scaler.state.scale
(True, 65536.0)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from ..plan import Plan, UsageError
from ..plan.loss_scale import ScaleRule, ScaleState, scale_rule


class LossScaler:
    """A loss scale over every rank of the world: scale the loss, unscale the gradients, skip the
    steps that overflowed anywhere, and move the scale (``loss_scale``: ``"dynamic"`` or a fixed
    number, as ``Plan.loss_scaling`` resolves it; ``rule`` replaces the one it implies; ``alone``: this
    process's gradients only, no collective, as ``sk.verify``'s single-process reference runs it, even
    inside a ``torchrun`` world). ``skipped``: the steps skipped so far; ``last_skipped``: whether the
    latest one was."""

    def __init__(self, loss_scale: str | float, device: torch.device, rule: ScaleRule | None = None,
                 alone: bool = False):
        self.rule = rule if rule is not None else scale_rule(loss_scale)
        self.alone = alone
        self.state = self.rule.start()
        self.device = device
        self._overflow: torch.Tensor | None = None  # the world's flag after unscale_, until update
        self._unscaled: list[tuple[weakref.ref, int]] = []  # the gradients the last step left, and their versions
        self.skipped = 0
        self.last_skipped = False

    @classmethod
    def of(cls, plan: Plan, device: torch.device) -> LossScaler | None:
        """The scaler of ``plan`` (``None`` when it scales nothing)."""
        mode = plan.loss_scaling
        return None if mode is None else cls(mode, device)

    def step_model(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                   backward: Callable[[Callable[[Any, Any], torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """A sharded model's ``step`` under the scale: ``backward(scaled loss_fn)`` (forward and backward, returning
        the loss), the gradients unscaled, the overflow decided over the world and the scale moved (:meth:`update`;
        after an overflow every gradient is ``None``). Returns the loss, unscaled."""
        self._refuse_left_gradients(model)
        scale = self.state.scale
        loss = backward(self.scaled(loss_fn)) / scale
        self.unscale_(model)
        self.update(model)
        return loss

    def scaled(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
        """``loss_fn`` times the current scale, in float32."""
        scale = self.state.scale

        def scaled_loss(output: Any, target: Any) -> torch.Tensor:
            return loss_fn(output, target).float() * scale

        return scaled_loss

    def unscale_(self, model: nn.Module) -> torch.Tensor:
        """Divide this rank's gradients by the scale, in place; returns the world's overflow flag (a float32
        scalar on the device, 1.0 when any rank's gradients hold an inf or nan). A collective: every rank calls it."""
        if self._overflow is not None:
            raise UsageError("LossScaler.unscale_ was called twice without an update in between: the gradients would "
                             "be divided by the scale twice")
        found = torch.zeros((), device=self.device)
        inverse = torch.full((), 1.0 / self.state.scale, device=self.device)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        with torch.no_grad():
            for param in model.parameters():
                grad = param.grad
                if grad is None:
                    continue
                local = _local(grad)
                groups.setdefault((local.device, local.dtype), []).append(local)
            for (device, _), grads in groups.items():
                here = found if device == found.device else torch.zeros((), device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, here, inverse.to(device))
                if here is not found:
                    found = torch.maximum(found, here.to(found.device))
        if not self.alone and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self._overflow = found
        return found

    def update(self, model: nn.Module) -> bool:
        """After :meth:`unscale_`: read the world's overflow flag to the host (one scalar, the same on every rank),
        move the scale, and after an overflow set every gradient of ``model`` to ``None`` so that the optimizer's
        next ``step()`` changes nothing. Returns whether the optimizer may step (no overflow anywhere)."""
        if self._overflow is None:
            raise UsageError("LossScaler.update before unscale_: the gradients are still multiplied by the scale")
        # a dry run's fake tensors hold no values: it measures a step that steps, as nearly every step does
        overflow = False if is_fake(self._overflow) else bool(self._overflow.item())
        self._overflow = None
        if overflow:
            self.skipped += 1
            for param in model.parameters():
                param.grad = None
        self.last_skipped = overflow
        self._unscaled = [(weakref.ref(p.grad), _local(p.grad)._version) for p in model.parameters()
                          if p.grad is not None]
        self.state = self.rule.next(self.state, overflow)
        return not overflow

    def _refuse_left_gradients(self, model: nn.Module) -> None:
        """A gradient the last scaled step left, unchanged since (no ``zero_grad`` in between), is refused by name."""
        left = {id(ref()): version for ref, version in self._unscaled if ref() is not None}
        for name, param in model.named_parameters():
            grad = param.grad
            if grad is not None and left.get(id(grad)) == _local(grad)._version:
                raise UsageError(f"model.step under the plan's loss scale (float16; the scale now {self.state.scale:g}): "
                                 f"parameter {name!r} still holds the gradient of "
                                 f"the previous step, already unscaled, and this step's scaled gradients would be "
                                 f"added to it; call optimizer.zero_grad() after each optimizer step, and accumulate "
                                 f"with model.step(inputs, targets, loss_fn, accumulate=k)")
        self._unscaled = []

    def state_dict(self) -> dict[str, Any]:
        """The scale and its good steps, JSON-able (a checkpoint's manifest holds them: the same on every rank)."""
        return self.state.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = ScaleState.from_dict(state)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


__all__ = ["LossScaler"]
