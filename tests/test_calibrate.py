"""Calibration: the alpha-beta fit (hypothesis), how measurements become a Hardware, and one real
``shardkit calibrate --world 2 --out f.yaml`` run whose result the API checks share."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

import shardkit as sk
import shardkit.observe.calibrate as calibrate_module
import shardkit.observe.probes as probes
from shardkit.cli import build_parser, main
from shardkit.cli.options import model_from_flag
from shardkit.cli.plan_flags import plan_from_args
from shardkit.observe.calibrate import measure
from shardkit.observe.fits import Fit, fit_alpha_beta, fit_residual
from shardkit.observe.probes import Overlap
from shardkit.planner.counters import OpCounter
from shardkit.planner.hardware import COLLECTIVES, DTYPES, Hardware, Link, ring_terms

SIZES = st.lists(st.integers(min_value=1, max_value=2**32), min_size=2, max_size=12, unique=True)
FACTORS = st.sampled_from([ring_terms(c, n) for c in COLLECTIVES for n in (2, 3, 4, 8, 64)])


# -- the fit --------------------------------------------------------------------------------------

@given(sizes=SIZES, latency=st.floats(1e-7, 1e-2), bandwidth=st.floats(1e6, 1e12), terms=FACTORS)
def test_exact_data_recovers_latency_and_bandwidth(sizes, latency, bandwidth, terms):
    steps, factor = terms
    times = [steps * latency + factor * s / bandwidth for s in sizes]
    link = fit_alpha_beta(sizes, times, factor, steps)
    assert link.latency == pytest.approx(latency, rel=1e-6)
    assert link.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert fit_residual(link, sizes, times, factor, steps) < 1e-9


@given(sizes=SIZES, bandwidth=st.floats(1e6, 1e12), terms=FACTORS)
def test_a_line_through_the_origin_has_no_latency(sizes, bandwidth, terms):
    steps, factor = terms
    times = [factor * s / bandwidth for s in sizes]
    link = fit_alpha_beta(sizes, times, factor, steps)
    assert link.latency <= 1e-9 * min(times) and link.bandwidth == pytest.approx(bandwidth, rel=1e-6)


@given(sizes=SIZES, scale=st.floats(0.1, 10.0))
def test_the_fit_does_not_depend_on_the_unit_of_time(sizes, scale):
    times = [1e-4 + s / 1e9 * (1 + 0.1 * (i % 3)) for i, s in enumerate(sizes)]  # not a line
    link = fit_alpha_beta(sizes, times, 1.0)
    scaled = fit_alpha_beta(sizes, [t * scale for t in times], 1.0)
    assert scaled.latency == pytest.approx(link.latency * scale, rel=1e-6, abs=1e-15)
    assert scaled.bandwidth == pytest.approx(link.bandwidth / scale, rel=1e-6)


def test_a_negative_intercept_is_clamped_and_the_line_refitted_through_zero():
    sizes, times = [1e3, 1e4, 1e5], [1e-7, 1e-5, 1.1e-4]  # the best line crosses below zero
    link = fit_alpha_beta(sizes, times, 2.0, steps=4)
    assert link.latency == 0.0
    ratios = [2.0 * s / t for s, t in zip(sizes, times)]  # the origin line weighs relative errors
    assert link.bandwidth == pytest.approx(sum(r * r for r in ratios) / sum(ratios), rel=1e-9)


def test_fit_residual_is_the_relative_rms_error():
    link = Link(bandwidth=1e9, latency=1e-6)
    assert fit_residual(link, [1e3, 1e6], [2e-6 * 1.1, 1.001e-3 * 0.8], 1.0) == pytest.approx(
        math.sqrt(((1 / 1.1 - 1) ** 2 + (1 / 0.8 - 1) ** 2) / 2))


@pytest.mark.parametrize("sizes, times, factor, steps, message", [
    ([1, 2, 3], [3e-6, 2e-6, 1e-6], 1.0, 1, "times do not grow with the message size"),
    ([5, 5], [1e-6, 2e-6], 1.0, 1, "at least two different sizes are needed"),
    ([1, 2], [1e-6], 1.0, 1, "two lists of the same length, got 2 and 1"),
    ([1, 2], [0.0, 1e-6], 1.0, 1, "finite and > 0"),
    ([1, 2], [1e-6, 2e-6], 0.0, 1, "factor must be a finite number > 0, got 0.0"),
    ([1, 2], [1e-6, 2e-6], 1.0, 0, "steps must be an integer >= 1, got 0"),
])
def test_data_that_gives_no_link_is_refused(sizes, times, factor, steps, message):
    with pytest.raises(sk.UsageError, match=message):
        fit_alpha_beta(sizes, times, factor, steps)


# -- overlap ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("compute, communication, both, fraction", [
    (1.0, 0.5, 1.0, 1.0),      # the all-reduces wholly hidden behind the products
    (1.0, 0.5, 1.5, 0.0),      # in turn: nothing hidden
    (0.5, 1.0, 1.25, 0.5),     # half of the shorter loop hidden, whichever it is
    (1.0, 1.0, 1.9, 0.1),
    (1.0, 0.5, 0.8, 1.0),      # faster together than the longer alone (noise): clamped to 1
    (1.0, 0.5, 2.0, 0.0),      # slower than in turn (contention): clamped to 0
])
def test_overlap_is_the_part_of_the_shorter_loop_hidden(compute, communication, both, fraction):
    assert Overlap(compute, communication, both).fraction == pytest.approx(fraction)


# -- measurements -> Hardware, without processes --------------------------------------------------

@pytest.fixture
def refuse_worlds(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a world was started although the arguments are invalid")

    monkeypatch.setattr(calibrate_module, "LocalWorld", refuse)


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=1), "calibrate\\(world_size=1\\): collectives need at least 2 processes"),
    (dict(world_size=2, message_sizes=(64, 64)), "give at least two different sizes in bytes"),
    (dict(world_size=2, matmul_sizes=()), "calibrate\\(matmul_sizes=\\(\\)\\): give matrix sizes"),
    (dict(world_size=2, seconds_per_size=float("nan")), "give a finite number of seconds > 0"),
])
def test_bad_arguments_start_nothing(kwargs, message, refuse_worlds):
    with pytest.raises(sk.UsageError, match=message):
        measure(**kwargs)


def test_under_torchrun_calibrate_measures_the_torchrun_world_and_no_other(refuse_worlds, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(sk.UsageError, match="the torchrun world of 2 processes is measured; give world_size=2"):
        measure(4)
    with pytest.raises(sk.UsageError, match="under torchrun the torchrun world is measured; give no world"):
        measure(2, world=type("World", (), {"size": 2})())


def test_the_name_and_cache_key_say_the_launcher_backend_and_device_kind(monkeypatch):
    """A CPU measurement is never read back for GPUs, nor one GPU model's for another's."""
    names = {calibrate_module.world_name(launcher, 8, backend, kind)
             for launcher in ("local", "torchrun") for backend, kind in (("gloo", "cpu"), ("nccl", "nvidia-h200"),
                                                                         ("nccl", "nvidia-a100-sxm4-80gb"))}
    assert len(names) == 6 and "torchrun-8-nccl-nvidia-h200" in names and "local-8-gloo-cpu" in names
    from shardkit.runtime import devices

    monkeypatch.setattr(devices.torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert devices.device_kind(torch.device("cuda", 1)) == "nvidia-h100-80gb-hbm3"
    assert devices.device_kind(torch.device("cpu")) == "cpu"
    # the local world's file is keyed by the backend devices.py chooses and that backend's device
    monkeypatch.setattr(calibrate_module, "choose_backend", lambda ranks: "gloo")
    seen = []
    monkeypatch.setattr(calibrate_module, "calibrate", lambda world_size, **kwargs: seen.append(world_size) or
                        Hardware.preset("a100-80g"))
    calibrate_module.cached(2, Path("/nonexistent"), say=seen.append, recalibrate=True)
    assert "local-2-gloo-cpu.yaml" in seen[0] and seen[1] == 2


def test_the_cache_key_of_a_local_nccl_world_names_its_gpus_without_touching_cuda(monkeypatch, tmp_path):
    """``--plan auto``'s kept hardware under NCCL: the GPUs' kind is asked of the world's ranks, and the
    same world measures when no file is kept; this process starts no CUDA (no context on cuda:0)."""
    def no_cuda(*args, **kwargs):
        raise AssertionError("CUDA touched in the parent process")

    for name in ("get_device_name", "get_device_properties", "init", "_lazy_init", "current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)

    class World:
        size, backend = 2, "nccl"

        def __init__(self, size: int, backend: str) -> None:
            assert (size, backend) == (2, "nccl")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    asked = []
    monkeypatch.setattr(calibrate_module, "choose_backend", lambda ranks: "nccl")
    monkeypatch.setattr(calibrate_module, "LocalWorld", World)
    monkeypatch.setattr(calibrate_module, "launch", lambda job, world, ranks_on_host: asked.append(job) or
                        [("nvidia-h200", 140 * 2**30, "memory: the total of each GPU")] * 2)
    measured = []
    monkeypatch.setattr(calibrate_module, "calibrate", lambda world_size, **kwargs: measured.append(kwargs) or
                        Hardware.preset("h100-80g"))
    kept = Hardware.preset("a100-80g")
    kept.save(tmp_path / "local-2-nccl-nvidia-h200.yaml")
    assert calibrate_module.cached(2, tmp_path, say=print).name == kept.name and not measured
    assert asked == [probes.device_job]
    calibrate_module.cached(2, tmp_path, say=print, recalibrate=True)
    assert isinstance(measured[0]["world"], World)  # measured in the world that named the GPUs


def test_per_process_throughput_is_the_slowest_rank_at_the_best_size():
    per_rank = [[(64, 5.0), (128, 9.0), (256, 8.0)], [(64, 6.0), (128, 7.0), (256, 7.5)]]
    assert calibrate_module._best_matmul(per_rank) == (256, 7.5)
    assert calibrate_module._best_matmul([None, None]) is None


def test_measurements_make_a_one_node_hardware(monkeypatch):
    """float16 that does not run takes bfloat16's figure, said in a note; inter = intra node."""
    link = Link(bandwidth=1e9, latency=1e-4)
    fits = {c: Fit(c, (64, 128), (1e-4, 2e-4), link, 0.0) for c in COLLECTIVES}
    matmul = {"float32": (256, 3e10), "bfloat16": (512, 5e10), "float16": None}
    monkeypatch.setattr(calibrate_module, "LocalWorld", lambda *a, **k: contextlib.nullcontext())
    overlap = Overlap(compute=2.0, communication=1.0, both=2.5)
    monkeypatch.setattr(calibrate_module, "_run", lambda *args: (matmul, fits, 8e9, ("float32", 1.5e10), (13, 2e-5),
                                                                   overlap, (7e-5, 3e-4), (0.02, 1e-3)))
    monkeypatch.setattr(calibrate_module, "_devices", lambda world, per_node: (
        "cpu", 2**30, f"memory: available RAM (MemAvailable) / {per_node} processes", "gloo"))
    result = measure(3)
    hw = result.hardware
    assert (hw.memory_bandwidth, hw.op_overhead, hw.overlap, hw.dtensor_overhead, hw.dtensor_collective, hw.skew,
            hw.sync_idle) == (8e9, 2e-5, 0.5, 7e-5, 3e-4, 0.02, 1e-3)
    assert hw.attention_efficiency == 0.5  # the attention kernel's rate over its dtype's matrix products
    assert result.ops_per_step == 13 and result.overlap is overlap
    assert hw.flops == {"float32": 3e10, "bfloat16": 5e10, "float16": 5e10}
    assert hw.devices_per_node == 3 and hw.inter_node == hw.intra_node == {c: link for c in COLLECTIVES}
    monkeypatch.setattr(calibrate_module.os, "cpu_count", lambda: 2)
    assert measure(3).hardware.shared_compute and not measure(2).hardware.shared_compute  # 3 processes, 2 cores
    assert hw.matmul_efficiency == 1.0 and hw.reserved == 0 and hw.name == "local-3-gloo-cpu"
    assert any("float16" in note and "bfloat16's figure" in note for note in result.notes)
    assert any("/ 3 processes" in note for note in result.notes)


