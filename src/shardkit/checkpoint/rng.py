"""A process's random-number-generator states, as JSON, so a resumed run draws what it would have.

Captured per rank: torch's CPU generator, every CUDA device's generator (when CUDA is
available), Python's ``random`` and numpy's global ``np.random`` state. Generators a program
creates itself (``torch.Generator()``, ``np.random.default_rng()``) are its own to save, in
``extra``; a shardkit data loader needs none (its order is a function of seed, epoch and
position).

>>> state = capture()
>>> first = (torch.rand(2), random.random(), float(np.random.rand()))
>>> restore(state)
>>> again = (torch.rand(2), random.random(), float(np.random.rand()))
>>> torch.equal(first[0], again[0]) and first[1:] == again[1:]
True
"""

from __future__ import annotations

import base64
import hashlib
import random
from typing import Any

import numpy as np
import torch


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture() -> dict[str, Any]:
    """This process's generator states, JSON-able."""
    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "torch": _encode(torch.get_rng_state()),
        "cuda": [_encode(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), position, has_gauss, cached],
    }


def restore(state: dict[str, Any]) -> None:
    """Set this process's generators to ``state`` (from :func:`capture`). CUDA generators are set
    when this process sees as many devices as were saved; otherwise they are left as they are."""
    torch.set_rng_state(_decode(state["torch"]))
    cuda = state["cuda"]
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all([_decode(s) for s in cuda])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))


def reseed(step: int, rank: int) -> int:
    """Seed every generator from ``(step, rank)`` alone (a rank the checkpoint has no state for);
    returns the seed.

    >>> reseed(100, 5) == reseed(100, 5) != reseed(100, 6)
    True
    """
    seed = int.from_bytes(hashlib.sha256(f"shardkit rng {step} {rank}".encode()).digest()[:8], "little")
    torch.manual_seed(seed)  # CUDA generators too
    random.seed(seed)
    np.random.seed(seed % 2**32)
    return seed


__all__ = ["capture", "reseed", "restore"]
