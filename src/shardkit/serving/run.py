"""One rank of ``shardkit serve``: the engine on every rank, and on rank 0 the HTTP server beside it.

Rank 0 runs the decode engine on its main thread (every rank follows its schedule, :mod:`.engine`) and
uvicorn on a thread of its own; they meet at the :class:`~.requests.Inbox`. How the server ends:

- SIGTERM (rank 0; a local world's parent forwards it): stop listening and take no new request (503),
  finish those in flight, and return on every rank (the command exits 0); requests still running
  ``drain_s`` seconds later are cancelled (their clients get 503 or the stream ends), so the bound holds.
- the engine fails (a rank died, so a collective broke): every open request is answered 500 (a stream
  already under way gets the error as its last event), then the error is raised, and the world names
  the rank that died.
- SIGINT (Ctrl-C) is the parent's: it stops the world at once. Under ``torchrun`` every rank gets it.

Under ``torchrun``, SIGTERM to rank 0's process drains as above and torchrun exits 0; SIGTERM to torchrun
itself reaches every rank (rank 0 drains, the others follow its schedule) but torchrun exits 1 all the
same: its agent raises ``SignalException`` on a signal of its own, whatever its ranks return, and no rank
can change that. So rank 0 prints its pid at start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from torch import nn

from .engine import Engine
from .requests import Inbox
from .server import EngineState, HttpThread, ModelInfo, Server
from .text import load_tokenizer

#: How long a failing rank 0 waits for the error answers to reach their clients before it raises.
FAIL_FLUSH_S = 1.0


@dataclass(frozen=True)
class ServeOptions:
    """How ``shardkit serve`` serves (plain data, sent to every rank)."""

    name: str  # the model's id in the API
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8  # requests decoded together (KV-cache slots)
    max_len: int | None = None  # positions per request, prompt and completion (None: the model's)
    max_queue: int = 256
    drain_s: float = 30.0
    mesh: str = ""
    tokenizer: str | None = None  # the model folder (its tokenizer), or None: byte-level


def serve_rank(model: nn.Module, rank: int, world_size: int, options: ServeOptions, eos_ids: frozenset[int],
               torchrun: bool) -> None:
    """Serve ``model`` (sharded, weights loaded) on this rank until SIGTERM or a failure."""
    restore = {signal.SIGTERM: signal.getsignal(signal.SIGTERM), signal.SIGINT: signal.getsignal(signal.SIGINT)}
    if not torchrun:  # Ctrl-C reaches the whole process group: the parent stops the world
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if rank != 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0's schedule says when to stop
            Engine(model, None, max_len=options.max_len, slots=options.max_batch).run()
            return
        _serve_leader(model, world_size, options, eos_ids, torchrun)
    finally:
        for number, handler in restore.items():
            signal.signal(number, handler)


def _serve_leader(model: nn.Module, world_size: int, options: ServeOptions, eos_ids: frozenset[int],
                  torchrun: bool) -> None:
    from ..families import token_sizes

    inbox = Inbox(options.max_queue)
    engine = Engine(model, inbox, max_len=options.max_len, slots=options.max_batch)
    vocab, _ = token_sizes(model)
    tokenizer = load_tokenizer(options.tokenizer, vocab)
    info = ModelInfo(options.name, engine.max_len, vocab, eos_ids, options.mesh)
    server = Server(inbox, tokenizer, info, lambda: _state(engine, world_size))
    http = HttpThread(server.app, options.host, options.port, options.drain_s)
    host = f"[{options.host}]" if ":" in options.host else options.host
    print(f"shardkit serve: {options.name} on {options.mesh or 'one process'}, {engine.decoder.slots} requests "
          f"at a time, {engine.max_len} positions each; tokenizer: {tokenizer.name}\n"
          f"shardkit serve: listening on http://{host}:{http.port} (OpenAI API under /v1, try it at /)", flush=True)
    if torchrun:  # torchrun exits 1 on a SIGTERM of its own, however its ranks end (docs/serve.md)
        print(f"shardkit serve: to stop, SIGTERM rank 0 (pid {os.getpid()}): it drains, every rank exits 0 and so "
              f"does torchrun", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: _drain(server, options.drain_s))
    try:
        engine.run()
    except BaseException as exc:
        server.fail_all(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}; "
                        f"the server is stopping")
        deadline = time.monotonic() + FAIL_FLUSH_S
        while server.open and time.monotonic() < deadline:
            time.sleep(0.01)
        http.stop(wait_s=FAIL_FLUSH_S)
        raise
    http.stop()
    print(f"shardkit serve: stopped; {server.stats.generated} tokens generated", file=sys.stderr, flush=True)


def _drain(server: Server, drain_s: float) -> None:
    """SIGTERM on rank 0: no new requests; those still open after ``drain_s`` are cancelled."""
    if server.draining:
        return
    print(f"shardkit serve: SIGTERM: finishing {len(server.open)} open requests (at most {drain_s:g} s), taking no "
          f"new ones", file=sys.stderr, flush=True)
    server.drain()

    def cancel_the_rest() -> None:
        for request_id in list(server.open):
            server.inbox.cancel(request_id)

    timer = threading.Timer(drain_s, cancel_the_rest)
    timer.daemon = True
    timer.start()


def _state(engine: Engine, world_size: int) -> EngineState:
    """The engine's batch and KV cache as the server reports them: every rank applies the same schedule, so
    each rank's cache holds the same positions (its own heads of them)."""
    with contextlib.suppress(RuntimeError):  # the batch changed while read: the next poll reads it again
        used = sum(row.length for row in list(engine.batch.rows))
        capacity = engine.decoder.slots * engine.max_len
        return EngineState(len(engine.batch.rows), engine.decoder.slots, [used] * world_size,
                           [capacity] * world_size)
    return EngineState(0, engine.decoder.slots)
