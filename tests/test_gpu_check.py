"""benchmarks/gpu_check.py, the check to run on a lent GPU machine, run here as it runs without one: on
two CPU processes (gloo) at its tiny sizes, a subset of its rows that covers every kind of row (verified
strategies, a tied pipeline, ring attention, the profile, generation by logits, a hung rank, and the rows
skipped for want of CUDA or devices). The whole script: ``python benchmarks/gpu_check.py --world 2``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

ROWS = ["world: verify hsdp", "world: verify pp zbv", "world: sp=2 accumulator", "world: generate tp",
        "world: hung rank", "one: ring vs sdpa memory"]


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
    world(2).run(_import_benchmarks, str(BENCHMARKS))
    code = gpu_check.main(["--world", "2", "--out", str(tmp_path), "--only", ",".join(ROWS)], worlds=world)
    table = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {row["check"]: row["status"] for row in table["rows"]}
    assert code == 0, table["rows"]
    assert sorted(status) == sorted(ROWS)
    assert status.pop("world: verify hsdp") == "skipped: needs an even number of at least 4 devices (--world 2)"
    assert status.pop("one: ring vs sdpa memory").startswith("skipped: no CUDA")
    assert set(status.values()) == {"ok"}, table["rows"]
    assert table["versions"]["pinned torch"] and "2 CPU processes, gloo" in table["where"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| world: hung rank | ok |" in markdown and "| world: verify pp zbv | ok |" in markdown


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
