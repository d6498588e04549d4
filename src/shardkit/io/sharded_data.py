"""A sharded data folder as language-model samples in an order that survives a change of the
data-parallel degree: :class:`ShardedDataset` and its :class:`Loader`.

- **Samples.** Shard ``s`` of ``n`` tokens gives ``(n - 1) // seq_len`` samples; its sample
  ``k`` is the ``seq_len + 1`` tokens starting at ``k * seq_len`` (inputs are the first
  ``seq_len``, targets the last ``seq_len``, so every token after the first is a target once).
  A sample never crosses into the next shard. Global sample indices number shard 0's samples,
  then shard 1's, and so on, so the count is known from the manifest alone.
- **Order.** Epoch ``e`` visits every sample once, in the permutation
  :func:`~shardkit.io.order.epoch_order` of ``(seed, e)``: a function of the seed, the
  epoch and the number of samples only, never of how many ranks read it.
- **Position.** The state of a run is ``(epoch, position)``: how many samples of the epoch's
  order all ranks together have consumed. Global batch ``b`` of a loader started at position
  ``p`` is order positions ``p + b*G .. p + (b+1)*G - 1``; rank ``r`` of ``R`` takes the
  contiguous slice ``r*G/R .. (r+1)*G/R - 1`` of it (as ``Context.shard_batch`` slices a batch).
  Resuming at a saved position with any degree that divides ``G`` continues the same order.
- **Selection.** ``shards=range(a, b)`` reads only those shards of the manifest (their samples
  numbered from 0 as above); :meth:`ShardedDataset.split` holds out the last whole shards.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..plan.errors import UsageError
from .manifest import check_checksums, check_folder, read_manifest
from .order import epoch_order

_MAX_U64 = 2**64 - 1


def samples_in(tokens: int, seq_len: int) -> int:
    """The samples a shard of ``tokens`` tokens gives: windows of ``seq_len + 1`` starting every ``seq_len``.

    >>> samples_in(9, 4), samples_in(8, 4), samples_in(1, 4)
    (2, 1, 0)
    """
    return max(0, (tokens - 1) // seq_len)


class ShardedDataset:
    """The samples of a folder written by ``shardkit data shard`` (or :func:`~shardkit.io.shard_writer.write_shards`).

    Opening checks the manifest and every shard's size; a shard's sha256 is checked the first
    time this process reads it (``verify()`` checks them all now). Shards are read through
    ``numpy.memmap``, never whole. It pickles as the folder, the manifest and the settings.

    >>> import shutil, tempfile
    >>> from shardkit.io.shard_writer import write_shards
    >>> root = Path(tempfile.mkdtemp())
    >>> _ = (root / "a.txt").write_text("the quick brown fox jumps over the lazy dog")
    >>> _ = write_shards(root / "a.txt", root / "out", shards=2)
    >>> ds = ShardedDataset(root / "out", seq_len=4, seed=1)
    >>> len(ds)                                     # shards of 22 tokens: (22 - 1) // 4 = 5 samples each
    10
    >>> bytes(ds.samples([0, 5]).flatten().tolist())  # 5 tokens each: shard 0's first, shard 1's first
    b'the qmps o'
    >>> ds.order(epoch=0).tolist()
    [4, 3, 2, 7, 8, 6, 1, 0, 9, 5]
    >>> for indices, tokens in ds.loader(global_batch=4, rank=1, ranks=2):  # order positions 2-3, 6-7
    ...     print(indices.tolist(), tuple(tokens.shape))
    [2, 7] (2, 5)
    [1, 0] (2, 5)
    >>> shutil.rmtree(root)
    """

    def __init__(self, folder: str | Path, seq_len: int = 128, seed: int = 0, shards: range | None = None):
        seq_len = _integer("seq_len", seq_len, 1, None, "tokens per sample (inputs), an integer >= 1")
        seed = _integer("seed", seed, 0, _MAX_U64, f"an integer in 0..{_MAX_U64}")
        self.folder, self.seq_len, self.seed = Path(folder), seq_len, seed
        self.manifest = read_manifest(self.folder)
        count = len(self.manifest.shards)
        if shards is not None and not (isinstance(shards, range) and shards.step == 1
                                       and 0 <= shards.start < shards.stop <= count):
            raise UsageError(f"ShardedDataset: shards={shards!r} is not valid; valid: range(a, b) with "
                             f"0 <= a < b <= {count} (the folder's shards)")
        #: the manifest indices of the shards read (``None`` given: all of them)
        self.shards = range(count) if shards is None else shards
        self.selected = shards is not None
        counts = [samples_in(self.manifest.shards[shard].tokens, seq_len) for shard in self.shards]
        #: the global index of each selected shard's first sample, then the number of samples
        self.first_sample = np.cumsum([0, *counts])
        if len(self) == 0:
            raise UsageError(self._too_short(seq_len))
        self._tokens: dict[int, np.memmap] = {}

    def _too_short(self, seq_len: int) -> str:
        """Why no shard gives a sample of ``seq_len + 1`` tokens, and the longest ``seq_len`` that would."""
        tokens = [self.manifest.shards[shard].tokens for shard in self.shards]
        which = f"selected shards {self.shards.start}..{self.shards.stop - 1}" if self.selected else "shards"
        found = (f"seq_len={seq_len}: the longest shard of {str(self.folder)!r} (of its {len(tokens)} {which}, "
                 f"{sum(tokens):,} tokens in all) has {max(tokens)} tokens, too few for one sample of seq_len + 1 "
                 f"tokens")
        if max(tokens) >= 2:
            return f"{found}; valid: seq_len < {max(tokens)} (at most {max(tokens) - 1}), or write fewer, larger shards"
        total = self.manifest.total_bytes
        fewer = (f"write the folder again with fewer shards (with --shards 1, seq_len up to {total - 1})"
                 if total >= 2 else "write it again from more text")
        return f"{found}, and no seq_len fits (a sample needs at least 2 tokens): {fewer}"

    def __len__(self) -> int:
        """Samples per epoch."""
        return int(self.first_sample[-1])

    def __repr__(self) -> str:
        part = f", shards={self.shards!r}" if self.selected else ""
        return (f"ShardedDataset({str(self.folder)!r}, seq_len={self.seq_len}, seed={self.seed}{part}): "
                f"{len(self)} samples from {len(self.shards)} shards")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": {}}  # each process maps (and checks) the files itself

    @property
    def fingerprint(self) -> str:
        """What the samples and their order depend on (every shard's name, size and sha256, ``seq_len``,
        ``seed`` and the selected shards), hashed to 16 hex digits: store it with a position, compare it
        on resume."""
        shards = [(shard.name, shard.size, shard.sha256) for shard in self.manifest.shards]
        fields = {"shards": shards, "seq_len": self.seq_len, "seed": self.seed}
        if self.selected:
            fields["selected"] = [self.shards.start, self.shards.stop]
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]

    def split(self, fraction: float) -> tuple[ShardedDataset, ShardedDataset]:
        """The selected shards in two: the first ones, and the last ``ceil(fraction * shards)`` (at least
        one, held out); ``0 < fraction < 1``, and at least one shard must remain in the first part.
        Samples never cross shards, so the parts share none.

        >>> import shutil, tempfile
        >>> from shardkit.io.shard_writer import write_shards
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = (root / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 4)
        >>> _ = write_shards(root / "a.txt", root / "out", shards=4)
        >>> train, held = ShardedDataset(root / "out", seq_len=4).split(0.25)
        >>> train.shards, held.shards, len(train) + len(held) == len(ShardedDataset(root / "out", seq_len=4))
        (range(0, 3), range(3, 4), True)
        >>> shutil.rmtree(root)
        """
        count = len(self.shards)
        if not 0 < fraction < 1:
            raise UsageError(f"split(fraction={fraction!r}): valid: a number between 0 and 1 (exclusive)")
        held = math.ceil(fraction * count)
        if held >= count:
            valid = f"a fraction <= {(count - 1) / count:.3g}, or" if count > 1 else "a folder of"
            raise UsageError(f"holding out {fraction:g} of the {count} shard(s) of {str(self.folder)!r} holds out "
                             f"{held}, leaving none to train on; valid: {valid} more shards ('shardkit data shard "
                             f"--shards N')")
        cut = self.shards.stop - held
        return (ShardedDataset(self.folder, self.seq_len, self.seed, range(self.shards.start, cut)),
                ShardedDataset(self.folder, self.seq_len, self.seed, range(cut, self.shards.stop)))

    def order(self, epoch: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The global sample indices at order positions ``start .. stop - 1`` of ``epoch`` (int64).

        ``stop`` defaults to the end of the epoch.
        """
        call = f"order(epoch={epoch}, start={start}, stop={stop})"
        epoch = _integer("epoch", epoch, 0, _MAX_U64, "0, 1, 2, ...", call)
        stop = len(self) if stop is None else _integer("stop", stop, 0, len(self), f"0..{len(self)}", call)
        start = _integer("start", start, 0, stop, f"0..stop={stop}", call)
        return torch.from_numpy(epoch_order(len(self), self.seed, epoch, start, stop))

    def samples(self, indices: torch.Tensor | list[int]) -> torch.Tensor:
        """The samples at global ``indices``: int64 ``[len(indices), seq_len + 1]``."""
        wanted = np.asarray(indices, dtype=np.int64).reshape(-1)
        if wanted.size and (wanted.min() < 0 or wanted.max() >= len(self)):
            raise UsageError(f"samples(indices): valid indices are 0..{len(self) - 1}, got {wanted.min()}..{wanted.max()}")
        shards = np.searchsorted(self.first_sample, wanted, side="right") - 1
        rows = np.empty((wanted.size, self.seq_len + 1), dtype=np.uint8)
        for row, (shard, index) in enumerate(zip(shards.tolist(), wanted.tolist())):
            start = (index - int(self.first_sample[shard])) * self.seq_len
            rows[row] = self._shard_tokens(self.shards[shard])[start: start + self.seq_len + 1]
        return torch.from_numpy(rows).long()

    def loader(self, global_batch: int, rank: int = 0, ranks: int = 1, position: int = 0,
               epoch: int = 0) -> Loader:
        """Rank ``rank`` of ``ranks``'s part of each global batch of ``global_batch`` samples,
        from order ``position`` of ``epoch`` to the epoch's end (a last batch of fewer than
        ``global_batch`` samples is dropped). ``global_batch`` must split evenly over ``ranks``.
        """
        call = f"loader(global_batch={global_batch}, rank={rank}, ranks={ranks}, position={position}, epoch={epoch})"
        ranks = _integer("ranks", ranks, 1, None, "the data-parallel degree, an integer >= 1", call)
        rank = _integer("rank", rank, 0, ranks - 1, f"0..{ranks - 1} (ranks={ranks})", call)
        global_batch = _integer("global_batch", global_batch, 1, len(self),
                                f"1..{len(self)} (the samples of an epoch)", call)
        if global_batch % ranks:
            raise UsageError(f"{call}: {split_problem(global_batch, ranks)}")
        epoch = _integer("epoch", epoch, 0, _MAX_U64, "0, 1, 2, ...", call)
        position = _integer("position", position, 0, len(self),
                            f"0..{len(self)} (samples of the epoch already consumed by all ranks)", call)
        return Loader(self, global_batch, rank, ranks, position, epoch)

    def verify(self) -> None:
        """Check every shard's size and sha256 against the manifest now (reads all the data once;
        reads that follow in this process are not checked again)."""
        check_folder(self.folder, self.manifest)
        check_checksums(self.folder, self.manifest.shards)
        self._tokens = {shard: self._map(shard) for shard in range(len(self.manifest.shards))}

    def _shard_tokens(self, shard: int) -> np.memmap:
        """Shard ``shard``'s tokens, mapped on first use after its sha256 is checked."""
        tokens = self._tokens.get(shard)
        if tokens is None:
            check_checksums(self.folder, (self.manifest.shards[shard],))
            tokens = self._tokens[shard] = self._map(shard)
        return tokens

    def _map(self, shard: int) -> np.memmap:
        return np.memmap(self.folder / self.manifest.shards[shard].name, dtype=np.uint8, mode="r")


