"""Step time of a plan: seconds per optimizer step by part, before any device is used.

Arithmetic on a model's measured costs (:class:`~shardkit.planner.costs.Costs`) for one point
of the plan space (:class:`~shardkit.planner.costs.Setting`) on a
:class:`~shardkit.planner.hardware.Hardware` (docs/planner.md has the same list with the reasons),
alpha-beta per collective on the link its group spans: within a node when the group's ranks
are consecutive and fit in one, else across nodes:

- ``compute``: per micro-batch, matmul FLOPs over ``peak FLOP/s x matmul_efficiency`` in the
  compute dtype (the attention core's at ``attention_efficiency`` of it) plus ``matmul_latency``
  per matrix product (a product's efficiency grows with its size: ``Hardware.matmul_efficiency_at``),
  plus the bytes the other operators read and write over
  ``memory_bandwidth``, plus operator calls x ``op_overhead``; the backward costs twice the
  forward's FLOPs, products and calls and :data:`BACKWARD_TRAFFIC` times its bytes, recompute runs
  the forward (``full``) or the attention core (``selective``: its share of the block's FLOPs,
  bytes and calls) again;
- ``dtensor``: what DTensor's dispatch adds, ``dtensor_overhead`` per operator on a DTensor: with
  ``tp``, per micro-batch the operators the analysis followed from the split modules (Megatron
  SP's residual stream too; backward twice the forward's, full recompute the forward again), and
  the optimizer's :data:`OPTIMIZER_OPS` on each DTensor parameter (every parameter under FSDP,
  which keeps them sharded as DTensors, or with a data axis beside ``tp``; else the split
  modules', and under SP the norms'); and ``dtensor_collective`` per collective of ``tp`` (each
  launched by DTensor's ``redistribute``, whose plan, functional collective and wait cost more than
  the collective's alpha-beta time: on a CPU world more than the collective itself);
- ``optimizer``: the step reads each parameter, gradient and optimizer state and writes the
  parameter and the states, over ``memory_bandwidth``, plus its :data:`OPTIMIZER_OPS` calls per
  parameter x ``op_overhead``;
- ``bubble``: a pipeline's idle share, ``(p-1)/(m v)`` of the compute (zero-bubble schedules: a
  third of it; ``sequential``: ``p-1`` stages idle); on ``shared_compute`` hardware (processes
  sharing cores) the compute is the average device's, since an idle process lends its cores to
  the others, and the bubble only what the schedule's critical path adds beyond it when fewer
  stages compute than there are cores (:func:`_shared_bubble`);
- ``tp``: per block, as counted by the analysis, an all-reduce of the block's hidden states
  backward for each column-parallel layer's input (the gradient of a replicated input) and
  forward for each row-parallel layer's output (an input counted once for the layers reading it,
  which share its conversion in the runtime: 2 and 2 with Megatron's fused QKV and with separate
  q, k, v projections alike); under Megatron SP an all-gather forward and a reduce-scatter backward
  for each input, the reverse for each output; full recompute runs the forward's again; plus the
  head's gathered logits, not overlapped;
- ``dp`` / ``fsdp``: gradient all-reduce over every data rank (``dp``, ``sp`` and ``ep``: context
  parallel's ranks see different tokens) in DDP's 25 MiB buckets, or per FSDP unit an all-gather
  forward, another backward (with resharding) and a reduce-scatter (HSDP adds an all-reduce of
  the shard); ``overlap`` of it runs while the backward computes (DDP: the last micro-batch's
  backward only, the one that makes the gradients), except the last bucket / the first unit's gather;
  and the wrapper's own copies, not hidden (:func:`wrapper_copies`: DDP's into and out of its buckets,
  or FSDP2's around each gather and reduce-scatter, or, for plans FSDP2's ``replicate`` runs, its
  copies of each parameter and of the gradients; casts under mixed precision);
- ``pp``: point-to-point of each micro-batch's hidden states, forward and backward: the fill's
  and the drain's ``p - 1`` transfers each way on the critical path, ``overlap`` of the
  steady state's behind the compute (the sends are asynchronous); with an
  embedding tied to the LM head, one all-reduce of its gradient between the first and the last
  device a step (none under ``zbv``, which puts both ends on one device);
- ``sp``: ring attention's key/value passes, ``overlap`` of them behind the attention core, and the
  ring's own operators (:func:`ring_work`: merging the blocks' partial results, accumulating the
  gradients), not hidden;
- ``loss``: the loss ``model.step`` returns, averaged over every rank: an all-reduce of one number
  over the world, ``2 log2(n)`` latencies of a tree (NCCL's algorithm for so small a message; a
  pipeline's broadcast from the last stage and all-reduce over the data axes cost about the same),
  blocking;
- ``skew``: the waits for the last rank at the step's blocking collectives (tp's, FSDP's gathers
  and reduce-scatters, DDP's last bucket, the loss's all-reduce, a pipeline's receives, the ring's
  exchanges, the all-to-alls), its compute spread evenly between them: :func:`skew_seconds` with the
  measured ``hw.skew`` (0 on the presets), and each one's idle beyond its link's latency,
  ``hw.sync_idle`` (0 on the presets);
- ``ep``: per MoE layer and micro-batch, the all-to-alls of expert parallelism at balanced routing
  (counts, rows out, rows back forward; their gradients backward: :func:`all_to_all_seconds`), not
  overlapped (the experts wait for their rows). With ``ep``, FSDP gathers and reduces each experts
  module as its own unit over the data axes but ``ep``, and DDP reduces the dense parameters over
  every data rank, the experts over ``dp``.
"""

