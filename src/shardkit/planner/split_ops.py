"""How torch ops carry a tensor-parallel split: which keep the split features apart, and where.

:func:`follow_split` says where a column-parallel split lies in the output of one torch op
given where it lies in the inputs (:class:`Split`), for the ops known to keep the split
features apart (elementwise ops, casts, reshapes, transposes, cuts, joins, reductions and norms
over other dims, matmuls, linear maps and attention that do not contract over them), and raises
:class:`Mixes` naming any other op (a norm, softmax or sum over them, a matmul contracting
over them, attention over one head). :mod:`shardkit.planner.tp_infer` pairs layers through
it; :mod:`shardkit.planner.split_activations` follows split activations through a whole
forward with it.

torch has no such table for eager code (DTensor's sharding rules need process groups and
DTensors; ``torch.export`` needs a traceable model), so the ops are listed here by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class Split:
    """Where the tensor-parallel split of a column layer's output lies in a tensor computed from
    it: dim ``dim`` is ``outer x size x inner`` (row-major) and the ranks cut ``size`` into equal
    runs (each keeps its ``inner`` block whole: a head's features after ``view(..., heads,
    head_dim)`` are ``head_dim``, not ``dim``). Two splits of one dim agree when their ``outer``
    do (each rank holds the same fraction of every outer block)."""

    dim: int
    outer: int
    size: int

    @classmethod
    def of_output(cls, tensor: torch.Tensor) -> Split:
        """The split of a column layer's output: its last dim, element by element."""
        return cls(tensor.dim() - 1, 1, tensor.shape[-1])


class Mixes(Exception):
    """An op computes across the split features (``certain``: a norm, reduction, contraction or
    attention over them) or shardkit cannot tell that it does not."""

    def __init__(self, reason: str, certain: bool = False):
        super().__init__(reason)
        self.certain = certain


#: Ops computing each output element from the same element of every input (broadcast).
_ELEMENTWISE = frozenset(
    "abs add addcdiv addcmul clamp clamp_max clamp_min clip cos div dropout elu eq erf erfc exp expm1 floordiv ge "
    "gelu gt hardsigmoid hardswish hardtanh le leaky_relu lerp log log1p logical_and logical_not logical_or lt "
    "masked_fill maximum minimum mish mul ne neg pos pow reciprocal relu relu6 rsqrt sigmoid sign silu sin softplus "
    "sqrt square sub tanh true_divide truediv where".split())
#: Ops whose output is their first argument, cast or copied (other tensors give only a dtype).
_CASTS = frozenset("bfloat16 clone contiguous detach double float half to type type_as".split())
#: Ops that only reshape their first argument (row-major), and ones that broadcast it.
_RESHAPES = frozenset("flatten reshape reshape_as squeeze unflatten unsqueeze view view_as".split())
_EXPANDS = frozenset("broadcast_to expand expand_as".split())
#: Reductions and scans over the dims named by their ``dim`` argument (all dims without one).
_REDUCTIONS = frozenset("all amax amin any argmax argmin cumprod cumsum log_softmax logsumexp max mean min "
                        "nanmean nansum prod softmax std sum var".split())
#: Ops whose tensors other than the first give only a dtype or a shape (no values, no gradient).
SHAPE_ONLY = _CASTS | _RESHAPES | _EXPANDS
#: Ops cutting their first argument along a dim.
_CUTTERS = frozenset("chunk narrow split split_with_sizes tensor_split unbind".split())


def op_name(func: Any) -> str:
    """``func``'s name without dunder, reflected (``__radd__``) or in-place (``add_``) decoration."""
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name[:1] in "ri" and name[1:] in _ELEMENTWISE:
            name = name[1:]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _arg(args: tuple, kwargs: dict, position: int, *names: str) -> Any:
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return args[position] if len(args) > position else None


