"""Nothing left running: what a rank starts (a DataLoader's workers, a subprocess, one in a session
of its own, a double-forked daemon) ends with the world, however the world ends: the job returns,
a rank raises, hangs past the timeout or is killed, or the parent is killed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from orphan_job import pid, start_descendants

from shardkit.runtime.world import LocalWorld, WorldError, WorldTimeout, launch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
ORPHAN_JOB = Path(__file__).with_name("orphan_job.py")
PROCESSES_PER_RANK = 6  # the rank, 2 DataLoader workers, 3 sleeps


def _sleep_marker() -> str:
    """A ``sleep`` duration unique to this test, found in the command line of what it starts."""
    return f"1000.{random.randrange(10**9)}"


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has ended


def _marked(sleep: str) -> list[int]:
    """The running processes whose command line holds ``sleep``."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if sleep.encode() in cmdline.split(b"\0") and _running(int(name)):
            found.append(int(name))
    return found


def _recorded(folder: Path) -> list[int]:
    return [int(pid) for record in sorted(folder.glob("rank*.pids")) for pid in record.read_text().split()]


def _left_running(pids: list[int], sleep: str, within: float) -> list[int]:
    """The processes of the job (by pid, or by ``sleep`` in the command line) still running after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        left = sorted({*filter(_running, pids), *_marked(sleep)})
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _kill_leftovers(pids: list[int], sleep: str) -> None:
    """So that a failing test leaves nothing behind either."""
    for left in {*filter(_running, pids), *_marked(sleep)}:
        os.kill(left, signal.SIGKILL)


def test_a_job_may_start_dataloader_workers_and_subprocesses_and_they_end_with_the_world(tmp_path):
    sleep = _sleep_marker()
    pids: list[int] = []
    try:
        # one rank: its DataLoader's workers are spawned (a rank's default), each importing torch
        [started] = launch(start_descendants, None, str(tmp_path), sleep, "return", None, world_size=1, timeout=120)
        pids = _recorded(tmp_path)
        assert started == pids and len(set(pids)) == PROCESSES_PER_RANK  # two distinct DataLoader workers
        assert _left_running(pids, sleep, within=5) == []
    finally:
        _kill_leftovers(pids, sleep)


@pytest.mark.parametrize(("then", "error", "words"), [
    ("raise", WorldError, "the rank fails with its processes running"),
    ("hang", WorldTimeout, "did not finish within its timeout of 12 s"),
    ("kill", WorldError, "was killed by SIGKILL"),
])
def test_what_a_rank_started_ends_when_the_rank_raises_hangs_or_is_killed(then, error, words, tmp_path):
    sleep = _sleep_marker()
    try:
        world = LocalWorld(2)
        world.run(pid, timeout=120)  # started: the timeout below counts from the job's start only
        with pytest.raises(error, match=words):
            world.run(start_descendants, str(tmp_path), sleep, then, timeout=12)
        pids = _recorded(tmp_path)
        assert not world.alive and len(pids) == 2 * PROCESSES_PER_RANK
        assert _left_running(pids, sleep, within=5) == []
    finally:
        _kill_leftovers(_recorded(tmp_path), sleep)


def test_what_the_ranks_started_ends_when_the_parent_is_killed(tmp_path):
    sleep = _sleep_marker()
    pids: list[int] = []
    with (tmp_path / "err.txt").open("w") as stderr:
        parent = subprocess.Popen([sys.executable, str(ORPHAN_JOB), "descendants", str(tmp_path), sleep],
                                  stderr=stderr, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 * PROCESSES_PER_RANK and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = _recorded(tmp_path)
        assert len(pids) == 2 * PROCESSES_PER_RANK, (tmp_path / "err.txt").read_text()[-3000:]
        parent.kill()  # SIGKILL: no atexit, no cleanup in the parent
        parent.wait()
        assert _left_running(pids, sleep, within=5) == []
    finally:
        parent.kill()
        _kill_leftovers(pids, sleep)