from __future__ import annotations

import functools
import math

from .costs import OPTIMIZER_STATES, Costs, Numbers, Setting
from .expert_costs import Exchange, exchanges
from .hardware import Hardware, Link, ring_terms
from .memory import blocks_per_device, ddp, tokens_per_microbatch
from .space import AXES
from .wrapper_costs import fsdp_gathers, wrapper_copies

#: What ring attention (runtime/ring_attention.py) adds to a block's attention per micro-batch, over the
#: one attention kernel the model's costs hold, forward then backward, each ``(per ring step, fixed)``:
#: operator calls, and passes over the rank's queries in float32 (the merging's accumulation dtype):
#: each block's partial output merged by its log-sum-exp forward, the query and key/value gradients
#: accumulated backward. Counted with OpCounter on torch 2.13 at sp=2 and 4, q, k and v no leaves (29
#: and 57 calls, 28.5 and 50.8 passes forward; 31 and 61, 75.3 and 139.7 backward) less plain SDPA's own
#: (1 call forward; 5 calls and 19.1 passes backward): ``tests/test_ring_attention.py`` counts them again.
RING_OPS = ((14, 0), (15, -4))
RING_TRAFFIC = ((11.1, 6.3), (32.2, -8.2))
#: DDP's default bucket: gradients are all-reduced in pieces of this many bytes.
DDP_BUCKET_BYTES = 25 * 2**20
#: Bytes the backward of a memory-bound operator moves per byte its forward moves: an elementwise
#: op, a norm or a softmax reads its input and writes its output forward (2 passes), and reads
#: the gradient and the saved tensor and writes the input's gradient backward (3 passes); the
#: backward's matrix products are priced by their FLOPs (twice the forward's).
BACKWARD_TRAFFIC = 1.5
#: ``(operators, of which on the parameter's DTensors)`` an optimizer's step runs per parameter in
#: torch's per-parameter implementation (CPU's default; on GPUs ``foreach`` groups them into fewer
#: launches), counted with a dispatch mode on torch 2.13 for AdamW and SGD; AdamW's other two
#: update its plain step counter; Adam is AdamW less the weight decay's multiply.
OPTIMIZER_OPS = {"adamw": (10, 8), "adam": (9, 7), "sgd-momentum": (3, 3), "sgd": (1, 1)}


