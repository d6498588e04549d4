"""Ops that mix positions, found on the meta device by following the sequence dim op by op.

Context parallel (``sp``) gives each rank chunks of the sequence through the whole model, and
Megatron sequence parallel splits the residual stream along the sequence between
tensor-parallel regions. An op whose output at one position reads other positions (a
convolution over time, a scan or cumulative sum, a recurrence, pooling, an FFT, a shift by
padding, slicing or rolling, a sort over positions, a softmax or matrix product over them)
then computes from the rank's chunk alone: no error, wrong numbers from each chunk's start.

:class:`SequenceWatch` watches one forward on meta tensors run with a *distinctive* sequence
length (a prime that no size of the model is a multiple of, so a dim of that size, or a
multiple of it once tokens are flattened together, is the sequence;
:func:`~shardkit.planner.sequence_checks.trace_sequence` runs it) and follows, at torch's
dispatch level (aten ops with explicit dims), every tensor computed from the sequence. Each op
on such a tensor either acts per position (elementwise ops, matrix products over features,
norms over features, views, lookups) or is recorded as a :class:`Mixer` of the innermost
module running. An op the rules do not know is a mixer too: shardkit cannot show it keeps
positions apart. So is an op combining the sequence with a tensor as long as it that was not
computed from the inputs or positions (a table sliced by the length: a chunk's length under
context parallel).

Integer tensors computed from activations' values (a router's top-k experts) are *routing*
indices: gathering the sequence by them and scattering back (a mixture of experts' dispatch)
moves whole positions and is accepted; counting them over the sequence (which experts any token
chose) only steers the loop. Gathering by indices made from positions or constants is a shift.

A causal 1-D convolution (``padding = dilation x (kernel - 1)`` and the outputs past the input's
length cut off, as LFM2's and Mamba's short convolutions do) is recorded as a
:class:`CausalConv`: it needs only the ``padding`` positions before each chunk, which
:mod:`shardkit.runtime.halo` passes between neighbouring ranks.

torch has no analysis of which dims an eager op mixes (``torch.export`` needs a traceable
model); this follows the same idea as :mod:`shardkit.planner.dataflow` for the sequence dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class Mixer:
    """An op that mixes positions: the innermost module running it (``""``: the model's own
    forward), that module's class, the aten op, what it does to the sequence, and the call itself."""

    module: str
    kind: str
    op: str
    why: str
    call: tuple | None = field(default=None, compare=False, repr=False)  # (aten op, args, kwargs) as run


@dataclass(frozen=True)
class CausalConv:
    """A causal 1-D convolution over the sequence run by ``module``: each output reads the
    ``padding`` (= ``dilation x (kernel - 1)``) positions before it; ``F.conv1d(x, weight,
    padding=padding, dilation=dilation)`` with the outputs past the input's length cut off; ``weight``
    names the parameter it convolves with."""

    module: str
    kernel: int
    dilation: int
    padding: int
    weight: str = ""  # the parameter the convolution's weight is (a view of), when it is one


@dataclass
class SequenceTrace:
    """What :func:`trace_sequence` found; ``error`` when the forward failed on meta tensors."""

    length: int
    mixers: list[Mixer] = field(default_factory=list)
    convs: list[CausalConv] = field(default_factory=list)
    error: str | None = None


# -- op rules -------------------------------------------------------------------------------------------
#: Ops computing each output element from the same element of their inputs, or only from shapes.
_PER_ELEMENT = frozenset(
    "_to_copy clone copy detach alias lift_fresh lift_fresh_copy empty_like zeros_like ones_like full_like "
    "rand_like randn_like fill zero native_dropout bernoulli masked_fill where _conj resolve_conj "
    "resolve_neg view_as_real view_as_complex new_empty new_zeros new_ones new_full new_empty_strided "
    "_local_scalar_dense embedding one_hot bernoulli uniform normal exponential geometric cauchy "
    "log_normal random polar complex real imag angle".split())
#: Ops that only reshape, move or broadcast dims (row-major views keep the sequence dim whole: its size is prime).
_SHAPES = frozenset("view _unsafe_view reshape _reshape_alias expand permute transpose t unsqueeze squeeze stack "
                    "contiguous".split())
