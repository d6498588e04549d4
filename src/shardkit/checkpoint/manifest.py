"""A checkpoint's manifest: what was saved, and the size and sha256 of every file; the checks
that a folder is what its manifest says, and the messages that name the damaged files and the
tensors stored in them.

``manifest.json`` is the last file written into a checkpoint, so a folder with a valid one is
complete (see :mod:`shardkit.checkpoint.store`)::

    {"format": "shardkit.checkpoint", "version": 2, "step": 123, "world_size": 4,
     "plan": {"mesh": {"fsdp": 4}, ...} or null,
     "model": {"hash": "3f0c...", "parameters": {"embed.weight": {"shape": [256, 64], "dtype": "float32"}, ...}},
     "optimizer": "AdamW" or null,
     "permutations": {"h.0.attn.c_attn.weight": [1, [0, 1, ...]]},
     "extra": {...},
     "files": [{"name": ".metadata", "bytes": 9051, "sha256": "..."}, {"name": "__0_0.distcp", ...}, ...],
     "saved_by": {"host": "node7", "pid": 4242},
     "checksum": "9f86d0..."}

``checksum`` is the sha256 of every other field (:func:`checksum_of`), so a manifest cut short,
edited by hand or damaged is refused, never read as if it were true (version 1, written before
it, has neither ``checksum`` nor ``saved_by``).

>>> parameters = {"w": ((2, 3), "float32")}
>>> manifest = Manifest(7, 1, None, parameters, None, {}, {"data": {"position": 12}},
...                     (FileEntry("__0_0.distcp", 10, "ab" * 32),))
>>> Manifest.from_json(manifest.to_json(), "example") == manifest
True
>>> model_mismatch(parameters, {"w": ((3, 3), "float32"), "b": ((3,), "float32")})
['not in the checkpoint: b [3] float32', 'shapes or dtypes differ: w: checkpoint [2, 3] float32, model [3, 3] float32']
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..io.manifest import sha256_of
from ..plan.errors import UsageError

FORMAT = "shardkit.checkpoint"
VERSION = 2
#: The versions this shardkit reads (1: no checksum, no saved_by).
READS = (1, 2)
MANIFEST_NAME = "manifest.json"
#: DCP's index of a checkpoint: every tensor, its shape, dtype and which file holds which part.
METADATA_NAME = ".metadata"
RNG_FILE = re.compile(r"rng-(\d+)\.json")
#: At most this many tensor names in a message; the rest are counted.
NAMES_SHOWN = 8

#: ``{parameter name: (full shape, dtype name)}``: the identity of a model.
Parameters = dict[str, tuple[tuple[int, ...], str]]


class CheckpointError(UsageError):
    """A checkpoint that cannot be saved or loaded as asked: incomplete or damaged (the message
    names each file and the tensors stored in it), from another model (the tensors named), or
    a call that does not fit it."""


def rng_file_name(rank: int) -> str:
    """The file of rank ``rank``'s random-number-generator states: ``rng-00003.json``."""
    return f"rng-{rank:05d}.json"


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its name in the folder, its size in bytes and its sha256 (hex)."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """Everything a checkpoint records besides the tensors (see the module docstring)."""

    step: int
    world_size: int
    plan: dict[str, Any] | None
    parameters: Parameters
    optimizer: str | None
    permutations: dict[str, list]
    extra: Any
    files: tuple[FileEntry, ...]
    #: who saved it: ``{"host": ..., "pid": ...}`` (None in a version 1 manifest)
    saved_by: dict[str, Any] | None = None

    @property
    def model_hash(self) -> str:
        return model_hash(self.parameters)

    @property
    def writer(self) -> str:
        """Who saved it, for messages: ``process 4242 on node7``."""
        if not self.saved_by:
            return "a shardkit that did not record its process"
        return f"process {self.saved_by.get('pid')} on {self.saved_by.get('host')}"

    def to_json(self) -> str:
        parameters = {name: {"shape": list(shape), "dtype": dtype} for name, (shape, dtype) in self.parameters.items()}
        files = [{"name": f.name, "bytes": f.size, "sha256": f.sha256} for f in self.files]
        fields = {"format": FORMAT, "version": VERSION, "step": self.step, "world_size": self.world_size,
                  "plan": self.plan, "model": {"hash": self.model_hash, "parameters": parameters},
                  "optimizer": self.optimizer, "permutations": self.permutations, "extra": self.extra,
                  "files": files, "saved_by": self.saved_by}
        fields = json.loads(json.dumps(fields, allow_nan=False))  # as a reader parses it (tuples are lists)
        return json.dumps({**fields, "checksum": checksum_of(fields)}, indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        """Parse a manifest; :class:`CheckpointError` naming ``where`` and the field on anything unexpected."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{where} is not valid JSON ({exc}): cut short or damaged") from None
        top = _Fields(data, where)
        if top.get("format", str) != FORMAT or top.get("version", int) not in READS:
            raise CheckpointError(f"{where} is format {data['format']!r} version {data['version']}; this shardkit "
                                  f"reads {FORMAT!r} versions {', '.join(map(str, READS))}")
        saved_by = None
        if data["version"] == 1 and {"checksum", "saved_by"} & set(data):
            raise CheckpointError(f"{where} says version 1 but has the fields of version 2 (checksum, saved_by): "
                                  f"the manifest was edited")
        if data["version"] >= 2:
            fields = {key: value for key, value in data.items() if key != "checksum"}
            if top.get("checksum", str) != checksum_of(fields):
                raise CheckpointError(f"{where}: its checksum is not that of its fields: the manifest was edited or "
                                      f"damaged, so nothing it says can be trusted")
            saved_by = data.get("saved_by")
            if saved_by is not None and not isinstance(saved_by, dict):
                raise CheckpointError(f"{where}: field 'saved_by' must be a JSON object or null, got {saved_by!r}")
        model = _Fields(top.get("model", dict), f"{where}: model")
        parameters = _parameters(model.get("parameters", dict), f"{where}: model.parameters")
        if model.get("hash", str) != model_hash(parameters):
            raise CheckpointError(f"{where}: model.hash is not the hash of model.parameters (the manifest was edited)")
        optimizer = data.get("optimizer")
        if optimizer is not None and not isinstance(optimizer, str):
            raise CheckpointError(f"{where}: field 'optimizer' must be a class name or null, got {optimizer!r}")
        plan = data.get("plan")
        if plan is not None and not isinstance(plan, dict):
            raise CheckpointError(f"{where}: field 'plan' must be a JSON object or null, got {type(plan).__name__}")
        return cls(top.get("step", int), top.get("world_size", int), plan, parameters, optimizer,
                   top.get("permutations", dict), data.get("extra"), _files(top.get("files", list), where), saved_by)


