"""Collectives within replica groups (a :class:`ReplicaGrouping` or its transpose), and gradient averaging.

torch's c10d collectives work on one process group at a time and are not differentiable;
the functions here take a :class:`ReplicaGrouping` (or its transpose), check that every
member passed the same shape and dtype (by default on the first call of each collective on each
group only: the check is a collective and a host read, which a training step should not pay on
every call), and carry gradients under the convention of tensor
parallelism: what follows a collective is computed identically by every member, so the
backward of ``all_reduce`` (sum) is the identity, of ``all_gather`` taking this member's
slice, of ``reduce_scatter`` an all-gather, of ``broadcast`` the identity at the source.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..plan import ReplicaGrouping, UsageError
from . import tensor_header
from .groups import ReplicaGroup, replica_group
from .pieces import local_tensor

REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def _op(op: str) -> Any:
    if op not in REDUCE_OPS:
        raise UsageError(f"reduce op {op!r} is unknown; valid: {list(REDUCE_OPS)}")
    return getattr(dist.ReduceOp, REDUCE_OPS[op])


#: The collectives whose first call on a process group checked the members' shapes and dtypes (every member
#: calls the same collectives on a group in the same order, so all of them skip the same later checks). Weak:
#: a group destroyed when no job uses it any more (meshes.py) goes with its connections.
_CHECKED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _wants_check(check: bool | None, process_group: Any, what: str) -> bool:
    """``check=None``: only on the first call of ``what`` on ``process_group``; ``True``: always; ``False``: never."""
    if check is not None:
        return check
    checked = _CHECKED.setdefault(process_group, set())
    first = what not in checked
    checked.add(what)
    return first


def _check_same(tensor: torch.Tensor, group: ReplicaGroup, what: str) -> None:
    """Raise on every member when the members passed different shapes or dtypes."""
    labels = [f"replica {m}" for m in group.members]
    check_same_layout(tensor, group.process_group, labels,
                      f"{what} over group {group.group} of {group.grouping!r}: every replica must pass")


def check_same_layout(tensor: torch.Tensor, process_group: Any, labels: list[str], what: str) -> None:
    """Raise on every member of ``process_group`` unless all passed the same shape and dtype.

    ``labels`` name the members in group-rank order; ``what`` starts the message.
    """
    if tensor.dim() > tensor_header.MAX_DIMS:
        raise UsageError(f"{what}: tensors with more than {tensor_header.MAX_DIMS} dims are not supported, got "
                         f"{tensor.dim()}")
    mine = tensor_header.encode(tensor)
    seen = [torch.empty_like(mine) for _ in labels]
    dist.all_gather(seen, mine, group=process_group)
    if all(torch.equal(s, seen[0]) for s in seen):
        return
    got = ", ".join(f"{label}: {tensor_header.describe(s)}" for label, s in zip(labels, seen))
    raise UsageError(f"{what} the same shape and dtype, got {got}")


def _needs_equal_groups(group: ReplicaGroup, what: str) -> None:
    if not group.grouping.has_equal_groups:
        raise UsageError(f"{what} cannot use {group.grouping!r}: its groups have different sizes "
                        f"{group.grouping.group_sizes}, so replicas would get results of different shapes. "
                        f"all_reduce and broadcast work with any grouping; for {what} use equal-size groups")


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, op: str, group: ReplicaGroup) -> torch.Tensor:
        ctx.scale = 1.0 / group.size if op == "mean" else 1.0
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        if group.process_group is not None:
            dist.all_reduce(out, op=_op(op), group=group.process_group)
        return out / group.size if op == "mean" else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale if ctx.scale != 1.0 else grad, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int, stack: bool, group: ReplicaGroup) -> torch.Tensor:
        ctx.dim, ctx.stack, ctx.index, ctx.length = dim, stack, group.index, tensor.shape[dim] if not stack else 1
        local = tensor.detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(group.size)]
        if group.process_group is None:
            parts = [local.clone()]
        else:
            dist.all_gather(parts, local, group=group.process_group)
        return torch.stack(parts, dim) if stack else torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine = grad.select(ctx.dim, ctx.index) if ctx.stack else grad.narrow(ctx.dim, ctx.index * ctx.length, ctx.length)
        return mine, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, op: str, dim: int, group: ReplicaGroup) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.scale = dim, group, 1.0 / group.size if op == "mean" else 1.0
        chunks = [c.contiguous() for c in tensor.detach().chunk(group.size, dim)]
        out = torch.empty_like(chunks[0])
        if group.process_group is None:
            out.copy_(chunks[0])
        else:
            dist.reduce_scatter(out, chunks, op=_op(op), group=group.process_group)
        return out * ctx.scale if op == "mean" else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full = _AllGather.apply(grad.contiguous(), ctx.dim, False, ctx.group)
        return full * ctx.scale if ctx.scale != 1.0 else full, None, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, src: int, group: ReplicaGroup) -> torch.Tensor:
        ctx.is_src = group.index == src
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        if group.process_group is not None:
            dist.broadcast(out, src=group.ranks[src], group=group.process_group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad if ctx.is_src else torch.zeros_like(grad), None, None


def _prepare(tensor: torch.Tensor, grouping: ReplicaGrouping | None, transpose: bool, what: str,
             check: bool | None, equal_groups: bool = False) -> ReplicaGroup:
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    group = replica_group(grouping, transpose=transpose)
    if equal_groups:
        _needs_equal_groups(group, what.split("(")[0])
    if group.process_group is not None and _wants_check(check, group.process_group, what):
        _check_same(tensor, group, what)
    return group


def all_reduce(tensor: torch.Tensor, grouping: ReplicaGrouping | None = None, op: str = "sum", *,
               transpose: bool = False, check: bool | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over the replicas of each group; every member gets the result.

    ``op``: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``; ``grouping=None``
    is one group of all replicas; ``transpose=True`` uses ``grouping.transpose()``.
    Returns a new tensor. Differentiable for sum and mean. ``check`` verifies first that
    every member passed the same shape and dtype (one small extra collective and a host read):
    ``None`` (every collective here) on the first call of this collective on this group only,
    ``True`` on every call, ``False`` never.

    >>> total = all_reduce(torch.ones(2), ReplicaGrouping(8, group_size=2))   # doctest: +SKIP
    """
    _op(op)
    if op not in ("sum", "mean") and tensor.requires_grad and torch.is_grad_enabled():
        raise UsageError(f"all_reduce(op={op!r}) is not differentiable; pass tensor.detach() or use 'sum' / 'mean'")
    group = _prepare(tensor, grouping, transpose, f"all_reduce(op={op!r})", check)
    return _AllReduce.apply(tensor, op, group)


