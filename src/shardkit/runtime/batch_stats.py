"""Batch norms synchronised over the data ranks: one process's statistics over the whole batch.

Under data parallelism each rank holds a part of the batch, and a batch norm in training mode
would normalise with that part's mean and variance (:mod:`shardkit.planner.batch_stats`). DDP's
users take ``nn.SyncBatchNorm`` for this, but torch's refuses every tensor that is not on a GPU
(gloo on CPU is shardkit's default), so this is our own: :func:`synchronise_batch_norms` gives every
one of torch's batch norms of a sharded model a forward that all-reduces, over the ranks the
batch is split over (the data mesh FSDP2/DDP reduce gradients over, one all-reduce per mesh dim),

- in forward, each channel's sum and the count of values, then the sum of squared deviations
  from the global mean (two passes, as exact as one process's);
- in backward, the gradients of both sums (funcol's all-reduce is differentiable: each rank's
  loss depends on every rank's inputs), so every input's gradient is one process's;
- the running mean and the running variance (unbiased: the global count ``n``, ``n / (n - 1)``),
  so every rank keeps one process's running statistics.

In eval mode with running statistics nothing is reduced (torch's forward runs). A
``SyncBatchNorm``'s own ``process_group`` is replaced by the data ranks of the plan.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.nn.modules.batchnorm import _BatchNorm

from ..plan import UsageError
from ..planner.batch_stats import synchronisable


def _reduced(tensor: torch.Tensor, groups: list[Any]) -> torch.Tensor:
    """The sum of ``tensor`` over every rank of ``groups`` (one mesh dim each), differentiable."""
    for group in groups:
        tensor = funcol.all_reduce(tensor, "sum", group)  # its gradient: every rank's gradient summed
    return tensor


class SynchronisedBatchNorm:
    """Mixed into a torch batch norm's class: training-mode statistics over every data rank (module docstring)."""

    _sk_groups: list[Any]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        assert isinstance(self, _BatchNorm)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not batch_stats:
            return _BatchNorm.forward(self, input)
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        x = input.float()
        count = x.new_tensor([x.numel() / max(x.shape[1], 1)])
        sums = _reduced(torch.cat([x.sum(dims), count]), self._sk_groups)
        total = sums[-1]
        mean = sums[:-1] / total
        centred = x - mean.view(shape)
        var = _reduced((centred * centred).sum(dims), self._sk_groups) / total
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.float().view(shape) + self.bias.float().view(shape)
        if self.training and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                unbiased = var * (total / (total - 1).clamp(min=1))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out.to(input.dtype)


_CLASSES: dict[type, type] = {}


def synchronise_batch_norms(module: nn.Module, data_mesh: Any) -> list[str]:
    """Give every torch batch norm in ``module`` the synchronised forward over ``data_mesh`` (a DeviceMesh,
    every dim of which the batch is split over); returns their names. Nothing happens on one rank."""
    if data_mesh is None or data_mesh.size() == 1:
        return []
    groups = [data_mesh.get_group(dim) for dim in range(data_mesh.ndim) if data_mesh.size(dim) > 1]
    names = []
    for name, child in module.named_modules():
        if not synchronisable(child) or isinstance(child, SynchronisedBatchNorm):
            continue
        cls = type(child)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Synchronised{cls.__name__}", (SynchronisedBatchNorm, cls), {})
        child.__class__ = _CLASSES[cls]
        child._sk_groups = groups
        names.append(name)
    return names


def refuse_micro_batches(model: nn.Module, parts: int) -> None:
    """:class:`UsageError` naming the batch norms that would see ``parts`` > 1 micro-batches of one step in
    training mode: each would normalise with its micro-batch's statistics, unlike one process."""
    if parts <= 1:
        return
    found = [f"{n!r} ({type(m).__name__})" for n, m in model.named_modules()
             if isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)]
    if found:
        raise UsageError(f"a step of {parts} micro-batches (accumulate x a pipeline's microbatches): "
                         f"module{'s' if len(found) > 1 else ''} {', '.join(found[:8])} normalise with statistics "
                         f"of the batch they see, so each micro-batch would have its own, unlike one step over the "
                         f"whole batch; use accumulate=1 (and microbatches=1), eval mode for these modules (running "
                         f"statistics), or a norm per sample (LayerNorm, GroupNorm)")


__all__ = ["SynchronisedBatchNorm", "refuse_micro_batches", "synchronise_batch_norms"]
