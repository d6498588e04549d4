"""The order of an epoch's samples: a seeded permutation, computed position by position.

``epoch_order(n, seed, epoch, start, stop)`` is the sample index at each order position in
``[start, stop)``. It is a bijection of ``range(n)`` that depends only on ``(n, seed, epoch)``:
a 6-round Feistel network over the smallest even number of bits that holds ``n``, keyed by
``splitmix64`` of the seed and epoch, with cycle walking (an output ``>= n`` is permuted
again until it lands in range). Nothing is stored, so any stretch of an epoch costs the same
whatever ``n`` is, and the arithmetic is this module's own (64-bit integers), so the order
does not change with the numpy or torch version.

>>> epoch_order(10, seed=1, epoch=0).tolist()
[4, 3, 2, 7, 8, 6, 1, 0, 9, 5]
>>> epoch_order(10, seed=1, epoch=0, start=3, stop=5).tolist()
[7, 8]
>>> sorted(epoch_order(10, seed=1, epoch=1).tolist()) == list(range(10))
True
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_U64 = np.uint64


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Sebastiano Vigna's splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def round_keys(seed: int, epoch: int) -> np.ndarray:
    """One 64-bit key per Feistel round, from ``seed`` and ``epoch`` (both in ``0 .. 2**64 - 1``)."""
    base = _splitmix64(_splitmix64(np.array([seed], dtype=_U64)) ^ _U64(epoch))
    return _splitmix64(base + np.arange(ROUNDS, dtype=_U64))


def _feistel(x: np.ndarray, keys: np.ndarray, half: int) -> np.ndarray:
    """A bijection of ``range(4**half)``: ``x`` split into two ``half``-bit halves, mixed per round."""
    mask = _U64((1 << half) - 1)
    left, right = x >> _U64(half), x & mask
    for key in keys:
        left, right = right, left ^ (_splitmix64(right ^ key) & mask)
    return (left << _U64(half)) | right


def epoch_order(n: int, seed: int, epoch: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The sample indices (int64) at order positions ``start .. stop - 1`` of epoch ``epoch``.

    ``0 <= start <= stop <= n`` (``stop`` defaults to ``n``); the caller checks the arguments.
    """
    stop = n if stop is None else stop
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 4**half >= n, and < 4n: few walks per position
    keys = round_keys(seed, epoch)
    out = _feistel(np.arange(start, stop, dtype=_U64), keys, half)
    outside = out >= _U64(n)
    while outside.any():  # cycle walking: each position's cycle returns to range(n)
        out[outside] = _feistel(out[outside], keys, half)
        outside = out >= _U64(n)
    return out.astype(np.int64)
