"""The data-parallel wrappers' own copies, counted as a training step runs (issue 17 §5): the operator
calls and bytes DDP and FSDP2 (``fully_shard``, ``replicate``) dispatch beyond the plain model's own
forward and backward, against what the step time prices for them (``wrapper_costs.wrapper_copies``:
``DDP_COPIES``, ``FSDP_COPIES``, ``REPLICATE_COPIES``). One shared world of 2 gloo processes, one job."""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed._composable.replicate import DDP
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import shardkit as sk
from shardkit.models.gpt import build_tiny_gpt, gpt_loss
from shardkit.planner.costs import Setting
from shardkit.planner.counters import OpCounter
from shardkit.planner.memory import ddp
from shardkit.planner.wrapper_costs import (
    DDP_COPIES,
    FSDP_COPIES,
    REPLICATE_COPIES,
    fsdp_gathers,
    wrapper_copies,
)
from shardkit.runtime.accumulation import gradient_sync_deferred

BF16 = "bfloat16"
CASES = {  # the runtime runs DDP (the first and last), FSDP2's fully_shard or its replicate
    "ddp": sk.Plan(sk.Mesh(dp=2)),
    "fsdp": sk.Plan(sk.Mesh(fsdp=2)),
    "fsdp bf16": sk.Plan(sk.Mesh(fsdp=2), fsdp=sk.FSDPOptions(param_dtype=BF16)),
    "replicate, reduced in bf16": sk.Plan(sk.Mesh(dp=2), fsdp=sk.FSDPOptions(reduce_dtype=BF16)),
    "replicate bf16": sk.Plan(sk.Mesh(dp=2), fsdp=sk.FSDPOptions(param_dtype=BF16)),
    "fsdp no reshard": sk.Plan(sk.Mesh(fsdp=2), fsdp=sk.FSDPOptions(reshard_after_forward=False)),
    "ddp, float32 written": sk.Plan(sk.Mesh(dp=2), fsdp=sk.FSDPOptions(param_dtype="float32")),  # no mixed precision
}
ACCUMULATED = "replicate, reduced in bf16"  # these two also counted over 2 micro-batches
REGATHERED = "fsdp no reshard"


class _Copies(OpCounter):
    """Counts, as :class:`OpCounter` books them, the operator calls that launch a kernel by name, and the
    bytes each moves taken as a copy: it reads its source (the first tensor argument its schema does not
    mark written, 0-dim scalars aside) and writes as many elements in its destination's dtype (its first
    written argument, else its first output). Collectives are counted apart by name; the profiler's
    ``record_function`` markers, which launch nothing, not at all."""

    def __init__(self):
        super().__init__(self._booked)
        self.calls, self.bytes, self.collectives = Counter(), Counter(), Counter()
        self._kernel = False

    def _booked(self, *args):
        self._kernel = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._kernel = False
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self._kernel and func.namespace == "c10d":
            self.collectives[func._opname] += 1
        elif self._kernel and func.namespace != "profiler":
            self.calls[func._opname] += 1
            self.bytes[func._opname] += _moved(func, args, kwargs or {}, out)
        return out


