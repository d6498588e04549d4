"""The OpenAI-compatible HTTP server: a Starlette app served by uvicorn on a thread of rank 0.

Why Starlette + uvicorn: the ASGI stack FastAPI itself runs on, kept by the same people, with
streaming responses that notice a client leaving (the request is then cancelled in the engine), and
a server that can run on a thread of its own (the rank's main thread runs the decode engine) and
stop gracefully: stop listening, let open requests finish, within a bound. FastAPI would add
pydantic models over the same stack; OpenAI's bodies are read strictly by :mod:`.protocol` instead,
so that every error names its field as OpenAI's own do.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` for server-sent
events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /state``
(the live state as JSON, for the page) and ``GET /`` (:mod:`.page`).

Status codes: 400 a request the server refuses (OpenAI's error body, ``param`` naming the field), 429
the queue is full, 503 the server is shutting down, 500 the engine failed (a rank died): a stream
that has sent tokens gets the error as its last event instead, without ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import html
import json
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from . import protocol
from .page import PAGE
from .protocol import Parsed, RequestError
from .requests import Finish, Inbox, TokenEvent
from .text import TextStream, Tokenizer

#: How far back ``tokens/s`` looks.
RATE_WINDOW_S = 5.0


@dataclass(frozen=True)
class ModelInfo:
    """What the server says of the model it serves and checks requests against."""

    name: str
    positions: int | None
    vocab: int | None
    eos_ids: frozenset[int] = frozenset()
    mesh: str = ""


@dataclass
class EngineState:
    """The engine's live state, for ``/metrics`` and the page: requests in the running batch, its
    slots, and each rank's KV cache in bytes (held by the running rows, allocated)."""

    batch: int = 0
    slots: int = 0
    kv_used: list[int] = field(default_factory=list)
    kv_capacity: list[int] = field(default_factory=list)


