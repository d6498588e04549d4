"""Byte-level language-model data from local text files, treated as a corpus of file shards.

The default corpus is the Python standard library's own source (``*.py`` under
``sysconfig.get_paths()["stdlib"]``): real text that every Python installation has, so
demos and tests need no download. Any folder of text files works the same way.

The byte stream is built lazily and capped (the first ``max_bytes`` of text in walk
order), so start-up stays fast however big the folder is. Batches are drawn with a seeded
generator, so every rank draws the same global batch and then takes its slice with
``ctx.shard_batch``. A part of the stream (``byte_range``, or :meth:`TextShards.split`)
draws its windows from that part only. :attr:`TextShards.digest` hashes the text the stream
holds (each file's name relative to the folder, its bytes read and those bytes), not the
folder's path: the same files anywhere give the same digest, other text another.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..plan import PlanError

if TYPE_CHECKING:  # imported where a stream is read: the command line shows DEFAULT_MAX_BYTES without torch
    import torch

DEFAULT_MAX_BYTES = 4 * 2**20
#: Directories never entered: caches, VCS metadata, and third-party packages under the stdlib.
SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
_SNIFF_BYTES = 8192


def stdlib_root() -> Path:
    """The folder holding this interpreter's standard-library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def decode_text(data: bytes) -> bytes | None:
    """``data`` if it is UTF-8 text (no NUL bytes, decodes cleanly), else ``None``."""
    if b"\0" in data[:_SNIFF_BYTES]:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


