"""sk.launch inside a world started by torchrun joins it (RANK / WORLD_SIZE) instead of spawning."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path


def test_launch_joins_a_torchrun_world():
    script = Path(__file__).with_name("torchrun_job.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS"))
    results = ast.literal_eval(line.removeprefix("RESULTS "))
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]  # every rank's value, gathered in rank order
    assert results[0][2] == results[1][2] and results[0][3] == "gloo"