def test_a_flat_sweep_goes_on_to_larger_messages_until_the_times_grow(monkeypatch):
    """A loaded machine (the CI's): 4 KiB to 4 MiB all take about 5 ms; 16 and 64 MiB are timed
    until the largest takes twice the smallest's time; a sweep that never grows stops at the cap."""
    timed = []

    def loaded(collective, size, seconds, device):
        timed.append(size)
        return 5e-3 + size / 4e9

    ctx = type("Ctx", (), {"device": torch.device("cpu")})()
    monkeypatch.setattr(probes, "_time_collective", loaded)
    sizes, times = probes.collective_job(ctx, "all_reduce", (4096, 2**22), 0.1)
    assert sizes == timed == [4096, 2**22, 2**24, 2**26] and times[-1] >= 2 * times[0] > times[-2]
    monkeypatch.setattr(probes, "_time_collective", lambda collective, size, seconds, device: 5e-3)
    sizes, _ = probes.collective_job(ctx, "p2p", (4096, 2**22), 0.1)
    assert sizes == [4096, 2**22, 2**24, 2**26, 2**28] and max(sizes) == probes.MAX_MESSAGE_BYTES
    monkeypatch.setattr(probes, "_time_collective", lambda collective, size, seconds, device: 1e-4 + size / 1e9)
    assert probes.collective_job(ctx, "p2p", (4096, 2**22), 0.1)[0] == [4096, 2**22]  # grows: no more


