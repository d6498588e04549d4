"""What the estimator reads: one point of the plan space (:class:`Setting`) and a model's measured
costs as plain numbers (:class:`Costs`, :class:`Numbers`), so that pricing a candidate is
arithmetic only (:mod:`shardkit.planner.memory`, :mod:`shardkit.planner.step_time`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..plan import LayoutMap, Mesh, Plan
from ..plan.dtypes import torch_dtype
from .analysis import ModelAnalysis, PartCost, analyse
from .expert_costs import without
from .measure import Piece
from .space import MESH_ORDER, OPTIMIZER_STATES


@dataclass(frozen=True)
class Setting:
    """One point of the plan space, as the estimator reads it (built from a Plan, or by autoshard)."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 1
    accumulation: int = 1  # gradient accumulation steps without a pipeline (a pipeline's are its micro-batches)
    virtual: int = 1
    recompute: str = "none"
    reshard: bool = True
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    order: tuple[str, ...] = field(default=MESH_ORDER)
    zero: int | None = None

    @property
    def devices(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp * self.sp * self.ep

    @property
    def data(self) -> int:
        """Data-parallel replicas: each sees different samples (``ep`` is a data axis for all but the experts)."""
        return self.dp * self.fsdp * self.ep

    @property
    def shards(self) -> int:
        """Ways FSDP2 shards a parameter that is not an expert: ``fsdp``, times ``sp`` and ``ep`` when
        used (1 without ``fsdp``; ``runtime/meshes.py``'s data mesh)."""
        return self.fsdp * self.sp * self.ep if self.fsdp > 1 else 1

    def itemsizes(self, master: int) -> tuple[int, int]:
        """Bytes an element is computed and reduced in, for parameters of ``master`` bytes: the compute
        dtype's (else the parameters'), the reduce dtype's (else the compute dtype's)."""
        compute = self.compute_dtype.itemsize if self.compute_dtype is not None else master
        return compute, self.reduce_dtype.itemsize if self.reduce_dtype is not None else compute

    @property
    def mixed_precision(self) -> bool:
        """Whether compute or gradient reduction runs below float32 (the runtime's rule,
        ``FSDPOptions.mixed_precision``: an explicit float32 is no mixed precision)."""
        return bool({self.compute_dtype, self.reduce_dtype} - {None, torch.float32})

    @property
    def expert_shards(self) -> int:
        """Ways FSDP2 shards an expert parameter, after ``ep`` split its experts: ``fsdp`` times ``sp``."""
        return self.fsdp * self.sp if self.fsdp > 1 else 1

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    @classmethod
    def of(cls, plan: Plan) -> Setting:
        """The setting of a resolved plan whose mesh has only the axes of :data:`MESH_ORDER` above size 1."""
        mesh = plan.mesh
        pipeline = plan.pipeline
        return cls(
            dp=mesh.size_of("dp"), fsdp=mesh.size_of("fsdp"), tp=mesh.size_of("tp"), pp=mesh.size_of("pp"),
            sp=mesh.size_of("sp"), ep=mesh.size_of("ep"), sequence_parallel=plan.sequence_parallel,
            schedule=pipeline.schedule if pipeline else "1f1b",
            microbatches=pipeline.microbatches if pipeline else 1,
            virtual=pipeline.virtual_stages if pipeline else 1,
            recompute=plan.recompute, reshard=plan.fsdp.reshard_after_forward,
            compute_dtype=torch_dtype(plan.fsdp.param_dtype) if plan.fsdp.param_dtype else None,
            reduce_dtype=torch_dtype(plan.fsdp.reduce_dtype) if plan.fsdp.reduce_dtype else None,
            order=tuple(mesh.names), zero=plan.zero)


def mesh_of(s: Setting) -> Mesh:
    """The mesh of a setting in the canonical order (pp, dp, fsdp, ep, sp, tp: tp innermost, within a node)."""
    return Mesh(**{a: s.size(a) for a in MESH_ORDER if s.size(a) > 1} or {"dp": 1})


@dataclass(frozen=True)
class Numbers:
    """A tensor-parallel rank's measured costs as plain numbers (per token unless said), read once
    so that estimating a candidate is arithmetic only."""

    layers: int
    hidden: int
    vocab: int
    kv_bytes: int  # keys + values per token of one block, per rank (elements, times 2)
    itemsize: int
    block_params: int
    embedding_params: int
    head_params: int
    tied: bool
    block_flops: float
    core_flops: float
    embedding_flops: float
    head_flops: float
    block_traffic: float  # bytes non-matmul ops read and write
    core_traffic: float  # of which the attention core's (what selective recompute runs again)
    embedding_traffic: float
    head_traffic: float
    block_ops: int  # operator calls of one forward (per micro-batch, not per token)
    core_ops: int
    embedding_ops: int
    head_ops: int
    block_saved: float  # bytes one block saves for backward
    block_split_by_sp: float  # of which norms and residual terms (split over tp by Megatron SP)
    block_core: float  # of which the attention core
    block_core_recomputed: float  # what selective recompute frees (the attention's saved less its projections' before the core)
    embedding_act: float
    head_act: float
    block_rebuilt: float  # what full recompute holds running a block again (saved and alive beside, its input aside)
    # at a block's moment of most bytes alive in its forward: what it saved so far and made unsaved, its input
    # (unsaved), the embedding's output (unsaved: a frame holds it through the blocks)
    block_ahead: float
    block_input: float
    embedding_output: float
    block_pieces: tuple[Piece, ...]  # the parameters as FSDP shards them
    embedding_pieces: tuple[Piece, ...]
    head_pieces: tuple[Piece, ...]
    head_borrowed: tuple[Piece, ...]  # a tied weight the head uses: a pipeline's last stage holds a copy
    moe_modules: int = 0  # experts modules per block (0: no mixture of experts)
    num_experts: int = 0
    top_k: int = 0
    expert_params: int = 0  # elements of one block's experts (all E), per tp rank
    expert_shapes: tuple[tuple[int, ...], ...] = ()  # each expert parameter's shape: ep splits dim 0 (E)
    dense_pieces: tuple[Piece, ...] = ()  # block_pieces less the experts'
    intermediate: int = 0  # the MLP's width on this rank (its hidden units over tp)
    block_products: int = 0  # matrix products and attention kernels of one forward
    core_products: int = 0  # of which the attention core's (what selective recompute runs again)
    embedding_products: int = 0
    head_products: int = 0
    # operators one forward runs on DTensors, and parameters that are DTensors, (tp, Megatron SP)
    block_dtensor_ops: tuple[int, int] = (0, 0)
    embedding_dtensor_ops: tuple[int, int] = (0, 0)
    head_dtensor_ops: tuple[int, int] = (0, 0)
    block_dtensor_params: tuple[int, int] = (0, 0)
    embedding_dtensor_params: tuple[int, int] = (0, 0)
    head_dtensor_params: tuple[int, int] = (0, 0)
    block_tp_boundaries: tuple[int, int] = (2, 2)  # column-parallel inputs, row-parallel outputs (Megatron's 2, 2)
    fused_attention: bool = False  # the attention core is a fused kernel (priced at Hardware.attention_efficiency)
    # the saved bytes of :data:`SAVED` with the parameters in a 2-byte float dtype, and of which in other dtypes
    half_saved: tuple[float, ...] = ()
    half_fixed: tuple[float, ...] = ()

    def computing_in(self, itemsize: int) -> Numbers:
        """These numbers with the saved bytes (:data:`SAVED`) of a model computing in ``itemsize``-byte
        floats: as measured in the parameters' dtype, else from the measurement in a 2-byte dtype, its
        tensors in that dtype scaled and the others (a norm's float32 upcast, integer indices) as they are.

        >>> n = Numbers.of(analyse("gpt-tiny", seq_len=16))
        >>> n.computing_in(4) is n, n.computing_in(2).block_saved < n.block_saved
        (True, True)
        """
        if itemsize == self.itemsize:
            return self
        return replace(self, **{name: (half - fixed) * itemsize / 2 + fixed
                                for name, half, fixed in zip(SAVED, self.half_saved, self.half_fixed, strict=True)})

    def block_params_at(self, ep: int) -> int:
        """Elements of one block a rank holds before FSDP: its experts split over ``ep``."""
        return self.block_params - self.expert_params + self.expert_params // ep

    @classmethod
    def of(cls, a: ModelAnalysis) -> Numbers:
        core = a.block.flops_per_token["attention_core"]
        share = core / a.block.flops if a.block.flops else 0.0  # the attention core's share, for traffic and ops
        head_dim = a.head_dim or (a.hidden // a.heads if a.heads else 0)  # 0: a model without attention heads
        ahead = a.block.ahead_per_token
        saved = _saved(a, lambda part: part.activations_per_token, a.block.rebuilt_per_token, ahead[:4])
        half = _saved(a, lambda part: part.half_activations_per_token, a.block.half_rebuilt_per_token[0], ahead[4:8])
        fixed = _saved(a, lambda part: part.fixed_activations_per_token, a.block.half_rebuilt_per_token[1], ahead[8:])
        e = a.experts
        experts = (e.modules, e.num_experts, e.top_k, e.params, e.shapes, without(a.block.pieces, e.measured)) \
            if e is not None else (0, 0, 0, 0, (), a.block.pieces)
        return cls(a.layers, a.hidden, a.vocab, 2 * a.kv_heads * head_dim, a.dtype.itemsize,
                   a.block.params, a.embedding.params, a.head.params, a.tied, a.block.flops, core,
                   a.embedding.flops, a.head.flops, a.block.traffic_per_token, share * a.block.traffic_per_token,
                   a.embedding.traffic_per_token, a.head.traffic_per_token, a.block.ops, round(share * a.block.ops),
                   a.embedding.ops, a.head.ops, *saved, a.block.pieces, a.embedding.pieces, a.head.pieces,
                   a.head.borrowed, *experts,
                   intermediate=a.intermediate // a.tp if a.intermediate % a.tp == 0 else a.intermediate,
                   block_products=a.block.products, core_products=round(share * a.block.products),
                   embedding_products=a.embedding.products, head_products=a.head.products,
                   block_dtensor_ops=a.block.dtensor_ops, embedding_dtensor_ops=a.embedding.dtensor_ops,
                   head_dtensor_ops=a.head.dtensor_ops, block_dtensor_params=a.block.dtensor_params,
                   embedding_dtensor_params=a.embedding.dtensor_params, head_dtensor_params=a.head.dtensor_params,
                   block_tp_boundaries=a.block.tp_boundaries, fused_attention=a.fused_attention,
                   half_saved=half, half_fixed=fixed)


#: The fields of :class:`Numbers` that are bytes saved for backward (:meth:`Numbers.computing_in`).
SAVED = ("block_saved", "block_split_by_sp", "block_core", "block_core_recomputed", "embedding_act", "head_act",
         "block_rebuilt", "block_ahead", "block_input", "embedding_output")


def _saved(a: ModelAnalysis, of: Callable[[PartCost], Mapping[str, float]], rebuilt: float,
           ahead: Sequence[float]) -> tuple[float, ...]:
    """:data:`SAVED` from ``of(part)``, the saved bytes per component of a part; ``rebuilt``, ``ahead``: the
    block's (:attr:`~shardkit.planner.analysis.PartCost.ahead_per_token`: its last is what selective recompute
    frees)."""
    block = of(a.block)
    return (sum(block.values()), block["norm"] + block["other"], block["attention_core"], ahead[3],
            sum(of(a.embedding).values()), sum(of(a.head).values()), rebuilt, *ahead[:3])


@functools.lru_cache(maxsize=4096)
def sharded_elements(pieces: tuple[Piece, ...], shards: int) -> int:
    """Elements a device stores of ``pieces`` sharded ``shards`` ways by FSDP2, which pads each
    tensor's sharded dim to ``ceil(size / shards)`` rows (as ``torch.chunk``).

    >>> sharded_elements(((10, 3), (5, 1)), 4)
    11
    """
    return sum(-(-size // shards) * rest for size, rest in pieces)


@dataclass(frozen=True)
class Costs:
    """The analyses one setting needs: at its ``tp`` degree, and whole (``tp=1``) for MFU."""

    local: ModelAnalysis
    whole: ModelAnalysis
    seq_len: int
    numbers: Numbers

    @classmethod
    def of(cls, model: Any, seq_len: int, tp: int, dtype: torch.dtype | None,
           rules: LayoutMap | None = None) -> Costs:
        """``rules``: the plan's layouts (its ``tp`` splits, and the dims FSDP shards); default: the model's own."""
        local = analyse(model, seq_len=seq_len, tp=tp, dtype=dtype, rules=rules)
        whole = local if tp == 1 else analyse(model, seq_len=seq_len, tp=1, dtype=dtype)
        return cls(local, whole, seq_len, Numbers.of(local))


__all__ = ["MESH_ORDER", "OPTIMIZER_STATES", "SAVED", "Costs", "Numbers", "Setting", "mesh_of", "sharded_elements"]
