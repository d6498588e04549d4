"""Joining a world that ``torchrun`` (or any launcher setting RANK and WORLD_SIZE) started.

The process group is opened on first use (devices.py: the backend, ``LOCAL_RANK``'s GPU set
first, the job's timeout plus a margin, which also bounds connecting the ranks), closed at exit
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
from typing import Any

import torch.distributed as dist

from ..plan import Plan
from .context import Context, run_job
from .devices import (
    choose_backend,
    device_of,
    launcher_local_rank,
    launcher_ranks_on_host,
    open_process_group,
)
from .meshes import release_unused, use_timeout
from .results import dumps, loads


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


def run_in_torchrun(fn: Callable[..., Any], plan: Plan | None, args: tuple, kwargs: dict,
                     timeout: float | None) -> list[Any]:
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = launcher_local_rank()  # required: never guessed from the global rank
    if dist.is_initialized():  # opened by the caller: its backend
        device = device_of(dist.get_backend(), local_rank)
    else:
        device = open_process_group(choose_backend(launcher_ranks_on_host()), local_rank, timeout)
        _watch_uncaught_exceptions()
        atexit.register(_close_joined_world)
    use_timeout(timeout)  # a later job's own timeout (+ the margin) on every group
    ctx = Context(rank, world_size, local_rank, device, None if plan is None else plan.resolved(world_size))
    with _stacks_when_stopped(timeout):  # stuck anywhere, in a collective or not: its stack, then exit 1
        value = dumps(run_job(ctx, fn, args, kwargs))  # plain, finished tensors on the CPU
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, value)
    release_unused(device)  # the meshes and groups no longer used (meshes.py)
    return [loads(data) for data in gathered]


__all__ = ["in_torchrun", "run_in_torchrun"]