def checksum_of(fields: dict[str, Any]) -> str:
    """The sha256 (hex) of a manifest's fields, as compact JSON with sorted keys."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


class _Fields:
    """Typed reads of a parsed JSON object, each failure a :class:`CheckpointError` naming the field."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise CheckpointError(f"{where} must be a JSON object, got {type(data).__name__}")
        self.data, self.where = data, where

    def get(self, key: str, kind: type) -> Any:
        value = self.data.get(key)
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
            wanted = "an integer >= 0" if kind is int else f"a JSON {kind.__name__}"
            raise CheckpointError(f"{self.where}: field {key!r} must be {wanted}, got {value!r}")
        return value


def _parameters(data: dict, where: str) -> Parameters:
    parameters = {}
    for name, entry in data.items():
        fields = _Fields(entry, f"{where}[{name!r}]")
        shape = fields.get("shape", list)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise CheckpointError(f"{where}[{name!r}]: shape must be a list of sizes, got {shape!r}")
        parameters[name] = (tuple(shape), fields.get("dtype", str))
    return parameters


def _files(data: list, where: str) -> tuple[FileEntry, ...]:
    files, names = [], set()
    for i, entry in enumerate(data):
        fields = _Fields(entry, f"{where}: files[{i}]")
        name = fields.get("name", str)
        if name != Path(name).name or name in (MANIFEST_NAME, "", ".", "..") or name in names:
            raise CheckpointError(f"{where}: files[{i}] is named {name!r}; a file of the checkpoint folder, "
                                  f"not {MANIFEST_NAME}, listed once")
        names.add(name)
        files.append(FileEntry(name, fields.get("bytes", int), fields.get("sha256", str)))
    return tuple(files)


