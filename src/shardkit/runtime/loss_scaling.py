"""Loss scaling across shards (``Plan(loss_scale=...)``, the rules in :mod:`shardkit.plan.loss_scale`).

One step: the loss is multiplied by the scale before the backward (:meth:`LossScaler.scaled` wraps
the loss function, so a pipeline's last stage scales each micro-batch's loss the same way); then
:meth:`LossScaler.unscale_` divides every gradient this rank holds by the scale, each DTensor
gradient (FSDP2, tensor parallel) through its local shard and plain gradients as they are, and
notes whether any of them holds an inf or nan; ONE all-reduce (MAX) of that flag over the whole
world makes every rank see the same answer, so every rank skips the same steps (pipeline stages,
tensor- and data-parallel ranks alike). :meth:`LossScaler.step` reads the flag (the one host read
a scaled step needs), steps the optimizer unless it is set, and moves the scale by the rule.
Clipping goes between the two, on the unscaled gradients.

Why not torch's scalers: ``torch.amp.GradScaler`` checks each rank's own gradients and reduces
nothing across ranks, so under FSDP, where each rank holds different shards, one rank would skip a
step the others take. ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` (FSDP1)
all-reduces the flag over a process group, but passes the gradients to
``_amp_foreach_non_finite_check_and_unscale_`` as they are: on FSDP2/tensor-parallel DTensors that
dispatches to DTensor, which all-reduces the flag over each call's mesh (one more collective per
group of gradients, every step), and refuses a group mixing DTensors with plain tensors ("got mixed
torch.Tensor and DTensor", torch 2.13); its scale's rule is a kernel, not data a checkpoint's
manifest can hold. Here the same kernel runs on local shards only, and one collective decides.

>>> import torch
>>> model = torch.nn.Linear(2, 1)
>>> scaler = LossScaler("dynamic", torch.device("cpu"))
>>> loss = scaler.scaled(lambda out, y: (out - y).pow(2).mean())(model(torch.ones(1, 2)), torch.zeros(1, 1))
>>> loss.backward()
>>> overflow = scaler.unscale_(model)
>>> scaler.step(torch.optim.SGD(model.parameters(), lr=0.1)), scaler.state.scale
(True, 65536.0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..plan import UsageError
from ..plan.loss_scale import ScaleRule, ScaleState, scale_rule


class LossScaler:
    """A loss scale over every rank of the world: scale the loss, unscale the gradients, skip the
    steps that overflowed anywhere, and move the scale (``loss_scale``: ``"dynamic"`` or a fixed
    number, as ``Plan.loss_scaling`` resolves it; ``rule`` replaces the one it implies)."""

    def __init__(self, loss_scale: str | float, device: torch.device, rule: ScaleRule | None = None):
        self.rule = rule if rule is not None else scale_rule(loss_scale)
        self.state = self.rule.start()
        self.device = device
        self._overflow: torch.Tensor | None = None  # the world's flag after unscale_, until step
        self.skipped = 0

    @classmethod
    def of(cls, model: nn.Module, device: torch.device) -> LossScaler | None:
        """The scaler of a sharded model's plan (``None`` when its plan scales nothing)."""
        mode = model.plan.loss_scaling
        return None if mode is None else cls(mode, device)

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
            raise UsageError("LossScaler.unscale_ was called twice without a step in between: the gradients would "
                             "be divided by the scale twice")
        found = torch.zeros((), device=self.device)
        inverse = torch.full((), 1.0 / self.state.scale, device=self.device)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        with torch.no_grad():
            for param in model.parameters():
                grad = param.grad
                if grad is None:
                    continue
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                groups.setdefault((local.device, local.dtype), []).append(local)
            for (device, _), grads in groups.items():
                here = found if device == found.device else torch.zeros((), device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, here, inverse.to(device))
                if here is not found:
                    found = torch.maximum(found, here.to(found.device))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self._overflow = found
        return found

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` unless the gradients overflowed on some rank (the same on every rank), then move
        the scale; returns whether it stepped. Reads the overflow flag to the host (one scalar)."""
        if self._overflow is None:
            raise UsageError("LossScaler.step before unscale_: the gradients are still multiplied by the scale")
        overflow = bool(self._overflow.item())
        self._overflow = None
        if overflow:
            self.skipped += 1
        else:
            optimizer.step()
        self.state = self.rule.next(self.state, overflow)
        return not overflow

    def state_dict(self) -> dict[str, Any]:
        """The scale and its good steps, JSON-able (a checkpoint's manifest holds them: the same on every rank)."""
        return self.state.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = ScaleState.from_dict(state)


__all__ = ["LossScaler"]