def _moved(func, args: tuple, kwargs: dict, out) -> int:
    schema = func._schema.arguments
    source = written = None
    for arg, value in zip(schema, [*args, *(kwargs.get(a.name) for a in schema[len(args):])]):
        tensors = [t for t in (value if isinstance(value, (list, tuple)) else [value])
                   if isinstance(t, torch.Tensor) and t.dim()]
        if not tensors:
            continue
        if arg.alias_info is not None and arg.alias_info.is_write:
            written = written or tensors
        else:
            source = source or tensors
    written = written or [t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
    if not source:
        return 0
    elements = sum(t.numel() for t in source)
    return elements * (source[0].element_size() + written[0].element_size())


def _count(model, x, y, micro_batches: int = 1) -> _Copies:
    """The forward and backward of a step (its optimizer's step is priced apart), in ``micro_batches``."""
    model.zero_grad(set_to_none=True)
    with _Copies() as counted:
        for i, (xi, yi) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            with gradient_sync_deferred(model) if i < micro_batches - 1 else nullcontext():
                gpt_loss(model(xi), yi).backward()
    return counted


def _difference(run: _Copies, base: _Copies) -> dict:
    return {"calls": {k: v - base.calls[k] for k, v in run.calls.items() if v != base.calls[k]},
            "bytes": {k: v - base.bytes[k] for k, v in run.bytes.items() if v != base.bytes[k]},
            "collectives": dict(run.collectives)}


def _wrapper_counts(ctx, cases: dict) -> dict:
    """Per case: what the wrapper dispatched beyond the plain model (in the compute dtype), the
    collectives, and the facts the planner prices them by; and what gloo's collectives copy themselves."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4, 33), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    found, bases = {}, {}
    for name, plan in cases.items():
        dtype = getattr(torch, plan.fsdp.param_dtype or "float32")
        if dtype not in bases:
            plain = build_tiny_gpt().to(dtype)
            bases[dtype] = _count(plain, x, y), _count(plain, x, y, 2)
        model = sk.shard(build_tiny_gpt(), plan)
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):  # DDP rebuilds its buckets at the second step
            model.step(x, y, gpt_loss)
            optimizer.step()
            optimizer.zero_grad()
        params = list(model.parameters())
        found[name] = {**_difference(_count(model, x, y), bases[dtype][0]),
                       "ddp": isinstance(model, DDP), "tensors": len(params),
                       "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
                       "whole": sum(p.numel() for p in params),
                       "stored": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)}
        if name in (ACCUMULATED, REGATHERED):
            found[name]["accumulated"] = _difference(_count(model, x, y, 2), bases[dtype][1])
    whole, share = torch.ones(64), torch.empty(32)
    with _Copies() as bare:
        dist.reduce_scatter_single(share, whole)
        dist.all_gather_single(whole, share)
        dist.all_reduce(whole)
    found["gloo"] = {"calls": sum(bare.calls.values()), "bytes": sum(bare.bytes.values()) / share.nbytes}
    return found


@pytest.fixture(scope="module")
def counts(world):
    return world(2).run(_wrapper_counts, CASES)[0]


def _sizes(plan: sk.Plan) -> tuple[int, int, int]:
    """Itemsizes of the parameters' (float32), the compute and the reduce dtype, as the step time takes them."""
    compute = getattr(torch, plan.fsdp.param_dtype or "float32").itemsize
    return 4, compute, getattr(torch, plan.fsdp.reduce_dtype).itemsize if plan.fsdp.reduce_dtype else compute


def _planned(name: str, case: dict, **setting) -> tuple[float, float]:
    """What the planner prices for the case, given the counted facts: the units, the parameter tensors and
    elements, and (fully_shard) the all-gathers of each unit."""
    plan = CASES[name]
    gathers = case["collectives"].get("_allgather_base_", 0) / case["units"] if case["units"] else 0
    return wrapper_copies(replace(Setting.of(plan), **setting), case["tensors"], case["units"], case["whole"],
                          case["stored"], gathers, _sizes(plan))


def test_gloo_copies_only_a_reduce_scatters_share_itself(counts):
    """gloo reduce-scatters by all-reducing the whole input and copying this rank's share out when the
    call is waited on (NCCL writes the share in place): that copy, one call reading and writing the
    share, is the collective's, not the wrapper's; all-gather and all-reduce copy nothing."""
    assert counts["gloo"] == {"calls": 1, "bytes": 2.0}


@pytest.mark.parametrize("name", CASES)
def test_the_planner_prices_the_copies_each_wrapper_dispatches(counts, name):
    """The calls and bytes a step's forward and backward dispatch beyond the plain model's (less gloo's
    own share copy per reduce-scatter) are what ``wrapper_copies`` prices for the plan, and the runtime
    ran DDP where ``memory.ddp`` says it does."""
    case = counts[name]
    assert case["ddp"] == ddp(Setting.of(CASES[name]))
    scatters = case["collectives"].get("_reduce_scatter_base_", 0)
    gloo = (scatters * counts["gloo"]["calls"], counts["gloo"]["bytes"] * case["stored"] * _sizes(CASES[name])[2]
            if scatters else 0)
    counted = (sum(case["calls"].values()) - gloo[0], sum(case["bytes"].values()) - gloo[1])
    assert counted == _planned(name, case), case


def test_the_constants_are_the_counts(counts):
    """By operator, on the tiny GPT's 37 parameter tensors: DDP's ``mul`` and ``copy_`` per gradient, each
    2 passes over it; fully_shard's copies per unit and all-gather (3 units, gathered forward and again
    backward) and per reduce-scatter (the ``copy_`` is gloo's share); replicate's ``copy_`` per tensor and
    forward, its ``chunk_cat`` and ``copy_`` per unit, and the cast back from the reduce dtype."""
    tensors = 37
    plain = counts["ddp"]
    assert plain["tensors"] == tensors and plain["calls"] == {"mul": tensors, "copy_": tensors}
    assert DDP_COPIES == (len(plain["calls"]), sum(plain["bytes"].values()) / (plain["whole"] * 4))
    sharded = counts["fsdp"]
    assert sharded["units"] == 3 and sharded["collectives"] == {"_allgather_base_": 6, "_reduce_scatter_base_": 3}
    assert sharded["calls"] == {"all_gather_copy_in": 6, "split_with_sizes_copy": 6, "chunk_cat": 3, "copy_": 3}
    assert FSDP_COPIES == {"all_gather": 2, "reduce_scatter": 1}
    replicated = counts[ACCUMULATED]
    per_tensor, per_unit = REPLICATE_COPIES
    assert replicated["units"] == 1 and (per_tensor, per_unit) == (1, 2)
    assert replicated["calls"] == {"copy_": tensors + 1, "chunk_cat": 1, "_to_copy": 1}


def test_accumulated_micro_batches_unshard_again_and_cast_to_the_reduce_dtype_once(counts):
    """Over 2 micro-batches replicate copies every parameter again at each forward, and casts each
    gradient to its reduce dtype once to accumulate in it; it reduces once."""
    case = counts[ACCUMULATED]
    accumulated = case["accumulated"]
    assert accumulated["calls"] == {"copy_": 2 * 37 + 1, "_to_copy": 37 + 1, "chunk_cat": 1}
    assert sum(accumulated["calls"].values()) == _planned(ACCUMULATED, case, accumulation=2)[0]


def test_each_micro_batch_gathers_the_units_again_as_the_planner_counts(counts):
    """FSDP2 reshards each unit after its backward, so without resharding after the forward an accumulated
    step's second micro-batch gathers every unit again (3 units, 2 micro-batches: 6 all-gathers, not 3):
    ``fsdp_gathers``, which prices the gathers and their copies, counts the same."""
    case = counts[REGATHERED]
    gathered = case["accumulated"]["collectives"]["_allgather_base_"] / case["units"]
    assert case["units"] == 3 and gathered == 2
    assert fsdp_gathers(replace(Setting.of(CASES[REGATHERED]), accumulation=2)) == gathered
    assert fsdp_gathers(Setting.of(CASES[REGATHERED])) == case["collectives"]["_allgather_base_"] / case["units"] == 1