def model_hash(parameters: Parameters) -> str:
    """16 hex digits of the sha256 of the parameters' names, shapes and dtypes, sorted by name."""
    text = json.dumps(sorted([name, list(shape), dtype] for name, (shape, dtype) in parameters.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_manifest(folder: Path) -> Manifest:
    """The manifest of checkpoint ``folder``; :class:`CheckpointError` when it has none or a bad one."""
    file = folder / MANIFEST_NAME
    try:
        text = file.read_text()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {str(folder)!r} has no readable {MANIFEST_NAME} "
                              f"({exc.strerror or exc}): it is incomplete or damaged (sk.save writes the manifest "
                              f"before it names a folder step-*), or not a shardkit checkpoint") from None
    return Manifest.from_json(text, repr(str(file)))


# -- the checks: each returns {file name: what is wrong with it} ---------------------------------

def size_problems(folder: Path, manifest: Manifest) -> dict[str, str]:
    """Listed files that are missing or of the wrong size, and files the manifest does not list
    (hidden ones aside). One ``stat`` per file."""
    problems = {}
    for entry in manifest.files:
        try:
            size = (folder / entry.name).stat().st_size
        except OSError:
            problems[entry.name] = "is missing"
            continue
        if size != entry.size:
            problems[entry.name] = f"has {size} bytes, the manifest says {entry.size} ({_resized(size, entry.size)})"
    listed = {entry.name for entry in manifest.files} | {MANIFEST_NAME}
    for path in sorted(folder.iterdir()):
        if path.name not in listed and not path.name.startswith("."):
            problems[path.name] = "is not in the manifest (a file from elsewhere)"
    return problems


def _resized(size: int, expected: int) -> str:
    return "truncated" if size < expected else "grown"


def checksum_problems(folder: Path, entries: tuple[FileEntry, ...] | list[FileEntry]) -> dict[str, str]:
    """Those of ``entries`` whose sha256 is not the manifest's (reads every byte of them)."""
    problems = {}
    for entry in entries:
        try:
            digest = sha256_of(folder / entry.name)
        except OSError as exc:
            problems[entry.name] = f"cannot be read ({exc.strerror or exc})"
            continue
        if digest != entry.sha256:
            problems[entry.name] = (f"has sha256 {digest[:12]}..., the manifest says {entry.sha256[:12]}... "
                                    f"(altered, or a file of another checkpoint)")
    return problems


def tensors_by_file(folder: Path) -> dict[str, list[str]]:
    """``{file name: the DCP keys of the tensors with a part stored in it}``, from DCP's ``.metadata``."""
    from torch.distributed.checkpoint import FileSystemReader

    found: dict[str, dict[str, None]] = {}
    for index, info in FileSystemReader(str(folder)).read_metadata().storage_data.items():
        found.setdefault(info.relative_path, {})[index.fqn] = None
    return {name: list(keys) for name, keys in found.items()}


def _contents(name: str, tensors: dict[str, list[str]] | None) -> str:
    """What file ``name`` holds, for a message."""
    if name == METADATA_NAME:
        return "is DCP's index of every tensor"
    rng = RNG_FILE.fullmatch(name)
    if rng:
        return f"holds rank {int(rng.group(1))}'s random-number-generator states"
    if tensors is None:
        return "holds tensors that cannot be named: .metadata, which lists them, is damaged too"
    return f"holds {name_list(tensors.get(name, []))}"


def name_list(names: list[str]) -> str:
    """``a, b, c`` or ``a, b, ... and 12 more``, for messages.

    >>> name_list(["a", "b"]), name_list([str(i) for i in range(10)])
    ('a, b', '0, 1, 2, 3, 4, 5, 6, 7 and 2 more')
    """
    if not names:
        return "nothing"
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown if len(names) <= NAMES_SHOWN else f"{shown} and {len(names) - NAMES_SHOWN} more"


def damage_message(folder: Path, manifest: Manifest, problems: dict[str, str], others: list[str] = ()) -> str:
    """One sentence naming each damaged file, what is wrong with it and the tensors it holds;
    ``others``: the complete checkpoints beside it, to load instead."""
    tensors = None if METADATA_NAME in problems else tensors_by_file(folder)
    listed = {entry.name for entry in manifest.files}
    parts = [f"{name} {what}; it {_contents(name, tensors)}" if name in listed else f"{name} {what}"
             for name, what in sorted(problems.items())]
    instead = f"another checkpoint ({', '.join(others)} beside it)" if others else "another checkpoint"
    return f"checkpoint {str(folder)!r} is damaged, nothing was loaded: {'; '.join(parts)}. Load {instead} or save again"


def model_mismatch(saved: Parameters, loading: Parameters) -> list[str]:
    """The differences between a checkpoint's parameters and a model's, one line per kind."""
    missing = [f"{n} {_shape(*saved[n])}" for n in saved if n not in loading]
    unexpected = [f"{n} {_shape(*loading[n])}" for n in loading if n not in saved]
    differ = [f"{n}: checkpoint {_shape(*saved[n])}, model {_shape(*loading[n])}"
              for n in saved if n in loading and saved[n] != loading[n]]
    lines = [("not in the model", missing), ("not in the checkpoint", unexpected),
             ("shapes or dtypes differ", differ)]
    return [f"{what}: {name_list(names)}" for what, names in lines if names]


def _shape(shape: tuple[int, ...], dtype: str) -> str:
    return f"{list(shape)} {dtype}"


__all__ = ["FORMAT", "MANIFEST_NAME", "METADATA_NAME", "READS", "VERSION", "CheckpointError", "FileEntry", "Manifest",
           "Parameters", "checksum_of", "checksum_problems", "damage_message", "model_hash", "model_mismatch", "name_list",
           "read_manifest", "rng_file_name", "size_problems", "tensors_by_file"]