def time_of(costs: Costs, s: Setting, batch_size: int, hw: Hardware, optimizer: str = "adamw") -> dict[str, float]:
    """Seconds per step by part: compute, bubble, and the communication not hidden, by axis."""
    n = costs.numbers
    dtype = s.compute_dtype if s.compute_dtype is not None else costs.local.dtype
    flops_rate = hw.peak_flops(dtype) * hw.matmul_efficiency
    itemsize = dtype.itemsize
    p, v = s.pp, s.virtual
    m = s.microbatches * s.accumulation  # forward-backward passes per step
    blocks = blocks_per_device(n, s)
    tokens = tokens_per_microbatch(s, batch_size, costs.seq_len)
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
    traffic = (1 + BACKWARD_TRAFFIC) * (ends[1] + blocks * n.block_traffic) + blocks * again[1]
    ops = 3 * ends[2] + blocks * (3 * n.block_ops + again[2])
    traffic *= itemsize / n.itemsize  # measured in the parameters' dtype, moved in the compute dtype
    products = _forward_backward(hw, s, blocks, n.embedding_products, n.head_products, n.block_products,
                                 {"none": 0, "selective": n.core_products, "full": n.block_products}[s.recompute])
    # a fused attention core's FLOPs (forward, backward twice, again under recompute) at the kernel's own rate
    core = blocks * (3 + (s.recompute != "none")) * n.core_flops * (1 / hw.attention_efficiency - 1) \
        if n.fused_attention else 0.0
    compute = m * (tokens * ((flops + core) / flops_rate + traffic / hw.memory_bandwidth) + ops * hw.op_overhead
                   + products * hw.matmul_latency)
    dtensor = m * dtensor_ops(n, s, hw, blocks) * hw.dtensor_overhead
    parts = {"compute": compute, "bubble": _shared_bubble(s, hw, compute + dtensor) if hw.shared_compute
             else _bubble(s) * (compute + dtensor)}
    hidden_bytes = tokens * n.hidden * itemsize
    stage_params = _stage(hw, s, blocks, n.embedding_params, n.head_params, n.block_params_at(s.ep))
    experts = blocks * (n.expert_params // s.ep) if s.ep > 1 else 0  # E / ep of each MoE layer, FSDP units apart
    dense = stage_params - experts
    # the optimizer reads each parameter, gradient and state and writes the parameter and states
    shards = s.shards
    stored = dense / shards + experts / s.expert_shards
    calls, on_dtensor = OPTIMIZER_OPS[optimizer]
    tensors = _stage(hw, s, blocks, len(n.embedding_pieces), len(n.head_pieces), len(n.block_pieces))
    parts["optimizer"] = stored * n.itemsize * (3 + 2 * OPTIMIZER_STATES[optimizer]) / hw.memory_bandwidth \
        + tensors * calls * hw.op_overhead
    variant = 1 if s.sequence_parallel else 0
    # FSDP keeps every parameter a DTensor, as does a data axis beside tp (replicate over the 2-D mesh)
    distributed = tensors if s.fsdp > 1 or (s.tp > 1 and s.dp * s.sp * s.ep > 1) else _stage(
        hw, s, blocks, n.embedding_dtensor_params[variant], n.head_dtensor_params[variant],
        n.block_dtensor_params[variant]) if s.tp > 1 else 0
    dtensor += distributed * on_dtensor * hw.dtensor_overhead
    if dtensor:
        parts["dtensor"] = dtensor
    shape = (s.order, s.dp, s.fsdp, s.tp, s.pp, s.sp, s.ep)
    syncs = 0.0  # blocking collectives a step waits in, each for the last rank to arrive (hw.skew)
    # tensor parallel: per block a collective per column-parallel input and row-parallel output, not hidden
    if s.tp > 1:
        all_reduce = _collective("all_reduce", hidden_bytes, s.tp, _link(hw, shape, ("tp",), "all_reduce"))
        gather = _collective("all_gather", hidden_bytes, s.tp, _link(hw, shape, ("tp",), "all_gather"))
        scatter = _collective("reduce_scatter", hidden_bytes, s.tp, _link(hw, shape, ("tp",), "reduce_scatter"))
        head = _collective("all_gather", tokens * n.vocab * itemsize, s.tp, _link(hw, shape, ("tp",), "all_gather"))
        inputs, outputs = n.block_tp_boundaries
        again = s.recompute == "full"  # the forward's collectives run again
        if s.sequence_parallel:  # inputs gathered forward, their gradients reduce-scattered; outputs the reverse
            calls = (2 + again) * (inputs + outputs)
            per_block = ((1 + again) * inputs + outputs) * gather + (inputs + (1 + again) * outputs) * scatter
        else:  # outputs all-reduced forward, the inputs' gradients backward
            calls = (1 + again) * outputs + inputs
            per_block = calls * all_reduce
        parts["tp"] = m * (blocks * per_block + head + 2 * all_reduce)
        # each of them launched by DTensor's redistribute, which costs more than the collective itself
        if hw.dtensor_collective:
            parts["dtensor"] = parts.get("dtensor", 0.0) + m * (blocks * calls + 3) * hw.dtensor_collective
        syncs += m * (blocks * calls + 3)
    # data parallel: gradients (DDP, in buckets) or parameters and gradients (FSDP, per unit), behind compute
    reduce = s.itemsizes(itemsize)[1]
    if s.fsdp > 1:
        units = blocks + 1
        gather = _collective("all_gather", dense * itemsize, shards, _link(hw, shape, ("fsdp", "sp", "ep"), "all_gather"),
                             calls=units)
        scatter = _collective("reduce_scatter", dense * reduce, shards,
                              _link(hw, shape, ("fsdp", "sp", "ep"), "reduce_scatter"), calls=units)
        if experts:  # each experts module its own unit, over the data axes but ep
            units += blocks * n.moe_modules
            gather += _collective("all_gather", experts * itemsize, s.expert_shards,
                                  _link(hw, shape, ("fsdp", "sp"), "all_gather"), calls=blocks * n.moe_modules)
            scatter += _collective("reduce_scatter", experts * reduce, s.expert_shards,
                                   _link(hw, shape, ("fsdp", "sp"), "reduce_scatter"), calls=blocks * n.moe_modules)
        gathers = fsdp_gathers(s)
        comm = gathers * gather + scatter
        syncs += units * (gathers + 1)
        if s.dp > 1:
            comm += _collective("all_reduce", stored * reduce, s.dp, _link(hw, shape, ("dp",), "all_reduce"),
                                calls=units)
        calls, moved = wrapper_copies(s, tensors, units, stage_params, stored, gathers, (n.itemsize, itemsize, reduce))
        parts["fsdp"] = _exposed(comm, compute, hw) + gather / units + calls * hw.op_overhead \
            + moved / hw.memory_bandwidth
    elif s.dp * s.sp * s.ep > 1:  # DDP (or replicate) over every data rank (sp's too); the experts but over ep
        size, units, plain_ddp = dense * reduce, 1 + (blocks * n.moe_modules if experts else 0), ddp(s)
        # DDP all-reduces its buckets, FSDP2's replicate each unit (the model, each experts module) flat
        buckets = max(1, math.ceil(size / DDP_BUCKET_BYTES)) if plain_ddp else 1
        comm = _collective("all_reduce", size, s.dp * s.sp * s.ep, _link(hw, shape, ("dp", "sp", "ep"), "all_reduce"),
                           calls=buckets)
        if experts and s.dp * s.sp > 1:
            comm += _collective("all_reduce", experts * reduce, s.dp * s.sp, _link(hw, shape, ("dp", "sp"), "all_reduce"),
                                calls=max(1, math.ceil(experts * reduce / DDP_BUCKET_BYTES)) if plain_ddp else units - 1)
        # the wrapper's own copies, not hidden: DDP's, or FSDP2's replicate's
        calls, moved = wrapper_copies(s, tensors, units, stage_params, stage_params, 1, (n.itemsize, itemsize, reduce))
        # only the last micro-batch's backward produces the gradients to reduce (accumulation steps skip the
        # reduction): DDP's buckets but the last hide behind it; FSDP2's replicate reduces its units once the
        # backward has ended (a pipeline's after its last micro-batch), in the open
        exposed = _exposed(comm - comm / buckets, compute * 2 / 3 / m, hw) + comm / buckets if plain_ddp else comm
        parts["dp"] = exposed + calls * hw.op_overhead + moved / hw.memory_bandwidth
        syncs += 1  # the step waits for the last bucket
    # expert parallel: per MoE layer the exchanges of expert_costs.exchanges, on the critical path
    if s.ep > 1 and n.moe_modules:
        parts["ep"] = m * blocks * n.moe_modules * all_to_all_seconds(n, s, tokens, itemsize, _link(
            hw, shape, ("ep",), "p2p"))
        syncs += m * blocks * n.moe_modules * sum(runs for _, runs in layer_exchanges(n, s, tokens, itemsize))
    # pipeline: each micro-batch's hidden states sent forward and their gradients back
    if p > 1:
        link = _link(hw, shape, ("pp",), "p2p")
        send = link.latency + hidden_bytes / link.bandwidth
        # sends are asynchronous: in the steady state a micro-batch's transfer runs while the stages compute
        # others, and only the fill's and the drain's transfers (p - 1 each way) are on the critical path
        parts["pp"] = 2 * (p - 1) * send + _exposed(2 * m * v * send, compute, hw)
        syncs += 2 * m * v  # each micro-batch's activations received forward, their gradients backward
        if n.tied and s.schedule != "zbv":  # the embedding's and the LM head's gradients summed once a step
            parts["pp"] += _collective("all_reduce", n.embedding_params / shards * reduce, 2,
                                       _link(hw, shape, ("pp",), "all_reduce"))
            syncs += 1
    # context parallel: keys and values go around the ring (forward, and keys, values and their
    # gradients backward), behind the attention core
    if s.sp > 1:
        link = _link(hw, shape, ("sp",), "p2p")
        ring = 3 * (s.sp - 1) * (link.latency + tokens * n.kv_bytes * itemsize / link.bandwidth)
        core = 3 * tokens * n.core_flops / flops_rate
        parts["sp"] = m * blocks * (_exposed(ring, core, hw) + ring_work(s, hw, tokens * n.hidden // s.tp))
        syncs += m * blocks * 2 * (s.sp - 1)  # each ring step's exchange, forward and backward
    # model.step returns the loss averaged over every rank: an all-reduce of one number, which blocks; a
    # tree's 2 log2(n) latencies (NCCL's algorithm for small messages), not a ring's 2 (n - 1)
    if s.devices > 1:
        parts["loss"] = 2 * math.ceil(math.log2(s.devices)) * _link(hw, shape, AXES, "all_reduce").latency
        syncs += 1
    if (hw.skew or hw.sync_idle) and syncs:
        parts["skew"] = skew_seconds(hw, syncs, parts["compute"] + parts["bubble"] + parts["optimizer"]
                                     + parts.get("dtensor", 0.0))
    return parts


def skew_seconds(hw: Hardware, syncs: float, work: float) -> float:
    """Seconds a step waits for the last rank at its ``syncs`` blocking collectives, ``work`` seconds of
    compute spread evenly between them: ranks drift apart as a random walk, ``hw.skew x sqrt(c)``
    after ``c`` seconds, so ``syncs x skew x sqrt(work / syncs)``; and each collective leaves the
    devices idle ``hw.sync_idle`` beyond its link's latency.

    >>> import dataclasses
    >>> from shardkit.planner.hardware import Hardware
    >>> hw = dataclasses.replace(Hardware.preset("a100-80g"), skew=0.02)
    >>> round(skew_seconds(hw, syncs=4, work=0.25), 3), round(skew_seconds(
    ...     dataclasses.replace(hw, sync_idle=0.001), syncs=4, work=0.25), 3)
    (0.02, 0.024)
    """
    return hw.skew * math.sqrt(syncs * work) + syncs * hw.sync_idle


def ring_work(s: Setting, hw: Hardware, queries: float) -> float:
    """Seconds ring attention's own operators add to one block's attention for one micro-batch, over
    the attention kernel the model's costs hold: :data:`RING_OPS` calls and :data:`RING_TRAFFIC`
    passes over the rank's ``queries`` elements in float32, forward and backward (full recompute
    runs the forward again)."""
    runs = (2 if s.recompute == "full" else 1, 1)
    calls = sum(r * (per * s.sp + fixed) for r, (per, fixed) in zip(runs, RING_OPS))
    passes = sum(r * (per * s.sp + fixed) for r, (per, fixed) in zip(runs, RING_TRAFFIC))
    return calls * hw.op_overhead + passes * queries * 4 / hw.memory_bandwidth


def dtensor_ops(n: Numbers, s: Setting, hw: Hardware, blocks: float) -> float:
    """Operators one micro-batch runs on DTensors on the busiest device, forward, backward (twice
    the forward's) and full recompute's forward again: those the analysis followed from the split
    modules (:class:`~shardkit.planner.counters.DTensorPaths`), under Megatron SP its variant's;
    none without ``tp``."""
    if s.tp == 1:
        return 0.0
    v = 1 if s.sequence_parallel else 0
    return _forward_backward(hw, s, blocks, n.embedding_dtensor_ops[v], n.head_dtensor_ops[v],
                             n.block_dtensor_ops[v], n.block_dtensor_ops[v] if s.recompute == "full" else 0)


def _stage(hw: Hardware, s: Setting, blocks: float, embedding: float, head: float, block: float) -> float:
    """A per-part count on the busiest device: ``blocks`` blocks, and the embedding and the head
    (in a pipeline the larger of the two; on ``shared_compute`` hardware the average device's)."""
    if hw.shared_compute:
        ends = (embedding + head) / s.pp
    elif s.pp > 1:
        ends = max(embedding, head)
    else:
        ends = embedding + head
    return ends + blocks * block


def _forward_backward(hw: Hardware, s: Setting, blocks: float, embedding: float, head: float, block: float,
                      again: float) -> float:
    """A per-forward count run forward, backward (twice) and ``again`` per block (recompute)."""
    return 3 * _stage(hw, s, blocks, embedding, head, block) + blocks * again


def layer_exchanges(n: Numbers, s: Setting, tokens: float, itemsize: int) -> list[tuple[Exchange, int]]:
    """One MoE layer's all-to-alls for one micro-batch of ``tokens`` tokens per rank at balanced
    routing (:func:`~shardkit.planner.expert_costs.exchanges`), each with the times it runs (the
    forward's twice under full recompute)."""
    return [(e, 2 if s.recompute == "full" and not e.backward else 1)
            for e in exchanges(tokens=tokens, top_k=n.top_k, hidden=n.hidden, itemsize=itemsize,
                               num_experts=n.num_experts, ep=s.ep)]


def all_to_all_seconds(n: Numbers, s: Setting, tokens: float, itemsize: int, link: Link) -> float:
    """Seconds of one MoE layer's all-to-alls for one micro-batch (:func:`layer_exchanges`): each
    exchange ``ep - 1`` point-to-point messages, pairwise as NCCL and gloo run an all-to-all, of
    the bytes that leave the rank, on the link's point-to-point figures (the hardware model has no
    all-to-all bandwidth of its own)."""
    return sum(runs * ((s.ep - 1) * link.latency + e.bytes / link.bandwidth)
               for e, runs in layer_exchanges(n, s, tokens, itemsize))


def _exposed(comm: float, window: float, hw: Hardware) -> float:
    """Communication time left after ``hw.overlap`` of it runs during ``window`` seconds of compute."""
    return comm - min(comm * hw.overlap, window)


def _shared_bubble(s: Setting, hw: Hardware, work: float) -> float:
    """A pipeline's idle time on processes sharing ``hw.cores_per_node`` cores: none while every core
    has a stage to run (an idle stage lends its cores), but the schedule's critical path, ``m v + p - 1``
    slots of one stage's micro-batch each on a core of its own, is a floor: with 4 stages on 2 cores a
    GPipe of 2 micro-batches takes 5 slots where the work fills 4 (``work``: the average process's
    seconds, every process sharing the cores; on a core of its own ``cores / processes`` of it).

    >>> import dataclasses
    >>> import shardkit as sk
    >>> from shardkit.planner.costs import Setting
    >>> from shardkit.planner.hardware import Hardware
    >>> shared = dataclasses.replace(Hardware.preset("a100-80g"), shared_compute=True, cores_per_node=2,
    ...                              devices_per_node=4)
    >>> gpipe = Setting.of(sk.Plan(sk.Mesh(pp=4), pipeline=sk.Pipeline(schedule="gpipe", microbatches=2)))
    >>> _shared_bubble(gpipe, shared, work=1.0)  # the critical path: 1/2 x (1 + 3/2) of the work
    0.25
    """
    if s.pp == 1 or not hw.cores_per_node:
        return 0.0
    share = min(1.0, hw.cores_per_node / hw.devices_per_node)
    return max(0.0, work * share * (1 + _bubble(s)) - work)


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

    ``shape``: ``(mesh axis order, dp, fsdp, tp, pp, sp, ep)``."""
    order, sizes = shape[0], dict(zip(AXES, shape[1:]))
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


__all__ = ["BACKWARD_TRAFFIC", "DDP_BUCKET_BYTES", "OPTIMIZER_OPS", "RING_OPS", "RING_TRAFFIC", "all_to_all_seconds",
           "dtensor_ops", "layer_exchanges", "ring_work", "skew_seconds", "time_of"]
