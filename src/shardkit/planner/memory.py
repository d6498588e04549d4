"""Memory per device of a plan: shardkit's one model of it (``sk.estimate``'s memory,
``sk.estimate_memory``, ``shardkit explain``, ``shardkit plan`` and ``sk.autoshard``).

Arithmetic on a model's measured costs (:class:`~shardkit.planner.costs.Costs`) for one point
of the plan space (:class:`~shardkit.planner.costs.Setting`), on the most loaded device (a
pipeline's first and last stages are both evaluated). Every term (docs/planner.md has the same
list with the reasons):

- ``parameters``, ``gradients``: the device's share of its stage's tensor-parallel-local
  parameters, in the parameters' dtype: FSDP2 (``fsdp x sp`` shards) pads each tensor's
  sharded dim to ``ceil(size / shards)``; a pipeline's last stage holds its own copy of an
  embedding tied to the LM head. FSDP2 keeps sharded parameters and gradients in that dtype
  under mixed precision. With ``ep``, a rank holds ``E / ep`` experts of every MoE layer, which
  FSDP shards ``fsdp x sp`` ways (on dim 0 when that divides ``E / ep``, else on a dim that
  divides: ``expert_costs.expert_shard_dim``), and the rest ``fsdp x sp x ep`` ways
  (:func:`stored_block`). With no data axis, a vocab-split embedding's gradient keeps the whole
  ``vocab x hidden`` (its rows are a view of DTensor's dense backward's).
- ``optimizer``: the optimizer's states per parameter (AdamW: 2) in the parameters' dtype;
  under ZeRO stage 1 (``Plan(zero=1)``) divided over the ``dp`` ranks, whose parameters and
  gradients stay whole (stages 2 and 3 are FSDP, counted as such).
- ``gathered``, ``activations``, ``temporaries``: what a step adds, in the categories of torch's
  memory tracker that ``sk.dry_run`` reads (:mod:`shardkit.observe.step_cost`), each at its own
  peak over the step's phases (:func:`step_phases`, which states every term): FSDP2's unsharded
  parameters, gradients and collective buffers; the tensors saved for backward, in the compute dtype
  as measured in it (:meth:`~shardkit.planner.costs.Numbers.computing_in`) (the micro-batches
  in flight: no pipeline 1; GPipe m; 1F1B min(m, p); interleaved min(m, p)(1 + (p-1)/(p v)));
  what the backward allocates (the loss's and the head's gradients, a block's, the embedding's; DDP's
  gradient buckets, :func:`ddp`).
- ``buffers``: communication buffers: a pipeline stage keeps a receive buffer for every
  micro-batch's hidden states (but the first stage), and one for their gradients (but the last).
- ``overhead``: the allocator's slack, ``ALLOCATOR_OVERHEAD`` of the tensors, and the device's
  ``reserved`` bytes.
- ``total``: the state, ``buffers``, the step's largest moment and ``overhead``: a phase (the three step
  components at one moment, less than their sum as they peak at different moments, and the gradients
  allocated then: a step starts with none) or the optimizer's step (every gradient, DDP's buckets, Adam's
  per-parameter temporaries). DDP and FSDP2's ``replicate`` as the runtime chooses them (:func:`ddp`,
  :func:`replicated`).
"""

from __future__ import annotations

import math

from .costs import OPTIMIZER_STATES, Costs, Numbers, Setting, sharded_elements
from .expert_costs import stored_expert_elements
from .hardware import Hardware
from .measure import Piece

#: Allocator slack over the tensors' own bytes (CUDA's caching allocator rounds and fragments;
#: glibc's malloc keeps arenas): 5 %, within the 10 % the estimate is held to.
ALLOCATOR_OVERHEAD = 0.05
#: The components of memory per device, in the order they are shown.
MEMORY_KEYS = ("parameters", "gradients", "optimizer", "gathered", "activations", "temporaries", "buffers", "overhead")
#: The components a step adds, each reported at its own peak (:func:`step_phases`).
STEP_KEYS = ("gathered", "activations", "temporaries")


