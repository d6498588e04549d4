"""Gradients left as unreduced sums (DTensor ``Partial``) made whole once, at the end of the backward.

Under Megatron sequence parallel the norms' parameters are replicated DTensors acting on a
sequence-split stream (torch's ``SequenceParallel``): each rank's gradient covers its part of the
sequence, and DTensor's backward leaves it ``Partial`` (a sum still to be taken over ``tp``).
With a data axis, FSDP2 reduces it with the data gradients; with none, nothing does: the optimizer
would then run on ``Partial`` DTensors, and DTensor would all-reduce them again on every op it
runs (AdamW: ~3 all-reduces per gradient per step, and the update of a replicated weight computed
from a sum not yet taken).

Why our own: torch reduces such gradients only inside its data-parallel wrappers. Here each
parameter that can receive one gets a post-accumulate-grad hook whose first call in a backward
queues one callback at the end of that backward (as FSDP2 queues its own); the callback reduces
every ``Partial`` gradient in one flat all-reduce per (mesh dim, dtype) and hands the parameter a
``Replicate`` gradient. Under gradient accumulation (:func:`gradient_sync_deferred`) the sums stay
``Partial`` (DTensor adds them locally) until the last micro-batch's backward reduces them once.

>>> reducer = PartialGradients([])
>>> reducer.deferred
False
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate


class PartialGradients:
    """Reduces the ``Partial`` gradients of ``params`` at the end of each backward (but deferred ones)."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.deferred = False
        self._queued = False
        # A parameter's hooks are held in C++, out of the garbage collector's sight: a hook holding this
        # reducer (which holds the parameters) would make a cycle never collected, keeping the model, and
        # so its meshes, alive after it is gone. The module holds the reducer; the hooks reach it weakly.
        on_grad = weakref.WeakMethod(self._on_grad)
        for p in params:
            p.register_post_accumulate_grad_hook(lambda param: _call_if_alive(on_grad, param))

    def _on_grad(self, param: torch.Tensor) -> None:
        if self.deferred or self._queued:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        reduce_partial_grads(self.params)


def _call_if_alive(method: weakref.WeakMethod, param: torch.Tensor) -> None:
    bound = method()
    if bound is not None:
        bound(param)


def _summed_dims(grad: torch.Tensor) -> tuple[int, ...]:
    """The mesh dims on which ``grad`` is a pending sum (none for a plain tensor)."""
    if not isinstance(grad, DTensor):
        return ()
    return tuple(i for i, p in enumerate(grad.placements) if p.is_partial())


def _only_sums(grad: torch.Tensor) -> bool:
    return all(p.reduce_op == "sum" for p in grad.placements if p.is_partial())  # type: ignore[attr-defined]


def reduce_partial_grads(params: list[nn.Parameter]) -> int:
    """Make every ``Partial(sum)`` gradient of ``params`` ``Replicate`` on those mesh dims, one flat
    all-reduce per (mesh, summed dims, dtype) (another pending reduction by DTensor's own
    ``redistribute``); returns the number of gradients reduced."""
    groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    others = 0
    for p in params:
        dims = _summed_dims(p.grad) if p.grad is not None else ()
        if dims and _only_sums(p.grad):
            groups[p.grad.device_mesh, dims, p.grad.dtype].append(p)
        elif dims:  # another reduction (avg, max): DTensor's own, one parameter at a time
            grad = p.grad
            p.grad = grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl  # type: ignore
                                                          for pl in grad.placements])
            others += 1
    for (mesh, dims, _dtype), members in groups.items():
        locals_ = [p.grad.to_local() for p in members]  # type: ignore[union-attr]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim in dims:
            dist.all_reduce(flat, group=mesh.get_group(dim))
        for p, part in zip(members, flat.split([t.numel() for t in locals_])):
            grad = p.grad
            assert isinstance(grad, DTensor)
            placements = [Replicate() if isinstance(pl, Partial) else pl for pl in grad.placements]
            p.grad = DTensor.from_local(part.view_as(grad.to_local()), mesh, placements, run_check=False,
                                        shape=grad.shape, stride=grad.stride())
    return others + sum(len(m) for m in groups.values())


def reduce_at_end_of_backward(module: nn.Module) -> PartialGradients:
    """Install :class:`PartialGradients` on ``module``'s DTensor parameters with a replicated dim
    (the only ones DTensor can leave a ``Partial`` gradient on); kept as ``module._sk_partial_grads``."""
    params = [p for p in module.parameters() if p.requires_grad and isinstance(p, DTensor)
              and any(pl.is_replicate() for pl in p.placements)]
    reducer = module._sk_partial_grads = PartialGradients(params)
    return reducer


__all__ = ["PartialGradients", "reduce_at_end_of_backward", "reduce_partial_grads"]