class Loader:
    """Iterating yields ``(indices, tokens)`` for each global batch left in the epoch: this
    rank's ``global_batch // ranks`` global sample indices (int64) and their samples
    (int64 ``[global_batch // ranks, seq_len + 1]``; inputs ``tokens[:, :-1]``, targets
    ``tokens[:, 1:]``). ``len()`` is the number of global batches left.

    ``position`` is the global position after the batches handed out so far: save it (with
    the epoch) in a checkpoint taken after training on the last batch received, and resume
    with ``dataset.loader(..., position=saved)``, with any number of ranks.
    """

    def __init__(self, dataset: ShardedDataset, global_batch: int, rank: int, ranks: int, position: int,
                 epoch: int):
        self.dataset, self.global_batch, self.rank, self.ranks = dataset, global_batch, rank, ranks
        self.start = self.position = position
        self.epoch = epoch

    def __len__(self) -> int:
        return (len(self.dataset) - self.start) // self.global_batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        local = self.global_batch // self.ranks
        self.position = self.start
        for batch in range(len(self)):
            first = self.start + batch * self.global_batch + self.rank * local
            indices = self.dataset.order(self.epoch, first, first + local)
            self.position = self.start + (batch + 1) * self.global_batch
            yield indices, self.dataset.samples(indices)


def split_problem(global_batch: int, ranks: int) -> str:
    """Why ``global_batch`` does not split over ``ranks``, with the valid sizes near it.

    >>> split_problem(12, 5)
    'global_batch=12 does not split over ranks=5; valid global batches near 12: 10, 15; valid ranks for global_batch=12: 1, 2, 3, 4, 6, 12'
    """
    below = global_batch - global_batch % ranks
    near = [size for size in (below, below + ranks) if size >= 1]
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    return (f"global_batch={global_batch} does not split over ranks={ranks}; valid global batches near "
            f"{global_batch}: {', '.join(map(str, near))}; valid ranks for global_batch={global_batch}: "
            f"{', '.join(map(str, divisors))}")


def _integer(name: str, value: object, low: int, high: int | None, valid: str, call: str = "ShardedDataset") -> int:
    """``value`` as an int in ``low..high``, else :class:`UsageError` naming ``name`` and ``valid``."""
    try:
        number = operator.index(value)  # ints and numpy/torch integers; not floats
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < low or (high is not None and number > high):
        raise UsageError(f"{call}: {name}={value!r} is not valid; valid: {valid}")
    return number
