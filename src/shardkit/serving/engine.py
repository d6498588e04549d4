"""The serving loop every rank runs: continuous batching over a tensor- and pipeline-parallel model.

Rank 0 (the first ``tp`` rank, of the first pipeline stage) reads the :class:`~.requests.Inbox` between
steps; each step it broadcasts one small int64 tensor to the other ranks (the model's ``tp`` group;
under a pipeline every rank of the world) — whether requests joined or were cancelled,
whether the inbox is closing, and the token it chose for every running row — followed, only when
requests joined or were cancelled, by those (``broadcast_object_list``). Then every rank applies
the same schedule to its :class:`~.batch.Batch`: rows whose token ends them leave (a stop id: the
token is not sent; ``max_new_tokens`` reached), cancelled rows leave, the requests joining are
prefilled together in one forward into free slots (:meth:`.Batch.join`), and the remaining rows run one
decode step together
(:class:`~shardkit.runtime.plain_decode.PlainDecoder`: plain tensors, one ``all_reduce`` per
row-parallel layer; under a pipeline :class:`~shardkit.runtime.plain_pipeline.PlainPipeline`: each
stage its own layers and their cache, the hidden states sent stage to stage, the last stage's
logits sent back to rank 0). Rank 0 chooses the next tokens (:mod:`.sampling`) and sends
:class:`~.requests.TokenEvent` s to the requests' sinks.

The cache holds ``slots`` sequences of ``max_len`` positions; with ``cache_bytes`` instead of
``slots``, as many as fit, planned with :func:`shardkit.kv_cache_bytes` (a rank holds its heads of
its stage's layers); the plan is printed at start. Prefill is bounded per step: rank 0 lets join at most
``prefill_tokens`` padded prompt positions (joins x the longest prompt; at least one request), and holds
the others admitted for the next steps, so a burst of arrivals delays the running rows' next token by a
bounded prefill. A request whose prompt plus ``max_new_tokens`` exceeds ``max_len``, or holds ids outside the
vocabulary, ends at once with :attr:`~.requests.Finish.ERROR` naming what is valid.

>>> from shardkit.models.gpt import build_tiny_gpt
>>> from shardkit.serving.requests import GenerationRequest, Inbox
>>> inbox, events = Inbox(max_queue=4), []
>>> inbox.submit(GenerationRequest("a", (1, 2, 3), max_new_tokens=2), events.append)
True
>>> inbox.close()
>>> Engine(build_tiny_gpt(), inbox, slots=2, max_len=16, quiet=True).run()
>>> [e.token for e in events], events[-1].finish  # sk.generate's tokens on this prompt: 146 164
([146, 164, None], <Finish.LENGTH: 'length'>)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from ..plan import UsageError
from ..planner.estimate import kv_cache_bytes
from ..runtime.pipeline import PipelinedModule
from ..runtime.plain_decode import PlainDecoder
from ..runtime.plain_pipeline import PlainPipeline, decode_positions
from .batch import Batch, Row
from .requests import Finish, GenerationRequest, Inbox, Sink, TokenEvent
from .sampling import choose, generator_for

#: How long rank 0 waits for a request when the batch is empty (the other ranks wait in the broadcast).
IDLE_WAIT_S = 0.02
#: The header's fields before the tokens: closing, requests joined or cancelled.
HEADER = 2
#: Padded prompt positions prefilled in one step by default (requests joining x the longest of their prompts).
PREFILL_TOKENS = 4096


class Engine:
    """Continuous batching of ``model`` (from ``sk.shard`` with ``Mesh(tp=N)``, ``Mesh(pp=N)`` with a
    pipeline of one stage per rank, or both; or whole in one process); built and :meth:`run` on every rank,
    with the ``inbox`` on rank 0 only (``None`` elsewhere)."""

    def __init__(self, model: nn.Module, inbox: Inbox | None, *, max_len: int | None = None, slots: int | None = None,
                 cache_bytes: int | None = None, prefill_tokens: int = PREFILL_TOKENS, quiet: bool = False):
        limit = decode_positions(model)
        max_len = max_len or limit
        if max_len is None or (limit is not None and max_len > limit):
            raise UsageError(f"Engine: max_len={max_len} must be given and at most the model's {limit} positions")
        model.eval()
        dtype = next(model.parameters()).dtype
        tp, pp = _size(model, "tp"), _size(model, "pp")
        per_sequence = kv_cache_bytes(model.config, tp=tp, pp=pp, batch_size=1, seq_len=max_len, dtype=dtype)
        split = f"tp={tp}" + (f", pp={pp}" if pp > 1 else "")
        if slots is None:
            if cache_bytes is None or cache_bytes < per_sequence:
                raise UsageError(f"Engine: give slots=N or cache_bytes of at least one sequence of max_len={max_len} "
                                 f"positions ({per_sequence} bytes per rank, sk.kv_cache_bytes at {split})")
            slots = cache_bytes // per_sequence
        if isinstance(model, PipelinedModule):
            self.decoder: PlainDecoder | PlainPipeline = PlainPipeline(model, slots, max_len, to_first=True)
            # the world's rank 0 is the first stage's first tp rank (the first coordinate of every axis)
            self.group, self.leader = dist.group.WORLD, dist.get_rank() == 0
        else:
            self.decoder = PlainDecoder(model, slots=slots, max_len=max_len)
            self.group, self.leader = self.decoder.group, self.decoder.tp_rank == 0
        self.batch, self.inbox, self.max_len = Batch(self.decoder), inbox, max_len
        if self.leader and inbox is None:
            raise UsageError("Engine: rank 0 reads the requests, so it needs an Inbox")
        self.sinks: dict[str, Sink] = {}
        self.generators: dict[str, torch.Generator | None] = {}
        self.chosen: list[int] = []  # rank 0: the next token of each row, sent with the next schedule
        self.failed: list[str] = []  # rank 0: requests whose sink raised, cancelled at the next step
        layers = f": the heads of {-(-_layers(model) // pp)} of {_layers(model)} layers per stage" if pp > 1 else ""
        self.deferred: list[GenerationRequest] = []  # rank 0: admitted, beyond a step's prefill_tokens: the next
        self.prefill_tokens = prefill_tokens
        if self.leader and not quiet:
            Console(stderr=True).print(
                f"KV cache: {slots} sequences of {max_len} positions, {slots * per_sequence / 2**20:.1f} MiB per rank "
                f"(sk.kv_cache_bytes, {split}{layers}, {dtype})", soft_wrap=True)

    def run(self) -> None:
        """Serve until the inbox closes and every request in the batch has finished."""
        while True:
            closing, joins, cancelled, tokens = self._schedule()
            self._advance(tokens, set(cancelled))
            fed = len(self.batch.rows)
            if joins:
                logits = self.batch.join(joins)
                if self.leader:
                    self.chosen += choose(logits, [r.sampling for r in joins], [self.generators[r.id] for r in joins])
            if fed:
                logits = self.batch.decode(tokens)
                if self.leader:
                    rows = self.batch.rows[:fed]
                    self.chosen[:fed] = choose(logits, [r.request.sampling for r in rows],
                                               [self.generators[r.request.id] for r in rows])
            if closing and not self.batch.rows:
                return

    def _schedule(self) -> tuple[bool, list[GenerationRequest], list[str], list[int]]:
        """Rank 0's poll of the inbox and its tokens, broadcast: (closing, joins, cancelled ids, each row's token)."""
        objects: list = [[], []]
        # on the cache's device: NCCL broadcasts device tensors only
        header = torch.zeros(HEADER + self.decoder.slots, dtype=torch.long, device=self.decoder.keys.device)
        if self.leader:
            busy = self.batch.rows or self.deferred
            arrivals = self.inbox.poll(self.batch.free - len(self.deferred), 0 if busy else IDLE_WAIT_S)
            cancelled = arrivals.cancelled + self.failed
            objects = [self._joining(self._admitted(arrivals.arrived), set(cancelled)), cancelled]
            self.failed = []
            header[0] = arrivals.closing and not self.deferred
            header[1] = bool(objects[0] or objects[1])
            header[HEADER:HEADER + len(self.chosen)] = torch.tensor(self.chosen, dtype=torch.long, device=header.device)
        if self.group is not None:
            dist.broadcast(header, group=self.group, group_src=0)
            if header[1]:
                dist.broadcast_object_list(objects, group=self.group, group_src=0)
        tokens = header[HEADER:HEADER + len(self.batch.rows)].tolist()
        return bool(header[0]), objects[0], objects[1], tokens

    def _admitted(self, arrived: list[tuple[GenerationRequest, Sink]]) -> list[GenerationRequest]:
        """Rank 0: the arrived requests the engine can run; the others end at once with the reason."""
        admitted = []
        for request, sink in arrived:
            problem = self._problem(request)
            if problem is not None:
                sink(TokenEvent(request.id, finish=Finish.ERROR, error=problem))
                continue
            self.sinks[request.id] = sink
            self.generators[request.id] = generator_for(request.sampling)
            admitted.append(request)
        return admitted

    def _joining(self, admitted: list[GenerationRequest], cancelled: set[str]) -> list[GenerationRequest]:
        """Rank 0: the requests to prefill this step, the earliest first, within ``prefill_tokens`` padded
        positions (at least one); the rest wait in ``deferred``, cancelled ones leave it at once."""
        waiting, joins = [], []
        for request in self.deferred + admitted:
            if request.id in cancelled:
                self._emit(TokenEvent(request.id, finish=Finish.CANCELLED))
                del self.sinks[request.id], self.generators[request.id]
            else:
                waiting.append(request)
        longest = 0
        for i, request in enumerate(waiting):
            longest = max(longest, len(request.prompt))
            if joins and (i + 1) * longest > self.prefill_tokens:
                break
            joins.append(request)
        self.deferred = waiting[len(joins):]
        return joins

    def _problem(self, request: GenerationRequest) -> str | None:
        need = len(request.prompt) + request.max_new_tokens
        vocab = self.decoder.vocab
        if not request.prompt or request.max_new_tokens < 1:
            return "a request needs a prompt of at least one token and max_new_tokens >= 1"
        if need > self.max_len:
            return (f"a prompt of {len(request.prompt)} tokens and max_new_tokens={request.max_new_tokens} need "
                    f"{need} positions, but the engine holds {self.max_len} per sequence; valid: max_new_tokens <= "
                    f"{self.max_len - len(request.prompt)}")
        if min(request.prompt) < 0 or max(request.prompt) >= vocab:
            return f"the prompt holds ids outside the model's vocabulary; valid ids: 0 to {vocab - 1}"
        return None

    def _advance(self, tokens: list[int], cancelled: set[str]) -> None:
        """Every rank: each row takes its token; rows that end (stop id, length, error, cancelled) leave.
        ``tokens`` keeps the fed token of each remaining row, in the rows' new order (``None`` elsewhere)."""
        leaving = []
        for i, (row, token) in enumerate(zip(self.batch.rows, tokens)):
            finish = self._take(row, token, row.request.id in cancelled)
            if finish is not None:
                leaving.append(i)
                tokens[i] = None
                if self.leader:
                    self._emit(TokenEvent(row.request.id, finish=finish[0], error=finish[1]))
                    del self.sinks[row.request.id], self.generators[row.request.id]
        for i in sorted(leaving, reverse=True):  # as Batch.leave moves rows: the last into the gap
            last = len(tokens) - 1
            tokens[i] = tokens[last]
            tokens.pop()
            if self.leader:
                self.chosen[i] = self.chosen[last]
                self.chosen.pop()
        self.batch.leave(leaving)

    def _take(self, row: Row, token: int, cancelled: bool) -> tuple[Finish, str | None] | None:
        if cancelled:
            return Finish.CANCELLED, None
        if token < 0:
            return Finish.ERROR, f"the model's logits were nan or +inf after {row.made} new tokens"
        row.made += 1
        if token in row.request.stop_ids:
            return Finish.STOP, None
        if self.leader:
            self._emit(TokenEvent(row.request.id, token=token))
        return (Finish.LENGTH, None) if row.made >= row.request.max_new_tokens else None

    def _emit(self, event: TokenEvent) -> None:
        """Send ``event`` to its request's sink; a sink that raises cancels its request (the other ranks
        would otherwise wait for rank 0 in the next broadcast for ever)."""
        try:
            self.sinks[event.request_id](event)
        except Exception:  # noqa: BLE001 - whatever the server's sink raised, the engine serves on
            if event.finish is None:
                self.failed.append(event.request_id)


def _size(model: nn.Module, axis: str) -> int:
    plan = getattr(model, "plan", None)
    return plan.mesh.size_of(axis) if plan is not None else 1


def _layers(model: nn.Module) -> int:
    """The whole model's decoder layers (a pipeline stage holds some of them)."""
    return getattr(model.config, "layers", None) or model.config.num_hidden_layers


__all__ = ["Engine"]
