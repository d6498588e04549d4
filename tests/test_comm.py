"""CommCounter: exact calls and payload bytes for eager c10d, FSDP2 and DTensor collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.observe.comm import CommCounter
from shardkit.plan import Mesh, Plan

PLAN = Plan(mesh=Mesh(fsdp=4))
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "bfloat16": torch.bfloat16}
KINDS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "sendrecv", "barrier")


def _issue(ctx, kind: str, numel: int, dtype: torch.dtype) -> None:
    t = torch.ones(numel, dtype=dtype)
    if kind == "all_reduce":
        dist.all_reduce(t)
    elif kind == "all_gather_into_tensor":
        dist.all_gather_single(torch.empty(numel * ctx.world_size, dtype=dtype), t)
    elif kind == "reduce_scatter_tensor":
        dist.reduce_scatter_single(torch.empty(numel, dtype=dtype), torch.ones(numel * ctx.world_size, dtype=dtype))
    elif kind == "broadcast":
        dist.broadcast(t, src=0)
    elif kind == "sendrecv":  # pairs (0,1), (2,3): the lower rank sends, then receives via batch_isend_irecv
        peer = ctx.rank ^ 1
        if ctx.rank < peer:
            dist.send(t, peer)
        else:
            dist.recv(t, peer)
        ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, torch.empty_like(t), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    else:
        dist.barrier()


def _run_sequence(ctx, sequence):
    with CommCounter() as comm:
        for kind, numel, dtype in sequence:
            _issue(ctx, kind, numel, DTYPES[dtype])
    return comm.summary()


def _expected(rank: int, world_size: int, sequence) -> dict[str, tuple[int, int]]:
    out: dict[str, list[int]] = {}

    def add(name: str, size: int) -> None:
        entry = out.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += size

    for kind, numel, dtype in sequence:
        size = numel * torch.tensor([], dtype=DTYPES[dtype]).element_size()
        if kind == "reduce_scatter_tensor":
            add(kind, size * world_size)
        elif kind == "sendrecv":
            add("send" if rank < (rank ^ 1) else "recv", size)
            add("send", size)
            add("recv", size)
        elif kind == "barrier":
            add(kind, 0)
        else:
            add(kind, size)
    return {k: (c, b) for k, (c, b) in sorted(out.items())}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(KINDS), st.integers(1, 64), st.sampled_from(sorted(DTYPES))),
                min_size=1, max_size=6))
def test_eager_collectives_counted_exactly(world, sequence):
    results = world(4).run(_run_sequence, sequence, plan=PLAN)
    for rank, summary in enumerate(results):
        assert summary == _expected(rank, 4, sequence)


def _dtensor_and_fsdp(ctx):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = ctx.mesh["fsdp"]
    sharded = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    with CommCounter() as gather:
        sharded.redistribute(mesh, [Replicate()])
    with CommCounter() as reduce:
        (sharded * 2).sum().full_tensor()  # Partial -> Replicate: one all_reduce of the local scalar
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8, bias=False)
    fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    with CommCounter() as fsdp:
        layer(torch.ones(2, 8)).sum().backward()
    return gather.summary(), reduce.summary(), fsdp.summary()


def test_dtensor_and_fsdp2_collectives_counted_once(world):
    for gather, reduce, fsdp in world(4).run(_dtensor_and_fsdp, plan=PLAN):
        assert gather == {"all_gather_into_tensor": (1, 2 * 4 * 4)}   # local shard [2, 4] float32
        assert reduce == {"all_reduce": (1, 4)}                         # one float32 partial sum
        # FSDP2: all-gather the [2, 8] local shard, reduce-scatter the full [8, 8] gradient
        assert fsdp == {"all_gather_into_tensor": (1, 2 * 8 * 4), "reduce_scatter_tensor": (1, 8 * 8 * 4)}


def test_counter_sees_nothing_outside_its_scope(world):
    results = world(4).run(_outside_scope, plan=PLAN)
    assert results == [{}] * 4


def _outside_scope(ctx):
    comm = CommCounter()
    dist.all_reduce(torch.ones(2))
    with comm:
        torch.ones(3).sum()
    dist.barrier()
    return comm.summary()
