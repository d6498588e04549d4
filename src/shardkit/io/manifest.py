"""The manifest of a sharded data folder, and the checks that the folder is what it says.

A folder written by ``shardkit data shard`` holds ``shard-00000.bin``, ``shard-00001.bin``, ...
(raw bytes: one byte is one token, vocabulary 256) and ``manifest.json``::

    {"format": "shardkit.bytes", "version": 1, "dtype": "uint8",
     "source": {"path": "/data/corpus", "files": 50, "bytes": 3750000000},
     "total_bytes": 3750000000, "total_tokens": 3750000000,
     "shards": [{"name": "shard-00000.bin", "bytes": 75000000, "tokens": 75000000,
                 "sha256": "9f86d0..."}, ...]}

:func:`check_folder` compares the folder with its manifest by file sizes (cheap: one ``stat``
per file); :func:`check_checksums` reads files and compares their sha256.

>>> manifest = Manifest((ShardFile("shard-00000.bin", 5, hashlib.sha256(b"hello").hexdigest()),),
...                     Source("/tmp/hello.txt", files=1, bytes=4))
>>> Manifest.from_json(manifest.to_json(), "example") == manifest
True
>>> manifest.total_bytes
5
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..plan.errors import UsageError
from .folders import interrupted_replacement

FORMAT = "shardkit.bytes"
VERSION = 1
DTYPE = "uint8"
MANIFEST_NAME = "manifest.json"
_HASH_CHUNK = 2**20
_REWRITE = "write the folder again with 'shardkit data shard SRC OUT --shards N'"


class DataError(UsageError):
    """A data folder that is not what its manifest says: no readable manifest, or a shard file
    missing, of the wrong size, with the wrong checksum, or not in the manifest. The message
    names the folder and every file concerned."""


@dataclass(frozen=True)
class ShardFile:
    """One shard file: its name in the folder, its size in bytes and its sha256 (hex)."""

    name: str
    size: int
    sha256: str

    @property
    def tokens(self) -> int:
        """Tokens in the file: one byte is one token."""
        return self.size


@dataclass(frozen=True)
class Source:
    """What a folder was written from: the path given as SRC, its text files and their bytes."""

    path: str
    files: int
    bytes: int


@dataclass(frozen=True)
class Manifest:
    """The shard files in order, and what they were written from."""

    shards: tuple[ShardFile, ...]
    source: Source

    @property
    def total_bytes(self) -> int:
        return sum(shard.size for shard in self.shards)

    def to_json(self) -> str:
        shards = [{"name": s.name, "bytes": s.size, "tokens": s.tokens, "sha256": s.sha256} for s in self.shards]
        source = {"path": self.source.path, "files": self.source.files, "bytes": self.source.bytes}
        return json.dumps({"format": FORMAT, "version": VERSION, "dtype": DTYPE, "source": source,
                           "total_bytes": self.total_bytes, "total_tokens": self.total_bytes,
                           "shards": shards}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        """Parse a manifest; :class:`DataError` naming ``where`` and the field on anything unexpected."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where} is not valid JSON ({exc}); {_REWRITE}") from None
        fields = _Fields(data, where)
        form, version, dtype = fields.get("format", str), fields.get("version", int), fields.get("dtype", str)
        if (form, version, dtype) != (FORMAT, VERSION, DTYPE):
            raise DataError(f"{where} is format {form!r} version {version} of {dtype} tokens; this shardkit "
                            f"reads {FORMAT!r} version {VERSION} of {DTYPE} tokens; {_REWRITE}")
        source = _Fields(fields.get("source", dict), f"{where}: source")
        shards, names = [], set()
        for i, entry in enumerate(fields.get("shards", list)):
            shard = _Fields(entry, f"{where}: shards[{i}]")
            size = shard.get("bytes", int)
            if shard.get("tokens", int) != size:
                raise DataError(f"{where}: shards[{i}] has {entry['tokens']} tokens in {size} bytes; "
                                f"{DTYPE} tokens are one byte each")
            name = shard.get("name", str)
            if name != Path(name).name or name.startswith(".") or name == MANIFEST_NAME or name in names:
                raise DataError(f"{where}: shards[{i}] is named {name!r}; a shard is a file of the folder, "
                                f"not hidden, not {MANIFEST_NAME}, listed once")
            names.add(name)
            shards.append(ShardFile(name, size, shard.get("sha256", str)))
        manifest = cls(tuple(shards), Source(source.get("path", str), source.get("files", int),
                                             source.get("bytes", int)))
        if not shards:
            raise DataError(f"{where} lists no shards; {_REWRITE}")
        if fields.get("total_bytes", int) != manifest.total_bytes:
            raise DataError(f"{where}: total_bytes {data['total_bytes']} is not the sum of its "
                            f"{len(shards)} shards ({manifest.total_bytes}); {_REWRITE}")
        return manifest


class _Fields:
    """Typed reads of a parsed JSON object, each failure a :class:`DataError` naming the field."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise DataError(f"{where} must be a JSON object, got {type(data).__name__}; {_REWRITE}")
        self.data, self.where = data, where

    def get(self, key: str, kind: type) -> Any:
        value = self.data.get(key)
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
            wanted = "an integer >= 0" if kind is int else f"a JSON {kind.__name__}"
            raise DataError(f"{self.where}: field {key!r} must be {wanted}, got {value!r}; {_REWRITE}")
        return value


def read_manifest(folder: Path) -> Manifest:
    """The manifest of ``folder``, after :func:`check_folder`."""
    file = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise DataError(f"data folder {str(folder)!r} does not exist or is not a folder; {_REWRITE}"
                        f"{interrupted_replacement(folder)}")
    try:
        text = file.read_text()
    except OSError as exc:
        raise DataError(f"data folder {str(folder)!r} has no readable {MANIFEST_NAME} ({exc.strerror or exc}); "
                        f"{_REWRITE}") from None
    manifest = Manifest.from_json(text, f"{str(file)!r}")
    check_folder(folder, manifest)
    return manifest


def check_folder(folder: Path, manifest: Manifest) -> None:
    """Every shard present with its manifest size, and no other file (hidden ones aside)."""
    problems = []
    for shard in manifest.shards:
        try:
            size = (folder / shard.name).stat().st_size
        except OSError:
            problems.append(f"{shard.name} is missing")
            continue
        if size != shard.size:
            problems.append(f"{shard.name} has {size} bytes, the manifest says {shard.size}")
    listed = {shard.name for shard in manifest.shards} | {MANIFEST_NAME}
    problems += [f"{path.name} is not in the manifest" for path in sorted(folder.iterdir())
                 if path.name not in listed and not path.name.startswith(".")]
    _raise_if(problems, folder)


def check_checksums(folder: Path, shards: tuple[ShardFile, ...]) -> None:
    """Each of ``shards`` has its manifest sha256 (reads every byte of them)."""
    problems = [f"{shard.name} has sha256 {digest[:12]}..., the manifest says {shard.sha256[:12]}... (altered)"
                for shard in shards if (digest := sha256_of(folder / shard.name)) != shard.sha256]
    _raise_if(problems, folder)


def sha256_of(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _raise_if(problems: list[str], folder: Path) -> None:
    if problems:
        raise DataError(f"data folder {str(folder)!r} does not match its {MANIFEST_NAME}: "
                        f"{'; '.join(problems)}; {_REWRITE}")
