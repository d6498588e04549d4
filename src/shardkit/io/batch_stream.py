"""The global batches of a training run, from a position, and the position after each.

``shardkit train`` reads either a folder of text files (:class:`~shardkit.io.data.TextShards`:
random windows of one byte stream, drawn from a seeded generator) or a sharded data folder
(:class:`~shardkit.io.sharded_data.ShardedDataset`: every sample once per epoch, in a seeded
order). Either way a checkpoint stores where the data stood (:attr:`Batch.position`, plain JSON)
and a resumed run carries on from there, under any plan: the position counts global samples
(or batches drawn), never ranks. A position from other data is refused, naming both: the
fingerprint hashes the data themselves (a text stream's :attr:`~TextShards.digest`, a sharded
folder's manifest of sha256s) with ``seq_len`` and ``seed``, never the path they were read from.

>>> stream = BatchStream.of(TextShards(max_bytes=4096), seq_len=8, seed=0)
>>> first, second = stream.batches(batch_size=2, steps=2)
>>> first.inputs.shape, first.position["kind"], first.position["batches"]
(torch.Size([2, 8]), 'text', 1)
>>> again = next(stream.batches(batch_size=2, steps=1, position=first.position))
>>> again.position["batches"], torch.equal(again.inputs, second.inputs)
(2, True)

:meth:`BatchStream.split` holds out the end of the data to evaluate on (the last whole shards
of a sharded folder, the last bytes of a text stream); the fraction is part of both parts'
fingerprints, so a position saved under one holdout is refused under another.
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

#: What a text position holds since its fingerprint hashes the text, not the folder's path: a position
#: without it was written by an older shardkit and never matches.
TEXT_FINGERPRINT = {"fingerprint_of": "contents"}


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

    Pickles as its settings; every rank draws the same global batches. ``holdout``: the fraction
    held out of the data this stream is a part of (:meth:`split`), ``None`` for all of it.
    """

    source: TextShards | ShardedDataset
    seq_len: int
    seed: int
    holdout: float | None = None

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
        """What the batches depend on, hashed: a position is only valid for the same fingerprint.

        The data (a text stream's digest: its files' names, sizes and contents, read here if not yet;
        a sharded folder's manifest), ``seq_len``, ``seed`` and the part read; not where the data lie.
        """
        if isinstance(self.source, ShardedDataset):
            fingerprint = self.source.fingerprint
        else:
            text = f"{self.source.digest}|{self.seq_len}|{self.seed}"
            if self.source.byte_range is not None:
                text += f"|{self.source.byte_range}"
            fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
        if self.holdout is None:
            return fingerprint
        return hashlib.sha256(f"{fingerprint}|holdout={self.holdout!r}".encode()).hexdigest()[:16]

    def split(self, fraction: float) -> tuple[BatchStream, BatchStream]:
        """The training part and the held-out part (``0 < fraction < 1``): of a sharded folder, the last
        ``ceil(fraction * shards)`` whole shards are held out (at least one shard remains); of text, the
        last ``ceil(fraction * bytes)`` bytes of the capped stream, each part large enough for one window.

        >>> train, held = BatchStream.of(TextShards(max_bytes=1000), seq_len=8, seed=0).split(0.1)
        >>> train.source.byte_range, held.source.byte_range, train.fingerprint != held.fingerprint
        ((0, 900), (900, 1000), True)
        >>> held.describe()
        'the last 10% of the text stream of ... (100 B)'
        """
        parts = self.source.split(fraction)  # each source checks 0 < fraction < 1
        if isinstance(self.source, TextShards):
            sizes = [part.span[1] - part.span[0] for part in parts]
            if min(sizes) < self.seq_len + 1:
                raise UsageError(f"holding out {fraction:g} of the {sum(sizes):,} bytes of text leaves {sizes[0]:,} "
                                 f"to train on and {sizes[1]:,} held out; each part needs seq_len + 1 = "
                                 f"{self.seq_len + 1} bytes for one window: use more data, a shorter seq_len or "
                                 f"another fraction")
        train, held = (BatchStream(part, self.seq_len, self.seed, fraction) for part in parts)
        return train, held

    def describe(self) -> str:
        """The data in words, with the part a :meth:`split` gave (the first part, or the last: held out)."""
        source = self.source
        if isinstance(source, ShardedDataset):
            text = f"{len(source):,} samples of {self.seq_len} tokens in {source.folder}"
            if source.selected:
                count, total = len(source.shards), len(source.manifest.shards)
                text += f" ({'the first' if source.shards.start == 0 else 'the last'} {count} of {total} shards)"
            return text
        if source.byte_range is None:
            return f"{source.root} (up to {format_bytes(source.max_bytes)})"
        start, stop = source.byte_range
        if self.holdout is None:
            return f"bytes {start:,}..{stop - 1:,} of the text stream of {source.root}"
        share = 1 - self.holdout if start == 0 else self.holdout
        return (f"the {'first' if start == 0 else 'last'} {100 * share:g}% of the text stream of {source.root} "
                f"({format_bytes(stop - start)})")

    def check_position(self, position: dict[str, Any] | None) -> None:
        """Refuse a position saved from other data (other files or contents, seq_len or seed)."""
        if position is None:
            return
        kind, data = position.get("kind"), position.get("data")
        if kind != self.kind or data != self.fingerprint:
            saved, now = position.get("holdout"), self.holdout
            holdout = "" if saved == now else (
                f"; it was saved holding out {'nothing' if saved is None else saved} of the training data "
                f"(--eval-holdout), this run holds out {'nothing' if now is None else now}")
            older = "" if kind != "text" or all(position.get(k) == v for k, v in TEXT_FINGERPRINT.items()) else (
                " (the checkpoint was written by an older shardkit, whose text fingerprint hashed the folder's "
                "path, not the text: it never matches)")
            raise UsageError(f"the checkpoint's data position is for {kind} data {data!r}{older}, but this run "
                             f"reads {self.kind} data {self.fingerprint!r} ({self.describe()}, seq_len {self.seq_len}, "
                             f"seed {self.seed}){holdout}: resume with the same data, seq_len, seed and holdout, or "
                             f"start from the weights alone (--init-from an export)")

    def _position_base(self) -> dict[str, Any]:
        """What every position of this stream holds: the kind of data, its fingerprint, the holdout if any."""
        base: dict[str, Any] = {"kind": self.kind, "data": self.fingerprint}
        if self.kind == "text":
            base.update(TEXT_FINGERPRINT)
        if self.holdout is not None:
            base["holdout"] = self.holdout
        return base

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
                yield Batch(inputs, targets, {**self._position_base(), "batches": index + 1})

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
                            {**self._position_base(), "epoch": epoch, "position": loader.position})
            epoch, start = epoch + 1, 0


__all__ = ["Batch", "BatchStream"]
