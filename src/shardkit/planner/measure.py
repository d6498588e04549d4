"""One forward of a language model on fake tensors, measured: FLOPs, bytes saved for backward,
operator calls and the memory traffic of the non-matmul operators, per part (before the blocks,
each block, after them), with no memory used.

torch does the counting: :class:`~torch.utils.flop_counter.FlopCounterMode` counts FLOPs (matrix
products, convolutions, attention kernels; elementwise ops count 0), saved-tensor hooks see every
tensor autograd saves, a :class:`~torch.utils._python_dispatch.TorchDispatchMode` every ATen operator
called (what a device would launch). What shardkit adds is the attribution: forward hooks on every
module keep the stack of modules running, which says the part and the component of each FLOP, saved
tensor and operator call; and what an operator costs (:class:`~shardkit.planner.counters.OpCounter`).

The forward runs on :class:`~torch._subclasses.fake_tensor.FakeTensorMode` CPU tensors (shapes only),
not on meta ones: torch picks attention kernels by device, and on meta ``scaled_dot_product_attention``
runs its math path, which saves the ``[heads, seq, seq]`` probabilities, where CPU and GPU run a flash
kernel saving its output and log-sum-exp (given the GPU flash kernel's FLOP formula, which torch lacks
for the CPU one).

A tensor-parallel rank is measured at its local shapes (:mod:`shardkit.planner.one_rank`, the one
simulation of what a rank sees): split parameters get local stand-ins, the family's attribute
changes are applied (local head counts), and where torch's styles gather an output (a
column-parallel layer with no row-parallel partner) or split an input locally, a hook makes the
same shapes, so a rank's FLOPs and saved bytes are what it computes and keeps. The operators
the rank would run on DTensors are followed from the split modules' parameters and inputs
(:class:`~shardkit.planner.counters.DTensorPaths`, :mod:`~shardkit.planner.dtensor_styles`), with and without
Megatron SP (:data:`DTENSOR_VARIANTS`).

Saved bytes depend on the compute dtype in ways no itemsize ratio tells (transformers' RMSNorm
saves a float32 copy of its input whatever it is; in float32 that upcast is no copy at all), so
unless the parameters are 2-byte floats the forward runs again in :data:`HALF`, counting only the
saved tensors and their dtypes. Each pass also keeps what full recompute holds rebuilding a part
(:class:`~shardkit.planner.counters.Births`: what its operators made that is alive at a save).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..families import Family
from ..families.modules import is_linear, is_norm
from ..families.on_meta import swapped
from .counters import (
    ATTENTION_CORE,
    EXTRA_FLOPS,
    FUSED_ATTENTION,
    Births,
    DTensorPaths,
    OpCounter,
    costly,
    saved_storages,
)
from .dtensor_styles import (
    DTENSOR_VARIANTS,
    distributed_parameters,
    dtensor_styles,
    reduced_out_of_place,
)
from .one_rank import one_rank, sliced_parameters
from .tensor_parallel import COLWISE, ROWWISE, AxisPlan, aliases

COMPONENTS = ("attention_core", "attention", "mlp", "norm", "embedding", "logits", "other")
#: The dtype the saved tensors are measured in besides the parameters' (:func:`measure`): a 2-byte
#: float, as bfloat16 and float16 compute alike (each upcast to float32 where the model does).
HALF = torch.bfloat16


#: One parameter as FSDP shards it: ``(size of the dim it shards, elements of the other dims)``.
Piece = tuple[int, int]


@dataclass
class Tally:
    """What one part holds and computes: parameters (elements, this rank's and whole; ``pieces``:
    each as FSDP shards it; ``borrowed``: those it uses that an earlier part holds, a tied
    weight), FLOPs by component, saved storages ``{storage id: (bytes, component, dtype)}`` (each
    counted once), operator calls and the bytes the non-matmul ones read and write (:class:`OpCounter`),
    matrix products (``products``), per :data:`DTENSOR_VARIANTS` the operators run on DTensors
    (``dtensor_ops``) and the parameters that are DTensors (``dtensor_params``), and the
    column-parallel inputs and row-parallel outputs whose collectives tensor parallel runs
    (``tp_boundaries``); ``rebuilt``: the most bytes alive of the storages the part made, at a
    save (what full recompute holds running it again, stopping at its last save; its input aside),
    and of which in another dtype than the parameters'; ``ahead``: at the block's moment of most bytes
    alive in the forward, ``(bytes, of which in another dtype)`` of what it saved so far and made
    unsaved, of what earlier blocks made unsaved (its input), of what the embedding part made unsaved
    (its output); ``so_far``: the bytes it saved so far, each storage where first saved; ``freed``: what
    selective recompute frees of it: the bytes made and saved inside its attention modules less those their
    projections made before the core (the policy keeps them)."""

    params: int = 0
    param_bytes: int = 0
    global_params: int = 0
    pieces: list[Piece] = field(default_factory=list)
    borrowed: list[Piece] = field(default_factory=list)
    flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    saved: dict[int, tuple[int, str, torch.dtype]] = field(default_factory=dict)
    ops: int = 0
    traffic: float = 0.0
    products: int = 0
    dtensor_ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dtensor_params: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tp_boundaries: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    rebuilt: tuple[int, int] = (0, 0)
    ahead: tuple[int, ...] = (0,) * 6
    so_far: list[int] = field(default_factory=lambda: [0, 0])
    freed: list[int] = field(default_factory=lambda: [0, 0])

    def tensor_parallel_counts(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """``(dtensor_ops, dtensor_params)`` per :data:`DTENSOR_VARIANTS`, and ``(column-parallel
        inputs, row-parallel outputs)``."""
        return (*(tuple(counts[v] for v in DTENSOR_VARIANTS) for counts in (self.dtensor_ops, self.dtensor_params)),
                (self.tp_boundaries[COLWISE], self.tp_boundaries[ROWWISE]))

    def saved_by_component(self, other_than: torch.dtype | None = None) -> dict[str, float]:
        """Saved bytes by component; with ``other_than``, only those of tensors in another dtype."""
        out: dict[str, float] = defaultdict(float)
        for nbytes, component, dtype in self.saved.values():
            if dtype != other_than:
                out[component] += nbytes
        return out


@dataclass
class Measurement:
    """Tallies of ``embedding``, ``block.0`` ... ``block.{n-1}`` and ``head``, with the parameters
    in ``dtype``; ``quadratic``: the attention ran as separate matrix products (a math kernel,
    saving ``[heads, seq, seq]`` tensors), not as a fused kernel; ``fused``: it ran as a fused
    kernel (SDPA's flash or memory-efficient one). ``half``: the saved tensors of the same forward
    with the parameters in :data:`HALF` (``None`` when ``dtype`` is a 2-byte float: this one)."""

    parts: dict[str, Tally]
    blocks: int
    dtype: torch.dtype
    quadratic: bool = False
    fused: bool = False
    half: Measurement | None = None

    def share(self) -> None:
        """Count each saved storage once, where it is first held (in :attr:`half` too): storages every
        block saves alike (made before the blocks: rotary ``cos``/``sin``) in the embedding part; a
        storage an earlier part saved too (the token ids, saved by the embedding and again as the
        loss's targets) in that part only."""
        blocks = [self.parts[f"block.{i}"] for i in range(self.blocks)]
        embedding, head = self.parts["embedding"], self.parts["head"]
        common = set(blocks[0].saved).intersection(*(b.saved for b in blocks[1:])) if len(blocks) > 1 else set()
        for key in common:
            embedding.saved.setdefault(key, blocks[0].saved[key])
        for block in blocks:
            for key in set(block.saved) & set(embedding.saved):
                del block.saved[key]
        earlier = set(embedding.saved).union(*(b.saved for b in blocks))
        for key in set(head.saved) & earlier:
            del head.saved[key]
        if self.half is not None:
            self.half.share()

    def ahead(self, seq_len: int) -> tuple[float, ...]:
        """Per token, at the last block's moment of most bytes alive in the forward (:attr:`Tally.ahead`; the last:
        its input made by a block): what it saved so far and made unsaved, its input, the embedding's output (unsaved
        ones), what selective recompute frees of it (:attr:`Tally.freed`); then the same in :data:`HALF`, then of which
        in other dtypes."""
        last, halved = (m.parts[f"block.{m.blocks - 1}"] for m in (self, self.half or self))
        return tuple(v / seq_len for v in (*last.ahead[0::2], last.freed[0], *halved.ahead[0::2], halved.freed[0],
                                           *halved.ahead[1::2], halved.freed[1]))


def block_names(model: nn.Module) -> list[str]:
    """The repeated blocks: the children of the longest ``ModuleList`` (``layers``, GPT-2's ``h``)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    name, longest = max(lists, key=lambda item: len(item[1]))
    return [f"{name}.{child}" if name else child for child, _ in longest.named_children()]


def _shape_of(module: nn.Module) -> tuple:
    return tuple((name, type(m).__name__, tuple((p, tuple(t.shape)) for p, t in m.named_parameters(recurse=False)))
                 for name, m in module.named_modules())


@contextmanager
def first_blocks(model: nn.Module, count: int) -> Iterator[list[str]]:
    """While open, the blocks' ``ModuleList`` holds only its first ``count`` blocks when every block
    is alike (the same module classes, parameter names and shapes), so a deep model is measured at
    the cost of a shallow one; yields the names of the blocks that run. Blocks that differ all run."""
    names = block_names(model)
    holder = model.get_submodule(names[0].rpartition(".")[0]) if names else None
    if len(names) <= count or len({_shape_of(model.get_submodule(n)) for n in names}) > 1:
        yield names
        return
    kept = holder._modules
    holder._modules = dict(list(kept.items())[:count])
    try:
        yield names[:count]
    finally:
        holder._modules = kept


class _Scopes:
    """Which component each module stands for: attentions (by the family), the MLP of a block (a
    child of a block with parameters that is neither its attention nor a norm)."""

    def __init__(self, model: nn.Module, family: Family, blocks: list[str]):
        self.modules = dict(model.named_modules())
        self.attentions = {a.name for a in family.attentions(model)}
        self.mlps = set()
        for block in blocks:
            for child, module in self.modules[block].named_children():
                name = f"{block}.{child}"
                if name not in self.attentions and not is_norm(module) and next(module.parameters(), None) is not None:
                    self.mlps.add(name)

    def component(self, stack: list[str], part: str) -> str:
        inner = self.modules[stack[-1]] if stack else None
        for name in reversed(stack):
            if name in self.attentions:
                return "attention" if is_linear(inner) and stack[-1] != name else "attention_core"
        if inner is not None and is_norm(inner):
            return "norm"
        if any(name in self.mlps for name in stack):
            return "mlp"
        if isinstance(inner, nn.Embedding):
            return "embedding"
        return "logits" if part == "head" else "other"


class _Recorder:
    """Module hooks keeping the running stack; FLOPs and saved tensors booked to (part, component)."""

    def __init__(self, model: nn.Module, scopes: _Scopes, blocks: list[str], counter: FlopCounterMode,
                 fixed: set[int], params: dict[str, tuple[int, int, int, Piece]], canonical: dict[str, str],
                 distributed: Mapping[str, tuple[str, ...]], dtype: torch.dtype):
        self.scopes, self.blocks, self.counter, self.fixed = scopes, {b: i for i, b in enumerate(blocks)}, counter, fixed
        self.params, self.canonical, self.distributed = params, canonical, distributed
        self.parts: dict[str, Tally] = defaultdict(Tally)
        self.stack: list[str] = []
        self.passed_block = False
        self.counted = 0.0
        self.owner: dict[str, str] = {}
        self.births = Births(self.part, dtype, self.after, self.zone)
        self.past_core = False  # in an attention module, its core has run
        self.first_saved: set[int] = set()

    def part(self) -> str:
        block = next((n for n in reversed(self.stack) if n in self.blocks), None)
        if block is not None:
            return f"block.{self.blocks[block]}"
        return "head" if self.passed_block else "embedding"

    def book_flops(self) -> None:
        total = float(sum(self.counter.flop_counts["Global"].values()))
        if total != self.counted:
            part = self.part()
            self.parts[part].flops[self.scopes.component(self.stack, part)] += total - self.counted
            self.counted = total

    def book_op(self, traffic: float, calls: int = 1) -> None:
        tally = self.parts[self.part()]
        tally.ops += calls
        tally.traffic += traffic

    def book_product(self) -> None:
        self.parts[self.part()].products += 1

    def book_dtensor(self, variant: str) -> None:
        self.parts[self.part()].dtensor_ops[variant] += 1

    def book_boundary(self, kind: str) -> None:
        self.parts[self.part()].tp_boundaries[kind] += 1

    def enter(self, name: str, module: nn.Module) -> None:
        self.book_flops()
        self.stack.append(name)
        if name in self.scopes.attentions:
            self.past_core = False
        part = self.part()
        prefix = f"{name}." if name else ""
        for pname, _ in module.named_parameters(recurse=False):
            canonical = self.canonical[prefix + pname]
            local, nbytes, whole, piece = self.params[canonical]
            tally = self.parts[part]
            if canonical not in self.owner:
                self.owner[canonical] = part
                tally.params += local
                tally.param_bytes += nbytes
                tally.global_params += whole
                tally.pieces.append(piece)
                for variant in self.distributed.get(canonical, ()):
                    tally.dtensor_params[variant] += 1
            elif self.owner[canonical] != part and piece not in tally.borrowed:
                tally.borrowed.append(piece)

    def leave(self, name: str) -> None:
        self.book_flops()
        self.stack.pop()
        if name in self.blocks:
            self.passed_block = True

    def saved(self, key: int, nbytes: int, dtype: torch.dtype) -> None:
        part = self.part()
        tally = self.parts[part]
        tally.saved.setdefault(key, (nbytes, self.scopes.component(self.stack, part), dtype))
        tally.rebuilt = max(tally.rebuilt, (self.births.live[part], self.births.other[part]))
        if key not in self.first_saved:
            self.first_saved.add(key)
            made, other = self.births.saved(key), nbytes * (dtype != self.births.dtype)
            tally.so_far[0] += nbytes
            tally.so_far[1] += other
            if made is not None and made[1] and self.in_attention():  # made and saved in one: selective recomputes it
                tally.freed[0] += nbytes
                tally.freed[1] += other

    def zone(self, op: Any) -> str:
        """``projection``: ``op`` is what selective recompute keeps (:func:`~.counters.costly`, in an attention's Linear
        layer before its core); ``attention`` elsewhere in an attention, else ``""``."""
        if not self.in_attention():
            return ""
        inside = any(is_linear(self.scopes.modules[name]) for name in self.stack) and not self.past_core
        return "projection" if inside and costly(op) else "attention"

    def in_attention(self) -> bool:
        return any(name in self.scopes.attentions for name in self.stack)

    def after(self, op: Any) -> None:
        """After each operator: an attention's core seen (:data:`ATTENTION_CORE`), the bytes alive (:meth:`alive`)."""
        self.past_core = self.past_core or op.overloadpacket in ATTENTION_CORE
        self.alive()

    def alive(self) -> None:
        """After each operator in a block: its :attr:`Tally.ahead` if more bytes are alive than before."""
        part = self.part()
        if not part.startswith("block."):
            return
        tally, unsaved = self.parts[part], self.births.unsaved
        before = [sum(v[i] for p, v in list(unsaved.items()) if p.startswith("block.") and p != part) for i in (0, 1)]
        now = (tally.so_far[0] + unsaved[part][0], tally.so_far[1] + unsaved[part][1], *before, *unsaved["embedding"])
        if now[0] + now[2] + now[4] > sum(tally.ahead[0::2]):
            tally.ahead = now

    @contextmanager
    def hooks(self) -> Iterator[None]:
        handles = []
        for name, module in self.scopes.modules.items():
            handles.append(module.register_forward_pre_hook(lambda m, _a, n=name: self.enter(n, m)))
            handles.append(module.register_forward_hook(lambda _m, _a, _o, n=name: self.leave(n)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def measure(model: nn.Module, family: Family, blocks: list[str], seq_len: int, dtype: torch.dtype,
            plan: AxisPlan | None = None, fsdp_dims: Mapping[str, int] | None = None) -> Measurement:
    """Run ``model`` once on token ids ``[1, seq_len]`` (fake CPU tensors, train mode) and, when its
    output is logits over its vocabulary, the cross-entropy loss; see the module docstring.
    ``fsdp_dims``: the dim FSDP shards of the parameters whose layout names one (else dim 0).
    Unless ``dtype`` is a 2-byte float already, the forward runs again with the parameters in
    :data:`HALF`, counting only the saved tensors (``Measurement.half``): which of them follow the
    compute dtype and which stay float32 (a norm that upcasts) shows only in that dtype.

    >>> from shardkit.families import family_of
    >>> from shardkit.models.gpt import build_tiny_gpt
    >>> gpt = build_tiny_gpt()
    >>> m = measure(gpt, family_of(gpt), block_names(gpt), 8, torch.float32)
    >>> m.blocks, m.parts["block.0"].ops > 0, m.parts["block.0"].traffic > 0, m.half.dtype
    (2, True, True, torch.bfloat16)
    """
    measured = _forward(model, family, blocks, seq_len, dtype, plan, fsdp_dims, counting=True)
    if dtype.itemsize != HALF.itemsize:
        measured.half = _forward(model, family, blocks, seq_len, HALF, plan, fsdp_dims, counting=False)
    return measured


def _forward(model: nn.Module, family: Family, blocks: list[str], seq_len: int, dtype: torch.dtype,
             plan: AxisPlan | None, fsdp_dims: Mapping[str, int] | None, counting: bool) -> Measurement:
    """One measured forward (:func:`measure`); without ``counting``, only the saved tensors (no
    FLOPs, operators or DTensor paths: they do not change what is saved)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    canonical = aliases(model)
    split_dims = sliced_parameters(model, plan)
    size = plan.size if plan is not None else 1
    vocab = family.vocab_size(model)
    modes = [m.training for m in model.modules()]
    with ExitStack() as stack:
        stack.enter_context(FakeTensorMode())
        tensors: dict[str, torch.Tensor] = {}
        params: dict[str, tuple[int, int, int, Piece]] = {}
        for name, p in model.named_parameters():
            shape = list(p.shape)
            if name in split_dims:
                shape[split_dims[name]] //= size
            kind = dtype if p.is_floating_point() else p.dtype
            tensors[name] = torch.empty(shape, dtype=kind, device="cpu", requires_grad=p.requires_grad)
            numel = tensors[name].numel()
            dim = (fsdp_dims or {}).get(name, 0)
            piece = (shape[dim], numel // shape[dim] if shape[dim] else 0) if shape else (1, 1)  # a scalar: whole
            params[name] = (numel, numel * tensors[name].element_size(), p.numel(), piece)
        for name, b in model.named_buffers():
            tensors[name] = torch.empty(b.shape, dtype=b.dtype, device="cpu")  # as built (rotary frequencies stay fp32)
        fixed = {t.untyped_storage()._cdata for t in tensors.values()}
        counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS)
        distributed = distributed_parameters(model, plan, canonical)
        recorder = _Recorder(model, _Scopes(model, family, blocks), blocks, counter, fixed, params, canonical,
                             distributed, dtype)
        paths = DTensorPaths(DTENSOR_VARIANTS, recorder.book_dtensor)
        for name, variants in distributed.items() if counting else ():
            paths.mark(tensors[name], variants)
        ops = OpCounter(recorder.book_op, recorder.book_product, paths if plan is not None else None)
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        stack.enter_context(swapped(model, tensors))
        stack.enter_context(one_rank(model, [plan] if plan is not None else [], local_weights=True,
                                     bridge=ops.pause))
        if plan is not None:
            stack.enter_context(reduced_out_of_place(model, plan, ops.pause))
        if plan is not None and counting:
            stack.enter_context(dtensor_styles(model, plan, paths, ops, recorder.book_boundary))
        stack.enter_context(recorder.hooks())
        if counting:
            stack.enter_context(counter)
            stack.enter_context(ops)
        stack.enter_context(recorder.births)
        stack.enter_context(saved_storages(recorder.saved, fixed))
        model.train()
        try:
            output = model(ids)
            logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
            if isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[-1] == vocab:
                F.cross_entropy(logits.reshape(-1, vocab), ids.reshape(-1))
            recorder.book_flops()
        finally:
            for module, mode in zip(model.modules(), modes):
                module.training = mode
    for part, tally in recorder.parts.items():
        kept = recorder.births.made[part, "projection"]
        tally.freed = [tally.freed[0] - kept[0], tally.freed[1] - kept[1]]
    fused = any(op in counter.flop_counts["Global"] for op in FUSED_ATTENTION)
    quadratic = not fused and any(t.flops.get("attention_core") for t in recorder.parts.values())
    return Measurement(dict(recorder.parts), len(blocks), dtype, quadratic, fused)


__all__ = ["COMPONENTS", "HALF", "Measurement", "Piece", "Tally", "block_names", "first_blocks", "measure"]
