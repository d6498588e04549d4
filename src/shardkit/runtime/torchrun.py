"""Joining a world that ``torchrun`` (or any launcher setting RANK and WORLD_SIZE) started.

The process group is opened on first use with the job's timeout (at least
:data:`MIN_GROUP_TIMEOUT_S`, since the same limit bounds connecting the ranks), closed at exit
with every rank together, and a rank still running at its job's timeout prints its Python
stack and exits 1 so torchrun stops the job.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..plan import Plan
from .context import Context, device_for, run_job
from .results import dumps, loads

MIN_GROUP_TIMEOUT_S = 60.0  # a joined world's collectives time out no sooner (see _process_group_timeout)


def in_torchrun() -> bool:
    """True inside a world started by ``torchrun`` (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


_LEAVING_ON_ERROR: list[BaseException] = []


def _watch_uncaught_exceptions() -> None:
    """Note an uncaught exception (then report it as before), for _close_joined_world."""
    previous = sys.excepthook

    def note_then_report(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        _LEAVING_ON_ERROR.append(exc)
        previous(exc_type, exc, tb)

    sys.excepthook = note_then_report


def _close_joined_world() -> None:
    """Close the torchrun world we joined, all ranks together: one rank tearing gloo down while
    its peer still holds the connection can abort the peer at exit ("terminate called without
    an active exception"). A rank leaving on an uncaught exception skips the barrier (its peers
    may never reach it); torchrun then stops the rest."""
    if not dist.is_initialized():
        return
    if not _LEAVING_ON_ERROR:
        dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def _stacks_when_stopped(timeout: float | None) -> Iterator[None]:
    """While the block runs, print every thread's Python stack to stderr if this rank is still
    running after ``timeout`` s (then exit with code 1, so torchrun stops the job) or is stopped
    by SIGTERM (how torchrun stops the other ranks). faulthandler does both without the GIL."""
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # then terminate as before
    if timeout is not None:
        faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        faulthandler.unregister(signal.SIGTERM)


def _process_group_timeout(timeout: float | None) -> timedelta | None:
    """How long a collective may wait before it raises on its rank: the job's timeout, but at
    least MIN_GROUP_TIMEOUT_S, since the same limit bounds connecting the ranks at start."""
    return None if timeout is None else timedelta(seconds=max(timeout, MIN_GROUP_TIMEOUT_S))


def run_in_torchrun(fn: Callable[..., Any], plan: Plan | None, args: tuple, kwargs: dict,
                     timeout: float | None) -> list[Any]:
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=_process_group_timeout(timeout))
        _watch_uncaught_exceptions()
        atexit.register(_close_joined_world)
    device = device_for(dist.get_backend(), local_rank)
    ctx = Context(rank, world_size, local_rank, device, None if plan is None else plan.resolved(world_size))
    with _stacks_when_stopped(timeout):  # stuck anywhere, in a collective or not: its stack, then exit 1
        value = dumps(run_job(ctx, fn, args, kwargs))  # plain, finished tensors on the CPU
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, value)
    return [loads(data) for data in gathered]


__all__ = ["in_torchrun", "run_in_torchrun"]
