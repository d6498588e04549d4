"""``sk.estimate``: memory per device and step time of a plan, before any device is used.

The model's costs are *measured* on the meta device by :func:`shardkit.planner.analysis.analyse`
(parameters, forward FLOPs and bytes saved for backward per token, by component, as one
tensor-parallel rank computes them); this module turns them into bytes per device and seconds
per step for a plan, a batch and a :class:`~shardkit.planner.hardware.Hardware`. Every term is
stated here (docs/planner.md has the same list with the reasons):

Memory (the most loaded device; a pipeline's first and last stages are both evaluated):

- ``parameters``, ``gradients``: the device's share of its stage's tensor-parallel-local
  parameters (divided by the FSDP shards, ``fsdp x sp``), in the parameters' dtype; FSDP2 keeps
  sharded parameters and gradients in that dtype under mixed precision.
- ``optimizer``: the optimizer's states per parameter (AdamW: 2) in the parameters' dtype;
  under ZeRO stage 1 (``Plan(zero=1)``) divided over the ``dp`` ranks, whose parameters and
  gradients stay whole (stages 2 and 3 are FSDP, counted as such).
- ``gathered``: FSDP's unsharded units in the compute dtype: the unit being computed and the
  prefetched next one, plus one unit's unsharded gradients before the reduce-scatter; with
  ``reshard_after_forward=False`` the whole stage stays gathered between forward and backward.
- ``activations``: bytes saved for backward per token (measured) x tokens per micro-batch x
  micro-batches in flight on the device (no pipeline: 1; GPipe: m; 1F1B: min(m, p);
  interleaved: min(m, p)(1 + (p-1)/(p v))); Megatron sequence parallel divides the norm and
  residual terms by ``tp``; context parallel (``sp``) divides the tokens; recompute
  ``selective`` drops the attention core, ``full`` keeps each block's input only, plus one
  block recomputed at a time and its gradients.
- ``logits``: the transient of the loss's backward (the logits' gradient, as large as the
  logits); under tensor parallel shardkit's column-parallel head gathers the whole vocabulary.
- ``buffers``: communication buffers: a pipeline stage keeps a receive buffer for every
  micro-batch's hidden states, and one for their gradients.
- ``overhead``: the allocator's slack, ``ALLOCATOR_OVERHEAD`` of the above, and the device's
  ``reserved`` bytes.

Step time (alpha-beta per collective on the link its group spans: within a node when the
group's ranks are consecutive and fit in one, else across nodes):

- ``compute``: per micro-batch, matmul FLOPs over ``peak FLOP/s x matmul_efficiency`` in the
  compute dtype, plus the bytes the other operators read and write over ``memory_bandwidth``,
  plus operator calls x ``op_overhead``; the backward costs twice the forward, recompute runs
  the forward (``full``) or the attention core (``selective``: its share of the block's FLOPs,
  bytes and calls) again;
- ``optimizer``: the step reads each parameter, gradient and optimizer state and writes the
  parameter and the states, over ``memory_bandwidth``;
- ``bubble``: a pipeline's idle share, ``(p-1)/(m v)`` of the compute (zero-bubble schedules: a
  third of it; ``sequential``: ``p-1`` stages idle); on ``shared_compute`` hardware (processes
  sharing cores) none, and the compute is the average device's, since an idle process lends
  its cores to the others;
- ``tp``: per block two all-reduces forward and two backward of the block's hidden states
  (Megatron SP: the same bytes as all-gathers and reduce-scatters), plus the head's gathered
  logits, not overlapped;
- ``dp`` / ``fsdp``: gradient all-reduce in DDP's 25 MiB buckets, or per FSDP unit an all-gather
  forward, another backward (with resharding) and a reduce-scatter (HSDP adds an all-reduce of
  the shard); ``overlap`` of it runs while the backward computes, except the last bucket / the
  first unit's gather;
- ``pp``: point-to-point of each micro-batch's hidden states, forward and backward; with an
  embedding tied to the LM head, one all-reduce of its gradient between the first and the last
  device a step (none under ``zbv``, which puts both ends on one device);
- ``sp``: ring attention's key/value passes, ``overlap`` of them behind the attention core.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..plan import Mesh, Plan, PlanError, UsageError
from ..plan.text import format_bytes, format_seconds
from .analysis import ModelAnalysis, analyse
from .hardware import Hardware, Link, ring_terms
from .hardware import hardware as as_hardware

#: Optimizer states per parameter, each the parameter's shape and dtype.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
#: Allocator slack over the tensors' own bytes (CUDA's caching allocator rounds and fragments;
#: glibc's malloc keeps arenas): 5 %, within the 10 % the estimate is held to.
ALLOCATOR_OVERHEAD = 0.05
#: DDP's default bucket: gradients are all-reduced in pieces of this many bytes.
DDP_BUCKET_BYTES = 25 * 2**20
MESH_ORDER = ("pp", "dp", "fsdp", "sp", "tp")
MEMORY_KEYS = ("parameters", "gradients", "optimizer", "gathered", "activations", "logits", "buffers", "overhead")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Estimate:
    """What a plan costs per device and per step.

    ``memory``: bytes on the most loaded device by component (``MEMORY_KEYS``) and ``total``.
    ``step_time``: seconds per optimizer step; ``step_time_parts``: its parts (``compute``,
    ``bubble`` and the communication not hidden behind compute, by axis). ``mfu``: the model's
    training FLOPs (no recompute) per second over the devices' peak in the compute dtype.
    """

    plan: Plan
    batch_size: int
    seq_len: int
    hardware: Hardware
    memory: Mapping[str, int]
    step_time: float
    step_time_parts: Mapping[str, float]
    tokens_per_s: float
    mfu: float
    notes: tuple[str, ...] = ()
    grad_accum: int = 1

    @property
    def fits(self) -> bool:
        """Whether the most loaded device's total fits the hardware's memory."""
        return self.memory["total"] <= self.hardware.memory

    def summary(self) -> str:
        """Memory by component, step time by part, tokens/s and MFU, as plain text lines."""
        memory = ", ".join(f"{k} {format_bytes(self.memory[k], digits=2)}" for k in MEMORY_KEYS if self.memory[k])
        parts = ", ".join(f"{k} {format_seconds(v)}" for k, v in self.step_time_parts.items() if v > 0)
        accumulation = f", {self.grad_accum} accumulation steps" if self.grad_accum > 1 else ""
        lines = [f"memory per device{accumulation}: {format_bytes(self.memory['total'], digits=2)} of "
                 f"{format_bytes(self.hardware.memory, digits=2)} on {self.hardware.name} ({memory})",
                 f"step time: {format_seconds(self.step_time)} ({parts}); {self.tokens_per_s:,.0f} tokens/s; "
                 f"MFU {100 * self.mfu:.1f}%"]
        return "\n".join(lines + list(self.notes))


@dataclass(frozen=True)
class Setting:
    """One point of the plan space, as the estimator reads it (built from a Plan, or by autoshard)."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
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
        return self.dp * self.fsdp * self.tp * self.pp * self.sp

    @property
    def data(self) -> int:
        return self.dp * self.fsdp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    @classmethod
    def of(cls, plan: Plan) -> Setting:
        mesh = plan.mesh
        pipeline = plan.pipeline
        return cls(
            dp=mesh.size_of("dp"), fsdp=mesh.size_of("fsdp"), tp=mesh.size_of("tp"), pp=mesh.size_of("pp"),
            sp=mesh.size_of("sp"), sequence_parallel=plan.sequence_parallel,
            schedule=pipeline.schedule if pipeline else "1f1b",
            microbatches=pipeline.microbatches if pipeline else 1,
            virtual=pipeline.virtual_stages if pipeline else 1,
            recompute=getattr(plan, "recompute", "none"), reshard=plan.fsdp.reshard_after_forward,
            compute_dtype=_DTYPES[plan.fsdp.param_dtype] if plan.fsdp.param_dtype else None,
            reduce_dtype=_DTYPES[plan.fsdp.reduce_dtype] if plan.fsdp.reduce_dtype else None,
            order=tuple(mesh.names), zero=plan.zero)


