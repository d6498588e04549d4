"""A rank that writes no stack when a job times out is described by what is known of it (still
starting, stopped, waiting in the kernel, or ended), not guessed to be starting."""

from __future__ import annotations

import os
import signal

import pytest

from shardkit.runtime.world import LocalWorld, WorldTimeout


def _pid(ctx):
    return os.getpid()


def _stop_rank_one(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped: it cannot run the handler that writes its stack
    return ctx.rank


def test_a_stopped_rank_is_said_to_be_stopped():
    world = LocalWorld(2)
    world.run(_pid)  # started: each worker has its stack handler
    with pytest.raises(WorldTimeout) as err:
        world.run(_stop_rank_one, timeout=2)
    assert err.value.finished == [0]
    assert err.value.stacks[1] == ("(no stack: the process is stopped (SIGSTOP, SIGTSTP, SIGTTIN or SIGTTOU), and a "
                                   "stopped process runs no signal handler; the world was stopped)")
    assert not world.alive


def test_a_rank_still_starting_is_said_to_be_starting():
    """A worker spawned a tenth of a second ago is still importing torch: the signal asking for its
    stack ends it, which its exit code says."""
    world = LocalWorld(1)
    with pytest.raises(WorldTimeout) as err:
        world.run(_pid, timeout=0.1)
    assert err.value.stacks[0] == ("(no stack: the process was still starting: it had not yet installed the handler "
                                   "that writes its stack, so SIGUSR1, which asks for it, ended it)")
