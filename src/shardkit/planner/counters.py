"""What torch does not count for shardkit's planner, counted on any tensors (real, fake, meta):
FLOPs of kernels torch's ``FlopCounterMode`` has no formula for (:data:`EXTRA_FLOPS`), kernel
launches, matrix products and the bytes the non-matmul operators move (:class:`OpCounter`), the
operators a tensor-parallel rank would run on DTensors (:class:`DTensorPaths`), the one count
of activation bytes, the storages autograd saves for backward (:func:`saved_storages`), and the
bytes alive of the storages operators make, by where they were made (:class:`Births`).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from math import prod
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from ..families.on_meta import meta_call

_aten = torch.ops.aten


def _cpu_flash_flops(*args: object, **kwargs: object) -> int:
    """torch's count for the GPU flash kernel, which takes (query, key, value, ...) as the CPU one does."""
    return flop_registry[_aten._scaled_dot_product_flash_attention](*args, **kwargs)


_cpu_flash_flops._get_raw = True  # type: ignore[attr-defined]  # called as registered formulas are


def _grouped_mm_flops(a_shape: tuple, b_shape: tuple, *args: object, out_shape: tuple, **kwargs: object) -> int:
    """A grouped product (a mixture of experts' experts): each output element is one dot product
    over ``a``'s last dim, whichever group (expert) its row went to; with both operands 2-D the
    groups split the contracted dim (``[m, k] x [k, n]``)."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * prod(out_shape) * a_shape[-1]


#: FLOP formulas torch's counter lacks (``FlopCounterMode(custom_mapping=EXTRA_FLOPS)``).
EXTRA_FLOPS = {_aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
                _aten._grouped_mm: _grouped_mm_flops}
#: Attention kernels that keep only their output and log-sum-exp for backward.
FUSED_ATTENTION = (_aten._scaled_dot_product_flash_attention_for_cpu, _aten._scaled_dot_product_flash_attention,
                    _aten._scaled_dot_product_efficient_attention, _aten._scaled_dot_product_cudnn_attention)
#: Operators that mix positions by attention weights (a fused kernel, or the softmax of a math one): where an
#: attention module's core runs. What its projections compute after one (the output projection) selective
#: recompute need not keep: no operator of the backward reads it.
ATTENTION_CORE = (*FUSED_ATTENTION, _aten._scaled_dot_product_fused_attention_overrideable, _aten._softmax,
                  _aten._safe_softmax)


def costly(op: Any) -> bool:
    """A matrix product (an operator whose FLOPs are counted) or a collective: what selective recompute keeps of
    what an attention's projections compute rather than run it again. The rest they run (a Megatron SP gather's
    concatenation of the pieces, a view) is recomputed from it: keeping both a collective's output and its copy
    held one more whole-sequence input than no recompute does."""
    packet = op.overloadpacket
    return packet in flop_registry or packet in EXTRA_FLOPS or op.namespace == "_c10d_functional"


#: Operators that launch no kernel, besides views (``OpOverload.is_view``: view, t, transpose,
#: expand, permute, slice, select, split, (un)squeeze, detach, alias, as_strided, lift_fresh):
#: views whose schema declares no alias, allocations without a fill, metadata queries.
_METADATA = {_aten.sym_size, _aten.sym_stride, _aten.sym_numel, _aten.sym_storage_offset, torch.ops.prim.device,
             torch.ops.prim.layout}
_NO_KERNEL = {_aten._unsafe_view, _aten._reshape_alias, _aten.empty, _aten.empty_like, _aten.empty_strided,
              _aten.new_empty, _aten.new_empty_strided, *_METADATA}


@contextmanager
def saved_storages(on_saved: Callable[[int, int, torch.dtype], None], excluded: Container[int] = ()) -> Iterator[None]:
    """While open, ``on_saved(key, nbytes, dtype)`` each time autograd saves a tensor for backward,
    with its storage's key (``untyped_storage()._cdata``), bytes and the tensor's dtype, except for
    the storages whose key is in ``excluded`` (parameters, buffers); a caller counts a key once
    where it books it (a view and its base share one storage). Real, fake, meta tensors and
    DTensors (this rank's part) alike: shardkit's one count of activation bytes (the planner's
    analysis, pipeline unit costs, a pipeline's timeline).

    >>> seen = {}
    >>> w = torch.ones(3, 3, requires_grad=True)
    >>> with saved_storages(lambda key, n, _dtype: seen.setdefault(key, n), {w.untyped_storage()._cdata}):
    ...     y = (torch.ones(2, 3) @ w).tanh()
    >>> sorted(seen.values())   # the input of the product (not the weight) and tanh's output
    [24, 24]
    """

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = getattr(tensor, "_local_tensor", tensor)
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage holds nothing of its own
            return tensor
        if storage._cdata not in excluded:
            on_saved(storage._cdata, storage.nbytes(), local.dtype)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _bytes(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor``'s distinct elements: a broadcast (stride 0) dimension is read once."""
    return prod(n for n, stride in zip(tensor.shape, tensor.stride()) if stride) * tensor.element_size()


def _storage(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage of its own
        return -1


def _tensors(value: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class DTensorPaths:
    """Which tensors a tensor-parallel rank would hold as DTensors, followed through the operators
    of a run on plain (fake) tensors, in several ``variants`` at once (shardkit's planner follows
    two: ``tp``, torch's styles handing local tensors between modules, and ``sp``, Megatron SP
    keeping the residual stream a DTensor). :meth:`mark` makes a tensor a DTensor in the variants
    named (a parameter of a split module, a style's input), :meth:`alias` hands out a new tensor
    object for a style's input or output with its own marks; every operator with a marked input
    (views included: DTensor dispatches them all; not metadata queries, which a DTensor answers
    itself) marks its outputs and is booked,
    ``book(variant)``, once per variant (:class:`OpCounter` calls :meth:`follow`).

    torch has no way to count DTensor operators without a process group, hence this simulation.

    >>> seen = []
    >>> paths = DTensorPaths(("tp",), seen.append)
    >>> w = paths.mark(torch.ones(3, 3), ("tp",))
    >>> with OpCounter(lambda *a: None, paths=paths):
    ...     y = (torch.ones(2, 3) @ w.t()).relu()
    >>> seen   # the transpose (a view), the product and the relu
    ['tp', 'tp', 'tp']
    """

    def __init__(self, variants: tuple[str, ...], book: Callable[[str], None]):
        self.variants = variants
        self.book = book
        # held weakly: a mark keeps no tensor alive (:class:`Births` sees what the model itself keeps)
        self._marked: dict[str, WeakIdKeyDictionary] = {v: WeakIdKeyDictionary() for v in variants}

    def mark(self, tensor: torch.Tensor, variants: tuple[str, ...]) -> torch.Tensor:
        for variant in variants:
            self._marked[variant][tensor] = True
        return tensor

    def marks(self, tensor: object) -> tuple[str, ...]:
        return tuple(v for v in self.variants if isinstance(tensor, torch.Tensor) and tensor in self._marked[v])

    def alias(self, tensor: object, variants: tuple[str, ...]) -> object:
        """A new tensor object sharing ``tensor``'s data (a style's ``from_local`` / ``to_local``)
        marked in ``variants`` only (call it while the :class:`OpCounter` is paused)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return self.mark(tensor.view_as(tensor), variants)

    def follow(self, args: object, out: object) -> None:
        inputs = _tensors(args)
        for variant in self.variants:
            if any(t in self._marked[variant] for t in inputs):
                self.book(variant)
                for t in _tensors(out):
                    self.mark(t, (variant,))


class OpCounter(TorchDispatchMode):
    """Books each ATen operator that launches a kernel (not in :data:`_NO_KERNEL`, not a view) as
    one call (``book(traffic)``; ``book(traffic, 0)``: bytes of a kernel already called), and,
    unless torch's FLOP counter prices it (matrix products, convolutions, attention kernels), its
    traffic: the bytes of its tensor inputs and outputs; those it prices are also booked as
    ``product()`` (matrix products' fixed time: ``Hardware.matmul_latency``). With ``paths``, the
    operators on DTensors are followed (:class:`DTensorPaths`).
    Gathers read the rows they gather, not their whole table: an embedding lookup counts its
    indices and its output twice (rows read, rows written), the loss's ``nll_loss`` its targets,
    one log-probability per target, and its outputs.

    torch counts FLOPs (:class:`~torch.utils.flop_counter.FlopCounterMode`) but neither kernel
    launches nor bytes moved, hence this mode. ``paused`` is set while shardkit's stand-ins for
    torch's collectives run (``measure``'s local shard): communication is priced apart."""

    def __init__(self, book: Callable[..., None], product: Callable[[], None] | None = None,
                 paths: DTensorPaths | None = None):
        super().__init__()
        self.book = book
        self.product = product
        self.paths = paths
        self.paused = False
        self._masks: set[int] = set()  # storages of dropout masks being made (CPU's unfused dropout)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = meta_call(func, args, kwargs or {})
        packet = func._overloadpacket
        if self.paths is not None and not self.paused and packet not in _METADATA:
            self.paths.follow((args, kwargs), out)
        if self.paused or func.is_view or packet in _NO_KERNEL:
            return out
        dropout = self._dropout(packet, args, out)
        if dropout is not None:
            if dropout:
                self.book(dropout)
            return out
        if packet in flop_registry or packet in EXTRA_FLOPS:
            traffic = 0
            if self.product is not None:
                self.product()
        elif packet is _aten.embedding:
            traffic = _bytes(args[1]) + 2 * _bytes(out)
        elif packet is _aten.nll_loss_forward:
            traffic = _bytes(args[1]) + args[1].numel() * args[0].element_size() + sum(map(_bytes, out))
        else:
            traffic = sum(map(_bytes, _tensors((args, kwargs)) + _tensors(out)))
        self.book(traffic)
        return out

    def _dropout(self, packet, args, out) -> float | None:
        """Dropout as a GPU runs it, one fused kernel (``aten.native_dropout``: the input read, the
        output and a one-byte mask written), not as the CPU the measurement runs on decomposes it
        (``bernoulli_`` of a mask, ``div_`` of it, ``mul`` by it: three kernels, five passes). The
        fused kernel is booked at the ``bernoulli_`` (a call, the mask's bytes), the product by
        the mask as its traffic without a call of its own (``0.0``), the scaling not at all.
        ``None``: not part of a dropout."""
        if packet is _aten.bernoulli_:
            self._masks.add(_storage(args[0]))
            return float(args[0].numel())
        if not self._masks:
            return None
        inputs = _tensors(args)
        masks = [t for t in inputs if _storage(t) in self._masks]
        if not masks:
            return None
        if packet is _aten.div_:
            return 0.0
        if packet is _aten.mul:
            self._masks.discard(_storage(masks[0]))
            self.book(sum(_bytes(t) for t in inputs if t is not masks[0]) + sum(map(_bytes, _tensors(out))), 0)
            return 0.0
        return None

    @contextmanager
    def pause(self) -> Iterator[None]:
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


class Births(TorchDispatchMode):
    """While entered, ``live[place]``: the bytes alive of the storages operators made while
    ``where()`` named ``place`` (a storage an operator returns that none of its inputs holds: no
    view, no in-place result), each dropped when its storage dies; ``other[place]``: of which
    those of tensors in another dtype than ``dtype``; ``unsaved[place]``: ``[bytes, of which in
    another dtype]`` of those autograd has not saved (:meth:`saved`); ``made[place, zone]``: ``[bytes, of
    which in another dtype]`` of all made while ``zone(operator)`` named ``zone`` too, dead or alive. ``after(operator)``
    is called after each operator.

    >>> births = Births(lambda: "here", torch.float32)
    >>> with births:
    ...     y = torch.ones(4).double().view(2, 2)
    >>> dict(births.live), dict(births.other), births.unsaved["here"]   # ones' storage died with its tensor
    ({'here': 32}, {'here': 32}, [32, 32])
    """

    def __init__(self, where: Callable[[], str], dtype: torch.dtype, after: Callable[[Any], None] = lambda _op: None,
                 zone: Callable[[Any], str] = lambda _op: ""):
        super().__init__()
        self.where, self.dtype, self.after, self.zone = where, dtype, after, zone
        self.made: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.live: dict[str, int] = defaultdict(int)
        self.other: dict[str, int] = defaultdict(int)
        self.unsaved: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._made: dict[int, list] = {}  # storage key -> [place, bytes, other, saved, zone] while alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        known = {_storage(t) for t in _tensors((args, kwargs))} | {-1}
        for tensor in _tensors(out):
            if _storage(tensor) in known:
                continue
            known.add(_storage(tensor))
            storage = tensor.untyped_storage()
            record = [self.where(), storage.nbytes(), tensor.dtype != self.dtype, False, self.zone(func)]
            self._made[storage._cdata] = record
            made = self.made[record[0], record[4]]
            made[0] += record[1]
            made[1] += record[1] * record[2]
            self._add(record, 1)
            weakref.finalize(storage, self._dead, storage._cdata, record)
        self.after(func)
        return out

    def saved(self, key: int) -> tuple[str, str] | None:
        """Storage ``key`` is saved for backward: the place and zone it was made in (``None``: not made here,
        or saved before)."""
        record = self._made.get(key)
        if record is None or record[3]:
            return None
        self._add(record, -1, unsaved_only=True)
        record[3] = True
        return record[0], record[4]

    def _dead(self, key: int, record: list) -> None:
        self._add(record, -1)
        if self._made.get(key) is record:
            del self._made[key]

    def _add(self, record: list, sign: int, unsaved_only: bool = False) -> None:
        place, nbytes, other, saved, _ = record
        if not unsaved_only:
            self.live[place] += sign * nbytes
            self.other[place] += sign * nbytes * other
        if not saved:
            self.unsaved[place][0] += sign * nbytes
            self.unsaved[place][1] += sign * nbytes * other


__all__ = ["ATTENTION_CORE", "EXTRA_FLOPS", "FUSED_ATTENTION", "Births", "DTensorPaths", "OpCounter", "costly",
           "saved_storages"]