def estimate(model: Any, plan: Plan, *, batch_size: int, seq_len: int, hardware: str | Hardware = "h100-80g",
             optimizer: str = "adamw", world_size: int | None = None, grad_accum: int = 1) -> Estimate:
    """Memory per device and step time of training ``model`` under ``plan``, without running it.

    ``model``: an ``nn.Module`` (the meta device is fine), a transformers config or a catalogue
    name (``shardkit.planner.catalogue``); ``batch_size``: the global batch in sequences;
    ``hardware``: a preset name, a hardware file or a :class:`Hardware`; ``grad_accum``: gradient
    accumulation steps (the batch is split into that many micro-steps; a pipeline accumulates
    over its own micro-batches instead).

    >>> import shardkit as sk
    >>> e = sk.estimate("gpt-small", sk.Plan(sk.Mesh(fsdp=4)), batch_size=8, seq_len=128, hardware="a100-80g")
    >>> e.memory["optimizer"] == 2 * e.memory["parameters"], e.fits
    (True, True)
    """
    if optimizer not in OPTIMIZER_STATES:
        raise UsageError(f"estimate(optimizer={optimizer!r}) is unknown; valid: {sorted(OPTIMIZER_STATES)}")
    hw = as_hardware(hardware)
    plan = plan.resolved(world_size) if world_size is not None else plan
    if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
        raise UsageError(f"estimate(grad_accum={grad_accum!r}): give a whole number of steps >= 1")
    if grad_accum > 1 and plan.pipeline is not None:
        raise UsageError(f"estimate(grad_accum={grad_accum}): a pipeline accumulates over its micro-batches; "
                         f"raise Pipeline(microbatches=...) instead")
    setting = replace(Setting.of(plan), accumulation=grad_accum)
    problems = plan.problems() + plan.batch_problems(batch_size, seq_len)
    if grad_accum > 1 and batch_size % (plan.mesh.data_size * grad_accum):
        problems.append(f"batch of {batch_size} samples does not split into {grad_accum} accumulation steps over "
                        f"{plan.mesh.data_size} data-parallel replicas; use a multiple of "
                        f"{plan.mesh.data_size * grad_accum}")
    if problems:
        raise PlanError(problems)
    costs = Costs.of(model, seq_len, setting.tp, dtype=None)
    memory, parts = evaluate(costs, setting, batch_size, hw, optimizer)
    return costs.estimate(plan, setting, batch_size, hw, memory, parts)