def blocks_per_device(n: Numbers, s: Setting) -> int:
    """Blocks one pipeline device holds: its stages' share, rounded up (all of them without a pipeline)."""
    return -(-n.layers // (s.pp * s.virtual)) * s.virtual


def tokens_per_microbatch(s: Setting, batch_size: int, seq_len: int) -> float:
    """Tokens one device computes per micro-batch: the global batch over the data replicas, the
    micro-batches, the accumulation steps and the ``sp`` chunks."""
    return batch_size / s.data / s.microbatches / s.accumulation * seq_len / s.sp


def stored_block(n: Numbers, s: Setting) -> int:
    """Elements of one block a device stores: FSDP's shard of the dense parameters (``s.shards``
    ways) and of its ``E / ep`` experts (``s.expert_shards`` ways), or all of them without FSDP."""
    if s.shards == 1:
        return n.block_params_at(s.ep)
    if s.ep == 1:
        return sharded_elements(n.block_pieces, s.shards)
    return sharded_elements(n.dense_pieces, s.shards) + stored_experts(n, s)


def stored_experts(n: Numbers, s: Setting) -> int:
    """Elements of one block's experts a device stores: ``E / ep`` of them, FSDP's shard of those."""
    if s.shards == 1:
        return n.expert_params // s.ep
    if s.ep == 1:  # no ep: the experts are in their block's FSDP unit, sharded on dim 0 like the rest of it
        return sharded_elements(tuple((shape[0], math.prod(shape) // shape[0]) for shape in n.expert_shapes), s.shards)
    return stored_expert_elements(n.expert_shapes, s.ep, s.expert_shards)


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


def block_saved(n: Numbers, s: Setting) -> float:
    """Bytes per token one block saves for backward with no recompute (Megatron SP: norm and
    residual terms split over tp)."""
    if s.sequence_parallel and s.tp > 1:
        return n.block_saved - n.block_split_by_sp * (1 - 1 / s.tp)
    return n.block_saved


def backward_transient(n: Numbers) -> float:
    """Bytes per token a block's backward allocates beside its saved tensors, at its peak: the
    gradient flowing in (hidden wide) and the gradient of its widest intermediate (the MLP's), in
    the parameters' dtype."""
    return (n.hidden + n.intermediate) * n.itemsize


def vocab_split(pieces: tuple[Piece, ...], n: Numbers, tp: int) -> bool:
    """Whether ``pieces`` hold a vocabulary-wide weight split over ``tp`` by its rows (a
    vocab-parallel embedding, a column-parallel LM head)."""
    rows = -(-n.vocab // tp)
    return tp > 1 and any(size * rest == rows * n.hidden for size, rest in pieces)


def whole_embedding_excess(n: Numbers, tp: int) -> int:
    """Elements a vocab-parallel embedding's gradient holds beyond its rank's rows: DTensor's dense
    backward makes the whole ``vocab x hidden``, of which the rank's rows are a view (0 unless
    the embedding is split by its rows over ``tp``)."""
    return (n.vocab - -(-n.vocab // tp)) * n.hidden if vocab_split(n.embedding_pieces, n, tp) else 0


def ddp(s: Setting) -> bool:
    """Whether the plan's data parallelism is DDP itself (torch's composable ``replicate``), as
    ``runtime/parallelize.py`` chooses it: ZeRO-1, or plain replication with no sharding, tensor
    parallel, pipeline or mixed precision (FSDP2's ``replicate`` does those). The runtime's
    ``_uses_ddp`` decides on the built module (unused parameters also take FSDP2's); the planner,
    which sees a :class:`Setting` and never imports the runtime, states the same rule on what a
    Setting holds, for a model whose parameters are all used."""
    return s.zero == 1 or (s.fsdp == 1 and s.dp * s.sp > 1 and s.ep == 1 and s.tp == 1 and s.pp == 1
                           and not s.mixed_precision)


def replicated(s: Setting) -> bool:
    """Whether the plan's data parallelism is FSDP2's ``replicate`` (``runtime/parallelize.py``): replication
    with no sharding and no expert axis where DDP does not serve (:func:`ddp`): tensor parallel, a pipeline,
    mixed precision. It wraps the whole model (a pipeline stage's) as one unit."""
    return s.shards == 1 and s.dp * s.sp > 1 and s.ep == 1 and not ddp(s)


def step_phases(n: Numbers, s: Setting, tokens: float, first: bool, last: bool, params: int,
                compute: int, reduce: int) -> dict[str, dict[str, float]]:
    """What a training step adds to a device's state, at each moment that can be its peak: bytes
    of ``gathered``, ``activations`` and ``temporaries`` (the categories of torch's memory
    tracker, :mod:`shardkit.observe.step_cost`) by phase: the end of the forward, inside its last block
    (no full recompute), the loss's and the head's backward (last stage), a block's backward (with FSDP
    the first one's and a later one's, beside its successor's reduce-scatter), its post-backward and its
    reduce-scatter (with FSDP; with accumulated gradients, a later micro-batch's backward too), the root unit's
    post-backward and its reduce-scatter (first stage, with FSDP), the embedding's backward (first stage,
    without FSDP). ``n``'s saved bytes are those of the compute dtype (:meth:`Numbers.computing_in`).
    docs/planner.md states the terms."""
    blocks = blocks_per_device(n, s)
    inflight = _inflight(s, 0 if first else s.pp - 1)
    unit = n.block_params_at(s.ep)
    head = n.head_params + sum(size * rest for size, rest in (n.head_borrowed if last and not first else ()))
    root = (n.embedding_params if first else 0) + (head if last else 0)  # the root FSDP unit's parameters
    whole = n.vocab * n.hidden  # a vocabulary-wide weight, whole
    # the embedding's gradient: DTensor's dense backward of a vocab-parallel embedding makes it whole
    embedding_grad = n.embedding_params + whole_embedding_excess(n, s.tp)
    split_head = last and vocab_split(n.head_pieces + n.head_borrowed, n, s.tp)
    logits = n.vocab * compute * tokens  # the whole vocabulary's logits (a column-parallel head gathers them)
    # activations: the micro-batches in flight, each with its blocks' saved tensors (with full recompute,
    # their inputs), the embedding's, and on a pipeline stage before the last its output, kept for its backward
    if s.recompute == "full":
        block_act = n.hidden * compute / (s.tp if s.sequence_parallel else 1)
    elif s.recompute == "selective":
        block_act = block_saved(n, s) - n.block_core_recomputed
    else:
        block_act = block_saved(n, s)
    per_token = blocks * block_act + (n.embedding_act if first else 0) + (n.hidden * compute if not last else 0)
    held = per_token * tokens * inflight
    # one block rebuilt by full recompute: what it holds at its last save (its saved tensors and the values alive
    # beside them, its input aside: held above), less what Megatron SP splits of its norms and residual terms
    rebuilt = (n.block_rebuilt - n.block_saved + block_saved(n, s)) * tokens if s.recompute == "full" else 0.0
    # FSDP's unsharded units: the root unit (embedding, head) is gathered for its forward and again from
    # its backward to its post-backward; a block is computed while the next one's all-gather output is in
    # flight (the whole stage, without resharding after the forward); its gradients, unsharded, are
    # copied into a reduce-scatter input (reduce dtype) kept until the next block's
    fsdp = s.shards > 1
    gathered_root = root * compute if fsdp else 0
    live = (2 * unit if s.reshard else params - root) * compute if fsdp else 0
    grads = unit * compute if fsdp else 0
    scatter = unit * reduce if fsdp else 0
    accumulated = 0
    if fsdp and (s.pp > 1 or s.accumulation > 1):  # no reduce-scatter until the last micro-batch: the stage's
        # gradients accumulate unsharded, in the reduce dtype (the embedding's whole), from the first backward on
        accumulated = (params - n.embedding_params * first + embedding_grad * first) * reduce
    # a micro-batch's backward after the first finds the gradients accumulated and one micro-batch fewer in flight
    later = held * (inflight - 1) / inflight if s.pp > 1 and inflight > 1 else held
    steady = accumulated if s.microbatches > inflight or s.accumulation > 1 else 0  # a forward after a backward
    # a pipeline's last stage: torch's schedule keeps the stage's output (the logits) from its forward until the
    # next micro-batch's forward returns, through their loss's and head's backward
    kept = logits if last and s.pp > 1 else 0
    previous = kept if s.microbatches > 1 else 0  # beside the next micro-batch's forward
    phases = {"forward": {"gathered": gathered_root + (live if not s.reshard else 0) + steady,
                          "activations": held, "temporaries": 0.0}}
    if s.recompute != "full":  # the last micro-batch's forward at its peak, in the stage's last block: the blocks before
        # it saved, and in it what it saved so far and made unsaved (the residual stream, a row-parallel output and its
        # reduction), its input when a block of the stage made it, on the first stage the embedding's output too
        inside = n.block_ahead - (n.block_saved - block_act) + (n.block_input if blocks > 1 else 0) \
            + (n.embedding_act + n.embedding_output if first else 0)
        phases["forward, last block"] = {**phases["forward"], "activations": held * (inflight - 1) / inflight
                                         + ((blocks - 1) * block_act + inside) * tokens + previous}
    if fsdp:  # a forward's start: the root unit's and the first block's all-gather outputs and their parameters
        phases["forward start"] = {"gathered": steady + 2 * (gathered_root + unit * compute),
                                   "activations": held * (inflight - 1) / inflight + previous, "temporaries": 0.0}
    if last:
        head_act = n.head_act * tokens
        # a split head gathers its logits (its columns, the gathered and the concatenated) beside the previous
        # micro-batch's (an unsplit head's are no more than its loss's, the logits and their log-softmax)
        phases["forward"]["activations"] += head_act + logits * (1 + 1 / s.tp if split_head else 1) \
            + (previous if split_head else 0)
        # the loss's backward (the root unit resharded after its forward): the gradients of the
        # log-softmax and of the logits
        phases["loss"] = {"gathered": accumulated, "activations": later + head_act + kept, "temporaries": 2 * logits}
        # the head's backward: the logits' gradient, the weight's gradient (a split head's: its rows, from
        # its columns of the logits' gradient, which it copies out and then frees the whole: the larger of
        # the two moments), the input's (and its sum over tp) and the final norm's, which transformers' norms
        # compute in float32
        input_grad = n.hidden * tokens * (compute * (2 if s.tp > 1 else 1) + 4)
        if split_head:
            head_grads = max(logits * (1 + 1 / s.tp), logits / s.tp + head * compute + input_grad)
        else:
            head_grads = logits + whole * compute + input_grad
        phases["head"] = {"gathered": gathered_root + live / 2 + accumulated, "activations": later + kept,
                          "temporaries": head_grads}
    # a block's backward (with full recompute, one block rebuilt): its gradients, filed with the
    # temporaries until its post-backward, and its transient ones; the head's gradients are filed with the
    # temporaries until the root's post-backward (with accumulated gradients, the first micro-batch's only:
    # a later one's are added into the accumulated, with the gathered)
    root_grads = head * compute if fsdp and last else 0
    later_root_grads = 0 if accumulated else root_grads
    transient = grads + backward_transient(n) * tokens * compute / n.itemsize
    # an LM head tied to the embedding on this device, unsplit, with plain gradients (no FSDP2): autograd holds its
    # weight's gradient, a temporary, from the head's backward until the embedding's adds to it
    tied = whole * compute if n.tied and first and last and not fsdp and not replicated(s) and not split_head else 0
    # with FSDP, the backward's first block finds no reduce-scatter in flight; a later one finds its successor's, whose
    # saved tensors (one micro-batch's) are freed
    done = block_act * tokens
    phases["blocks"] = {"gathered": gathered_root + live, "activations": held + rebuilt,
                        "temporaries": transient + root_grads + tied}
    if fsdp and not accumulated and blocks > 1:
        phases["blocks, next"] = {**phases["blocks"], "gathered": gathered_root + live + scatter,
                                  "activations": held - done + rebuilt}
    if accumulated:
        phases["blocks, accumulated"] = {"gathered": gathered_root + live + accumulated,
                                         "activations": later + rebuilt, "temporaries": transient}
    if fsdp:  # its post-backward: its gradients unsharded, then copied into the reduce-scatter input (a temporary
        # until the collective is issued, as torch's tracker files it), then the output
        phases["post-backward"] = {"gathered": gathered_root + live + grads + accumulated, "activations": later - done,
                                   "temporaries": (scatter if not accumulated else 0) + later_root_grads}
        phases["reduce-scatter"] = {"gathered": gathered_root + live - unit * compute + grads + accumulated,
                                    "activations": later - done,
                                    "temporaries": scatter * (1 + 1 / s.shards) + later_root_grads}
    if first and fsdp:
        root_grad = embedding_grad + (head if last else 0)  # the root's gradients (the embedding's whole)
        # with accumulated gradients, the rank's rows of the embedding's whole gradient, copied out for its
        # reduce-scatter (without, they are a view of it: a real run measures no copy)
        rows = n.embedding_params if accumulated and embedding_grad > n.embedding_params else 0
        # the root's post-backward: its gradients, the last block's reduce-scatter input, and with accumulated
        # gradients the root's (the last micro-batch's backward reduce-scattered the blocks' as it went)
        phases["end"] = {"gathered": gathered_root + root_grad * compute + (root_grad * reduce if accumulated else 0)
                         + scatter, "activations": 0.0, "temporaries": rows * reduce}
        # with accumulated gradients, earlier micro-batches' (the micro-batches still in flight beside them): the
        # first's, every block's gradients accumulated and the root's upcast to the reduce dtype (its parameters
        # resharded); the second's (of three or more), every gradient accumulated
        if accumulated and reduce != compute:
            phases["end, first micro-batch"] = {"gathered": accumulated - root_grad * reduce + root_grad * compute,
                                                "activations": held * (inflight - 1) / inflight,
                                                "temporaries": root_grad * reduce}
        if accumulated and s.microbatches * s.accumulation > 2:
            phases["end, second micro-batch"] = {
                "gathered": gathered_root + root_grad * compute + accumulated,
                "activations": held * max(min(s.microbatches, inflight + 1) - 2, 0) / inflight, "temporaries": 0.0}
        # then its reduce-scatter: the input and output (and the copied rows: their accumulated whole freed)
        phases["end, reduce-scatter"] = {
            "gathered": root_grad * compute + (embedding_grad * reduce if accumulated and not rows else 0),
            "activations": 0.0, "temporaries": rows * reduce + root * reduce * (1 + 1 / s.shards)}
    if first and not fsdp:  # the embedding's backward: its largest table's gradient (a vocab-split one's whole,
        # DTensor's dense backward), a temporary until added into its .grad, and the gradient flowing into it
        largest = max((size * rest for size, rest in n.embedding_pieces), default=0)
        dense = whole if vocab_split(n.embedding_pieces, n, s.tp) else largest
        phases["embedding"] = {"gathered": 0.0, "activations": held * (inflight - 1) / inflight,
                               "temporaries": (dense + n.hidden * tokens) * compute + 2 * tied}  # tied: and their sum
    if replicated(s) and s.accumulation == 1:
        _replicate_phases(phases, n, s, tokens, first, params, compute, reduce)
    plain = not fsdp and not replicated(s)
    # every gradient made by the step's one backward (replicate's at its one reduce, after a pipeline's last)
    fresh = s.accumulation == 1 and (s.pp == 1 or replicated(s))
    if fresh or (plain and s.pp > 1):
        # a step starts with no gradients (``zero_grad(set_to_none=True)``): a phase's ``gradients`` are the state's
        # allocated then (:func:`memory_of` counts all of them elsewhere). FSDP2 makes its sharded gradients at each
        # unit's reduce-scatter, replicate at its one reduce (its output); plain tensors get their ``.grad`` in the
        # backward: by a block's (its MLP's, the widest, first), the head's and the block's largest weight's; by the
        # embedding's, all but the embedding's (its gradient is a temporary then). A pipeline's first backward comes
        # after its stage's forwards of the micro-batches in flight; a later one finds every gradient accumulated
        for name, phase in phases.items():
            if name.startswith("forward") or (fresh and (name in ("loss", "head") or not plain)):
                phase["gradients"] = 0
        if plain and s.pp > 1:  # (with no data axis a vocab-split embedding's whole, until a tie's sum at the end)
            whole_grad = whole_embedding_excess(n, s.tp) if first and s.data * s.sp == 1 else 0
            phases["blocks, later"] = {"gathered": 0.0, "activations": later + rebuilt,
                                       "temporaries": phases["blocks"]["temporaries"],
                                       "gradients": (params + whole_grad) * n.itemsize}
        if plain:
            largest = max((size * rest for size, rest in n.block_pieces), default=0)
            phases["blocks"]["gradients"] = (head + largest) * n.itemsize
        if plain and "embedding" in phases:
            table = max((size * rest for size, rest in n.embedding_pieces), default=0)
            phases["embedding"]["gradients"] = (params - table) * n.itemsize
    # DDP's gradient buckets: a flat copy of every gradient (its gradients are no views of them), made with
    # DDP and kept (the dry run counts them as temporaries from the step's start)
    bucket = params * n.itemsize if ddp(s) else 0
    for phase in phases.values():
        phase["temporaries"] += bucket
    return phases


def _replicate_phases(phases: dict[str, dict[str, float]], n: Numbers, s: Setting, tokens: float, first: bool,
                      params: int, compute: int, reduce: int) -> None:
    """FSDP2's ``replicate`` in ``phases`` (one step, no accumulation): its one unit, the whole model, is
    gathered (its parameters unsharded, in the compute dtype) from the forward to the post-backward; its
    gradients, unsharded, are temporaries until then (the embedding's backward holds every other's, and a
    vocab-split embedding's whole, unless tied: the head's rows of it are added); the post-backward files them
    gathered beside the parameters, then copies them into the reduce's input (the reduce dtype) and the output
    it all-reduces, the gradients freed."""
    whole = (params + whole_embedding_excess(n, s.tp) * (first and not n.tied)) * compute
    for phase in phases.values():
        phase["gathered"] += params * compute
    if "embedding" in phases:
        phases["embedding"]["temporaries"] = whole + n.hidden * tokens * compute
    phases["post-backward"] = {"gathered": params * compute + whole, "activations": 0.0, "temporaries": 0.0}
    if s.pp > 1 and s.microbatches > 1:  # a pipeline: the gradients of its micro-batches but the last accumulate
        # unsharded (gathered, the reduce dtype) until the last one's post-backward, beside every later moment (if
        # every forward of the stage comes before its first backward: its last micro-batch's, one fewer in flight)
        inflight = _inflight(s, 0 if first else s.pp - 1)
        after = s.microbatches > inflight
        for name, phase in phases.items():
            phase["gathered"] += params * reduce if after and name != "post-backward" else 0
        if not after:
            blocks = phases["blocks"]
            phases["blocks, later"] = {"gathered": blocks["gathered"] + params * reduce,
                                       "temporaries": blocks["temporaries"],
                                       "activations": blocks["activations"] * (inflight - 1) / inflight}
    phases["reduce"] = {"gathered": 0.0, "activations": 0.0, "temporaries": 2 * params * reduce}


def step_peak(costs: Costs, s: Setting, batch_size: int) -> int:
    """The most bytes a step adds at once on one device holding the whole model beside its state, with every
    gradient allocated ahead (the largest phase of :func:`step_phases`, gradients aside): what
    ``benchmarks/memory_model.py`` measures, a step accumulating into a warm-up's gradients."""
    compute, reduce = s.itemsizes(costs.numbers.itemsize)
    n = costs.numbers.computing_in(compute)
    params = blocks_per_device(n, s) * n.block_params_at(s.ep) + n.embedding_params + n.head_params
    phases = step_phases(n, s, tokens_per_microbatch(s, batch_size, costs.seq_len), True, True, params, compute,
                         reduce)
    return int(max(sum(p[part] for part in STEP_KEYS) for p in phases.values()))


def memory_of(costs: Costs, s: Setting, batch_size: int, hw: Hardware, optimizer: str = "adamw",
              position: tuple[bool, bool] | None = None) -> dict[str, int]:
    """Bytes on the most loaded device by component (:data:`MEMORY_KEYS`), and ``total``: the
    state, the step's peak (the largest phase of :func:`step_phases`, each of ``gathered``,
    ``activations`` and ``temporaries`` reported at its own peak), ``buffers`` and ``overhead``.
    ``position``: ``(first, last)``, a pipeline device holding the first stage, the last, or both,
    instead of the most loaded one (``sk.dry_run`` sets each rank beside its own).

    >>> from shardkit.planner.costs import Costs, Setting
    >>> from shardkit.planner.hardware import hardware
    >>> m = memory_of(Costs.of("gpt-tiny", 32, 1, None), Setting(fsdp=4), 8, hardware("a100-80g"))
    >>> m["optimizer"] == 2 * m["parameters"], m["total"] <= sum(m[k] for k in MEMORY_KEYS)
    (True, True)
    """
    master = costs.numbers.itemsize
    compute, reduce = s.itemsizes(master)
    n = costs.numbers.computing_in(compute)  # the bytes saved for backward in the compute dtype
    shards = s.shards
    blocks = blocks_per_device(n, s)
    tokens = tokens_per_microbatch(s, batch_size, costs.seq_len)
    states = OPTIMIZER_STATES[optimizer]
    best: dict[str, int] | None = None
    # the first device holds the embedding and the most micro-batches; the last holds the head
    positions = ((True, False), (False, True)) if s.pp > 1 else ((True, True),)
    for first, last in positions if position is None else (position,):
        copy = n.head_borrowed if last and not first else ()  # a tied embedding's copy on the last stage
        head = n.head_params + sum(size * rest for size, rest in copy)
        params = blocks * n.block_params_at(s.ep) + (n.embedding_params if first else 0) + (head if last else 0)
        stored = params * master
        if shards > 1:
            pieces = (n.embedding_pieces if first else ()) + ((n.head_pieces + copy) if last else ())
            stored = (blocks * stored_block(n, s) + sharded_elements(pieces, shards)) * master
        # ZeRO-1: torch's ZeroRedundancyOptimizer gives each dp rank the state of 1/dp of the parameters
        optimized = -(-params // s.dp) * master if s.zero == 1 else stored
        phases = step_phases(n, s, tokens, first, last, params, compute, reduce).values()
        # a receive buffer per micro-batch for each stage's inputs (but the first's) and their gradients (but the last's)
        buffers = int((2 * s.virtual - first - last) * s.microbatches * tokens * n.hidden * compute) if s.pp > 1 else 0
        # with no data axis, a vocab-split embedding's gradient is its rows of the whole one DTensor's dense backward
        # makes (a view: the whole is kept); a data axis's FSDP2 or replicate reduces it into a tensor of its own,
        # and so does a pipeline's sum of tied copies on a stage without the head (it lays the copy's out as its rows)
        tie_summed = n.tied and s.pp > 1 and not last
        whole_grad = whole_embedding_excess(n, s.tp) * master if first and s.data * s.sp == 1 and not tie_summed else 0
        memory = {"parameters": stored, "gradients": stored + whole_grad, "optimizer": states * optimized}
        memory.update({part: int(max(p[part] for p in phases)) for part in STEP_KEYS})
        memory["buffers"] = buffers
        # the optimizer's step: every gradient, DDP's buckets, and what Adam's per-parameter step makes beside its
        # state (two tensors the size of the parameter it updates: the largest's); torch's tracker files them as
        # optimizer state, so they show in the peak only
        pieces = n.block_pieces + (n.embedding_pieces if first else ()) + ((n.head_pieces + copy) if last else ())
        largest = max((-(-size // shards) * rest for size, rest in pieces), default=0) * master
        stepping = memory["gradients"] + (params * n.itemsize if ddp(s) else 0) + (2 * largest if states == 2 else 0)
        # the state and the step's largest phase, with the gradients allocated then (all, unless the phase says)
        held = memory["parameters"] + memory["optimizer"] + buffers + int(max(
            stepping, *(sum(p[part] for part in STEP_KEYS) + p.get("gradients", memory["gradients"]) for p in phases)))
        memory["overhead"] = int(ALLOCATOR_OVERHEAD * held) + hw.reserved
        memory["total"] = held + memory["overhead"]
        if best is None or memory["total"] > best["total"]:
            best = memory
    assert best is not None
    return best


__all__ = ["ALLOCATOR_OVERHEAD", "MEMORY_KEYS", "STEP_KEYS", "backward_transient", "block_saved", "blocks_per_device",
           "ddp", "memory_of", "replicated", "step_peak", "step_phases", "stored_block", "stored_experts",
           "tokens_per_microbatch", "vocab_split", "whole_embedding_excess"]
