"""sk.launch inside a world started by torchrun joins it (RANK / WORLD_SIZE) instead of spawning."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

JOB = Path(__file__).with_name("torchrun_job.py")


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(JOB), *args], capture_output=True, text=True, timeout=300, env=env)


def test_launch_joins_a_torchrun_world_and_leaves_it_cleanly():
    proc = _torchrun()
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
