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

import torch
import torch.distributed as dist
from torch import nn

from ..plan import UsageError
from ..planner.estimate import kv_cache_bytes
from ..runtime.devices import launcher_ranks_on_host, memory_per_process
from ..runtime.plain_pipeline import decode_positions
from ..runtime.torchrun import in_torchrun
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
    max_batch: int | None = 8  # requests decoded together (KV-cache slots); None: as many as cache_memory holds
    max_len: int | None = None  # positions per request, prompt and completion (None: the model's)
    max_queue: int = 256
    drain_s: float = 30.0
    mesh: str = ""
    tokenizer: str | None = None  # the model folder (its tokenizer), or None: byte-level
    cache_memory: float | None = None  # KV cache per rank: bytes (> 1), or a fraction of the free memory; None: 1.0


def serve_rank(model: nn.Module, rank: int, world_size: int, options: ServeOptions, eos_ids: frozenset[int],
               torchrun: bool) -> None:
    """Serve ``model`` (sharded, weights loaded) on this rank until SIGTERM or a failure."""
    restore = {signal.SIGTERM: signal.getsignal(signal.SIGTERM), signal.SIGINT: signal.getsignal(signal.SIGINT)}
    if not torchrun:  # Ctrl-C reaches the whole process group: the parent stops the world
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        slots = cache_slots(model, options, world_size)
        if rank != 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0's schedule says when to stop
            engine = Engine(model, None, max_len=options.max_len, slots=slots)
            _position_bytes(engine, world_size)
            engine.run()
            return
        _serve_leader(model, world_size, options, eos_ids, torchrun, slots)
    finally:
        for number, handler in restore.items():
            signal.signal(number, handler)


def cache_slots(model: nn.Module, options: ServeOptions, world_size: int) -> int:
    """The KV-cache slots every rank allocates (weights loaded, cache not yet): ``options.max_batch``
    sequences of ``max_len`` positions (:func:`shardkit.kv_cache_bytes` each), or as many as
    ``cache_memory`` holds, checked against the memory free on the rank with the least (one ``all_reduce``
    at start); :class:`UsageError` with the sizes and what would fit, before anything is allocated."""
    max_len = options.max_len or decode_positions(model)
    dtype = next(model.parameters()).dtype
    tp, pp = _axis(model, "tp"), _axis(model, "pp")
    per_sequence = kv_cache_bytes(model.config, tp=tp, pp=pp, batch_size=1, seq_len=max_len, dtype=dtype)
    free = _least(free_memory(next(model.parameters()).device, world_size), model)
    asked = options.cache_memory
    budget = int(asked) if asked is not None and asked > 1 else int(free * (1.0 if asked is None else asked))
    flag = ("the free memory" if asked is None else
            f"--kv-cache-memory {int(asked)}" if asked > 1 else f"--kv-cache-memory {asked:g} of the free memory")
    fits = budget // per_sequence
    slots = options.max_batch or fits
    where = (f"{flag} ({budget / 2**20:.1f} MiB per rank; {free / 2**20:.1f} MiB free on the rank with the "
             f"least, weights loaded)")
    if budget > free:
        raise UsageError(f"{where}: more than is free; valid: at most {free} bytes per rank")
    if slots > fits or fits < 1:
        per_position = per_sequence // max_len
        raise UsageError(f"KV cache: --max-batch {slots} x --max-tokens {max_len} takes {slots * per_sequence} bytes "
                         f"per rank (sk.kv_cache_bytes, tp={tp}, pp={pp}, {dtype}), but {where} holds {fits} such "
                         f"sequences; valid: --max-batch at most {fits}, or --max-tokens at most "
                         f"{budget // (per_position * max(slots, 1))} with --max-batch {max(slots, 1)}")
    return slots


def free_memory(device: torch.device, world_size: int) -> int:
    """Bytes this rank may still allocate: a GPU's free memory; on the CPU the machine's available RAM
    shared by the processes of this host (``MemAvailable`` / the local ranks)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return memory_per_process(max(1, launcher_ranks_on_host() if in_torchrun() else world_size))[0]


def _least(value: int, model: nn.Module) -> int:
    """The smallest ``value`` over the world (every rank must allocate the same slots)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    least = torch.tensor([value], dtype=torch.long, device=next(model.parameters()).device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return int(least.item())


def _position_bytes(engine: Engine, world_size: int) -> list[int]:
    """Each rank's KV-cache bytes per position held (its heads of its stage's layers), gathered once at start:
    every rank applies the same schedule, so a rank's cache use is the positions held times its figure."""
    mine = engine.decoder.nbytes // (engine.decoder.slots * engine.max_len)
    if world_size == 1 or not dist.is_initialized():
        return [mine]
    every: list[int | None] = [None] * world_size
    dist.all_gather_object(every, mine)
    return [int(b) for b in every]


def _axis(model: nn.Module, axis: str) -> int:
    plan = getattr(model, "plan", None)
    return plan.mesh.size_of(axis) if plan is not None else 1


def _serve_leader(model: nn.Module, world_size: int, options: ServeOptions, eos_ids: frozenset[int],
                  torchrun: bool, slots: int) -> None:
    from ..families import token_sizes

    inbox = Inbox(options.max_queue)
    engine = Engine(model, inbox, max_len=options.max_len, slots=slots)
    position_bytes = _position_bytes(engine, world_size)
    vocab, _ = token_sizes(model)
    tokenizer = load_tokenizer(options.tokenizer, vocab)
    info = ModelInfo(options.name, engine.max_len, vocab, eos_ids, options.mesh)
    server = Server(inbox, tokenizer, info, lambda: _state(engine, position_bytes))
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


def _state(engine: Engine, position_bytes: list[int]) -> EngineState:
    """The engine's batch and each rank's KV cache in bytes as the server reports them: every rank applies
    the same schedule, so each holds the same positions, times its own bytes per position (its heads of its
    stage's layers); no collective per step."""
    with contextlib.suppress(RuntimeError):  # the batch changed while read: the next poll reads it again
        used = sum(row.length for row in list(engine.batch.rows))
        capacity = engine.decoder.slots * engine.max_len
        return EngineState(len(engine.batch.rows), engine.decoder.slots, [used * b for b in position_bytes],
                           [capacity * b for b in position_bytes])
    return EngineState(0, engine.decoder.slots)
