"""The running batch of the engine: which request holds which KV-cache slot, at which position.

Every rank keeps the same rows in the same order (the engine applies one broadcast schedule on
all of them). Row ``i`` holds cache slot ``i``: the requests joining at a step take the next free
slots and their prompts are prefilled together in one forward
(:meth:`~shardkit.runtime.plain_decode.PlainDecoder.prefill`: right-padded, each row attending its
own prompt only, so each computes as transformers' ``generate`` on that prompt alone); a leaving row's slot is filled by the last row (its keys and values copied once), so the
running rows are always slots ``0 .. n-1`` and a decode step runs them as one batch, each at its
own position (:meth:`~shardkit.runtime.plain_decode.PlainDecoder.step` masks the rest).

>>> from shardkit.models.gpt import build_tiny_gpt
>>> from shardkit.runtime.plain_decode import PlainDecoder
>>> from shardkit.serving.requests import GenerationRequest
>>> batch = Batch(PlainDecoder(build_tiny_gpt().eval(), slots=2, max_len=16))
>>> batch.join([GenerationRequest("a", (1, 2, 3), max_new_tokens=4)]).shape
torch.Size([1, 256])
>>> batch.decode([7]).shape, batch.rows[0].length
(torch.Size([1, 256]), 4)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.plain_decode import PlainDecoder
from .requests import GenerationRequest


@dataclass
class Row:
    """One request in the batch: ``length`` positions cached, ``made`` tokens generated so far."""

    request: GenerationRequest
    length: int
    made: int = 0


class Batch:
    """Rows over a :class:`PlainDecoder`'s cache slots (one request per slot)."""

    def __init__(self, decoder: PlainDecoder):
        self.decoder = decoder
        self.rows: list[Row] = []

    @property
    def free(self) -> int:
        """Slots no request holds."""
        return self.decoder.slots - len(self.rows)

    def join(self, requests: list[GenerationRequest]) -> torch.Tensor:
        """Prefill ``requests``' prompts together in the next free slots; returns each one's last position's
        logits ``[len(requests), vocab]``."""
        logits = self.decoder.prefill([request.prompt for request in requests], first_slot=len(self.rows))
        self.rows += [Row(request, len(request.prompt)) for request in requests]
        return logits

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One step of the first ``len(tokens)`` rows, each fed its token at its own position: ``[rows, vocab]``."""
        rows = self.rows[: len(tokens)]
        device = self.decoder.keys.device
        past = torch.tensor([row.length for row in rows], device=device)
        kv_len = max(row.length for row in rows) + 1
        logits = self.decoder.step(torch.tensor(tokens, device=device)[:, None], past, kv_len=kv_len)
        for row in rows:
            row.length += 1
        return logits

    def leave(self, indices: list[int]) -> None:
        """Drop the rows at ``indices``; the last rows move into their slots."""
        for i in sorted(set(indices), reverse=True):  # from the end: the row moved in never leaves after
            last = len(self.rows) - 1
            if i != last:
                self.decoder.move(last, i)
                self.rows[i] = self.rows[last]
            self.rows.pop()


__all__ = ["Batch", "Row"]
