"""CommCounter: exact calls and payload bytes for eager c10d, FSDP2 and DTensor collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from shardkit.observe.comm import CommCounter
from shardkit.observe.report import comm_table
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


WIDTH = 3  # float32 columns of every all-to-all row below


def _all_to_alls(ctx):
    """Every way to issue an all-to-all, each counted on its own: rank r sends ``r + p + 1`` rows to rank p."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    n, r = ctx.world_size, ctx.rank
    splits = [r + p + 1 for p in range(n)]  # symmetric: what p sends r is what r sends p
    rows = torch.ones(sum(splits), WIDTH)
    counted = {}
    with CommCounter() as counted["uneven"]:
        dist.all_to_all_single(torch.empty_like(rows), rows, splits, splits)
    with CommCounter() as counted["even"]:
        dist.all_to_all_single(torch.empty(2 * n, WIDTH), torch.ones(2 * n, WIDTH))
    with CommCounter() as counted["list"]:
        dist.all_to_all([torch.empty(2, WIDTH) for _ in range(n)], [torch.ones(2, WIDTH) for _ in range(n)])
    leaf = rows.clone().requires_grad_()
    with CommCounter() as counted["forward"]:
        out = wait_tensor(all_to_all_single_autograd(leaf, splits, splits, dist.group.WORLD))
    with CommCounter() as counted["backward"]:
        out.sum().backward()
    return {name: (c.summary(), c.remote()) for name, c in counted.items()}


def test_all_to_all_bytes_and_what_leaves_the_rank(world):
    """Eager and functional all-to-all (and its autograd backward): calls, payload bytes, and the
    bytes addressed to other ranks (the payload less the rank's split to itself)."""
    row = WIDTH * 4
    for r, got in enumerate(world(4).run(_all_to_alls, plan=PLAN)):
        sent = sum(r + p + 1 for p in range(4)) * row
        own = (2 * r + 1) * row
        assert got["uneven"] == ({"all_to_all_single": (1, sent)}, {"all_to_all_single": sent - own})
        assert got["even"] == ({"all_to_all_single": (1, 8 * row)}, {"all_to_all_single": 6 * row})
        assert got["list"] == ({"all_to_all": (1, 8 * row)}, {"all_to_all": 6 * row})  # gloo: equal tensors
        assert got["forward"] == got["backward"] == got["uneven"]


def _expert_step(ctx):
    """One step of the tiny MoE GPT under ``dp=2,ep=2`` (ep-group ranks differ from world ranks): the
    forward's and the backward's collectives, counted apart, and the rows each experts module sent."""
    import shardkit as sk
    from shardkit.models.gpt import build_tiny_gpt_moe, gpt_loss

    plan = sk.Plan(mesh=sk.Mesh(dp=2, ep=2))
    model = sk.shard(build_tiny_gpt_moe(), plan, ctx)
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(3))
    inputs, targets = (t.chunk(4)[plan.mesh.data_index(ctx.rank)] for t in (tokens[:, :-1], tokens[:, 1:]))
    with CommCounter() as forward:
        loss = gpt_loss(model(inputs), targets)
    with CommCounter() as backward:
        loss.backward()
    rows = [(m._sk_rows, m._sk_expert_group.group.rank()) for m in model.modules() if hasattr(m, "_sk_rows")]
    return forward.summary(), forward.remote(), backward.summary(), backward.remote(), rows


def test_expert_exchanges_count_the_rows_sent_times_hidden_times_element_size(world):
    """Per layer the forward sends its rows out and their results back (two ``all_to_all_single``,
    after one of the int64 per-expert counts), and the backward the same rows' gradients both ways."""
    experts, row = 4, 64 * 4  # gpt-moe: 4 experts, hidden 64, float32
    results = world(4).run(_expert_step, plan=PLAN)
    for forward, forward_remote, backward, backward_remote, rows in results:
        assert len(rows) == 2 and all(sum(r.sent) > 0 for r, _ in rows)
        moved = sum(sum(r.sent) + sum(r.received) for r, _ in rows) * row
        left = sum(sum(r.sent) + sum(r.received) - r.sent[me] - r.received[me] for r, me in rows) * row
        counts = len(rows) * experts * 8
        assert forward["all_to_all_single"] == (3 * len(rows), moved + counts)
        assert forward_remote == {"all_to_all_single": left + counts // 2}   # half the counts stay on ep=2
        assert backward["all_to_all_single"] == (2 * len(rows), moved)
        assert backward_remote == {"all_to_all_single": left}
        assert left < moved
    for layer in range(2):  # every (token, slot) of the batch was sent once: 8 x 16 tokens x top 2
        assert sum(sum(rows[layer][0].sent) for *_, rows in results) == 8 * 16 * 2


def test_shardkit_train_counts_the_expert_exchanges(world):
    """``shardkit train``'s communication table (its ranks' ``comm``) holds the expert exchanges: per layer 3
    all-to-alls forward and 2 backward; over the ranks, every (token, slot) row goes out and comes back
    in both passes (4 x tokens x top_k x hidden x 4 bytes) and each rank sends its ``E`` int64 counts."""
    import shardkit as sk

    config = sk.TrainConfig(model="gpt-moe", plan=sk.Plan(mesh=sk.Mesh(ep=4)), steps=1, batch_size=4,
                            seq_len=16, data_mb=0.05)
    stats = sk.train(config, world=world(4)).stats
    layers, experts, top_k, hidden = 2, 4, 2, 64
    assert [s.comm["all_to_all_single"][0] for s in stats] == [5 * layers] * 4
    total = sum(s.comm["all_to_all_single"][1] for s in stats)
    assert total == layers * (4 * 4 * 16 * top_k * hidden * 4 + 4 * experts * 8)
    assert all(0 < s.comm_remote["all_to_all_single"] < s.comm["all_to_all_single"][1] for s in stats)
    console = Console(record=True, width=400)
    console.print(comm_table(stats))
    row = next(line for line in console.export_text().splitlines() if "all_to_all_single" in line)
    assert row.count("to others)") == 4 and f"{5 * layers} / " in row