def all_gather(tensor: torch.Tensor, grouping: ReplicaGrouping | None = None, *, dim: int = 0,
               stack: bool = False, transpose: bool = False, check: bool | None = None) -> torch.Tensor:
    """The members' tensors concatenated along ``dim`` in replica order (``stack=True``: a new dim).

    Needs groups of equal size. Differentiable: the backward keeps this member's slice.
    """
    group = _prepare(tensor, grouping, transpose, "all_gather", check, equal_groups=True)
    return _AllGather.apply(tensor, _dim(dim, tensor.dim() + int(stack)), stack, group)


def reduce_scatter(tensor: torch.Tensor, grouping: ReplicaGrouping | None = None, op: str = "sum", *,
                   dim: int = 0, transpose: bool = False, check: bool | None = None) -> torch.Tensor:
    """Reduce over each group, then member ``i`` keeps the ``i``-th of ``group_size`` chunks along ``dim``.

    Needs groups of equal size and ``tensor.shape[dim]`` divisible by the group size.
    Differentiable for sum and mean (the backward all-gathers).
    """
    _op(op)
    if op not in ("sum", "mean") and tensor.requires_grad and torch.is_grad_enabled():
        raise UsageError(f"reduce_scatter(op={op!r}) is not differentiable; pass tensor.detach() or use 'sum' / 'mean'")
    group = _prepare(tensor, grouping, transpose, f"reduce_scatter(op={op!r})", check, equal_groups=True)
    dim = _dim(dim, tensor.dim())
    if tensor.shape[dim] % group.size:
        raise UsageError(f"reduce_scatter: dim {dim} of shape {tuple(tensor.shape)} has size {tensor.shape[dim]}, not "
                        f"divisible by the group size {group.size}; use a multiple of {group.size}")
    return _ReduceScatter.apply(tensor, op, dim, group)


def broadcast(tensor: torch.Tensor, grouping: ReplicaGrouping | None = None, *, src: int = 0,
              transpose: bool = False, check: bool | None = None) -> torch.Tensor:
    """Every member gets the tensor of the group's ``src``-th member (0: the group's first replica)."""
    group = _prepare(tensor, grouping, transpose, "broadcast", check)
    if not 0 <= src < min(group.grouping.group_sizes):
        raise UsageError(f"broadcast src={src} is the position of a member within its group; valid: "
                        f"0..{min(group.grouping.group_sizes) - 1} for {group.grouping!r}")
    return _Broadcast.apply(tensor, src, group)


def _dim(dim: int, ndim: int) -> int:
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise UsageError(f"dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % max(ndim, 1)


# -- training ----------------------------------------------------------------------------------------
def average_gradients(module: nn.Module | Iterable[torch.Tensor], grouping: ReplicaGrouping | Any = None, *,
                      transpose: bool = False) -> None:
    """Average the parameters' gradients within each replica group (in place, one all-reduce per dtype).

    ``grouping``: a :class:`ReplicaGrouping` (``None``: all replicas) or a torch process
    group (e.g. ``grouped_device_mesh(plan)["dp_replica"].get_group()``). Works for any
    grouping, including non-constant ones a plan cannot hold; ``sk.shard`` does this itself
    for a plan's ``replicas``. DTensor gradients are averaged shard by shard.

    >>> loss.backward(); average_gradients(model, ReplicaGrouping(8, group_size=2))   # doctest: +SKIP
    """
    params = module.parameters() if isinstance(module, nn.Module) else module
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if isinstance(grouping, ReplicaGrouping) or grouping is None:
        group = replica_group(grouping, transpose=transpose)
        pg, size = group.process_group, group.size
    else:
        if transpose:
            raise UsageError("average_gradients(transpose=True) needs a ReplicaGrouping, not a process group")
        group, pg, size = None, grouping, dist.get_world_size(grouping)
    if pg is None or size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    with torch.no_grad():
        for dtype in sorted(by_dtype, key=str):
            bucket = by_dtype[dtype]
            flat = torch.cat([g.reshape(-1) for g in bucket])
            what = "average_gradients (all gradients of one dtype, flattened)"
            if group is not None and _wants_check(None, pg, f"{what} {dtype}"):  # once per group and dtype
                _check_same(flat, group, what)
            dist.all_reduce(flat, group=pg)
            flat /= size
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


__all__ = ["REDUCE_OPS", "all_gather", "all_reduce", "average_gradients", "broadcast", "check_same_layout",
           "reduce_scatter"]