#: Ops reading whole windows of their spatial dims (the last ``n`` of a ``[batch, channels, *spatial]`` input).
_WINDOWS = ("pool", "upsample", "im2col", "col2im", "pixel_shuffle", "pixel_unshuffle")
#: Matrix products: (first operand, second operand); the first contracts its last dim, the second its dim -2.
_PRODUCTS = {"mm": ("self", "mat2"), "bmm": ("self", "mat2"), "addmm": ("mat1", "mat2"),
             "baddbmm": ("batch1", "batch2"), "addbmm": ("batch1", "batch2"), "_grouped_mm": ("self", "mat2"),
             "mv": ("self", "vec"), "dot": ("self", "tensor"), "vdot": ("self", "other")}
#: What an op along the sequence does, for messages.
_ALONG = {
    "cumsum": "computes a cumulative sum over the sequence (a scan)",
    "cumprod": "computes a cumulative product over the sequence (a scan)",
    "cummax": "computes a running maximum over the sequence (a scan)",
    "cummin": "computes a running minimum over the sequence (a scan)",
    "logcumsumexp": "computes a cumulative log-sum-exp over the sequence (a scan)",
    "sort": "sorts positions", "argsort": "sorts positions", "topk": "picks the top positions",
    "kthvalue": "ranks positions", "median": "ranks positions", "mode": "ranks positions",
    "_softmax": "takes a softmax over positions (attention that shardkit does not run as ring attention)",
    "_log_softmax": "takes a log-softmax over positions", "flip": "reverses the sequence",
    "roll": "rolls the sequence (a shift)", "unfold": "takes sliding windows over the sequence",
    "select": "picks single positions (x[:, i]: a loop over positions, as a recurrence or a scan runs, or one "
              "position used for all)",
    "unbind": "splits the sequence into single positions (a loop over positions: a recurrence or a scan)",
    "cat": "concatenates along the sequence (positions prepended or appended: a shift)",
    "repeat_interleave": "repeats positions",
}
#: Ops acting along the dims their ``dim`` argument names (every dim without one).
_ALONG_DIMS = frozenset(
    "sum mean prod amax amin max min var std var_mean std_mean norm linalg_vector_norm logsumexp any all argmax "
    "argmin nansum nanmean count_nonzero cumsum cumprod cummax cummin logcumsumexp sort argsort topk kthvalue median "
    "nanmedian mode _softmax _log_softmax flip roll unfold diff repeat_interleave bincount histc unique _unique2 "
    "unique_consecutive unique_dim".split())
#: Reductions over the sequence that only count routing decisions (which experts any token chose).
_COUNTS = frozenset("sum any all amax amin max min count_nonzero sort argsort topk bincount histc unique "
                    "_unique2 unique_consecutive nonzero".split())