def kv_cache_bytes(model: Any, *, tp: int = 1, pp: int = 1, batch_size: int, seq_len: int,
                   dtype: torch.dtype | None = None) -> int:
    """Bytes of the KV cache one rank holds for ``batch_size`` sequences of ``seq_len`` positions in
    ``sk.generate``: keys and values of its layers (with ``pp`` stages split evenly, the stage with
    the most: ``ceil(layers / pp)``), for its KV heads (``kv_heads / tp``), ``head_dim`` wide, in
    ``dtype`` (default: the parameters').

    >>> kv_cache_bytes("llama3-8b", tp=8, batch_size=1, seq_len=8192, dtype=torch.bfloat16) / 2**20
    128.0
    >>> kv_cache_bytes("llama3-8b", tp=8, pp=4, batch_size=1, seq_len=8192, dtype=torch.bfloat16) / 2**20
    32.0
    """
    a = analyse(model, seq_len=seq_len, tp=1, dtype=dtype)
    if a.kv_heads % tp:
        raise PlanError(f"kv_cache_bytes(tp={tp}): the model's {a.kv_heads} KV heads do not split over tp={tp}")
    if not 1 <= pp <= a.layers:
        raise PlanError(f"kv_cache_bytes(pp={pp}): the model has {a.layers} layers; valid: 1 to {a.layers} stages")
    if not a.heads:
        raise PlanError(f"kv_cache_bytes: no attention with heads was found in {a.name}, so it keeps no KV cache "
                        f"shardkit can size")
    head_dim = a.head_dim or a.hidden // a.heads
    layers = -(-a.layers // pp)
    return 2 * layers * batch_size * seq_len * (a.kv_heads // tp) * head_dim * (dtype or a.dtype).itemsize


# -- the model's measured costs --------------------------------------------------------------------

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
    block_core_recomputed: float  # of which selective recompute frees (not q, k, v and the output)
    embedding_act: float
    head_act: float

    @classmethod
    def of(cls, a: ModelAnalysis) -> Numbers:
        acts = a.block.activations_per_token
        core = a.block.flops_per_token["attention_core"]
        share = core / a.block.flops if a.block.flops else 0.0  # the attention core's share, for traffic and ops
        head_dim = a.head_dim or (a.hidden // a.heads if a.heads else 0)  # 0: a model without attention heads
        qkvo = 2 * (a.heads + a.kv_heads) // a.tp * head_dim * a.dtype.itemsize
        return cls(a.layers, a.hidden, a.vocab, 2 * a.kv_heads * head_dim, a.dtype.itemsize,
                   a.block.params, a.embedding.params, a.head.params, a.tied, a.block.flops, core,
                   a.embedding.flops, a.head.flops, a.block.traffic_per_token, share * a.block.traffic_per_token,
                   a.embedding.traffic_per_token, a.head.traffic_per_token, a.block.ops, round(share * a.block.ops),
                   a.embedding.ops, a.head.ops, a.block.activations, acts["norm"] + acts["other"],
                   acts["attention_core"], max(0.0, acts["attention_core"] - qkvo), a.embedding.activations,
                   a.head.activations)


@dataclass(frozen=True)
class Costs:
    """The analyses one setting needs: at its ``tp`` degree, and whole (``tp=1``) for MFU."""

    local: ModelAnalysis
    whole: ModelAnalysis
    seq_len: int
    numbers: Numbers

    @classmethod
    def of(cls, model: Any, seq_len: int, tp: int, dtype: torch.dtype | None) -> Costs:
        local = analyse(model, seq_len=seq_len, tp=tp, dtype=dtype)
        return cls(local, analyse(model, seq_len=seq_len, tp=1, dtype=dtype), seq_len, Numbers.of(local))

    def estimate(self, plan: Plan, setting: Setting, batch_size: int, hw: Hardware,
                 memory: dict[str, int], parts: dict[str, float]) -> Estimate:
        step = sum(parts.values())
        tokens = batch_size * self.seq_len
        whole = self.whole
        model_flops = 3 * tokens * (whole.embedding.flops + whole.layers * whole.block.flops + whole.head.flops)
        peak = hw.peak_flops(setting.compute_dtype or whole.dtype) * setting.devices
        notes = []
        if memory["total"] > hw.memory:
            notes.append(f"does not fit: needs {format_bytes(memory['total'], digits=2)} of "
                         f"{format_bytes(hw.memory, digits=2)} per device")
        return Estimate(plan, batch_size, self.seq_len, hw, memory, step, parts, tokens / step,
                        model_flops / (step * peak), tuple(notes), setting.accumulation)


# -- the arithmetic ---------------------------------------------------------------------------------

def evaluate(costs: Costs, s: Setting, batch_size: int, hw: Hardware,
             optimizer: str = "adamw") -> tuple[dict[str, int], dict[str, float]]:
    """``(memory by component with total, step time by part)`` of one setting: plain arithmetic on
    measured costs, fast enough for autoshard to call for every candidate."""
    return memory_of(costs, s, batch_size, hw, optimizer), time_of(costs, s, batch_size, hw, optimizer)


def _blocks_per_device(n: Numbers, s: Setting) -> int:
    return -(-n.layers // (s.pp * s.virtual)) * s.virtual


def _tokens_per_microbatch(s: Setting, batch_size: int, seq_len: int) -> float:
    return batch_size / (s.dp * s.fsdp) / s.microbatches / s.accumulation * seq_len / s.sp


def _inflight(s: Setting, device: int) -> float:
    """Micro-batches whose activations pipeline device ``device`` holds at its peak."""
    if s.pp == 1:
        return 1.0
    m, p = s.microbatches, s.pp
    if s.schedule == "1f1b":
        return float(min(m, p - device))
    if s.schedule == "interleaved-1f1b":
        return min(m, p - device) * (1 + (p - 1) / (p * s.virtual))
    return float(m)  # gpipe, sequential (m = 1), zero-bubble schedules: bounded by m


def memory_of(costs: Costs, s: Setting, batch_size: int, hw: Hardware, optimizer: str = "adamw") -> dict[str, int]:
    """Bytes on the most loaded device by component, and ``total``."""
    n = costs.numbers
    master = n.itemsize
    compute = s.compute_dtype.itemsize if s.compute_dtype is not None else master
    reduce = s.reduce_dtype.itemsize if s.reduce_dtype is not None else compute
    scale = compute / master  # activations were measured in the parameters' dtype
    shards = s.fsdp * s.sp if s.fsdp > 1 else 1
    blocks = _blocks_per_device(n, s)
    tokens = _tokens_per_microbatch(s, batch_size, costs.seq_len)
    block_saved = _block_saved(n, s)
    if s.recompute == "full":  # the block's input only
        block_act = n.hidden * master / (s.tp if s.sequence_parallel else 1)
    elif s.recompute == "selective":  # the core's own tensors go; q, k, v and its output stay (the
        block_act = block_saved - n.block_core_recomputed  # projections keep them)
    else:
        block_act = block_saved
    states = OPTIMIZER_STATES[optimizer]
    best: dict[str, int] | None = None
    # the first device holds the embedding and the most micro-batches; the last holds the head
    for first, last in ((True, False), (False, True)) if s.pp > 1 else ((True, True),):
        params = blocks * n.block_params + (n.embedding_params if first else 0) + (n.head_params if last else 0)
        if n.tied and first and last:
            params -= min(n.embedding_params, n.head_params)
        stored = -(-params // shards) * master
        gathered = 0
        if shards > 1:
            unit = max(n.block_params, n.embedding_params if first else 0, n.head_params if last else 0)
            # a pipeline, or gradient accumulation, turns gradient sync off until the last micro-batch: the
            # stage's gradients accumulate unsharded
            accumulating = s.pp > 1 or s.accumulation > 1
            gathered = (params if not s.reshard else 2 * unit) * compute + (params if accumulating else unit) * reduce
        per_token = blocks * block_act + (n.embedding_act if first else 0) + (n.head_act if last else 0)
        held = per_token * tokens * _inflight(s, 0 if first else s.pp - 1)
        if s.recompute == "full":  # one block rebuilt at a time during backward, and its gradients
            held += 2 * block_saved * tokens
        # ZeRO-1: torch's ZeroRedundancyOptimizer gives each dp rank the state of 1/dp of the parameters
        optimized = -(-params // s.dp) * master if s.zero == 1 else stored
        memory = {"parameters": stored, "gradients": stored, "optimizer": states * optimized, "gathered": int(gathered),
                  "activations": int(held * scale),
                  "logits": int(n.vocab * compute * tokens) if last else 0,
                  "buffers": int(2 * s.virtual * s.microbatches * tokens * n.hidden * compute) if s.pp > 1 else 0}
        memory["overhead"] = int(ALLOCATOR_OVERHEAD * sum(memory.values())) + hw.reserved
        memory["total"] = sum(memory.values())
        if best is None or memory["total"] > best["total"]:
            best = memory
    assert best is not None
    return best


def _block_saved(n: Numbers, s: Setting) -> float:
    """Bytes per token one block saves for backward with no recompute (Megatron SP: norm and
    residual terms split over tp)."""
    if s.sequence_parallel and s.tp > 1:
        return n.block_saved - n.block_split_by_sp * (1 - 1 / s.tp)
    return n.block_saved


def time_of(costs: Costs, s: Setting, batch_size: int, hw: Hardware, optimizer: str = "adamw") -> dict[str, float]:
    """Seconds per step by part: compute, bubble, and the communication not hidden, by axis."""
    n = costs.numbers
    dtype = s.compute_dtype if s.compute_dtype is not None else costs.local.dtype
    flops_rate = hw.peak_flops(dtype) * hw.matmul_efficiency
    itemsize = dtype.itemsize
    p, v = s.pp, s.virtual
    m = s.microbatches * s.accumulation  # forward-backward passes per step
    blocks = _blocks_per_device(n, s)
    tokens = _tokens_per_microbatch(s, batch_size, costs.seq_len)
    # the backward costs about twice the forward; recompute runs (part of) the forward again
    again = {"none": (0.0, 0.0, 0.0), "selective": (n.core_flops, n.core_traffic, n.core_ops),
             "full": (n.block_flops, n.block_traffic, n.block_ops)}[s.recompute]
    ends = (n.embedding_flops + n.head_flops, n.embedding_traffic + n.head_traffic, n.embedding_ops + n.head_ops)
    if hw.shared_compute:  # devices share the cores: the step takes the average device's work, idle is lent
        blocks = n.layers / p
        ends = tuple(e / p for e in ends)
    elif p > 1:  # the busiest device: the first or the last stage
        ends = (max(n.embedding_flops, n.head_flops), max(n.embedding_traffic, n.head_traffic),
                max(n.embedding_ops, n.head_ops))
    flops = 3 * ends[0] + blocks * (3 * n.block_flops + again[0])
    traffic = 3 * ends[1] + blocks * (3 * n.block_traffic + again[1])
    ops = 3 * ends[2] + blocks * (3 * n.block_ops + again[2])
    traffic *= itemsize / n.itemsize  # measured in the parameters' dtype, moved in the compute dtype
    compute = m * (tokens * (flops / flops_rate + traffic / hw.memory_bandwidth) + ops * hw.op_overhead)
    parts = {"compute": compute, "bubble": 0.0 if hw.shared_compute else _bubble(s) * compute}
    hidden_bytes = tokens * n.hidden * itemsize
    stage_params = blocks * n.block_params + max(n.embedding_params, n.head_params)
    # the optimizer reads each parameter, gradient and state and writes the parameter and states
    shards = s.fsdp * s.sp if s.fsdp > 1 else 1
    parts["optimizer"] = stage_params / shards * n.itemsize * (3 + 2 * OPTIMIZER_STATES[optimizer]) \
        / hw.memory_bandwidth
    shape = (s.order, s.dp, s.fsdp, s.tp, s.pp, s.sp)
    # tensor parallel: 2 all-reduces forward + 2 backward per block (+2 when the forward runs again), not hidden
    if s.tp > 1:
        all_reduce = _collective("all_reduce", hidden_bytes, s.tp, _link(hw, shape, ("tp",), "all_reduce"))
        head = _collective("all_gather", tokens * n.vocab * itemsize, s.tp, _link(hw, shape, ("tp",), "all_gather"))
        per_block = (4 + (2 if s.recompute == "full" else 0)) * all_reduce
        parts["tp"] = m * (blocks * per_block + head + 2 * all_reduce)
    # data parallel: gradients (DDP, in buckets) or parameters and gradients (FSDP, per unit), behind compute
    reduce = s.reduce_dtype.itemsize if s.reduce_dtype is not None else itemsize
    if s.fsdp > 1:
        units = blocks + 1
        link = _link(hw, shape, ("fsdp", "sp"), "all_gather")
        gather = _collective("all_gather", stage_params * itemsize, shards, link, calls=units)
        comm = (2 if s.reshard else 1) * gather * (m if s.reshard and m > 1 else 1)
        comm += _collective("reduce_scatter", stage_params * reduce, shards, link, calls=units)
        if s.dp > 1:
            comm += _collective("all_reduce", stage_params * reduce / shards, s.dp,
                                _link(hw, shape, ("dp",), "all_reduce"), calls=units)
        parts["fsdp"] = _exposed(comm, compute, hw) + gather / units  # the first unit's gather waits
    elif s.dp > 1:
        size = stage_params * reduce
        buckets = max(1, math.ceil(size / DDP_BUCKET_BYTES))
        comm = _collective("all_reduce", size, s.dp, _link(hw, shape, ("dp",), "all_reduce"), calls=buckets)
        parts["dp"] = _exposed(comm - comm / buckets, compute * 2 / 3, hw) + comm / buckets  # the last bucket waits
    # pipeline: each micro-batch's hidden states sent forward and their gradients back
    if p > 1:
        link = _link(hw, shape, ("pp",), "p2p")
        parts["pp"] = 2 * (m * v + p - 1) * (link.latency + hidden_bytes / link.bandwidth)
        if n.tied and s.schedule != "zbv":  # the embedding's and the LM head's gradients summed once a step
            parts["pp"] += _collective("all_reduce", n.embedding_params / shards * reduce, 2,
                                       _link(hw, shape, ("pp",), "all_reduce"))
    # context parallel: keys and values go around the ring (forward, and keys, values and their
    # gradients backward), behind the attention core
    if s.sp > 1:
        link = _link(hw, shape, ("sp",), "p2p")
        ring = 3 * (s.sp - 1) * (link.latency + tokens * n.kv_bytes * itemsize / link.bandwidth)
        core = 3 * tokens * n.core_flops / flops_rate
        parts["sp"] = m * blocks * _exposed(ring, core, hw)
    return parts


def _exposed(comm: float, window: float, hw: Hardware) -> float:
    """Communication time left after ``hw.overlap`` of it runs during ``window`` seconds of compute."""
    return comm - min(comm * hw.overlap, window)


def _bubble(s: Setting) -> float:
    if s.pp == 1:
        return 0.0
    if s.schedule == "sequential":
        return float(s.pp - 1)
    fraction = (s.pp - 1) / (s.microbatches * s.virtual)
    return fraction / 3 if s.schedule in ("zero-bubble", "zbv") else fraction


@functools.lru_cache(maxsize=4096)
def _link(hw: Hardware, shape: tuple, axes: tuple[str, ...], collective: str) -> Link:
    """The link a group over ``axes`` uses: within a node when its ranks are consecutive and fit in one.

    ``shape``: ``(mesh axis order, dp, fsdp, tp, pp, sp)``."""
    order, sizes = shape[0], dict(zip(("dp", "fsdp", "tp", "pp", "sp"), shape[1:]))
    order = [a for a in order if a in sizes]
    present = [order.index(a) for a in axes if a in order]
    innermost = max(present) if present else len(order) - 1
    stride = math.prod(sizes[a] for a in order[innermost + 1:])
    span = math.prod(sizes[a] for a in axes)
    return hw.link(collective, across_nodes=stride * span > hw.devices_per_node)


def _collective(name: str, size: float, n: int, link: Link, calls: int = 1) -> float:
    """Ring ``name`` of ``size`` bytes in all over ``n`` devices, issued as ``calls`` collectives."""
    if n <= 1:
        return 0.0
    steps, factor = ring_terms(name, n)
    return link.seconds(size, factor=factor, steps=steps * calls)



def mesh_of(s: Setting) -> Mesh:
    """The mesh of a setting in the canonical order (pp, dp, fsdp, sp, tp: tp innermost, within a node)."""
    return Mesh(**{a: s.size(a) for a in MESH_ORDER if s.size(a) > 1} or {"dp": 1})


__all__ = ["ALLOCATOR_OVERHEAD", "Estimate", "OPTIMIZER_STATES", "Setting", "estimate", "evaluate", "kv_cache_bytes", "memory_of", "mesh_of", "time_of"]
