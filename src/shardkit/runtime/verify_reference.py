"""``sk.verify``'s single-device side: the model, batch, loss and optimizer in this process, in the plan's
precision and under its loss scale (:class:`~shardkit.runtime.loss_scaling.LossScaler`, this process alone), each
step recomputed from the weights the sharded run started it with (:mod:`shardkit.runtime.verify`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..planner.tensor_parallel import aliases
from .dropout_off import DropoutOff
from .loss_scaling import LossScaler
from .materialize import materialize
from .optimizer import optimizer as optimizer_for
from .precision import Precision, mixed_precision_backward

#: The optimizers ``sk.verify(optimizer=...)`` takes, by name.
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def make_optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer as training builds it (``sk.optimizer``: ZeRO-1's partitioned one under ``Plan(zero=1)``)."""
    return optimizer_for(model, OPTIMIZERS[name], lr=lr)


class SingleProcess:
    """The single-device side: the model, batch, loss and optimizer in this process, in the plan's precision."""

    def __init__(self, build_model: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                 loss_fn: Callable, optimizer: str, lr: float, precision: Precision, scaler: LossScaler | None):
        self.model = build_model()
        if any(p.device.type == "meta" for p in self.model.parameters()):
            materialize(self.model, seed=0)  # as sk.shard does: the same weights whatever the plan
        self.params = dict(self.model.named_parameters())
        self.aliases = aliases(self.model)
        self.batch, self.loss_fn, self.lr, self.precision = batch, loss_fn, lr, precision
        self.optimizer = make_optimizer(optimizer, self.model, lr)
        self.dropouts = 0  # dropout calls switched off in the last backward
        self.scaler = scaler
        self.scale: float | None = None  # the loss scale of the last scaled backward, and whether it overflowed
        self.skipped = False

    def backward(self, precision: Precision | None = None) -> tuple[float, dict[str, torch.Tensor]]:
        """(loss, gradients) at the current weights, in ``precision`` (default: the plan's, under the plan's loss
        scale as the sharded ``model.step`` runs it: the scale then moves as the sharded run's does), dropout off."""
        self.optimizer.zero_grad()
        scaler = self.scaler if precision is None else None
        loss_fn = self.loss_fn if scaler is None else scaler.scaled(self.loss_fn)
        with DropoutOff() as off:
            loss = mixed_precision_backward(self.model, *self.batch, loss_fn, precision or self.precision)
        self.dropouts = off.calls
        if scaler is not None:
            self.scale = scaler.state.scale
            loss = loss / self.scale
            scaler.unscale_(self.model)
            self.skipped = not scaler.update(self.model)
        return loss.item(), {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                             for n, p in self.params.items()}

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in weights.items():
                self.params[name].copy_(value)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {n: b.detach().clone() for n, b in self.model.named_buffers()}

    def load_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        own = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, value in buffers.items():
                if name in own and own[name].shape == value.shape:
                    own[name].copy_(value)

    def update(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One optimizer step from the current weights with ``grads`` (none after an overflow the scale skipped);
        returns the new weights."""
        if self.skipped:
            return {n: p.detach().clone() for n, p in self.params.items()}
        for name, p in self.params.items():  # a frozen parameter has no gradient (AdamW would decay it)
            p.grad = grads[name].to(p.dtype).clone() if name in grads and p.requires_grad else None
        self.optimizer.step()
        return {n: p.detach().clone() for n, p in self.params.items()}


__all__ = ["OPTIMIZERS", "SingleProcess", "make_optimizer"]