def test_a_sweep_without_slope_stops_naming_the_collective_and_what_to_do(monkeypatch):
    flat = ([4096, 2**28], [5e-3, 4.9e-3])
    monkeypatch.setattr(calibrate_module, "launch", lambda job, world, **kwargs: [
        flat if job is probes.collective_job else [(64, 1e9)] if job is probes.matmul_job
        else None])
    with pytest.raises(sk.UsageError, match=r"gloo all_reduce up to 268435456 bytes gives no bandwidth.*"
                                            r"too loaded.*when it is idle"):
        calibrate_module._run(None, 2, "gloo", (64,), (4096,), 0.1, lambda *a: None, 10)


# -- one real run on a 2-process world, shared by the CLI and API checks ---------------------------

@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """``shardkit calibrate --world 2 --out f.yaml``: (the Calibration measured, the file, stdout,
    the progress calls)."""
    out = tmp_path_factory.mktemp("calibrate") / "local.yaml"
    seen: dict = {"progress": []}

    def spy(*args, progress, **kwargs):
        def record(done, total, what):
            seen["progress"].append((done, total, what))
            progress(done, total, what)

        seen["calibration"] = measure(*args, progress=record, **kwargs)
        return seen["calibration"]

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.setattr("shardkit.observe.calibrate.measure", spy)  # where the command finds it when it runs
        code = main(["calibrate", "--world", "2", "--out", str(out)])
    assert code == 0
    return seen["calibration"], out, stdout.getvalue(), seen["progress"]


