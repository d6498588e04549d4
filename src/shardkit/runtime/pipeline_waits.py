"""Timing the blocking point-to-point waits of torch's pipeline schedules as ``wait`` spans.

This is the one place shardkit replaces something of torch's at run time, and why: torch
2.13's schedules (``torch/distributed/pipelining/schedules.py``) wait for every batch of
point-to-point operations through the module-level function ``_wait_batch_p2p(work)``, and
offer no public hook around it. The alternatives do not reach the wait: ``PipelineStage``'s
``get_*_send_ops`` / ``get_*_recv_ops`` return ``P2POp`` objects, which ``batch_isend_irecv``
only accepts with torch's own ``isend``/``irecv``; the ``Work`` objects are made inside
torch; ``_PipelineScheduleRuntime.register_custom_function`` is private and covers the
multi-stage schedules only. So while a timeline records (and only then), for the duration
of one step, :func:`recording_waits` puts a timed wrapper in place of
``schedules._wait_batch_p2p`` and restores the original after; a torch without that
function is left alone (its waits are then not shown). On CUDA the wait does not block the
host, so the spans say little there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed.pipelining import schedules

from . import spans as timeline

#: The function of torch's schedules that waits for point-to-point work (torch 2.13).
WAIT_FUNCTION = "_wait_batch_p2p"


@contextmanager
def recording_waits() -> Iterator[None]:
    """While recording, time torch's blocking point-to-point waits as ``wait`` spans."""
    original = getattr(schedules, WAIT_FUNCTION, None)
    if not timeline.is_recording() or original is None:
        yield
        return

    def waiting(work: list) -> None:
        if not work:
            return original(work)
        with timeline.span("wait"):
            return original(work)

    setattr(schedules, WAIT_FUNCTION, waiting)
    try:
        yield
    finally:
        setattr(schedules, WAIT_FUNCTION, original)


__all__ = ["WAIT_FUNCTION", "recording_waits"]
