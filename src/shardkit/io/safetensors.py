"""The safetensors format, read box by box and written tensor by tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``) and the
tensors' raw bytes, row-major, little-endian.

Why our own reader and writer rather than the ``safetensors`` package's: its torch loader maps
each whole file as one torch storage (``UntypedStorage.from_file``), so a box is a view into a
mapping of the whole file, and its writer takes every tensor at once. Here a rank reads only the
bytes of the boxes it holds (``os.pread``, one run of contiguous bytes at a time), into a tensor
of the box's size, and an export writes one tensor at a time, never holding a whole file.
Files written here are read by ``safetensors`` and ``transformers``, and the other way round.

>>> import tempfile, torch
>>> path = tempfile.mkdtemp() + "/t.safetensors"
>>> with SafetensorsWriter(path, {"w": ((2, 3), torch.float32)}) as out:
...     out.write("w", torch.arange(6.).reshape(2, 3))
>>> SafetensorsFile(path).read("w", (slice(0, 2), slice(1, 3)))
tensor([[1., 2.],
        [4., 5.]])
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..plan import UsageError
from ..plan.dtypes import SAFETENSORS, available

#: safetensors' dtype codes -> the torch dtypes this torch has (:data:`shardkit.plan.dtypes.SAFETENSORS`).
DTYPES = {code: getattr(torch, name) for code, name in SAFETENSORS.items() if name in available(SAFETENSORS.values())}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20


class SafetensorsError(UsageError):
    """A safetensors file that cannot be read or written as asked: the file and the reason."""


class SafetensorsFile:
    """One safetensors file: its header read at once, its tensors read box by box.

    ``tensors``: ``{name: (shape, dtype)}``; ``metadata``: the header's ``__metadata__``.
    A header that does not describe the file (offsets past its end, sizes that do not match the
    shapes, tensors overlapping) raises :class:`SafetensorsError` naming the file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._offsets: dict[str, int] = {}
        header = self._header()
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_size = self.path.stat().st_size - self._start
        spans = []
        for name, entry in header.items():
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = tuple(int(s) for s in entry["shape"])
                begin, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._error(f"tensor {name!r} has no valid dtype, shape and data_offsets: {entry!r}") from None
            size = math.prod(shape) * _itemsize(dtype)
            if end - begin != size or begin < 0 or end > data_size:
                raise self._error(f"tensor {name!r} ({entry['dtype']} {list(shape)}, {size} bytes) is given bytes "
                                  f"{begin}..{end} of {data_size}: the file is truncated or its header damaged")
            self.tensors[name] = (shape, dtype)
            self._offsets[name] = self._start + begin
            spans.append((begin, end, name))
        spans.sort()
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                raise self._error(f"tensors {first!r} and {second!r} overlap in the file")

    def _error(self, reason: str) -> SafetensorsError:
        return SafetensorsError(f"{self.path}: {reason}")

    def _header(self) -> dict[str, Any]:
        try:
            with open(self.path, "rb") as file:
                prefix = file.read(8)
                if len(prefix) < 8:
                    raise self._error("shorter than a safetensors header (8 bytes of length)")
                (length,) = struct.unpack("<Q", prefix)
                if length > _MAX_HEADER:
                    raise self._error(f"header length {length} bytes is not plausible: not a safetensors file")
                raw = file.read(length)
        except OSError as error:
            raise self._error(f"cannot be read ({error.strerror})") from None
        if len(raw) < length:
            raise self._error("the header is cut short: the file is truncated")
        try:
            header = json.loads(raw)
        except ValueError as error:
            raise self._error(f"the header is not JSON ({error}): not a safetensors file, or damaged") from None
        if not isinstance(header, dict):
            raise self._error("the header is not a JSON object")
        self._start = 8 + length
        return header

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Box ``box`` (one ``slice(start, stop)`` per dim; all of it by default) of tensor ``name``.

        Reads only those bytes: one read per run of contiguous bytes (the box's leading dims
        that do not cover the whole tensor times one run)."""
        shape, dtype = self.tensors[name]
        box = box or tuple(slice(0, n) for n in shape)
        sizes = [s.stop - s.start for s in box]
        out = torch.empty(sizes, dtype=dtype)
        if out.numel() == 0:
            return out
        item = _itemsize(dtype)
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        whole = len(shape)  # the box covers every dim from ``whole`` on
        while whole > 0 and sizes[whole - 1] == shape[whole - 1]:
            whole -= 1
        if whole == 0:
            runs = [0]  # the whole tensor is one run
            length = out.numel() * item
        else:  # one run per index of the dims before the last partial one
            last = whole - 1
            length = sizes[last] * strides[last] * item
            runs = [sum(i * strides[d] for d, i in enumerate(index)) + box[last].start * strides[last]
                    for index in _leading(box[:last])]
        buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for k, start in enumerate(runs):
                if os.preadv(fd, [buffer[k * length:(k + 1) * length]], self._offsets[name] + start * item) != length:
                    raise self._error(f"tensor {name!r}: the file ended while reading (truncated after it was opened?)")
        finally:
            os.close(fd)
        return out


def _leading(box: tuple[slice, ...]):
    """Every index tuple in the box (row-major); one empty tuple for no dims."""
    if not box:
        yield ()
        return
    for i in range(box[0].start, box[0].stop):
        for rest in _leading(box[1:]):
            yield (i, *rest)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor: the header (every name, dtype and shape,
    given up front) first, then each tensor's bytes as it comes, in the order given.

    Use as a context manager; leaving it checks every tensor was written (a partial file is
    removed). ``metadata``: string pairs for the header's ``__metadata__``.
    """

    def __init__(self, path: str | Path, tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 metadata: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, (shape, dtype) in tensors.items():
            size = math.prod(shape) * _itemsize(dtype)
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._order = list(tensors)
        self._expected = dict(tensors)
        self._next = 0
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor, in the order given to the constructor, with its shape and dtype."""
        if self._next >= len(self._order) or self._order[self._next] != name:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing"
            raise SafetensorsError(f"{self.path}: {name!r} written out of order; expected {expected!r}")
        shape, dtype = self._expected[name]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise SafetensorsError(f"{self.path}: {name!r} is {tensor.dtype} {list(tensor.shape)}; the header says "
                                   f"{dtype} {list(shape)}")
        data = tensor.detach().cpu().contiguous()
        self._file.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        self._file.close()
        if kind is not None or self._next != len(self._order):
            self.path.unlink(missing_ok=True)
            if kind is None:
                raise SafetensorsError(f"{self.path}: {len(self._order) - self._next} tensor(s) never written, "
                                       f"from {self._order[self._next]!r}; the partial file was removed")


__all__ = ["DTYPES", "SafetensorsError", "SafetensorsFile", "SafetensorsWriter"]