def _reshaped(split: Split, before: torch.Size, after: torch.Size) -> Split:
    """``split`` after a row-major reshape from ``before`` to ``after``."""
    inner = before[split.dim] // (split.outer * split.size)
    pre, stride = math.prod(before[:split.dim]) * split.outer, math.prod(before[split.dim + 1:]) * inner
    k = next((k for k in range(len(after)) if math.prod(after[:k + 1]) > pre), None)
    if k is not None and pre % math.prod(after[:k]) == 0 and after[k] % (pre // math.prod(after[:k])) == 0:
        outer = pre // math.prod(after[:k])
        avail, rest = after[k] // outer, math.prod(after[k + 1:])
        if avail >= split.size and avail % split.size == 0 and rest * (avail // split.size) == stride:
            return Split(k, outer, split.size)
        if avail < split.size and split.size % avail == 0 and rest == stride * (split.size // avail):
            return Split(k, outer, avail)
    raise Mixes(f"is reshaped from {list(before)} to {list(after)} across its split features")


def _aligned(split: Split, ndim: int, out_ndim: int) -> Split:
    return Split(split.dim + out_ndim - ndim, split.outer, split.size)


def _only(found: list[Split], what: str) -> Split:
    """The one split ``found`` agrees on, else :class:`Mixes`."""
    if any((s.dim, s.outer) != (found[0].dim, found[0].outer) for s in found):
        raise Mixes(f"is combined in {what} with a tensor split along another dim")
    return found[0]


def _whole_across(tensors: list[torch.Tensor], splits: dict[int, Split], dim: int, out_ndim: int, what: str) -> None:
    """:class:`Mixes` when a tensor that is not split has more than one element along output dim ``dim``."""
    for tensor in tensors:
        position = dim - (out_ndim - tensor.dim())
        if id(tensor) not in splits and 0 <= position < tensor.dim() and tensor.shape[position] > 1:
            raise Mixes(f"is combined in {what} with a whole tensor of shape {list(tensor.shape)} across its "
                        f"split features")


def _cut(split: Split, tensor: torch.Tensor, dim: int, width: int, target: int, what: str) -> Split:
    """The split of a piece ``width`` wide cut from ``tensor`` along ``dim``, the piece's dim ``target``."""
    if dim != split.dim:
        return split
    if width != tensor.shape[dim] and (split.outer != 1 or split.size != tensor.shape[dim]):
        raise Mixes(f"is cut by {what} inside its split features")
    return Split(target, split.outer, split.size if width == tensor.shape[dim] else width)


def _getitem(split: Split, tensor: torch.Tensor, index: Any, out: torch.Tensor) -> Split:
    """``split`` in ``tensor[index]``: ints, slices, ``None``, ``...`` and one list or 1-D tensor
    (which keeps its dim in place, as a slice does) on another dim."""
    index = index if isinstance(index, tuple) else (index,)
    lists = [i for i in index if isinstance(i, list) or isinstance(i, torch.Tensor) and i.dim() == 1]
    others = [i for i in index if not any(i is j for j in lists)]
    if len(lists) > 1 or any(isinstance(i, bool) or not isinstance(i, (int, slice)) and i is not None
                             and i is not Ellipsis for i in others) or (lists and any(isinstance(i, int) for i in others)):
        raise Mixes("is indexed with several or many-dim tensors or lists (__getitem__)")
    position = next((n for n, i in enumerate(index) if i is Ellipsis), None)
    if position is not None:
        taken = sum(i is not None for i in index) - 1
        index = index[:position] + (slice(None),) * (tensor.dim() - taken) + index[position + 1:]
    source = target = 0
    for entry in index:
        if entry is None:
            target += 1
            continue
        if source == split.dim:
            if not isinstance(entry, slice):
                raise Mixes("has some of its split features picked (__getitem__)")
            return _cut(split, tensor, source, out.shape[target], target, "__getitem__")
        source, target = source + 1, target + (not isinstance(entry, int))
    return Split(target + split.dim - source, split.outer, split.size)


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, splits: dict[int, Split], what: str) -> Split:
    """The split of ``out = a @ b``; :class:`Mixes` when it contracts over the split features."""
    if a.dim() < 2 or b.dim() < 2:
        raise Mixes(f"is multiplied with a vector in {what}")
    n = out.dim()
    found = []
    for tensor, contracted, kept, position in ((a, a.dim() - 1, a.dim() - 2, n - 2), (b, b.dim() - 2, b.dim() - 1, n - 1)):
        split = splits.get(id(tensor))
        if split is None:
            continue
        if split.dim == contracted:
            raise Mixes(f"is contracted over its split features in {what}", certain=True)
        found.append(Split(position, split.outer, split.size) if split.dim == kept else _aligned(split, tensor.dim(), n))
    split = _only(found, what)
    if split.dim < n - 2:
        _whole_across([a, b], splits, split.dim, n, what)
    return split


def _attention(args: tuple, kwargs: dict, out: torch.Tensor, splits: dict[int, Split], what: str) -> Split:
    """The split of ``scaled_dot_product_attention``'s output: only a batch dim (heads) may be split."""
    q, k, v, mask = (_arg(args, kwargs, i, name) for i, name in enumerate(("query", "key", "value", "attn_mask")))
    found = []
    for tensor in (q, k, v):
        split = splits.get(id(tensor))
        if split is None:
            continue
        if split.dim >= tensor.dim() - 2:
            raise Mixes(f"enters {what} split inside a head (attention contracts over a head's features and "
                        f"attends over the sequence; it is split only between whole heads, after a view as "
                        f"[..., heads, head_dim] with more than one head)", certain=True)
        found.append(_aligned(split, tensor.dim(), out.dim()))
    split = _only(found, what)
    _whole_across([t for t in (q, k, v, mask) if isinstance(t, torch.Tensor)], splits, split.dim, out.dim(), what)
    return split


def _reduced(split: Split, tensor: torch.Tensor, dim: Any, outs: list[torch.Tensor], what: str) -> dict[int, Split]:
    """The splits of the outputs of a reduction or scan of ``tensor`` over ``dim``."""
    if not isinstance(dim, (int, list, tuple)) or isinstance(dim, bool):
        raise Mixes(f"passes through {what} over all its dims")
    dims = {_norm_dim(d, tensor.dim()) for d in ([dim] if isinstance(dim, int) else dim)}
    if split.dim in dims:
        raise Mixes(f"passes through {what} over its split features", certain=True)
    shift = sum(d < split.dim for d in dims)
    return {id(o): split if o.dim() == tensor.dim() else Split(split.dim - shift, split.outer, split.size)
            for o in outs}


def _elementwise(tensors: list[torch.Tensor], outs: list[torch.Tensor], splits: dict[int, Split], what: str
                 ) -> dict[int, Split]:
    out = outs[0]
    if any(o.shape != out.shape for o in outs) or any(t.dim() > out.dim() for t in tensors):
        raise Mixes(f"passes through {what}, whose output is not shaped as its inputs")
    split = _only([_aligned(splits[id(t)], t.dim(), out.dim()) for t in tensors if id(t) in splits], what)
    if any(t.shape[splits[id(t)].dim] != out.shape[split.dim] for t in tensors if id(t) in splits):
        raise Mixes(f"is broadcast across its split features in {what}")
    _whole_across(tensors, splits, split.dim, out.dim(), what)
    return {id(o): split for o in outs}


def _joined(name: str, args: tuple, kwargs: dict, out: torch.Tensor, splits: dict[int, Split]) -> Split:
    """The split of ``torch.cat`` / ``torch.stack``'s output."""
    pieces = [t for t in _arg(args, kwargs, 0, "tensors") if isinstance(t, torch.Tensor)]
    dim = _norm_dim(_arg(args, kwargs, 1, "dim") or 0, out.dim())
    found = [splits[id(t)] for t in pieces if id(t) in splits]
    split = _only(found, name)
    if name == "stack":
        if any(id(t) not in splits and t.shape[split.dim] > 1 for t in pieces):
            raise Mixes("is stacked with a whole tensor (stack)")
        return Split(split.dim + (dim <= split.dim), split.outer, split.size)
    if dim == split.dim:
        raise Mixes(f"is concatenated along its split features ({name})")
    _whole_across(pieces, splits, split.dim, out.dim(), name)
    return split


def follow_split(func: Any, args: tuple, kwargs: dict, out: Any, splits: dict[int, Split]) -> dict[int, Split]:
    """Where the split lies in each tensor of ``out`` (``{id: split}``), given ``splits``, the
    splits of ``func``'s inputs computed from a split output (``{id: split}``). Only ops known to
    keep the split features apart are followed (elementwise ops, casts, reshapes, transposes,
    cuts, joins, reductions and norms over other dims, matmuls and attention that do not contract
    over them); any other op raises :class:`Mixes` naming it.

    >>> x = torch.zeros(2, 7, 64, device="meta")
    >>> heads = x.view(2, 7, 4, 16)
    >>> follow_split(torch.Tensor.view, (x, 2, 7, 4, 16), {}, heads, {id(x): Split.of_output(x)})[id(heads)]
    Split(dim=2, outer=1, size=4)
    """
    name = op_name(func)
    if name == "setitem":
        raise Mixes("is written into another tensor (__setitem__)")
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not outs:
        return {}  # sizes, dtypes, ...
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    first = args[0] if args else next(iter(kwargs.values()), None)
    split = splits.get(id(first)) if isinstance(first, torch.Tensor) else None
    own = split is not None and name in _CASTS | _RESHAPES | _EXPANDS | _REDUCTIONS | _CUTTERS | {
        "getitem", "transpose", "swapaxes", "swapdims", "permute", "t", "layer_norm", "rms_norm"}
    if name in ("max", "min") and isinstance(_arg(args, kwargs, 1, "other"), torch.Tensor):
        own = False  # elementwise maximum
    if own and name in _CASTS:
        return {id(o): split for o in outs}
    if own and name in _RESHAPES:
        return {id(outs[0]): _reshaped(split, first.shape, outs[0].shape)}
    if own and name in _EXPANDS:
        return {id(outs[0]): _aligned(split, first.dim(), outs[0].dim())}
    if own and name in ("transpose", "swapaxes", "swapdims", "t") and first.dim() > 1:
        a, b = (0, 1) if name == "t" else (_norm_dim(_arg(args, kwargs, i + 1, f"dim{i}"), first.dim()) for i in (0, 1))
        moved = b if split.dim == a else a if split.dim == b else split.dim
        return {id(outs[0]): Split(moved, split.outer, split.size)}
    if own and name == "permute":
        dims = kwargs.get("dims", args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:])
        return {id(outs[0]): Split([_norm_dim(d, first.dim()) for d in dims].index(split.dim), split.outer, split.size)}
    if own and name == "getitem":
        return {id(outs[0]): _getitem(split, first, args[1], outs[0])}
    if own and name in _CUTTERS:
        dim = _norm_dim(_arg(args, kwargs, 1 if name in ("narrow", "unbind") else 2, "dim") or 0, first.dim())
        if name == "unbind":
            if dim == split.dim:
                raise Mixes("is unbound along its split features")
            return {id(o): Split(split.dim - (dim < split.dim), split.outer, split.size) for o in outs}
        return {id(o): _cut(split, first, dim, o.shape[dim], dim, name) for o in outs}
    if own and name in ("layer_norm", "rms_norm"):
        shape = _arg(args, kwargs, 1, "normalized_shape")
        if split.dim >= first.dim() - (1 if isinstance(shape, int) else len(shape)):
            raise Mixes(f"passes through {name}, which normalises over its split features", certain=True)
        return {id(o): split for o in outs}
    if own and name in _REDUCTIONS:
        return _reduced(split, first, _arg(args, kwargs, 1, "dim"), outs, name)
    if name in _ELEMENTWISE or name in ("max", "min"):
        return _elementwise(tensors, outs, splits, name)
    if name in ("matmul", "bmm", "mm"):
        return {id(outs[0]): _matmul(_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other", "mat2"), outs[0],
                                     splits, name)}
    if name == "baddbmm":
        bias, a, b = (_arg(args, kwargs, i, key) for i, key in enumerate(("input", "batch1", "batch2")))
        split = _matmul(a, b, outs[0], splits, name)
        _whole_across([bias], splits, split.dim, outs[0].dim(), name)
        return {id(outs[0]): split}
    if name == "scaled_dot_product_attention":
        return {id(outs[0]): _attention(args, kwargs, outs[0], splits, name)}
    if name in ("cat", "concat", "concatenate", "stack"):
        return {id(outs[0]): _joined(name, args, kwargs, outs[0], splits)}
    raise Mixes(f"passes through {name or func}, which shardkit does not know to keep its split features apart")


__all__ = ["SHAPE_ONLY", "Mixes", "Split", "follow_split", "op_name"]
