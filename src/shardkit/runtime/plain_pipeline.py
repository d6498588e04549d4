"""The plain-tensor decode step over pipeline stages (``pp``, and ``pp`` x ``tp``).

Each rank runs its own stage's layers with :class:`~shardkit.runtime.plain_decode.PlainDecoder`
(its local ``tp`` shards as plain tensors; the embedding on the first stage, the final norm and
the head on the last), and its KV cache holds only those layers' keys and values, its own heads of
them. A step sends the new positions' hidden states from each stage to the next one's rank of the
same ``tp`` coordinate (their shape is known to every rank from the step's arguments, so one
message, no header), each send and its receive in one batch (:mod:`shardkit.runtime.p2p`). The
last stage's ranks hold the logits; with ``to_first=True`` its first ``tp`` rank also sends them to
the first stage's (the serving engine's scheduling rank, global rank 0).

Why not :meth:`PipelinedModule.through_stages`: it runs the model's own forward, DTensor dispatch
on every operator, and sends a shape header before each message; a decode step here is the plain
path's, as fast as ``tp`` alone.

One stage per rank (torch's single-stage schedules, ``sequential`` included); with virtual stages
(a rank running several) :func:`pipeline_problems` says why not, and ``sk.generate`` runs the
stages' own forward instead.

>>> steps = PlainPipeline(sharded_model, slots=4, max_len=64)   # doctest: +SKIP
>>> steps.step(torch.tensor([[1, 2, 3]]), 0)                     # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..plan import UsageError
from ..planner.stages import StageAssignment
from . import p2p
from .pipeline import PipelinedModule
from .plain_decode import PlainDecoder, plain_problems


def pipeline_problems(model: nn.Module) -> list[str]:
    """Why :class:`PlainPipeline` cannot run ``model`` (a model from ``sk.shard`` with a pipeline; empty: it can)."""
    if not isinstance(model, PipelinedModule):
        return [f"plain pipeline decode runs a model sk.shard split into pipeline stages, not {type(model).__name__}"]
    runtime = model._sk_runtime
    problems = plain_problems(model) + assignment_problems(runtime.assignment)
    if len(runtime.local) != 1:
        problems.append(f"plain pipeline decode runs one stage per rank, but this rank runs stages {runtime.local} "
                        f"(schedule {runtime.schedule_name!r} with virtual stages); use a single-stage schedule "
                        f"such as 'sequential' or '1f1b'")
    return problems


def decode_positions(model: nn.Module) -> int | None:
    """The positions of a model :class:`PlainDecoder` runs, read from its config (a later pipeline stage holds
    no position embedding to count)."""
    from ..models.gpt import GPT

    return model.config.seq_len if isinstance(model, GPT) else getattr(model.config, "max_position_embeddings", None)


def assignment_problems(assignment: StageAssignment) -> list[str]:
    """Why stages assigned so (:func:`~shardkit.planner.stages.assign_stages`, on meta before launch) cannot
    decode on the plain path: a stage without a decoder layer (empty: they can)."""
    empty = [s for s, units in enumerate(assignment.stages) if not any(assignment.layout.units[i].block for i in units)]
    return [f"plain pipeline decode runs stages of at least one decoder layer each, but stage {s} holds "
            f"{', '.join(assignment.unit_names(s))}; use at most as many stages as the model has layers"
            for s in empty]


class PlainPipeline:
    """This rank's stage of ``model`` (from ``sk.shard`` with a pipeline) as a :class:`PlainDecoder` of
    ``slots`` cache rows of ``max_len`` positions; every rank of the model calls :meth:`step` with the same
    arguments. ``to_first``: the logits also go to the first stage's first ``tp`` rank."""

    def __init__(self, model: nn.Module, slots: int, max_len: int, to_first: bool = False):
        problems = pipeline_problems(model)
        if problems:
            raise UsageError(problems[0])
        runtime = model._sk_runtime
        self.stage = PlainDecoder(model, slots=slots, max_len=max_len)
        self.group, ranks = runtime.pp_group, runtime.assignment.ranks
        (index,) = runtime.local
        self.previous = ranks[index - 1] if index > 0 else None
        self.next = ranks[index + 1] if index + 1 < len(ranks) else None
        self.first, self.last = ranks[0], ranks[-1]
        self.hidden = model.config.dim if self.stage.gpt else model.config.hidden_size
        self.to_first = to_first and self.stage.tp_rank == 0 and self.first != self.last
        self.stages = len(ranks)

    # what the serving batch reads of its decoder: the same as PlainDecoder's
    @property
    def slots(self) -> int:
        return self.stage.slots

    @property
    def max_len(self) -> int:
        return self.stage.max_len

    @property
    def vocab(self) -> int:
        return self.stage.vocab

    @property
    def keys(self) -> torch.Tensor:
        return self.stage.keys

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's KV cache (its stage's layers, its heads)."""
        return self.stage.nbytes

    @property
    def has_first(self) -> bool:
        return self.previous is None

    @property
    def has_last(self) -> bool:
        return self.next is None

    def move(self, source: int, target: int) -> None:
        """Copy slot ``source``'s cached keys and values into slot ``target`` (this stage's layers)."""
        self.stage.move(source, target)

    @torch.no_grad()
    def step(self, ids: torch.Tensor, past: int | torch.Tensor, first_slot: int = 0,
             kv_len: int | None = None) -> torch.Tensor | None:
        """:meth:`PlainDecoder.step` through every stage: the last position's logits ``[batch, vocab]`` on the
        last stage's ranks (and, with ``to_first``, the first stage's first ``tp`` rank), ``None`` elsewhere."""
        return self._through_stages(ids, past, first_slot, kv_len, None)

    @torch.no_grad()
    def prefill(self, prompts: list[Sequence[int]], first_slot: int = 0) -> torch.Tensor | None:
        """:meth:`PlainDecoder.prefill` through every stage (prompts right-padded, one forward): each prompt's
        last position's logits where :meth:`step` returns them."""
        ids, last = self.stage.padded(prompts, first_slot)
        return self._through_stages(ids, 0, first_slot, None, last)

    def _through_stages(self, ids: torch.Tensor, past: int | torch.Tensor, first_slot: int, kv_len: int | None,
                        last: torch.Tensor | None) -> torch.Tensor | None:
        batch, new = ids.shape
        x = ids
        if self.previous is not None:
            x = self.stage.keys.new_empty(batch, new, self.hidden)
            p2p.exchange_and_wait(self.group, receives=[(self.previous, x)])
        out = self.stage.forward(x, past, first_slot, kv_len, last)
        if self.next is not None:
            p2p.exchange_and_wait(self.group, sends=[(self.next, out)])
        if not self.to_first:
            return out if self.has_last else None
        if self.has_last:
            p2p.exchange_and_wait(self.group, sends=[(self.first, out)])
            return out
        if not self.has_first:
            return None
        logits = self.stage.keys.new_empty(batch, self.vocab)
        p2p.exchange_and_wait(self.group, receives=[(self.last, logits)])
        return logits


__all__ = ["PlainPipeline", "assignment_problems", "decode_positions", "pipeline_problems"]
