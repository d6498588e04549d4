"""The world as checkpoints see it: rank 0 decides, every rank hears it, and an error on one rank
is raised on all (as a :class:`~shardkit.checkpoint.manifest.CheckpointError` with its text), so
that no rank waits in a collective another has left. In one process without a process group
each helper runs its function alone.

>>> from_rank0(lambda: 41 + 1), everyone(lambda: rank())
(42, [0])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch.distributed as dist

from .manifest import CheckpointError

T = TypeVar("T")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_gather(value: T) -> list[T]:
    """Every rank's ``value``, in rank order."""
    if not distributed():
        return [value]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def _outcome(fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
    try:
        return fn(), None
    except Exception as exc:
        return None, exc


def _message(error: Exception, where: int) -> str:
    """An error as the other ranks raise it (a CheckpointError): its text, with the rank unless it is ours."""
    return str(error) if isinstance(error, CheckpointError) else f"rank {where}: {type(error).__name__}: {error}"


def from_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` run on rank 0 only; every rank returns its value, or raises its error."""
    if not distributed():
        return fn()
    value, error = _outcome(fn) if dist.get_rank() == 0 else (None, None)
    box = [(value, None if error is None else _message(error, 0))]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    value, message = box[0]
    if message is not None:
        raise CheckpointError(message)
    return value  # type: ignore[return-value]


def everyone(fn: Callable[[], T]) -> list[T]:
    """``fn()`` on every rank; the values in rank order, or on every rank an error of the first rank that failed."""
    value, error = _outcome(fn)
    every = all_gather((value, None if error is None else _message(error, rank())))
    if error is not None:
        raise error
    message = next((message for _, message in every if message is not None), None)
    if message is not None:
        raise CheckpointError(message)
    return [found for found, _ in every]


@contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every save and load in one process without a process group, the use intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


__all__ = ["all_gather", "distributed", "everyone", "from_rank0", "rank", "single_process_quiet", "world_size"]
