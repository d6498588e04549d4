"""What the planner measures about a model, kept on disk between processes.

A first ``sk.autoshard`` in a process otherwise builds the model on the meta device (whose
random initialisation imports torch's compiler stack), measures it on fake tensors at each
tensor-parallel degree and runs ``sk.validate`` on a few probe plans: seconds, for numbers that
depend only on the model and the code measuring it. Each such result is stored once, as a
pickle under ``$SHARDKIT_CACHE`` (default ``~/.cache/shardkit``, ``$XDG_CACHE_HOME`` honoured;
``SHARDKIT_CACHE=off`` stores nothing), keyed by what it depends on: the model's signature (its
config, attention implementation and the other arguments, as the in-process caches key them),
torch's and transformers' versions, and a digest of shardkit's own source, so a changed
measurement code or library never reads an old answer. Only models given by config or
catalogue name are stored (a module has no signature that says its code did not change).

An entry the store does not hold is read, for a catalogue model, from the measurements shipped
with shardkit (:mod:`shardkit.planner.shipped`, valid for one measurement version and one torch
and transformers), before it is measured: a fresh install's first search measures nothing for
them. ``SHARDKIT_CACHE=off`` reads neither: everything is measured.

Why not torch's or Python's own caches: they live in one process; this is the planner's inputs,
which nothing in torch keeps. A store that cannot be read or written is ignored: the value is
computed as if there were none.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from .shipped import MISSING, shipped_value

T = TypeVar("T")
#: The environment variable naming the store's folder (``off``: no store).
CACHE_ENV = "SHARDKIT_CACHE"
_PACKAGE = Path(__file__).resolve().parents[1]


def store_folder() -> Path | None:
    """The folder results are stored in, or ``None`` when ``SHARDKIT_CACHE=off``.

    >>> import os
    >>> before = os.environ.get(CACHE_ENV)
    >>> os.environ[CACHE_ENV] = "off"
    >>> store_folder() is None, stored("example", "1 + 1", lambda: 1 + 1)
    (True, 2)
    >>> _ = os.environ.pop(CACHE_ENV) if before is None else os.environ.update({CACHE_ENV: before})
    """
    chosen = os.environ.get(CACHE_ENV)
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen) / "planner"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shardkit" / "planner"


@functools.cache
def code_version() -> str:
    """torch's and transformers' versions and a digest of shardkit's source: a stored result is
    read only by the code that wrote it."""
    from importlib import metadata

    import torch

    try:
        transformers = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers = "none"
    digest = hashlib.sha256(f"torch {torch.__version__} transformers {transformers}".encode())
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


#: While :func:`recording` is open: every catalogue model's value computed, ``{name: {kind: {key: value}}}``.
_RECORD: dict[str, dict[str, dict[str, Any]]] | None = None


@contextmanager
def recording() -> Iterator[dict[str, dict[str, dict[str, Any]]]]:
    """While open, every value asked of a catalogue model is measured once (no store, no shipped
    entry read or written) and recorded in the dict yielded, ``{name: {kind: {key: value}}}``: what
    :mod:`shardkit.planner.ship` writes and its test compares."""
    global _RECORD
    previous, _RECORD = _RECORD, {}
    try:
        yield _RECORD
    finally:
        _RECORD = previous


def stored(kind: str, key: str, compute: Callable[[], T], catalogue: str | None = None,
           types: Iterable[type] = ()) -> T:
    """``compute()``'s value for ``key``, read from the store when it holds it, else, for the
    catalogue model named ``catalogue``, from the shipped entries (decoded into ``types``), else
    computed and stored.

    ``kind`` names what is stored (``"analysis"``, ``"refusal"``); ``key`` must say everything the
    value depends on beyond shardkit's code and torch's and transformers' versions.
    """
    if _RECORD is not None:
        if catalogue is None:
            return compute()
        recorded = _RECORD.setdefault(catalogue, {}).setdefault(kind, {})
        if key not in recorded:
            recorded[key] = compute()
        return recorded[key]
    folder = store_folder()
    if folder is None:
        return compute()
    name = hashlib.sha256(f"{code_version()}\n{kind}\n{key}".encode()).hexdigest()[:32]
    path = folder / f"{kind}-{name}.pkl"
    try:
        with path.open("rb") as f:
            return pickle.load(f)
    except Exception:  # noqa: BLE001  (absent, partly written or unreadable: computed again)
        pass
    if catalogue is not None:
        value = shipped_value(catalogue, kind, key, types)
        if value is not MISSING:
            return value
    value = compute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with partial.open("wb") as f:
            pickle.dump(value, f)
        os.replace(partial, path)  # readers see the whole file or none
    except (OSError, pickle.PicklingError, TypeError, AttributeError):
        pass
    return value


__all__ = ["CACHE_ENV", "code_version", "recording", "store_folder", "stored"]
