"""The data-parallel wrappers' own work in a training step, beyond their collectives: the copies DDP
and FSDP2 (``fully_shard``, ``replicate``) make of parameters and gradients, and how often FSDP2
gathers a unit. :func:`~shardkit.planner.step_time.time_of` prices them (``dp`` / ``fsdp`` parts);
``tests/test_wrapper_copies.py`` counts them as a real step runs."""

from __future__ import annotations

from .costs import Setting
from .memory import ddp

#: DDP's own work per gradient tensor, ``(operator calls, passes over its bytes)``: scaled by ``1/world``
#: into its bucket (``mul``) and copied back after the all-reduce (``copy_``), each reading and writing
#: it. ``tests/test_wrapper_copies.py`` counts them as a step runs (dp=2 on gloo, torch 2.13).
DDP_COPIES = (2, 4)
#: FSDP2's ``fully_shard``: its own operator calls per unit and collective, each reading and writing what it
#: copies once: an all-gather's ``all_gather_copy_in`` (the shard into the send buffer) and
#: ``split_with_sizes_copy`` (the gathered unit out to the parameters); a reduce-scatter's ``chunk_cat``
#: (the gradients into the send buffer). NCCL writes this rank's share of the reduction in place; gloo
#: copies it out of an all-reduce when the call is waited on, the collective's own work (timed with it by
#: ``shardkit calibrate``), not the wrapper's. Counted by ``tests/test_wrapper_copies.py``.
FSDP_COPIES = {"all_gather": 2, "reduce_scatter": 1}
#: FSDP2's ``replicate`` (its shard group is one rank), ``(calls per parameter tensor and forward, calls
#: per unit and step)``: each parameter copied to its unsharded tensor as the forward starts (``copy_``),
#: and the gradients copied into the reduce-scatter's send buffer (``chunk_cat``) and out to its output
#: (``copy_``: a reduce-scatter of one rank) before the all-reduce; each copy reads and writes its tensor
#: once. Counted by ``tests/test_wrapper_copies.py``.
REPLICATE_COPIES = (1, 2)


def wrapper_copies(s: Setting, tensors: float, units: float, whole: float, stored: float, gathers: float,
                   sizes: tuple[int, int, int]) -> tuple[float, float]:
    """``(operator calls, bytes read and written)`` of the data-parallel wrapper's own copies in a step on one
    device: DDP's (:data:`DDP_COPIES`; where :func:`~shardkit.planner.memory.ddp` says the runtime runs it),
    else FSDP2's ``fully_shard`` (``fsdp``: :data:`FSDP_COPIES`, ``gathers`` all-gathers of each of ``units``
    units) or ``replicate`` (:data:`REPLICATE_COPIES`; each forward of an accumulated step unshards again, a
    pipeline's schedule keeps the parameters unsharded between its micro-batches). ``tensors`` parameter
    tensors of ``whole`` elements on the device, ``stored`` of them kept here; ``sizes``: the itemsizes of the
    parameters', the compute and the reduce dtype. FSDP2 casts, one call reading one dtype and writing the
    other: the parameters to a compute dtype of their own before each gather (``fully_shard``: the shard, one
    ``_foreach_copy_``; ``replicate``: each tensor, ``_to_copy``), the reduced gradients back to the
    parameters' dtype after each reduction (``_to_copy``), and, over several micro-batches, each gradient to
    a reduce dtype of its own once a step, to accumulate in it (``_to_copy``)."""
    param, compute, reduce = sizes
    if ddp(s):
        calls, passes = DDP_COPIES
        return tensors * calls, passes * whole * reduce
    cast, back = compute != param, reduce != param
    accumulated = s.microbatches * s.accumulation > 1 and reduce != compute
    calls, moved = accumulated * tensors, accumulated * whole * (compute + reduce)
    if s.fsdp > 1:
        calls += units * (gathers * (FSDP_COPIES["all_gather"] + cast) + FSDP_COPIES["reduce_scatter"] + back)
        return calls, moved + gathers * (stored * (cast * param + (2 + cast) * compute) + 2 * whole * compute) \
            + whole * (compute + reduce) + back * stored * (reduce + param)
    per_tensor, per_unit = REPLICATE_COPIES
    calls += s.accumulation * tensors * (per_tensor + cast) + units * (per_unit + back)
    return calls, moved + s.accumulation * whole * (cast * param + (2 + cast) * compute) \
        + whole * (compute + 3 * reduce) + back * whole * (reduce + param)


def fsdp_gathers(s: Setting) -> int:
    """All-gathers of each FSDP unit in a step: each micro-batch gathers it for its forward and, resharded
    after it, again for its backward; FSDP2 reshards after each backward (an accumulated step's micro-batches
    gather again), but a pipeline's schedule keeps its units gathered until its last micro-batch.

    >>> fsdp_gathers(Setting(fsdp=4, accumulation=2, reshard=False))
    2
    >>> fsdp_gathers(Setting(fsdp=4, pp=2, microbatches=4, reshard=False))
    1
    """
    m = s.microbatches * s.accumulation
    return (2 if s.reshard else 1) * (m if s.reshard or s.pp == 1 else 1)


__all__ = ["DDP_COPIES", "FSDP_COPIES", "REPLICATE_COPIES", "fsdp_gathers", "wrapper_copies"]
