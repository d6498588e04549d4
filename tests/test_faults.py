"""Faults: a hung job times out with every unfinished rank's stack, a dead rank is the rank
named, workers end with their parent, and a job that cannot run is refused before any process."""

from __future__ import annotations

import multiprocessing.process
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardkit as sk
from shardkit.runtime.world import STACK_WAIT_S, LocalWorld, WorldError, WorldTimeout

ORPHAN_JOB = Path(__file__).with_name("orphan_job.py")


def _pid(ctx):
    return os.getpid()


def _nap_forever():
    time.sleep(600)


def _hang_two_ranks(ctx):
    if ctx.rank == 0:
        dist.barrier()  # waits for rank 2, which has returned
    elif ctx.rank == 1:
        _nap_forever()
    return ctx.rank


def _die_in_a_collective(ctx):
    total = torch.ones(1)
    dist.all_reduce(total)
    if ctx.rank == 1:
        os._exit(3)
    dist.all_reduce(total)  # rank 0 loses its connection here: the survivor, not the cause


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has ended


def _wait_until_gone(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _running(pid)]


def test_a_timeout_shows_every_unfinished_rank_where_it_hangs_and_stops_the_world():
    world = LocalWorld(3)
    pids = world.run(_pid)
    start = time.monotonic()
    with pytest.raises(WorldTimeout) as err:
        world.run(_hang_two_ranks, timeout=2)
    assert time.monotonic() - start < 2 + STACK_WAIT_S + 10
    assert sorted(err.value.stacks) == [0, 1] and err.value.finished == [2] and err.value.rank == 0
    assert "in barrier" in err.value.stacks[0] and "_hang_two_ranks" in err.value.stacks[0]
    assert "_nap_forever" in err.value.stacks[1]
    message = str(err.value)
    assert "timeout of 2 s" in message and "rank 0:" in message and "rank 1:" in message and "rank 2:" not in message
    assert not world.alive and _wait_until_gone(pids, within=5) == []


def test_a_rank_that_dies_in_a_collective_is_named_rather_than_its_survivor():
    # (a rank killed by a signal is named "was killed by SIGKILL": tests/test_descendants.py's kill case)
    world = LocalWorld(2)
    with pytest.raises(WorldError) as err:
        world.run(_die_in_a_collective)
    assert err.value.rank == 1 and "exited with code 3" in str(err.value), str(err.value)
    assert str(err.value).startswith("rank 1 died") and "rank 0 then lost its connection" in str(err.value)
    assert not world.alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_of_a_world_started_by_a_thread_end_when_their_parent_is_killed(tmp_path):
    """The polling fallback (a world started by the main thread, prctl's case, is
    tests/test_descendants.py's parent case: its ranks and all they started end)."""
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        parent = subprocess.Popen([sys.executable, str(ORPHAN_JOB), "thread"], stdout=stdout, stderr=stderr,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not out.read_text().startswith("PIDS") and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(pid) for pid in out.read_text().split()[1:]]
        assert len(pids) == 2, err.read_text()[-3000:]
        parent.kill()  # SIGKILL: no atexit, no cleanup in the parent
        parent.wait()
        assert _wait_until_gone(pids, within=5) == []
    finally:
        parent.kill()
        for pid in filter(_running, pids):
            os.kill(pid, signal.SIGKILL)


def test_launch_refuses_a_job_that_cannot_run_before_starting_any_process(monkeypatch):
    started: list = []
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", started.append)
    plan = sk.Plan(mesh=sk.Mesh(dp=2))
    with pytest.raises(sk.UsageError, match=r"fn \(<function .*lambda.*top-level"):
        sk.launch(lambda ctx: ctx.rank, plan)
    with pytest.raises(sk.UsageError, match=r"args\[1\] \(.*lock.*top-level"):
        sk.launch(_pid, plan, 1, threading.Lock())
    with pytest.raises(sk.UsageError, match=r"kwargs\['lock'\] \(.*lock"):
        sk.launch(_pid, plan, lock=threading.Lock())
    with pytest.raises(sk.PlanError, match="has 2 devices but the world has 3"):
        sk.launch(_pid, plan, world_size=3)
    assert started == []


@pytest.mark.parametrize("timeout", [0, -5, float("inf"), float("nan"), "60", True])
def test_a_timeout_must_be_a_positive_finite_number_of_seconds(timeout):
    with pytest.raises(sk.UsageError, match=r"timeout=.*or timeout=None for no limit"):
        sk.launch(_pid, sk.Plan(mesh=sk.Mesh(dp=2)), timeout=timeout)


def test_a_world_needs_at_least_one_process():
    with pytest.raises(sk.UsageError, match="at least 1; got 0"):
        sk.launch(_pid, world_size=0)
    with pytest.raises(sk.UsageError, match="at least 1; got -2"):
        LocalWorld(-2)


def test_no_timeout_runs_the_job_and_world_errors_are_shardkit_errors(world):
    assert len(sk.launch(_pid, world=world(2), timeout=None)) == 2
    assert issubclass(WorldTimeout, WorldError) and issubclass(WorldError, sk.ShardkitError)
    assert issubclass(WorldError, RuntimeError)
