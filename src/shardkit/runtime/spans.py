"""Spans of a step on this rank: forward/backward per micro-batch and stage, communication waits.

The pipeline runtime records ``F`` forward, ``B`` full backward, ``I``/``W`` input/weight
backward of zero-bubble schedules, ``wait`` for blocking P2P waits, ``sync`` for the loss
broadcast, and one ``step`` span per step, while :func:`recording` is open in the process
(a no-op otherwise). :func:`collect` returns them; :mod:`shardkit.observe.timeline` turns
every rank's spans into a trace, a Gantt chart and the bubble fraction.

Timestamps are ``time.time_ns()`` so spans from processes of one machine (and NTP-synced
machines) share a clock, read once the work queued on the accelerator has run (devices.py's
``wall_ns``: kernels run after the Python that launched them returns, so an unsynchronised span
would time the launching). Recording therefore slows a GPU's steps: profile, do not train, with it.

>>> with recording():
...     with span("F", stage=0, microbatch=0):
...         pass
>>> [s.kind for s in collect()]
['F']
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .devices import wall_ns


@dataclass
class Span:
    """One interval on one rank. ``bytes``: activation bytes a forward saved for its backward."""

    rank: int
    kind: str
    start_ns: int
    end_ns: int = 0
    stage: int | None = None
    microbatch: int | None = None
    step: int = 0
    bytes: int = 0

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class _Recorder:
    def __init__(self) -> None:
        self.active = False
        self.rank = 0
        self.step = -1
        self.spans: list[Span] = []


_REC = _Recorder()


def is_recording() -> bool:
    """Whether :func:`recording` is open in this process."""
    return _REC.active


@contextmanager
def recording(rank: int | None = None) -> Iterator[None]:
    """Record spans in this process (previous ones are dropped); ``rank`` defaults to the job's rank."""
    if rank is None:
        try:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
        except (ImportError, RuntimeError):
            rank = 0
    _REC.active, _REC.rank, _REC.step, _REC.spans = True, rank, -1, []
    try:
        yield
    finally:
        _REC.active = False


class _NoSpan:
    bytes = 0


@contextmanager
def span(kind: str, stage: int | None = None, microbatch: int | None = None) -> Iterator[Any]:
    """Time the block as one span (a no-op unless recording). A ``step`` span starts a new step."""
    if not _REC.active:
        yield _NoSpan()
        return
    if kind == "step":
        _REC.step += 1
    record = Span(_REC.rank, kind, wall_ns(), stage=stage, microbatch=microbatch, step=max(_REC.step, 0))
    try:
        yield record
    finally:
        record.end_ns = wall_ns()
        _REC.spans.append(record)


def collect(clear: bool = True) -> list[Span]:
    """This process's recorded spans (in end order)."""
    spans = list(_REC.spans)
    if clear:
        _REC.spans = []
    return spans


__all__ = ["Span", "collect", "is_recording", "recording", "span"]