@pytest.mark.world
def test_calibrate_writes_a_loadable_file_of_measured_figures(calibrated):
    calibration, out, stdout, progress = calibrated
    hw = Hardware.load(out)
    assert hw == calibration.hardware and sk.Hardware is Hardware
    assert hw.name == "local-2-gloo-cpu" and hw.devices_per_node == 2 and hw.inter_node == hw.intra_node
    assert hw.matmul_efficiency == 1.0 and hw.reserved == 0 and 0 < hw.memory
    assert all(hw.flops[d] > 1e7 for d in DTYPES)
    for collective, fit in calibration.fits.items():
        steps, factor = ring_terms(collective, 2)
        given = len(calibrate_module.MESSAGE_SIZES)
        assert fit.sizes[:given] == calibrate_module.MESSAGE_SIZES and all(t > 0 for t in fit.times)
        assert fit.sizes[given:] == tuple(fit.sizes[given - 1] * 4 ** (k + 1) for k in range(len(fit.sizes) - given))
        assert fit.times[-1] >= probes.GROWTH * fit.times[0] or fit.sizes[-1] * 4 > probes.MAX_MESSAGE_BYTES
        assert fit.link == hw.link(collective, False) == fit_alpha_beta(fit.sizes, fit.times, factor, steps)
        assert fit.residual == fit_residual(fit.link, fit.sizes, fit.times, factor, steps)
    assert [p[0] for p in progress] == list(range(len(progress))) and progress[-1] == (15, 15, "done")
    # the three cost-model fields: measured, in range, and what was measured
    assert 1e8 < hw.memory_bandwidth < 1e13  # bytes/s of one process's add, CPU RAM to caches
    assert 1e-7 < hw.op_overhead < 1e-3 and 0 <= hw.dtensor_overhead < 1e-2  # the difference of two timings
    assert 0 <= hw.dtensor_collective < 0.1 and 0.01 < hw.attention_efficiency <= 1
    assert 0 <= hw.skew < 1.0 and "skew" in stdout  # seconds per sqrt(second): a wait of under 0.2 s after 40 ms
    assert 0 <= hw.sync_idle < 0.1 and "sync idle" in stdout  # a tiny all-reduce's idle beyond its latency
    assert set(calibration.fits) == set(COLLECTIVES) and "gloo reduce_scatter" in stdout  # measured, not a ring's
    forward: list[float] = []
    with OpCounter(forward.append):
        torch.nn.Linear(4, 4)(torch.randn(4, 4)).sum()
    assert calibration.ops_per_step > len(forward) >= 2  # backward's ops are counted too
    times = calibration.overlap
    assert min(times.compute, times.communication, times.both) > 0
    assert 0 <= hw.overlap == times.fraction <= 1
    assert calibration.seconds < 60  # about 13 s; a sweep that no longer stops in time fails
    for row in ("matmul float32", "gloo all_reduce", "gloo all_gather", "gloo p2p", "fit residual", "memory",
                "memory bandwidth", "op overhead", f"{calibration.ops_per_step} aten ops", f"{hw.overlap:.0%}",
                "DTensor op overhead", "DTensor collective", "attention"):
        assert row in stdout
    assert f"wrote {out}" in stdout


