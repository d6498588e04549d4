"""Local worlds and launch: results by rank, failures stop every process with the traceback."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import shardkit as sk
from shardkit.models.gpt import build_tiny_gpt, gpt_loss
from shardkit.runtime.world import LocalWorld, WorldError


def _sum_ranks(ctx, offset):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return ctx.rank, t.item() + offset, ctx.data_rank, ctx.coordinates()


def _fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # the other ranks would wait here forever without the world's failure handling


def test_launch_runs_every_rank_and_returns_in_rank_order():
    values = sk.launch(_sum_ranks, sk.Plan(mesh=sk.Mesh(dp=2)), 10.0)
    assert [v[:3] for v in values] == [(0, 11.0, 0), (1, 11.0, 1)]


def test_shared_world_runs_jobs_with_different_plans(world):
    w = world(4)
    values = w.run(_sum_ranks, 0.0, plan=sk.Plan(mesh=sk.Mesh(dp=2, tp=2), rules=sk.LayoutMap([(".*", None)])))
    assert [v[1] for v in values] == [6.0] * 4
    assert [v[2] for v in values] == [0, 0, 1, 1]  # tp ranks share a data rank
    assert values[3][3] == {"dp": 1, "tp": 1}


def test_a_failing_rank_stops_the_world_with_its_traceback():
    world = LocalWorld(2)
    world.run(_sum_ranks, 0.0)  # started: the bound below is the failure's handling, not the start-up
    start = time.monotonic()
    with pytest.raises(WorldError) as err:
        world.run(_fail_on_rank_one)
    assert time.monotonic() - start < 30
    assert err.value.rank == 1 and "boom on purpose" in err.value.details and "_fail_on_rank_one" in err.value.details
    assert not world.alive


def test_unpicklable_job_is_rejected_before_sending(world):
    with pytest.raises(sk.UsageError, match="top-level"):
        world(2).run(lambda ctx: ctx.rank)


def test_verify_rejects_unpicklable_build_model_before_any_process():
    with pytest.raises(sk.UsageError, match="build_model cannot be pickled"):
        sk.verify(lambda: build_tiny_gpt(), sk.Plan(mesh=sk.Mesh(dp=2)), (None, None), loss_fn=gpt_loss)


def test_launch_rejects_mesh_that_does_not_fit_world(world):
    with pytest.raises(sk.PlanError, match="has 2 devices but the world has 4"):
        world(4).run(_sum_ranks, 0.0, plan=sk.Plan(mesh=sk.Mesh(dp=2)))
