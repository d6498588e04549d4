"""A fake decode engine for the server's tests: it keeps the :class:`Inbox` contract as the real one does
(slots, cancellations, closing, stop ids, max_new_tokens) with tokens computed from the prompt, so the
HTTP layer is tested in one process without a world.

Greedy: token ``i`` is the prompt's token ``i`` modulo its length (the prompt repeated); sampled: seeded
lowercase letters (the same seed, the same tokens).
"""

from __future__ import annotations

import random
import threading
import time

from shardkit.serving.requests import Finish, Inbox, TokenEvent
from shardkit.serving.server import EngineState


def expected_tokens(prompt, n, temperature=0.0, seed=None):
    if temperature == 0:
        return [prompt[i % len(prompt)] for i in range(n)]
    rng = random.Random(seed)
    return [rng.randrange(97, 123) for _ in range(n)]


class FakeEngine:
    """Runs on a thread: each step gives every request in the batch its next token."""

    def __init__(self, inbox: Inbox, slots: int = 4, step_s: float = 0.002):
        self.inbox, self.slots, self.step_s = inbox, slots, step_s
        self.running: dict[str, list] = {}
        self.cancelled: list[str] = []
        self.paused = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def state(self) -> EngineState:
        used = sum(len(r[0].prompt) + r[2] for r in list(self.running.values()))
        # two ranks holding 8 and 4 bytes per position (two pipeline stages of 2 and 1 layers)
        return EngineState(len(self.running), self.slots, [used * 8, used * 4], [self.slots * 32 * 8, self.slots * 32 * 4])

    def _loop(self) -> None:
        while True:
            if self.paused.is_set():
                time.sleep(0.01)
                continue
            got = self.inbox.poll(self.slots - len(self.running), wait_s=0 if self.running else 0.05)
            for request_id in got.cancelled:
                entry = self.running.pop(request_id, None)
                if entry is not None:
                    self.cancelled.append(request_id)
                    entry[1](TokenEvent(request_id, finish=Finish.CANCELLED))
            for request, sink in got.arrived:
                s = request.sampling
                tokens = expected_tokens(request.prompt, request.max_new_tokens, s.temperature, s.seed)
                self.running[request.id] = [request, sink, 0, tokens]
            if got.closing and not self.running:
                return
            for request_id, entry in list(self.running.items()):
                request, sink, done, tokens = entry
                token = tokens[done]
                if token in request.stop_ids:
                    del self.running[request_id]
                    sink(TokenEvent(request_id, finish=Finish.STOP))
                    continue
                sink(TokenEvent(request_id, token=token))
                entry[2] = done + 1
                if entry[2] == request.max_new_tokens:
                    del self.running[request_id]
                    sink(TokenEvent(request_id, finish=Finish.LENGTH))
            time.sleep(self.step_s)
