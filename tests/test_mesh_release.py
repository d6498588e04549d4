"""A world running many jobs with different plans frees the meshes and process groups no job uses any
more (runtime/meshes.py's release_unused): the live groups stay bounded, torch's DTensor caches keep
no freed mesh, a mesh a kept model still uses is never freed, a model let go of is freed with its meshes
(measured under torch's memory tracker, as the dry run's comparison jobs do; keeping its router loss), and a
plan made again after its release trains exactly as a fresh one."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch

import shardkit as sk
from shardkit.models.gpt import GPT, GPT_RULES, build_tiny_gpt, gpt_loss

pytestmark = pytest.mark.world

# groups of its own (pp's, tp's) and no data axis: shardkit reduces its Partial gradients itself
PP_TP = sk.Plan(mesh=sk.Mesh(pp=2, tp=2), rules=GPT_RULES, pipeline=sk.Pipeline(microbatches=2))
DP_TP = sk.Plan(mesh=sk.Mesh(dp=2, tp=2))  # groups of its own: dp's and tp's
OTHERS = [  # every kind of mesh: a data axis, a sharded one, HSDP, flattened data dims, a pipeline
    sk.Plan(mesh=sk.Mesh(dp=4)),
    sk.Plan(mesh=sk.Mesh(dp=2, fsdp=2)),
    sk.Plan(mesh=sk.Mesh(fsdp=2, sp=2)),
    sk.Plan(mesh=sk.Mesh(pp=2, fsdp=2), pipeline=sk.Pipeline(microbatches=2)),
]

# In each worker process, kept between jobs: weak references to the meshes of the jobs before, the
# model a job keeps for a later one, a thread a job leaves running.
_SEEN: list[weakref.ref] = []
_KEPT: list[torch.nn.Module] = []
_THREADS: list[tuple[threading.Thread, threading.Event]] = []
_MEASURED: list[weakref.ref] = []  # the model a job measured and its mesh


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _live_groups() -> int:
    return len(torch.distributed.distributed_c10d._world.pg_map)


def _seen_alive() -> int:
    """How many meshes of the jobs before are alive."""
    return sum(ref() is not None for ref in _SEEN)


def _step(model: torch.nn.Module, ctx) -> float:
    loss = model.step(*ctx.shard_batch(*_batch()), gpt_loss).item()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
            p.grad = None
    return loss


def _train(ctx, steps: int, keep: bool) -> tuple[list[float], int]:
    """``steps`` SGD steps of the tiny GPT on the job's plan: the losses and how many meshes of the jobs
    before are alive; ``keep``: the model stays for a later job."""
    alive = _seen_alive()
    model = sk.shard(build_tiny_gpt(), ctx.plan)
    losses = [_step(model, ctx) for _ in range(steps)]
    _SEEN.append(weakref.ref(ctx.mesh))
    if keep:
        _KEPT.append(model)
    return losses, alive


def _redistribute_on(mesh) -> None:
    """A DTensor redistribution on ``mesh`` (torch caches its decisions on it)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)] * mesh.ndim)
    assert torch.equal((x * 2).redistribute(placements=[Replicate()] * mesh.ndim).to_local(), torch.full((8, 4), 2.0))


def _use_meshes(ctx) -> tuple[int, int]:
    """Make the plan's meshes and redistribute on each axis and on the data mesh: how many process
    groups and meshes of the jobs before are alive."""
    from shardkit.runtime.meshes import meshes_for

    alive = _seen_alive()
    meshes = meshes_for(ctx.plan, ctx.device.type)
    data = meshes.data()
    for mesh in [meshes.axis(name) for name in ctx.plan.mesh.names] + [data.mesh] * (data is not None):
        _redistribute_on(mesh)
    _SEEN.append(weakref.ref(meshes.root))
    return _live_groups(), alive


def _redistribute_then_wait(box: list, done: threading.Event, go: threading.Event) -> None:
    _redistribute_on(box.pop())  # then only this thread's DTensor caches refer to the mesh
    done.set()
    go.wait()


def _cache_on_a_thread(ctx) -> int:
    """A thread of the job's own redistributes on the plan's tp axis, then waits past the job's end."""
    from shardkit.runtime.meshes import meshes_for

    done, go = threading.Event(), threading.Event()
    box = [meshes_for(ctx.plan, ctx.device.type).axis("tp")]
    thread = threading.Thread(target=_redistribute_then_wait, args=(box, done, go), daemon=True)
    thread.start()
    done.wait()
    _THREADS.append((thread, go))
    return _live_groups()


def _end_thread(ctx) -> int:
    thread, go = _THREADS.pop()
    go.set()
    thread.join()
    return _live_groups()


