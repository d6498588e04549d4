"""The header that goes ahead of a tensor whose shape and dtype the other side does not know.

One fixed-size ``int64`` tensor: the number of dims, the dtype's index in :data:`DTYPES` (``-1``
for another dtype) and the shape, padded with zeros to :data:`MAX_DIMS`. The pipeline sends
it point-to-point before a stage's output (:mod:`shardkit.runtime.p2p`), so the next stage can
allocate the buffer to receive into; the replica-group collectives all-gather it to check that
every member passed the same shape and dtype (:mod:`shardkit.runtime.collectives`).

>>> header = encode(torch.zeros(2, 3))
>>> decode(header), describe(header)
(((2, 3), torch.float32), '(2, 3) torch.float32')
"""

from __future__ import annotations

import torch

from ..plan.dtypes import HEADER

#: dtypes a header names, by index (:data:`shardkit.plan.dtypes.HEADER`).
DTYPES = tuple(getattr(torch, name) for name in HEADER)
#: The most dims a header holds.
MAX_DIMS = 16
#: The length of a header.
LENGTH = 2 + MAX_DIMS


def encode(tensor: torch.Tensor) -> torch.Tensor:
    """The header of ``tensor``, on its device. Raises ``ValueError`` beyond :data:`MAX_DIMS` dims."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"a tensor of {tensor.dim()} dims has no header (at most {MAX_DIMS} dims)")
    values = [tensor.dim(), DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else -1, *tensor.shape]
    return torch.tensor(values + [0] * (LENGTH - len(values)), dtype=torch.int64, device=tensor.device)


def empty(device: torch.device) -> torch.Tensor:
    """A buffer to receive a header into."""
    return torch.empty(LENGTH, dtype=torch.int64, device=device)


def decode(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype | None]:
    """``(shape, dtype)`` of a header (``None``: a dtype outside :data:`DTYPES`)."""
    dims, code, *shape = header.tolist()
    return tuple(shape[:dims]), DTYPES[code] if code >= 0 else None


def describe(header: torch.Tensor) -> str:
    """``"(2, 3) torch.float32"``, for messages."""
    shape, dtype = decode(header)
    return f"{shape} {dtype if dtype is not None else 'another dtype'}"


__all__ = ["DTYPES", "LENGTH", "MAX_DIMS", "decode", "describe", "empty", "encode"]
