"""Where the HTTP server and the decode engine meet: a request, the events it produces, and a thread-safe inbox.

The server (a thread on rank 0) submits requests and reads their tokens; the engine (the decode loop
every rank runs, rank 0 reading the inbox and broadcasting its schedule) takes them between decode
steps. Neither imports the other, so each is built and tested on its own against this module.

>>> inbox = Inbox(max_queue=2)
>>> events = []
>>> inbox.submit(GenerationRequest("a", (1, 2, 3), max_new_tokens=4), events.append)
True
>>> [r.id for r, _ in inbox.poll(free_slots=8, wait_s=0).arrived]
['a']
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sampling:
    """How a request's next token is chosen: ``temperature == 0`` is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to continue: token ids in, at most ``max_new_tokens`` out.

    ``stop_ids`` end the request when generated (the model's eos ids and the user's stop ids);
    the finishing token is not part of the output. Stop *strings* are the server's to match.
    """

    id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: frozenset[int] = frozenset()


class Finish(enum.Enum):
    """Why a request ended (OpenAI's ``finish_reason`` for the first two)."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class TokenEvent:
    """One thing that happened to a request: a token, or its end (``finish`` set, ``error`` for ERROR)."""

    request_id: str
    token: int | None = None
    finish: Finish | None = None
    error: str | None = None


#: Where a request's events go; called from the engine's thread, so it must be thread-safe and quick.
Sink = Callable[[TokenEvent], None]


@dataclass
class Arrivals:
    """What the engine takes from the inbox between two decode steps."""

    arrived: list[tuple[GenerationRequest, Sink]]
    cancelled: list[str]
    closing: bool  # no new requests will come: finish what is running and stop


class Inbox:
    """Requests waiting for a slot in the running batch, bounded: ``submit`` refuses beyond ``max_queue``."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._waiting: deque[tuple[GenerationRequest, Sink]] = deque()
        self._cancelled: list[str] = []
        self._closing = False
        self._changed = threading.Condition()

    def submit(self, request: GenerationRequest, sink: Sink) -> bool:
        """Queue ``request``; False (nothing queued) when the queue is full or the inbox is closing."""
        with self._changed:
            if self._closing or len(self._waiting) >= self.max_queue:
                return False
            self._waiting.append((request, sink))
            self._changed.notify_all()
            return True

    def cancel(self, request_id: str) -> None:
        """Drop a request (its client left): from the queue at once, from the batch at the next step."""
        with self._changed:
            kept = [item for item in self._waiting if item[0].id != request_id]
            if len(kept) == len(self._waiting):
                self._cancelled.append(request_id)
            self._waiting = deque(kept)
            self._changed.notify_all()

    def close(self) -> None:
        """Accept nothing more; the engine finishes what it holds and stops."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()

    def waiting(self) -> int:
        """Requests queued, not yet in the batch."""
        with self._changed:
            return len(self._waiting)

    def poll(self, free_slots: int, wait_s: float) -> Arrivals:
        """Up to ``free_slots`` queued requests and every cancellation; waits up to ``wait_s`` for one."""
        with self._changed:
            if not (self._waiting or self._cancelled or self._closing) and wait_s > 0:
                self._changed.wait(wait_s)
            taken = [self._waiting.popleft() for _ in range(min(free_slots, len(self._waiting)))]
            cancelled, self._cancelled = self._cancelled, []
            return Arrivals(taken, cancelled, self._closing and not self._waiting)