def _step_kept(ctx) -> float:
    """A step of the model a job before kept (its meshes must still work), then let it go."""
    loss = _step(_KEPT[0], ctx)
    _KEPT.clear()
    return loss


def _nothing(ctx) -> int:
    return _live_groups()


def _measure(ctx) -> None:
    """One step of the tiny Llama measured as the dry run's comparison jobs measure it (torch's memory tracker
    around it), then let go of."""
    from shardkit.models.hf import build_tiny_llama
    from shardkit.training.measured_step import measure_step

    model = sk.meta_model(build_tiny_llama)  # sharded in place
    _MEASURED[:] = [weakref.ref(model), weakref.ref(ctx.mesh)]
    measure_step(ctx, model, ctx.plan, 2, 8)


def _train_with_aux_loss(ctx) -> None:
    """One step of the tiny MoE GPT with a router loss (the model keeps the last one), then let go of."""
    from shardkit.models.gpt import GPTConfig, tiny_moe_config

    torch.manual_seed(0)
    model = sk.shard(GPT(GPTConfig(**{**tiny_moe_config().__dict__, "router_aux_loss_coef": 0.01})), ctx.plan)
    _MEASURED[:] = [weakref.ref(model), weakref.ref(ctx.mesh)]
    _step(model, ctx)


def _measured_alive(ctx) -> list[bool]:
    """Whether the model a job before measured and its mesh are alive."""
    return [ref() is not None for ref in _MEASURED]


@pytest.mark.parametrize("job", [_measure, _train_with_aux_loss], ids=["measured step", "model keeping its aux loss"])
def test_a_model_let_go_of_is_freed_with_its_meshes_when_the_job_ends(world, job):
    """Two holders found through C++ cycles the collector cannot follow: torch's memory tracker hooked each
    module's gradients with hooks holding autograd nodes (observe/step_cost.py); the MoE GPT kept its last
    router loss with its graph (models/gpt.py). Each kept the step's graph, and through FSDP2's hooks on it the
    model, alive past the job."""
    w = world(2)
    w.run(job, plan=sk.Plan(sk.Mesh(fsdp=2)))
    w.run(_nothing)  # the plan unused since: its meshes released at the job's end, if nothing holds them
    assert w.run(_measured_alive) == [[False, False]] * 2


def _live_meshes(ctx) -> list[tuple]:
    from shardkit.runtime.meshes import _MESHES

    return list(_MESHES)


def test_many_plans_free_their_groups_and_a_plan_made_again_trains_as_a_fresh_one(world):
    w = world(4)
    w.run(_nothing)  # what earlier tests left is freed when it ends
    alone = w.run(_nothing)[0]
    # the world's group only: the models earlier jobs on this shared world let go of hold no mesh
    assert alone == 1, f"meshes earlier tests left alive: {w.run(_live_meshes)[0]}"
    fresh, _ = w.run(_train, 2, True, plan=PP_TP)[0]  # its model kept
    cycles = [[w.run(_use_meshes, plan=plan)[0] for plan in OTHERS] for _ in range(2)]
    # each job sees the world's group, its own, the job before's and the kept model's: the same in both
    # cycles (they would pile up otherwise), and the kept model's mesh stays alive in every job
    assert cycles[1][1:] == cycles[0][1:], cycles
    assert [alive for _, alive in cycles[1]] == [2] * len(OTHERS), cycles  # PP_TP's and the job before's
    kept_loss = w.run(_step_kept, plan=PP_TP)[0]  # the kept model still trains: nothing it uses was freed
    w.run(_nothing)
    assert w.run(_nothing)[0] == alone  # nothing holds PP_TP's meshes any more: freed
    again, alive = w.run(_train, 3, False, plan=PP_TP)[0]
    assert alive == 0  # no mesh of an earlier job survives, in torch's caches either
    assert again == [*fresh, kept_loss]  # made again, the plan trains exactly as the first time


def test_a_mesh_another_threads_dtensor_cache_refers_to_is_kept_until_the_thread_ends(world):
    """torch's C++ DTensor dispatch caches sharding decisions per thread, and only the calling thread's
    can be emptied: a mesh such a cache refers to is held, so it is not freed (which would leave that
    cache serving its destroyed groups) until the thread ends and torch drops its cache."""
    w = world(4)
    w.run(_nothing)  # what earlier tests left is freed when it ends
    alone = w.run(_nothing)[0]
    made = w.run(_cache_on_a_thread, plan=DP_TP)[0]
    assert made > alone
    w.run(_nothing)  # unused since: released, but kept for the thread's cache
    assert w.run(_end_thread)[0] == made  # still alive
    assert w.run(_nothing)[0] == alone  # the thread and its cache gone: freed
