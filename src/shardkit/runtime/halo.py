"""Causal 1-D convolutions over a sequence split across the ``sp`` group: each chunk gets the positions before it.

A causal convolution of kernel ``k`` (dilation ``d``) reads, at each position, the ``d x (k-1)``
positions before it. Under context parallel a rank holds two chunks of the sequence (chunks
``r`` and ``2*sp-1-r`` of ``2*sp``, :func:`~shardkit.runtime.ring_attention.shard_sequence`),
so each chunk needs the last ``d x (k-1)`` positions of the chunk before it (a *halo*):

- chunk ``r`` follows chunk ``r-1``, the first chunk of rank ``r-1`` (rank 0's comes first: zeros);
- chunk ``2*sp-1-r`` follows chunk ``2*sp-2-r``, the second chunk of rank ``r+1`` (for the last
  rank, its own first chunk).

So every rank sends the tail of its first chunk to rank ``r+1`` and the tail of its second to
rank ``r-1``, all four sends and receives posted in one batch (:func:`shardkit.runtime.p2p.exchange`) (one message per
direction and pair, so NCCL matches them whatever the order); the backward sends the halos'
gradients back the same way, to be added to the tails they came from.

Where: :func:`install_halo_convolutions` wraps the forward of each module in which
:mod:`shardkit.planner.sequence_checks` found a causal convolution on the meta device (LFM2's
``Lfm2ShortConv``, Mamba's mixer) in a ``TorchFunctionMode`` that runs the matching
``conv1d`` calls with the halo: each chunk's conv then has ``padding=0`` and its halo in front,
and the output keeps the shape of the original call (the ``padding`` outputs past the end,
which the model cuts off, are zeros). Why not torch: DTensor's convolution shards batch and
channels, and its halo exchange (``_tp_conv``) covers a plain split of the last dim, not
context parallel's two chunks per rank; the module calls ``F.conv1d`` on a plain tensor anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..plan import PlanError
from ..planner.sequence_mixing import CausalConv
from . import p2p

_WRAPPED = "_shardkit_halo"


class _Halo(torch.autograd.Function):
    """``(halo before the first chunk, halo before the second chunk)`` of ``x`` (time on the last dim)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        half = x.shape[-1] // 2
        first_tail, second_tail = x[..., half - width:half], x[..., x.shape[-1] - width:]
        before_first = x.new_zeros(first_tail.shape)
        before_second = first_tail.contiguous() if rank == size - 1 else x.new_empty(second_tail.shape)
        sends = {}
        recvs = {}
        if rank < size - 1:
            sends[rank + 1] = first_tail
            recvs[rank + 1] = before_second
        if rank > 0:
            sends[rank - 1] = second_tail
            recvs[rank - 1] = before_first
        p2p.exchange_and_wait(group, list(sends.items()), list(recvs.items()))
        ctx.group, ctx.width, ctx.shape = group, width, x.shape
        return before_first, before_second

    @staticmethod
    def backward(ctx, grad_first: torch.Tensor, grad_second: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        group, width = ctx.group, ctx.width
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        grad = grad_first.new_zeros(ctx.shape)
        half = ctx.shape[-1] // 2
        grad_first, grad_second = grad_first.contiguous(), grad_second.contiguous()
        from_next, from_prev = torch.empty_like(grad_first), torch.empty_like(grad_second)
        sends, recvs = {}, {}
        if rank > 0:  # our first halo came from rank-1's first chunk; its second tail went to rank-1
            sends[rank - 1] = grad_first
            recvs[rank - 1] = from_prev
        if rank < size - 1:  # our second halo came from rank+1's second chunk; our first tail went to rank+1
            sends[rank + 1] = grad_second
            recvs[rank + 1] = from_next
        p2p.exchange_and_wait(group, list(sends.items()), list(recvs.items()))
        if rank < size - 1:
            grad[..., half - width:half] += from_next
        else:
            grad[..., half - width:half] += grad_second  # the last rank's second halo is its own first tail
        if rank > 0:
            grad[..., ctx.shape[-1] - width:] += from_prev
        return grad, None, None


def halo_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv: CausalConv, groups: int,
                group: dist.ProcessGroup) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, padding=conv.padding, dilation=conv.dilation, groups=groups)`` on this
    rank's two chunks of the sequence (time on the last dim of ``x``), each given the positions before it.
    The first ``length`` outputs are the causal convolution over the whole sequence; the ``padding``
    after them are zeros (the model cuts them off)."""
    length, width = x.shape[-1], conv.padding
    if length % 2 or length // 2 < width:
        raise PlanError(f"the causal convolution in module {conv.module!r} reads the {width} positions before each "
                        f"one, but this sp rank's chunks hold {length // 2} positions each; use sequences of at "
                        f"least {2 * width * dist.get_world_size(group)} positions (2 x sp x {width})")
    before_first, before_second = _Halo.apply(x, group, width)
    half = length // 2
    parts = [F.conv1d(torch.cat([before, chunk], dim=-1), weight, bias, dilation=conv.dilation, groups=groups)
             for before, chunk in ((before_first, x[..., :half]), (before_second, x[..., half:]))]
    return F.pad(torch.cat(parts, dim=-1), (0, width))


def _arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    bound = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def _single(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) and len(value) == 1 else value


class _HaloMode(TorchFunctionMode):
    """Runs the module's causal ``conv1d`` calls through :func:`halo_conv1d`; every other call as it is."""

    def __init__(self, convs: Sequence[CausalConv], group: dist.ProcessGroup):
        super().__init__()
        self.convs, self.group = convs, group

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.conv1d:
            bound = _arguments(args, kwargs)
            weight = bound["weight"]
            for conv in self.convs:
                if (_single(bound["stride"]), _single(bound["padding"]), _single(bound["dilation"])) == \
                        (1, conv.padding, conv.dilation) and weight.shape[-1] == conv.kernel:
                    return halo_conv1d(bound["input"], weight, bound["bias"], conv, bound["groups"], self.group)
        return func(*args, **kwargs)


def install_halo_convolutions(model: nn.Module, convs: Sequence[CausalConv], group: dist.ProcessGroup) -> None:
    """Make each module of ``convs`` run its causal convolutions over the sp group's whole sequence."""
    by_module: dict[str, list[CausalConv]] = {}
    for conv in convs:
        by_module.setdefault(conv.module, []).append(conv)
    for name, found in by_module.items():
        module = model.get_submodule(name)
        if getattr(module, _WRAPPED, None) is not None:
            continue
        forward = module.forward

        @functools.wraps(forward)
        def with_halo(*args: Any, _forward: Any = forward, _convs: list = found, **kwargs: Any) -> Any:
            with _HaloMode(_convs, group):
                return _forward(*args, **kwargs)

        module.forward = with_halo
        setattr(module, _WRAPPED, tuple(found))


__all__ = ["halo_conv1d", "install_halo_convolutions"]