#: Ops gathering along a dim by an index tensor, and ones writing along a dim at an index tensor.
_GATHERS = frozenset("index_select gather take_along_dim".split())
_SCATTERS = frozenset("index_add index_copy index_fill index_reduce scatter scatter_add scatter_reduce".split())
_CUTS = frozenset("split split_with_sizes unsafe_split unsafe_split_with_sizes tensor_split chunk narrow".split())
_SCALED_DOT = ("_scaled_dot_product", "scaled_dot_product", "_flash_attention", "_efficient_attention")
#: Norms: where their normalised dims are, from the arguments.
_NORMS = frozenset("native_layer_norm _fused_rms_norm rms_norm layer_norm".split())


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``func``'s arguments by schema name, defaults filled in."""
    bound = {}
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            bound[argument.name] = args[i]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _dims(value: Any, ndim: int) -> set[int] | None:
    """Dims named by a ``dim`` argument, normalised; ``None`` for "every dim" (a missing or empty list)."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return None
    values = value if isinstance(value, (list, tuple)) else [value]
    return {int(d) % ndim if ndim else 0 for d in values}


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class SequenceWatch(TorchDispatchMode):
    """Follows the tensors computed from the sequence; see the module docstring. ``split_only``: the
    followed tensors are sequence-split DTensors (Megatron sequence parallel), which torch refuses to
    combine with a plain tensor of more than one element."""

    def __init__(self, length: int, stack: list[str], kinds: dict[str, str], split_only: bool = False,
                 params: dict[int, str] | None = None):
        super().__init__()
        self.length, self.split_only = length, split_only
        self.stack, self.kinds, self.params = stack, kinds, params or {}
        self.carrying: dict[int, tuple[torch.Tensor, bool]] = {}  # id -> (tensor kept alive, routing/routed)
        self.pending: dict[int, tuple[torch.Tensor, CausalConv, int, int]] = {}  # conv outputs awaiting their cut
        self.mixers: list[Mixer] = []
        self.convs: list[CausalConv] = []
        self.paused = 0

    # -- bookkeeping -----------------------------------------------------------------------------------
    def mark(self, tensor: torch.Tensor, routing: bool = False) -> None:
        self.carrying[id(tensor)] = (tensor, routing)

    def seq_dims(self, tensor: Any) -> set[int]:
        """Dims of a tensor computed from the sequence whose size is a multiple of the distinctive length."""
        if not isinstance(tensor, torch.Tensor) or id(tensor) not in self.carrying:
            return set()
        return {d for d, size in enumerate(tensor.shape) if size >= self.length and size % self.length == 0}

    def routing(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and self.carrying.get(id(tensor), (None, False))[1]

    def _mixes(self, op: str, why: str, call: tuple | None = None) -> None:
        module = self.stack[-1] if self.stack else ""
        self.mixers.append(Mixer(module, self.kinds.get(module, ""), op, why, call))

    # -- dispatch --------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return _STAND_IN_SCALARS[args[0].dtype.is_floating_point or args[0].dtype.is_complex]
        out = func(*args, **kwargs)
        if self.paused:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        name = name[:-1] if name.endswith("_") and not name.endswith("__") else name  # in place: as its op
        for tensor in inputs:
            if id(tensor) in self.pending:
                self._cut_conv(name, func, args, kwargs, out, tensor)
                return out
        carried = [t for t in inputs if id(t) in self.carrying]
        if not carried:
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs:  # asserts, comparisons of whole tensors: they steer the code, they compute nothing
            return out
        written = {id(t) for t in outs}  # a buffer written in place (index_add_) becomes part of the sequence
        whole = [t for t in inputs if id(t) not in self.carrying and id(t) not in written]
        if self.split_only and any(t.numel() > 1 for t in whole):
            shape = next(list(t.shape) for t in whole if t.numel() > 1)
            self._mixes(name, f"combines the split sequence with a tensor that is not split (shape {shape}: a "
                              f"parameter, or a tensor made from the inputs or sizes)", (func, args, kwargs))
        elif not self.split_only and any(self._sized(t) for t in whole):
            shape = next(list(t.shape) for t in whole if self._sized(t))
            self._mixes(name, f"combines the sequence with a tensor as long as it that is not computed from the "
                              f"inputs or the positions (shape {shape}: a table sliced or a range made by the "
                              f"sequence's length, which under context parallel is a chunk's)", (func, args, kwargs))
        try:
            routed = self._follow(name, func, _bind(func, args, kwargs), carried, outs)
        except _Mixes as exc:
            self._mixes(name, str(exc), (func, args, kwargs))
            routed = False
        if routed is None:  # a causal convolution waiting for its cut
            return out
        from_values = any(_is_float(t) for t in carried) or any(self.routing(t) for t in carried)
        for tensor in outs:
            self.mark(tensor, routed or (not _is_float(tensor) and from_values))
        return out

    def _cut_conv(self, name: str, func: Any, args: tuple, kwargs: dict, out: Any, conv_out: torch.Tensor) -> None:
        """A causal convolution's output may only be cut back to the input's first ``length`` positions."""
        _, conv, dim, length = self.pending[id(conv_out)]
        bound = _bind(func, args, kwargs)
        if name == "slice" and bound.get("self") is conv_out and int(bound["dim"]) % conv_out.dim() == dim \
                and (bound.get("start") or 0) == 0 and bound.get("step", 1) == 1 \
                and isinstance(out, torch.Tensor) and out.shape[dim] == length:
            self.mark(out)
            if conv not in self.convs:
                self.convs.append(conv)
            return
        self._mixes("convolution", f"is a 1-D convolution over the sequence whose outputs past the input's length "
                                   f"are used ({name} of its output), so it reads positions after each output's own")

    # -- rules -----------------------------------------------------------------------------------------
    def _follow(self, name: str, func: Any, bound: dict, carried: list[torch.Tensor], outs: list[torch.Tensor]
                ) -> bool | None:
        """Whether the outputs are routed rows; :class:`_Mixes` when the op mixes positions; ``None``
        when the op is a causal convolution left pending."""
        first = bound.get("self", bound.get("input", carried[0]))
        first = first if isinstance(first, torch.Tensor) else carried[0]
        seq = self.seq_dims(first)
        routed = any(self.routing(t) and _is_float(t) for t in carried)
        counting = all(not _is_float(t) and self.routing(t) for t in carried)
        if name in _PER_ELEMENT or torch.Tag.pointwise in func.tags or name in _SHAPES:
            return routed
        if name == "convolution":
            return self._convolution(bound, outs)
        if name in _PRODUCTS:
            a, b = (bound.get(key) for key in _PRODUCTS[name])
            if (isinstance(a, torch.Tensor) and a.dim() - 1 in self.seq_dims(a)) or \
                    (isinstance(b, torch.Tensor) and b.dim() >= 2 and b.dim() - 2 in self.seq_dims(b)) or \
                    (isinstance(b, torch.Tensor) and b.dim() == 1 and 0 in self.seq_dims(b)):
                raise _Mixes("contracts over positions (a matrix product along the sequence: attention or token "
                             "mixing that shardkit does not run as ring attention)")
            return routed
        if name.startswith(_SCALED_DOT):
            raise _Mixes("is attention over positions that shardkit does not run as ring attention")
        if name in _NORMS:
            shape = bound.get("normalized_shape") or ()
            if any(d >= first.dim() - len(shape) for d in seq):
                raise _Mixes("normalises over the sequence dim")
            return routed
        if name in ("native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
                    "_native_batch_norm_legit_no_training", "instance_norm"):
            normalised = set(range(1, first.dim())) if name == "native_group_norm" else \
                {d for d in range(first.dim()) if d != 1}
            if (name != "_native_batch_norm_legit_no_training" and bound.get("training", True)) and seq & normalised:
                raise _Mixes("computes its statistics over positions (a batch or group norm over the sequence)")
            return routed
        if any(key in name for key in _WINDOWS):
            spatial = {d for d in range(2, first.dim())}
            if seq & spatial:
                raise _Mixes(f"reads windows of positions ({name}: pooling or resampling over the sequence)")
            return routed
        if name in ("constant_pad_nd",) or name.startswith(("reflection_pad", "replication_pad", "_pad")):
            pad = list(bound.get("pad") or bound.get("padding") or ())
            padded = {first.dim() - 1 - i // 2 for i, p in enumerate(pad) if p}
            if seq & padded:
                raise _Mixes("pads the sequence dim (positions shifted: a causal shift or convolution built by hand)")
            return routed
        if name.startswith("_fft"):
            if seq & (_dims(bound.get("dim"), first.dim()) or set(range(first.dim()))):
                raise _Mixes("is an FFT over the sequence")
            return routed
        if name == "index":
            return self._index(first, bound.get("indices") or [], seq, routed)
        if name in ("index_put", "_index_put_impl"):
            return self._index(first, bound.get("indices") or [], self._sized(first), routed, writes=True)
        if name == "slice":
            dim = int(bound["dim"]) % first.dim()
            size = first.shape[dim]
            start, end, _ = slice(bound.get("start"), bound.get("end"), bound.get("step", 1)).indices(size)
            # an empty cut holds no position (torch.tensor_split's piece past the end: Jamba's scan in transformers 5.25)
            if dim in seq and start < end and (start, end, bound.get("step", 1)) != (0, size, 1):
                raise _Mixes(f"cuts the sequence to positions [{start}:{end}] (a shift, or a part of the sequence "
                             f"taken as the whole)")
            return routed
        dims = _dims(next((bound[k] for k in ("dim", "dims", "dimension") if k in bound), None), first.dim())
        if name in _GATHERS or name in _SCATTERS:
            target = self._sized(first) if name in _SCATTERS else seq
            if dims is not None and target & dims and not self.routing(bound.get("index")):
                raise _Mixes("moves positions by indices computed from positions or constants (a shift)")
            return routed or (name in _GATHERS and bool(target & (dims or set())))
        if name in _CUTS:
            cut = seq & (dims or {0})
            if cut and not routed and any(o.shape[d] != first.shape[d] for o in outs for d in cut if o.dim() == first.dim()):
                raise _Mixes("cuts the sequence into pieces")
            return routed
        if name == "cat":
            # empty pieces add no position: one whole piece alone is the identity (a scan's outputs joined)
            pieces = [t for t in bound.get("tensors") or () if isinstance(t, torch.Tensor) and t.numel()]
            dim = int(bound.get("dim") or 0) % max(outs[0].dim(), 1)
            if len(pieces) > 1 and any(dim in self._sized(t) for t in pieces) \
                    and not all(self.routing(t) for t in carried):
                raise _Mixes(_ALONG["cat"])
            return routed
        if name == "nonzero":
            return routed or counting
        if name in ("select", "unbind"):
            if seq & (dims or {0}):
                raise _Mixes(_ALONG[name])
            return routed
        if name in _ALONG_DIMS:
            if seq & (set(range(first.dim())) if dims is None else dims):
                if counting and name in _COUNTS:
                    return True
                if not _is_float(first) and name not in _ALONG:
                    raise _Mixes(f"reduces the tokens' ids or positions over the sequence ({name}), which differ "
                                 f"between the ranks' chunks (a length or scaling taken from the longest position?)")
                raise _Mixes(_ALONG.get(name, f"reduces over the sequence ({name}: pooling or a statistic over "
                                               f"positions)"))
            return routed
        if name in ("repeat", "tile"):
            repeats = list(bound.get("repeats") or bound.get("dims") or ())
            offset = len(repeats) - first.dim()
            if any(repeats[offset + d] != 1 for d in seq if offset + d >= 0):
                raise _Mixes("repeats the sequence")
            return routed
        raise _Mixes(f"is not an op shardkit knows to act position by position ({name})")

    def _sized(self, tensor: Any) -> set[int]:
        """Dims of any tensor whose size is a multiple of the distinctive length (a target of a scatter)."""
        if not isinstance(tensor, torch.Tensor):
            return set()
        return {d for d, size in enumerate(tensor.shape) if size >= self.length and size % self.length == 0}

    def _index(self, source: torch.Tensor, indices: list, seq: set[int], routed: bool, writes: bool = False) -> bool:
        """``source[indices]`` (or a write there): an index on a sequence dim must be a routing index."""
        dim = 0
        hit = False
        for index in indices:
            if index is None:
                dim += 1
                continue
            width = index.dim() if index.dtype == torch.bool else 1
            if seq & set(range(dim, dim + width)):
                if not self.routing(index):
                    raise _Mixes("picks positions by indices computed from positions or constants (a shift)")
                hit = True
            dim += width
        return routed or (hit and not writes)

    def _convolution(self, bound: dict, outs: list[torch.Tensor]) -> bool | None:
        x, weight = bound["input"], bound["weight"]
        seq = self.seq_dims(x)
        kernel = list(weight.shape[2:])
        spatial = {2 + i for i, k in enumerate(kernel)}
        if 1 in seq:
            raise _Mixes("is a convolution across the sequence dim held as channels (token mixing)")
        mixing = {d for d in seq & spatial if kernel[d - 2] > 1}
        if not mixing:
            return False
        stride, padding, dilation = (list(bound[key]) for key in ("stride", "padding", "dilation"))
        if len(kernel) == 1 and not bound.get("transposed") and stride == [1] and \
                padding[0] == dilation[0] * (kernel[0] - 1):
            base = weight
            while base._base is not None:
                base = base._base
            conv = CausalConv(self.stack[-1] if self.stack else "", kernel[0], dilation[0], padding[0],
                              self.params.get(id(base), ""))
            self.pending[id(outs[0])] = (outs[0], conv, 2, x.shape[2])
            return None
        raise _Mixes(f"is a convolution over the sequence (conv{len(kernel)}d, kernel {kernel}, padding {padding}, "
                     f"stride {stride}) that is not causal: shardkit passes neighbours' positions only to a 1-D "
                     f"convolution with padding = dilation x (kernel - 1) whose outputs past the input are cut off")


#: What ``.item()`` of a meta tensor gives while tracing (ints and bools: 0, floats: 0.0): the values steer
#: data-dependent loops (a mixture of experts' "skip this expert"), never the shapes followed here.
_STAND_IN_SCALARS = {False: 0, True: 0.0}


class _Mixes(Exception):
    """An op reads other positions; the message says how."""


__all__ = ["CausalConv", "Mixer", "SequenceTrace", "SequenceWatch"]
