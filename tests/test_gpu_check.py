"""benchmarks/gpu_check.py, the check to run on a lent GPU machine, run here as it runs without one: on
two CPU processes (gloo) at its tiny sizes, the rows whose code nothing else in the suite runs (the
witnessed steps of ``shardkit train``, the step timer against the device clock, ring attention against
SDPA (on one process, and in bfloat16 over two), the sp=2 accumulator, the serving engine under tp with seeded sampling) and rows skipped for want
of CUDA or devices. The rows left out repeat what other tests run, or
cost more than this file's share of the suite (``docs/gpu.md``, "Where each row runs"). The whole script:
``python benchmarks/gpu_check.py --world 2``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

ROWS = ["one: train cli", "one: step time vs events", "one: ring vs sdpa output", "one: ring vs sdpa memory",
        "world: verify hsdp", "world: verify pp x fsdp x tp", "world: sp=2 ring bf16 vs sdpa", "world: sp=2 accumulator",
        "world: serve tp"]


def _import_benchmarks(ctx, path: str) -> None:
    """Lets a shared world's processes (started before this test) import the checks' jobs."""
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    return gpu_check


def test_the_gpu_check_runs_its_rows_on_two_cpu_processes(world, gpu_check, tmp_path):
    for size in (1, 2):
        world(size).run(_import_benchmarks, str(BENCHMARKS))
    code = gpu_check.main(["--world", "2", "--out", str(tmp_path), "--only", ",".join(ROWS)], worlds=world)
    table = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {row["check"]: row["status"] for row in table["rows"]}
    assert code == 0, table["rows"]
    assert sorted(status) == sorted(ROWS)
    assert status.pop("world: verify hsdp") == "skipped: needs an even number of at least 4 devices (--world 2)"
    assert status.pop("world: verify pp x fsdp x tp").startswith("skipped: needs a multiple of 4 devices, at least 8")
    assert status.pop("one: ring vs sdpa memory").startswith("skipped: no CUDA")
    assert set(status.values()) == {"ok"}, table["rows"]
    assert table["versions"]["pinned torch"] and "2 CPU processes, gloo" in table["where"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| world: serve tp | ok |" in markdown and "| one: train cli | ok |" in markdown
    detail = {row["check"]: row["detail"] for row in table["rows"]}
    assert "mean step" in detail["one: train cli"] and "as one CPU process" in detail["world: serve tp"]


def test_an_older_torch_than_the_pinned_one_stops_the_run(gpu_check):
    found = {**gpu_check.versions(), "torch": "2.12.1+cu126", "pinned torch": "2.13.0"}
    assert "torch 2.12.1+cu126 is older than the pinned 2.13.0" in gpu_check.gate(found)
    assert gpu_check.gate({**found, "torch": "2.13.0+cu128"}) is None
    assert gpu_check.pinned_torch() == gpu_check.versions()["pinned torch"]


def _slow(env):
    time.sleep(5)


def _wrong(env):
    import gpu_check_jobs

    raise gpu_check_jobs.Failed("the sharded loss differs")


def test_a_row_over_its_time_bound_or_wrong_fails(gpu_check, tmp_path):
    import gpu_check_jobs

    env = gpu_check_jobs.Env(sizes=gpu_check_jobs.TINY, world=2, cuda=False, worlds=None, out=tmp_path, limit_s=0.1)
    began = time.monotonic()
    slow = gpu_check.run_check(gpu_check.Check("slow", _slow, False, 0.1), env)
    wrong = gpu_check.run_check(gpu_check.Check("wrong", _wrong, False, 0.1), env)
    assert (slow.status, wrong.status, wrong.detail) == ("FAIL", "FAIL", "the sharded loss differs")
    assert time.monotonic() - began < 5 and "still running after" in slow.detail


def test_the_ring_memory_row_fails_on_the_math_kernels_quadratic_scores(gpu_check, tmp_path, monkeypatch):
    """The bound is SDPA's measured peak (2x + O(L d)): a float32 L x L score matrix per head (the math
    kernel) fails it at the full sizes; a fused kernel's linear memory passes."""
    import gpu_check_jobs as jobs

    s = jobs.FULL
    env = jobs.Env(sizes=s, world=1, cuda=True, worlds=None, out=tmp_path)
    sdpa = {n: 3 * 2 * s.ring_heads * n * s.ring_head_dim * 4 for n in s.ring_lengths}  # q, k, v and grads, bf16, x4
    fused = [{"length": n, "sdpa_bytes": sdpa[n], "ring_bytes": 2 * sdpa[n]} for n in s.ring_lengths]
    math = [{"length": n, "sdpa_bytes": sdpa[n], "ring_bytes": sdpa[n] + 4 * s.ring_heads * n * n}
            for n in s.ring_lengths]
    monkeypatch.setitem(jobs._CACHE, ("ring", 1), fused)
    assert "16384 tokens" in jobs.ring_memory(env)
    monkeypatch.setitem(jobs._CACHE, ("ring", 1), math)
    with pytest.raises(jobs.Failed, match="above 2x SDPA's peak"):
        jobs.ring_memory(env)