class Stats:
    """The server's counters; the engine's thread adds tokens, the server's loop the rest."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.generated = 0
        self.prompt_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()

    def answered(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[endpoint, status] += 1

    def token(self) -> None:
        with self._lock:
            self.generated += 1
            self._recent.append((time.monotonic(), 1))

    def tokens_per_second(self) -> float:
        with self._lock:
            start = time.monotonic() - RATE_WINDOW_S
            while self._recent and self._recent[0][0] < start:
                self._recent.popleft()
            return len(self._recent) / RATE_WINDOW_S


class Server:
    """The app and what it keeps: every open request's event sink (so that a failing engine can end them
    all), the stats, and whether it is draining.

    >>> from shardkit.serving.text import ByteTokenizer
    >>> server = Server(Inbox(8), ByteTokenizer(), ModelInfo("gpt-tiny", 32, 256), EngineState)
    >>> sorted(r.path for r in server.app.routes)
    ['/', '/health', '/metrics', '/state', '/v1/chat/completions', '/v1/completions', '/v1/models']
    """

    def __init__(self, inbox: Inbox, tokenizer: Tokenizer, info: ModelInfo, engine: Callable[[], EngineState]):
        self.inbox, self.tokenizer, self.info, self.engine = inbox, tokenizer, info, engine
        self.stats = Stats()
        self.open: dict[str, Callable[[TokenEvent], None]] = {}
        self.failure: str | None = None
        self.draining = False
        self.started = time.time()
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/state", self.state, methods=["GET"]),
            Route("/", self.page, methods=["GET"]),
        ])

    def drain(self) -> None:
        """Take no new request (503); the engine finishes those it holds."""
        self.draining = True
        self.inbox.close()

    def fail_all(self, message: str) -> None:
        """End every open request with an error (the engine failed); thread-safe."""
        self.failure = message
        for request_id, sink in list(self.open.items()):
            sink(TokenEvent(request_id, finish=Finish.ERROR, error=message))

    # ---- endpoints

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/completions", protocol.parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "/v1/chat/completions", protocol.parse_chat)

    async def models(self, request: Request) -> Response:
        self.stats.answered("/v1/models", 200)
        return JSONResponse({"object": "list", "data": [
            {"id": self.info.name, "object": "model", "created": int(self.started), "owned_by": "shardkit"}]})

    async def health(self, request: Request) -> Response:
        if self.failure is not None:
            return JSONResponse({"status": "failed", "error": self.failure}, status_code=503)
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def state(self, request: Request) -> Response:
        return JSONResponse(self.snapshot())

    async def page(self, request: Request) -> Response:
        return HTMLResponse(PAGE.replace("{{model}}", html.escape(self.info.name)))

    def snapshot(self) -> dict[str, Any]:
        engine = self.engine()
        return {"model": self.info.name, "mesh": self.info.mesh, "queue": self.inbox.waiting(),
                "open": len(self.open), "batch": engine.batch, "slots": engine.slots,
                "tokens_per_second": round(self.stats.tokens_per_second(), 2), "generated": self.stats.generated,
                "kv_cache": [{"rank": r, "used": u, "capacity": c}
                             for r, (u, c) in enumerate(zip(engine.kv_used, engine.kv_capacity))]}

    async def metrics(self, request: Request) -> Response:
        state = self.snapshot()
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP shardkit_{name} {help}", f"# TYPE shardkit_{name} {kind}"])
            lines.extend(f"shardkit_{name}{labels} {_number(value)}" for labels, value in samples)

        with self.stats._lock:
            answered = sorted(self.stats.requests.items())
        metric("requests_total", "counter", "Requests answered, by endpoint and status code.",
               [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in answered])
        metric("requests_open", "gauge", "Requests being answered (queued or in the batch).", [("", state["open"])])
        metric("queue_length", "gauge", "Requests waiting for a slot in the batch.", [("", state["queue"])])
        metric("batch_size", "gauge", "Requests in the running batch.", [("", state["batch"])])
        metric("batch_slots", "gauge", "Requests the running batch can hold.", [("", state["slots"])])
        metric("generated_tokens_total", "counter", "Tokens generated.", [("", state["generated"])])
        metric("prompt_tokens_total", "counter", "Prompt tokens received.", [("", self.stats.prompt_tokens)])
        metric("tokens_per_second", "gauge", f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.",
               [("", state["tokens_per_second"])])
        metric("kv_cache_used_bytes", "gauge", "Bytes of each rank's KV cache held by the running requests.",
               [(f'{{rank="{k["rank"]}"}}', k["used"]) for k in state["kv_cache"]])
        metric("kv_cache_capacity_bytes", "gauge", "Bytes of KV cache each rank allocated.",
               [(f'{{rank="{k["rank"]}"}}', k["capacity"]) for k in state["kv_cache"]])
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # ---- generation

    async def _generate(self, request: Request, endpoint: str, parse: Callable[[object], Parsed]) -> Response:
        try:
            parsed, ids = self._read(await request.body(), parse)
            generation = protocol.to_generation(parsed, ids, model=self.info.name, positions=self.info.positions,
                                                vocab=self.info.vocab, eos_ids=self.info.eos_ids)
        except RequestError as exc:
            return self._error(endpoint, exc)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:  # the engine's thread
            if event.token is not None:
                self.stats.token()
            loop.call_soon_threadsafe(events.put_nowait, event)

        self.open[generation.id] = sink
        if self.failure is not None or not self.inbox.submit(generation, sink):
            del self.open[generation.id]
            return self._error(endpoint, self._refusal())
        self.stats.prompt_tokens += len(ids)
        answer = _Answer(self, parsed, generation.id, len(ids), events)
        if parsed.stream:
            return await self._stream(request, endpoint, answer)
        try:
            text, finish, error = await _until_disconnect(request, answer.whole())
        finally:
            answer.close()
        if error is not None:
            return self._error(endpoint, error)
        self.stats.answered(endpoint, 200)
        return JSONResponse(protocol.response(parsed, self.info.name, text, finish, len(ids), answer.tokens))

    def _read(self, raw: bytes, parse: Callable[[object], Parsed]) -> tuple[Parsed, list[int]]:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"We could not parse the JSON body of your request ({exc}). The body must be one "
                               f"JSON object.") from None
        parsed = parse(body)
        if parsed.kind == "chat":
            ids = self.tokenizer.chat(parsed.prompt)
        elif isinstance(parsed.prompt, str):
            ids = self.tokenizer.encode(parsed.prompt)
        else:
            ids = list(parsed.prompt)
        return parsed, ids

    def _refusal(self) -> RequestError:
        if self.failure is not None:
            return RequestError(f"the server is stopping: {self.failure}", status=503, type="server_error")
        if self.draining:
            return RequestError("the server is shutting down and takes no new requests", status=503,
                                type="server_error", code="shutting_down")
        return RequestError(f"the queue is full ({self.inbox.max_queue} requests wait for a slot); retry later",
                            status=429, type="rate_limit_exceeded", code="queue_full")

    def _error(self, endpoint: str, error: RequestError) -> Response:
        self.stats.answered(endpoint, error.status)
        return JSONResponse(error.body(), status_code=error.status)

    async def _stream(self, request: Request, endpoint: str, answer: _Answer) -> Response:
        pieces = answer.pieces()
        try:  # the status waits for the first event: an error before any token is still a 5xx
            first = await _until_disconnect(request, anext(pieces))
        except BaseException:
            answer.close()
            raise
        if isinstance(first, RequestError):
            answer.close()
            return self._error(endpoint, first)
        self.stats.answered(endpoint, 200)

        async def events() -> AsyncIterator[str]:
            try:
                piece: object = first
                while True:
                    if isinstance(piece, RequestError):  # after tokens: the error is the last event
                        yield _sse(piece.body())
                        return
                    yield _sse(piece)
                    try:
                        piece = await anext(pieces)
                    except StopAsyncIteration:
                        break
                yield "data: [DONE]\n\n"
            finally:
                answer.close()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _number(value: float) -> str:
    """A sample as Prometheus reads it back exactly: integers in full (not ``1.23457e+06``), floats by ``repr``."""
    return str(int(value)) if isinstance(value, int) or float(value).is_integer() else repr(float(value))


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _until_disconnect(request: Request, awaitable):
    """``awaitable``'s value, or :class:`asyncio.CancelledError` when the client leaves first."""
    task = asyncio.ensure_future(awaitable)
    left = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if not task.done():
        task.cancel()
        raise asyncio.CancelledError("the client disconnected")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Answer:
    """One request's events turned into text (stop strings cut), whole or piece by piece; ``close``
    cancels it in the engine unless it has finished."""

    def __init__(self, server: Server, parsed: Parsed, request_id: str, prompt_tokens: int,
                 events: asyncio.Queue[TokenEvent]):
        self.server, self.parsed, self.id, self.prompt_tokens, self.events = (server, parsed, request_id,
                                                                              prompt_tokens, events)
        self.text = TextStream(server.tokenizer.decode, parsed.stop)
        self.tokens = 0
        self.finished = False

    async def _next(self) -> tuple[str, Finish | None] | RequestError:
        """The next piece of text and, at the end, why it ended; a :class:`RequestError` for a failure."""
        event = await self.events.get()
        if event.token is not None:
            self.tokens += 1
            piece, stopped = self.text.push(event.token)
            if stopped:
                self.close()  # a stop string: the engine need not go on
                return piece, Finish.STOP
            return piece, None
        self.finished = True
        if event.finish is Finish.ERROR:
            return RequestError(f"the engine failed: {event.error}", status=500, type="server_error")
        if event.finish is Finish.CANCELLED:
            return RequestError("the request was cancelled: the server is shutting down", status=503,
                                type="server_error")
        return self.text.finish(), event.finish

    async def whole(self) -> tuple[str, Finish | None, RequestError | None]:
        text = []
        while not self.finished:
            got = await self._next()
            if isinstance(got, RequestError):
                return "", None, got
            text.append(got[0])
            finish = got[1]
        return "".join(text), finish, None

    async def pieces(self) -> AsyncIterator[dict[str, Any] | RequestError]:
        """Stream events: the chat's role first, then text as it comes, the finish, then usage if asked."""
        parsed, model = self.parsed, self.server.info.name
        role = parsed.kind == "chat"  # sent with the first event, so that a failure before it is a 5xx
        while not self.finished:
            got = await self._next()
            if isinstance(got, RequestError):
                yield got
                return
            if role:
                yield protocol.chunk(parsed, model, "", first=True)
                role = False
            piece, finish = got
            if piece or finish is not None:
                yield protocol.chunk(parsed, model, piece if piece or parsed.kind != "chat" else None, finish)
        if parsed.include_usage:
            yield protocol.chunk(parsed, model, None, usage_counts=protocol.usage(self.prompt_tokens, self.tokens))

    def close(self) -> None:
        self.server.open.pop(self.id, None)
        if not self.finished:
            self.finished = True
            self.server.inbox.cancel(self.id)


class HttpThread:
    """uvicorn serving ``app`` on a thread of its own, on a socket bound here (a port in use is an
    ``OSError`` at once); ``stop`` stops listening and lets open requests finish within ``drain_s``.

    >>> from starlette.applications import Starlette
    >>> http = HttpThread(Starlette(), "127.0.0.1", 0, drain_s=1)
    >>> http.port > 0, http.stop()
    (True, None)
    """

    def __init__(self, app: Starlette, host: str, port: int, drain_s: float):
        import socket

        import uvicorn

        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError:
            self.socket.close()
            raise
        self.port = self.socket.getsockname()[1]
        self.drain_s = drain_s
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=drain_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True,
                                       name="shardkit-http")
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            time.sleep(0.01)
        if not self.thread.is_alive():
            raise OSError(f"the HTTP server did not start on {host}:{port}")

    def stop(self, wait_s: float | None = None) -> None:
        """Stop listening; wait for open requests (at most ``drain_s``, or ``wait_s``) and the thread."""
        self.server.should_exit = True
        self.thread.join(self.drain_s + 5 if wait_s is None else wait_s)
