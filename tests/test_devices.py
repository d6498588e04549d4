"""devices.py, the one home of the device and the backend: the backend chosen or refused (GPU counts
faked), LOCAL_RANK required under a launcher, process groups' timeouts, results read on the CPU,
initialisation drawn on the CPU whatever the device, and replica groups freed when no job uses them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardkit as sk
from shardkit.models.gpt import build_tiny_gpt
from shardkit.runtime import devices, materialize, results
from shardkit.runtime.world import LocalWorld


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` GPUs (named), whatever it has; no backend asked by the environment."""
    monkeypatch.delenv(devices.BACKEND_VARIABLE, raising=False)

    def fake(n: int) -> None:
        monkeypatch.setattr(devices, "gpu_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"FakeGPU-{i}")

    return fake


def test_backend_nccl_with_a_gpu_per_rank_gloo_without_gpus(gpus):
    gpus(4)
    assert devices.choose_backend(4) == "nccl"
    assert devices.choose_backend(4, "gloo") == "gloo"  # the CPU, asked for
    gpus(0)
    assert devices.choose_backend(8) == "gloo"


def test_fewer_gpus_than_ranks_is_refused_naming_both_never_run_on_the_cpu(gpus, monkeypatch):
    gpus(1)
    with pytest.raises(sk.UsageError, match=r"2 rank\(s\) .* but 1 GPU\(s\) were found \(cuda:0 FakeGPU-0\): "
                                            r"ask for at most 1 rank\(s\) .*backend='gloo', or SHARDKIT_BACKEND=gloo"):
        devices.choose_backend(2)
    with pytest.raises(sk.UsageError, match=r"2 rank\(s\)"):
        LocalWorld(2)  # refused before any process starts
    gpus(0)
    with pytest.raises(sk.UsageError, match=r"1 rank\(s\) on this machine need one GPU each for NCCL, but 0 GPU"):
        devices.choose_backend(1, "nccl")
    monkeypatch.setenv(devices.BACKEND_VARIABLE, "mpi")
    with pytest.raises(sk.UsageError, match=r"backend 'mpi' .* choose one of \['gloo', 'nccl'\]"):
        devices.choose_backend(1)
    gpus(1)
    monkeypatch.setenv(devices.BACKEND_VARIABLE, "gloo")
    assert devices.choose_backend(2) == "gloo"


def test_local_rank_is_required_under_a_launcher_never_the_global_rank(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(sk.UsageError, match=r"RANK=5, WORLD_SIZE=8\) shardkit needs LOCAL_RANK.*it is not set"):
        devices.launcher_local_rank()
    with pytest.raises(sk.UsageError, match="LOCAL_RANK"):
        sk.launch(_rank, world_size=8)  # joins the launcher's world: refused before opening it
    monkeypatch.setenv("LOCAL_RANK", "x1")
    with pytest.raises(sk.UsageError, match=r"it is 'x1'"):
        devices.launcher_local_rank()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert devices.launcher_local_rank() == 1 and devices.launcher_ranks_on_host() == 4
    assert devices.device_of("nccl", 1) == torch.device("cuda", 1) and devices.device_of("gloo", 1).type == "cpu"


def _rank(ctx):
    return ctx.rank


def test_group_timeout_is_the_jobs_plus_the_margin():
    assert devices.group_timeout_for(300).total_seconds() == 300 + devices.GROUP_MARGIN_S
    assert devices.group_timeout_for(None) == devices.NO_LIMIT


def _timeouts(ctx):
    """Every group this job's mesh uses, and the world's: their timeouts in seconds."""
    groups = [dist.group.WORLD, *ctx.mesh.get_all_groups()]
    return {g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups}


def test_every_group_waits_as_long_as_the_job_plus_the_margin(world):
    plan = sk.Plan(mesh=sk.Mesh(dp=1, tp=2))  # dp: groups of one rank, made by the mesh; tp: the world
    for timeout in (100, 250):
        assert world(2).run(_timeouts, plan=plan, timeout=timeout) == [{timeout + devices.GROUP_MARGIN_S}] * 2


def _groups_alive(ctx, ranks):
    """Ask for the group of ``ranks`` (this rank's pair), then: how many groups are alive."""
    from shardkit.runtime.meshes import process_group

    for r in ranks:
        process_group(r)  # a collective: every rank asks for every group, in order
    for mine in (r for r in ranks if ctx.rank in r):
        assert dist.get_process_group_ranks(process_group(mine)) == list(mine)
    return len(dist.distributed_c10d._world.pg_map)


def test_groups_no_job_uses_are_freed_the_worlds_group_never(world):
    """Each job asks for other groups: those of the job before it are destroyed when it ends, so a
    job sees its own groups and the last job's (they would pile up otherwise); the world's lives on."""
    pairings = [((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 3), (1, 2)), ((0, 1, 2, 3),)]
    world(4).run(_groups_alive, ())  # the meshes and groups earlier tests' jobs left are freed when it ends
    counts = [world(4).run(_groups_alive, pairs)[0] for pairs in pairings]
    first = counts[0]
    assert counts == [first, first + 1, first + 1, first], counts  # the last job makes none: the world's
    assert world(4).run(_groups_alive, pairings[0]) == [first] * 4  # made again, as new


def test_results_are_read_on_the_cpu(monkeypatch):
    seen = {}
    load = torch.load

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    assert results.loads(results.dumps({"x": torch.ones(2)}))["x"].device.type == "cpu"
    assert seen["map_location"] == "cpu"  # a CUDA tensor would not initialise CUDA in the parent


def test_initialisation_draws_on_the_cpu_whatever_the_device(monkeypatch):
    """Materialised onto another device type ("meta" stands for any accelerator), each module's
    values are drawn on the CPU, bitwise the same as when materialised onto the CPU."""
    drawn: dict[str, dict[str, torch.Tensor]] = {}
    real = materialize.family_of

    class Spy:
        def __init__(self, family):
            self.family = family

        def __getattr__(self, name):
            return getattr(self.family, name)

        def init_module(self, model, module):
            self.family.init_module(model, module)
            name = next(n for n, m in model.named_modules() if m is module)
            drawn.setdefault(name, {k: p.detach().clone() for k, p in module._parameters.items() if p is not None})

    monkeypatch.setattr(materialize, "family_of", lambda model: Spy(real(model)))
    on_meta = materialize.materialize(sk.meta_model(build_tiny_gpt), "meta", seed=3)
    assert next(on_meta.parameters()).device.type == "meta"
    on_cpu = materialize.materialize(sk.meta_model(build_tiny_gpt), "cpu", seed=3)
    compared = 0
    for name, param in on_cpu.named_parameters():
        owner, _, key = name.rpartition(".")
        value = drawn[owner][key]
        assert value.device == devices.INIT_DEVICE, name
        assert torch.equal(value, param), name
        compared += 1
    assert compared == len(list(on_cpu.parameters()))


def test_inputs_stay_on_the_cpu_for_a_cpu_rank():
    t = torch.arange(4)
    assert devices.to_device(t, torch.device("cpu")) is t