@pytest.mark.world
def test_calibrate_without_out_prints_the_file(calibrated, monkeypatch, capsys):
    calibration = calibrated[0]
    monkeypatch.setattr("shardkit.observe.calibrate.measure", lambda *args, **kwargs: calibration)
    assert main(["calibrate", "--world", "2"]) == 0
    captured = capsys.readouterr()
    assert Hardware.from_dict(yaml.safe_load(captured.out)) == calibration.hardware
    assert "gloo all_reduce" in captured.err and "gloo" not in captured.out.replace("local-2-gloo-cpu", "")


@pytest.mark.parametrize("argv, message", [
    (["--world", "1"], "--world 1: collectives need at least 2 processes"),
    (["--out", "hw.txt"], "--out 'hw.txt': a hardware file ends in .json, .yaml, .yml"),
    (["--out", "no/such/folder/hw.yaml"], "folder 'no/such/folder' does not exist"),
    (["--name", ""], "--name must be a non-empty name"),
])
def test_bad_flags_exit_2_before_measuring(argv, message, monkeypatch, capsys):
    monkeypatch.setattr("shardkit.observe.calibrate.measure", lambda *a, **k: pytest.fail("measured although a flag is bad"))
    assert main(["calibrate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_default_world_is_the_one_train_starts():
    parser = build_parser()
    train = parser.parse_args(["train"])
    _, train_world = plan_from_args(train, model_from_flag(train.model))
    args = parser.parse_args(["calibrate"])
    assert args.world == train_world and args.out is None and args.name is None


def test_steps_compared_are_timed_in_turn_so_a_change_of_load_meets_each_alike(monkeypatch):
    """seconds_per_steps times each step's blocks in turn (A, B, A, B, ...), after each one's warm-up
    and first timing: a load that rises during the measurement slows both, not the later one only."""
    calls: list[str] = []
    monkeypatch.setattr(probes.dist, "barrier", lambda: None)
    monkeypatch.setattr(probes, "_slowest", lambda value, device: value)
    steps = [lambda: calls.append("A"), lambda: calls.append("B")]
    times = probes.seconds_per_steps(steps, torch.device("cpu"), seconds=1e-9)
    assert calls == ["A", "A", "B", "B"] + ["A", "B"] * probes._BLOCKS and len(times) == 2
