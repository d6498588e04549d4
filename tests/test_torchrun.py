"""sk.launch inside a world started by torchrun joins it (RANK / WORLD_SIZE) instead of spawning;
a failing or hung rank ends the job; ``shardkit train --plan auto`` there measures that world once."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shardkit.planner.hardware import Hardware

JOB = Path(__file__).with_name("torchrun_job.py")


def _torchrun(*args: str, options: tuple[str, ...] = (), **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_vars}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *options, str(JOB), *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def joined(tmp_path_factory):
    """One torchrun job of 2 processes: sk.launch, then ``shardkit train --plan auto`` and its plan again
    (torchrun_job.py ``auto``), with the hardware kept in a folder of its own: (the run, the folder)."""
    cache = tmp_path_factory.mktemp("cache")
    return _torchrun("auto", SHARDKIT_CACHE=str(cache)), cache


def test_launch_joins_a_torchrun_world_and_leaves_it_cleanly(joined):
    proc, _ = joined
    # exit code 0 on every rank: the joined world is torn down together at exit (gloo aborts
    # a process whose peer closes the connection under it)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS"))
    results = ast.literal_eval(line.removeprefix("RESULTS "))
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]  # every rank's value, gathered in rank order
    assert results[0][2] == results[1][2] and results[0][3] == "gloo"


def test_a_failing_rank_ends_a_torchrun_job_instead_of_hanging_it():
    start = time.monotonic()
    proc = _torchrun("fail")
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stderr


def test_a_hung_torchrun_job_ends_at_its_timeout_with_each_ranks_stack():
    start = time.monotonic()
    # timeout=3: rank 0 naps, rank 1 waits for it in a barrier; --tee prefixes each rank's lines
    proc = _torchrun("hang", options=("--tee", "3"))
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    rank_lines = [[line for line in proc.stderr.splitlines() if line.startswith(f"[default{rank}]:")]
                  for rank in (0, 1)]
    assert any("in nap_forever" in line for line in rank_lines[0]), proc.stderr[-3000:]
    assert any("in barrier" in line for line in rank_lines[1]), proc.stderr[-3000:]
    assert all(any("in hang_on_rank_0" in line for line in lines) for lines in rank_lines), proc.stderr[-3000:]


def test_plan_auto_under_torchrun_measures_the_torchrun_world_once_and_every_rank_plans_alike(joined):
    proc, cache = joined
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    # every rank measured the world together, once: the second plan read the kept file (rank 0) instead
    assert sorted(line for line in lines if line.startswith("MEASURE")) == ["MEASURE rank 0", "MEASURE rank 1"], \
        (proc.stdout[-3000:], proc.stderr[-3000:], sorted(p.name for p in cache.rglob("*")))
    assert proc.stderr.count("measuring the torchrun world of 2 processes") == 1
    name = "torchrun-2-gloo-cpu"
    assert [line for line in lines if line.startswith("WROTE")] == [f"WROTE rank 0 {name}.yaml {name}"]
    assert sorted(p.name for p in cache.iterdir()) == [f"{name}.yaml"]  # no temporary file left
    kept = Hardware.load(cache / f"{name}.yaml")  # whole: every field read strictly
    assert kept.name == name and kept.devices_per_node == 2 and yaml.safe_load((cache / f"{name}.yaml").read_text())
    plans = [line.split(" ", 3)[3] for line in lines if line.startswith("PLAN")]
    assert len(plans) == 4 and len(set(plans)) == 1, plans  # both ranks, both times: the same plan
    assert sorted(line for line in lines if line.startswith("TRAINED")) == ["TRAINED rank 0 0", "TRAINED rank 1 0"]
    assert proc.stderr.count("--plan auto chose") == 2  # rank 0 says it, once per plan