class TextShards:
    """Text files under ``root`` matching ``pattern``, as one capped byte stream.

    ``root=None`` means the standard library sources (``pattern`` defaults to ``*.py``
    there, to ``*`` elsewhere). Files are visited in a sorted walk (files of a folder
    before its sub-folders, names sorted), so the stream is the same on every machine
    with the same files. Binary or non-UTF-8 files are skipped. ``byte_range=(start, stop)``
    draws every window from bytes ``start .. stop - 1`` of the stream (default: all of it).

    >>> shards = TextShards(max_bytes=4096)
    >>> x, y = next(shards.batches(seq_len=8, batch_size=2, seed=0, steps=1))
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([2, 8]), True)
    """

    def __init__(self, root: str | Path | None = None, pattern: str | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, byte_range: tuple[int, int] | None = None):
        if max_bytes < 2:
            raise PlanError(f"max_bytes={max_bytes}: the data stream needs at least 2 bytes; use e.g. {DEFAULT_MAX_BYTES}")
        if byte_range is not None and not 0 <= byte_range[0] < byte_range[1] <= max_bytes:
            raise PlanError(f"byte_range={byte_range}: valid: (start, stop) with 0 <= start < stop <= "
                            f"max_bytes={max_bytes}")
        self.root = stdlib_root() if root is None else Path(root)
        self.pattern = pattern or ("*.py" if root is None else "*")
        self.max_bytes = max_bytes
        self.byte_range = byte_range
        self._stream: torch.Tensor | None = None
        self._digest: str | None = None

    def __getstate__(self) -> dict:
        # each process rebuilds the stream and its digest from what it reads: send paths, not bytes
        return {**self.__dict__, "_stream": None, "_digest": None}

    def __repr__(self) -> str:
        part = "" if self.byte_range is None else f", byte_range={self.byte_range}"
        return f"TextShards({str(self.root)!r}, pattern={self.pattern!r}, max_bytes={self.max_bytes}{part})"

    def files(self) -> Iterator[Path]:
        """Every file under ``root`` matching ``pattern``, in sorted walk order (lazy)."""
        if not self.root.is_dir():
            raise PlanError(f"data folder {str(self.root)!r} does not exist or is not a folder; "
                            f"pass --data with a folder of text files, or omit it to use the Python standard library")
        for folder, dirs, names in os.walk(self.root):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("."))
            for name in sorted(names):
                if fnmatch.fnmatch(name, self.pattern) and not name.startswith("."):
                    yield Path(folder, name)

    def texts(self) -> Iterator[tuple[Path, bytes]]:
        """``(path, content)`` of each text file, skipping binary and undecodable ones."""
        for path in self.files():
            try:
                data = decode_text(path.read_bytes())
            except OSError:
                continue
            if data:
                yield path, data

    def check(self) -> Path:
        """The first text file; raises :class:`PlanError` when there is none (reads one file, not all)."""
        for path, _ in self.texts():
            return path
        raise PlanError(f"data folder {str(self.root)!r} has no text files matching {self.pattern!r} "
                        f"(binary and non-UTF-8 files are skipped); point --data at a folder of text files")

    @property
    def stream(self) -> torch.Tensor:
        """The corpus as one uint8 tensor: files joined by newlines, cut at ``max_bytes``."""
        import torch

        if self._stream is None:
            buffer, size = [], 0
            digest = hashlib.sha256()
            for path, data in self.texts():
                piece = data[: self.max_bytes - size]
                digest.update(f"{path.relative_to(self.root).as_posix()}\0{len(piece)}\0".encode())
                digest.update(piece)
                buffer.append(piece)
                size += len(piece)
                if size >= self.max_bytes:
                    break
                buffer.append(b"\n")
                size += 1
            if not buffer:
                self.check()
            self._stream = torch.frombuffer(bytearray(b"".join(buffer)), dtype=torch.uint8)
            self._digest = digest.hexdigest()
        return self._stream

    @property
    def digest(self) -> str:
        """The sha256 (hex) of the text :attr:`stream` holds, file by file in walk order: each file's path
        relative to ``root``, the number of its bytes read and those bytes (reads the stream once).

        The same files reached by another path give the same digest; changed text gives another.
        """
        _ = self.stream  # built with its digest
        assert self._digest is not None
        return self._digest

    @property
    def span(self) -> tuple[int, int]:
        """The bytes ``(start, stop)`` of :attr:`stream` that windows are drawn from (reads the stream)."""
        return (0, self.stream.numel()) if self.byte_range is None else self.byte_range

    def split(self, fraction: float) -> tuple[TextShards, TextShards]:
        """This span cut in two: the first part, and the last ``ceil(fraction * bytes)`` bytes
        (held out); ``0 < fraction < 1``. No window of one part reads a byte of the other.

        >>> first, last = TextShards(max_bytes=1000).split(0.1)
        >>> first.byte_range, last.byte_range
        ((0, 900), (900, 1000))
        """
        if not 0 < fraction < 1:
            raise PlanError(f"split(fraction={fraction!r}): valid: a number between 0 and 1 (exclusive)")
        start, stop = self.span
        cut = stop - math.ceil(fraction * (stop - start))
        parts = (TextShards(self.root, self.pattern, self.max_bytes, (start, cut)),
                 TextShards(self.root, self.pattern, self.max_bytes, (cut, stop)))
        for part in parts:
            part._stream, part._digest = self._stream, self._digest  # read once, shared (never pickled)
        return parts

    def batches(self, seq_len: int, batch_size: int, seed: int, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``steps`` batches of ``(inputs, targets)``, int64 ``[batch_size, seq_len]``.

        Each row is a random window of :attr:`span` (``seq_len + 1`` bytes, all inside it);
        ``targets`` is ``inputs`` shifted by one byte. The same ``seed`` gives the same batches
        in every process.
        """
        import torch

        if seq_len < 1 or batch_size < 1 or steps < 0:
            raise PlanError(f"batches(seq_len={seq_len}, batch_size={batch_size}, steps={steps}): "
                            f"seq_len and batch_size must be >= 1 and steps >= 0")
        stream = self.stream
        start, stop = self.span
        if stop > stream.numel():
            raise PlanError(f"byte_range={self.byte_range}: the data stream has only {stream.numel()} bytes "
                            f"({self.root})")
        windows = stop - start - seq_len
        if windows < 1:
            valid = (f"valid: seq_len <= {stop - start - 1}, or more data" if stop - start >= 2 else
                     "too few for any seq_len (a window needs at least 2 bytes): give more text")
            raise PlanError(f"the data stream of {str(self.root)!r} has {stop - start} bytes (max_bytes="
                            f"{self.max_bytes}), too few for seq_len={seq_len} (a window is seq_len + 1 bytes); {valid}")
        generator = torch.Generator().manual_seed(seed)
        offsets = torch.arange(seq_len + 1)
        for _ in range(steps):
            starts = torch.randint(start, start + windows, (batch_size, 1), generator=generator)
            rows = stream[starts + offsets].long()
            yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
