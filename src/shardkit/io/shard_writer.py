"""Writing a sharded data folder from text, atomically: :func:`write_shards`.

The text of SRC (one text file, or a folder's text files in :class:`~shardkit.io.data.TextShards`'
sorted walk) is one byte stream: every file's bytes followed by a newline, the stream
``TextShards(SRC).stream`` would give uncapped. Its ``T`` bytes are cut into ``N`` files of
nearly equal size (shard ``i`` holds bytes ``i*T//N`` up to ``(i+1)*T//N``), so a document
may continue into the next shard.

Everything is written into a hidden sibling folder ``.OUT.partial-*``, the manifest last, and
that folder takes OUT's place only when complete (:class:`~shardkit.io.folders.FolderWrite`:
synced, swapped in one atomic step with a previous OUT, which is then deleted); an error removes
it. A run killed at any moment leaves OUT absent, the previous folder, or the new one, complete,
plus at most hidden leftovers that the next write to OUT clears. With ``overwrite`` a previous
OUT is replaced only when it holds nothing but a data folder's files (a file of the user's is
named and kept).

>>> import shutil, tempfile
>>> root = Path(tempfile.mkdtemp())
>>> _ = (root / "a.txt").write_text("hello")
>>> manifest = write_shards(root / "a.txt", root / "out", shards=2)
>>> [(s.name, s.size) for s in manifest.shards], (root / "out" / "shard-00001.bin").read_bytes()
([('shard-00000.bin', 3), ('shard-00001.bin', 3)], b'lo\\n')
>>> shutil.rmtree(root)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path

from ..plan.errors import UsageError
from .data import TextShards, decode_text
from .folders import FolderWrite
from .manifest import MANIFEST_NAME, Manifest, ShardFile, Source

#: ``progress(bytes_written, total_bytes)``, called after each source file.
Progress = Callable[[int, int], None]
#: What a data folder holds: what ``overwrite`` may replace.
DATA_FILES = re.compile(rf"shard-\d{{5,}}\.bin|{re.escape(MANIFEST_NAME)}")


def write_shards(src: str | Path, out: str | Path, shards: int, *, pattern: str = "*", overwrite: bool = False,
                 progress: Progress | None = None) -> Manifest:
    """Write ``shards`` shard files and ``manifest.json`` into the folder ``out``; returns the manifest.

    ``src`` is a text file or a folder of text files (``pattern`` filters a folder's file
    names). A non-empty ``out`` is refused unless ``overwrite``, and even then when it holds
    anything but a data folder's files. :class:`UsageError` names the argument and what would be valid.
    """
    src, out = Path(src), Path(out)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise UsageError(f"shards={shards!r}: give the number of shard files, an integer >= 1")
    if not src.exists():
        raise UsageError(f"SRC {str(src)!r} does not exist; give a text file or a folder of text files")
    write = FolderWrite(out, DATA_FILES.fullmatch)
    write.prepare(overwrite, f"OUT {str(out)!r}", f"OUT {str(out)!r} exists and is not empty; pass --overwrite "
                  f"(overwrite=True) to replace it, or choose another folder", (f"SRC {str(src)!r}", src))
    files = _text_files(src, pattern)
    total = sum(size + 1 for _, size in files)
    if shards > total:
        raise UsageError(f"shards={shards}: {str(src)!r} has {total} bytes of text (with a newline after each "
                         f"file), so valid shard counts are 1..{total}: every shard holds at least one byte")
    sizes = [(i + 1) * total // shards - i * total // shards for i in range(shards)]
    with write.open() as partial:
        written = _write_stream(partial, files, sizes, progress)
        manifest = Manifest(written, Source(str(src.resolve()), len(files), sum(size for _, size in files)))
        (partial / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def _text_files(src: Path, pattern: str) -> list[tuple[Path, int]]:
    """``(path, size)`` of each text file of ``src``, in walk order (each read once to check it is text)."""
    if src.is_file():
        found = [(src, len(data))] if (data := decode_text(src.read_bytes())) else []
    else:
        found = [(path, len(data)) for path, data in TextShards(src, pattern).texts()]
    if not found:
        raise UsageError(f"SRC {str(src)!r} has no text (pattern {pattern!r}; empty, binary and non-UTF-8 files "
                         f"are skipped); give a UTF-8 text file or a folder of them")
    return found


def _write_stream(folder: Path, files: list[tuple[Path, int]], sizes: list[int],
                  progress: Progress | None) -> tuple[ShardFile, ...]:
    sink = _ShardSink(folder, sizes)
    done, total = 0, sum(sizes)
    try:
        for path, size in files:
            data = path.read_bytes()
            if len(data) != size:
                raise UsageError(f"{path} changed while it was being sharded ({size} bytes, then {len(data)}); "
                                 f"run again when SRC is not being written")
            sink.write(data)
            sink.write(b"\n")
            done += size + 1
            if progress is not None:
                progress(done, total)
    finally:
        sink.close()
    return tuple(sink.written)


class _ShardSink:
    """One byte stream written into consecutive shard files of the given sizes, each hashed."""

    def __init__(self, folder: Path, sizes: list[int]):
        self.folder, self.sizes = folder, sizes
        self.digits = max(5, len(str(len(sizes) - 1)))
        self.written: list[ShardFile] = []
        self._open()

    def _open(self) -> None:
        self.name = f"shard-{len(self.written):0{self.digits}d}.bin"
        self.file = (self.folder / self.name).open("xb")
        self.hash, self.filled = hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            size = self.sizes[len(self.written)]
            piece, view = view[: size - self.filled], view[size - self.filled:]
            self.file.write(piece)
            self.hash.update(piece)
            self.filled += len(piece)
            if self.filled == size:
                self._finish_file()

    def _finish_file(self) -> None:
        self.close()
        self.written.append(ShardFile(self.name, self.filled, self.hash.hexdigest()))
        if len(self.written) < len(self.sizes):
            self._open()

    def close(self) -> None:
        self.file.close()

