"""The global batches of a training run, from a position, and the position after each.

``shardkit train`` reads either a folder of text files (:class:`~shardkit.io.data.TextShards`:
random windows of one byte stream, drawn from a seeded generator) or a sharded data folder
(:class:`~shardkit.io.sharded_data.ShardedDataset`: every sample once per epoch, in a seeded
order). Either way a checkpoint stores where the data stood (:attr:`Batch.position`, plain JSON)
and a resumed run carries on from there, under any plan: the position counts global samples
(or batches drawn), never ranks. A position from other data is refused, naming both.

>>> stream = BatchStream.of(TextShards(max_bytes=4096), seq_len=8, seed=0)
>>> first, second = stream.batches(batch_size=2, steps=2)
>>> first.inputs.shape, first.position["kind"], first.position["batches"]
(torch.Size([2, 8]), 'text', 1)
>>> again = next(stream.batches(batch_size=2, steps=1, position=first.position))
>>> again.position["batches"], torch.equal(again.inputs, second.inputs)
(2, True)
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..plan import UsageError
from ..plan.text import format_bytes
from .data import TextShards
from .manifest import MANIFEST_NAME
from .sharded_data import ShardedDataset


@dataclass(frozen=True)
class Batch:
    """One global batch (``inputs``, ``targets``: int64 ``[batch, seq_len]``) and the data's
    position after it (what a checkpoint taken after training on it stores)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    position: dict[str, Any]


@dataclass(frozen=True)
class BatchStream:
    """Global batches of ``seq_len`` tokens from text or a sharded data folder (see the module).

    Pickles as its settings; every rank draws the same global batches.
    """

    source: TextShards | ShardedDataset
    seq_len: int
    seed: int

    @classmethod
    def of(cls, data: TextShards | ShardedDataset | str | Path | None, seq_len: int, seed: int,
           max_bytes: int | None = None) -> BatchStream:
        """A folder with a ``manifest.json`` is a sharded data folder; any other folder (or
        ``None``: the standard library's sources) is text; a data object is taken as it is."""
        if isinstance(data, (TextShards, ShardedDataset)):
            return cls(data, seq_len, seed)
        if data is not None and (Path(data) / MANIFEST_NAME).is_file():
            return cls(ShardedDataset(data, seq_len, seed), seq_len, seed)
        text = TextShards(data) if max_bytes is None else TextShards(data, max_bytes=max_bytes)
        return cls(text, seq_len, seed)

    @property
    def kind(self) -> str:
        return "sharded" if isinstance(self.source, ShardedDataset) else "text"

    @property
    def fingerprint(self) -> str:
        """What the batches depend on, hashed: a position is only valid for the same fingerprint."""
        if isinstance(self.source, ShardedDataset):
            return self.source.fingerprint
        text = f"{self.source.root}|{self.source.pattern}|{self.source.max_bytes}|{self.seq_len}|{self.seed}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        if isinstance(self.source, ShardedDataset):
            return f"{len(self.source):,} samples of {self.seq_len} tokens in {self.source.folder}"
        return f"{self.source.root} (up to {format_bytes(self.source.max_bytes)})"

    def check_position(self, position: dict[str, Any] | None) -> None:
        """Refuse a position saved from other data (another folder, seq_len or seed)."""
        if position is None:
            return
        kind, data = position.get("kind"), position.get("data")
        if kind != self.kind or data != self.fingerprint:
            raise UsageError(f"the checkpoint's data position is for {kind} data {data!r}, but this run reads "
                             f"{self.kind} data {self.fingerprint!r} ({self.describe()}, seq_len {self.seq_len}, "
                             f"seed {self.seed}): resume with the same data, seq_len and seed, or start from the "
                             f"weights alone (--init-from an export)")

    def batches(self, batch_size: int, steps: int, position: dict[str, Any] | None = None) -> Iterator[Batch]:
        """``steps`` global batches of ``batch_size`` from ``position`` (the start by default)."""
        self.check_position(position)
        if isinstance(self.source, ShardedDataset):
            return itertools.islice(self._sharded(batch_size, position), steps)
        return self._text(batch_size, steps, position)

    def _text(self, batch_size: int, steps: int, position: dict[str, Any] | None) -> Iterator[Batch]:
        done = 0 if position is None else int(position["batches"])
        drawn = self.source.batches(self.seq_len, batch_size, self.seed, done + steps)
        for index, (inputs, targets) in enumerate(drawn):
            if index >= done:  # the generator's draws before ``done`` are replayed, not used
                yield Batch(inputs, targets, {"kind": "text", "data": self.fingerprint, "batches": index + 1})

    def _sharded(self, batch_size: int, position: dict[str, Any] | None) -> Iterator[Batch]:
        dataset = self.source
        assert isinstance(dataset, ShardedDataset)
        epoch, start = (0, 0) if position is None else (int(position["epoch"]), int(position["position"]))
        if len(dataset) < batch_size:
            raise UsageError(f"the data folder {dataset.folder} has {len(dataset)} samples of {self.seq_len} tokens, "
                             f"fewer than one batch of {batch_size}: use a smaller --batch-size or --seq-len")
        while True:
            loader = dataset.loader(batch_size, position=min(start, len(dataset)), epoch=epoch)
            for _, tokens in loader:
                yield Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
                            {"kind": "sharded", "data": self.fingerprint, "epoch": epoch, "position": loader.position})
            epoch, start = epoch + 1, 0


__all__ = ["Batch", "BatchStream"]
