"""sk.launch inside a world started by torchrun joins it (RANK / WORLD_SIZE) instead of spawning;
a failing or hung rank ends the job."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

JOB = Path(__file__).with_name("torchrun_job.py")


def _torchrun(*args: str, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *options, str(JOB), *args], capture_output=True, text=True, timeout=300, env=env)


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
