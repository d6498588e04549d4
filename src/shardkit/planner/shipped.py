"""The planner's measurements of the catalogue's models, shipped with shardkit.

What ``sk.autoshard`` measures about a model (its analyses at each tensor-parallel degree, what
``sk.validate`` says of the kinds of plan searched, its experts) costs seconds the first time:
torch imports its compiler stack on the first meta or fake operator, transformers its model
code. For the named models of :mod:`shardkit.planner.catalogue` those answers ship in
``planner/shipped/<name>.json``, read when the user's store (:mod:`shardkit.planner.stored`) has
no entry, so a first search on a fresh install builds no model.

A file holds the entries of :mod:`shardkit.planner.ship`'s grid (each model at its own context
length, every tensor-parallel degree up to 8 its sizes allow) and says what they were measured
with: :data:`MEASUREMENT`, torch's release and transformers' version. It is read only when all
three are the running ones: another torch or transformers measures afresh, as a change of the
measurement does once the version is bumped. torch's release is its version without the local
build label (``2.13.0`` of ``2.13.0+cpu`` or ``2.13.0+cu128``): the measurement runs on fake CPU
tensors, which every build of one release dispatches through the same kernels and Python
decompositions. ``tests/test_shipped.py`` measures every entry again and fails when one differs
(on another build too), so a change of the code that measures cannot leave them stale; ``make
shipped`` (``python -m shardkit.planner.ship``) writes them again.

Entries are JSON, not pickles: diffable, and decoded only into the classes the caller names
(:func:`decode`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..plan import LayoutMap, PlanError

#: The version of what the planner measures and stores: bump it with any change to the analysis
#: (``analysis.py``, ``measure.py``, ``counters.py``, ``one_rank.py``), to what ``sk.validate``
#: refuses of a searched plan or to the experts found, then run ``make shipped``.
MEASUREMENT = 6
#: Where the files live: one per catalogue model.
FOLDER = Path(__file__).with_name("shipped")
#: Returned by :func:`shipped_value` when the files hold no valid entry (``None`` is a value).
MISSING: Any = object()


def versions() -> dict[str, Any]:
    """What a shipped entry is valid for: :data:`MEASUREMENT`, torch's release (its version without
    the build label) and transformers' version (read from its metadata: not imported)."""
    from importlib import metadata

    import torch

    try:
        transformers = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers = None
    return {"measurement": MEASUREMENT, "torch": torch.__version__.split("+")[0], "transformers": transformers}


def path_of(name: str) -> Path:
    """The file of catalogue model ``name``."""
    return FOLDER / f"{name}.json"


@functools.cache
def _entries(name: str) -> dict[str, dict[str, Any]] | None:
    """The entries of ``name``'s file, ``None`` when there is none or it was measured with other versions."""
    try:
        data = json.loads(path_of(name).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or {k: data.get(k) for k in versions()} != versions():
        return None
    return data.get("entries")


def shipped_value(name: str, kind: str, key: str, types: Iterable[type] = ()) -> Any:
    """The shipped value of ``kind`` and ``key`` for catalogue model ``name``, decoded into
    ``types`` (:func:`decode`), or :data:`MISSING`."""
    entries = _entries(name)
    if entries is None or key not in entries.get(kind, {}):
        return MISSING
    try:
        return decode(entries[kind][key], types)
    except (KeyError, TypeError, ValueError, PlanError):  # a file edited by hand: measured instead
        return MISSING


# -- the codec --------------------------------------------------------------------------------------
def encode(value: Any) -> Any:
    """``value`` as JSON data: numbers, strings, ``None``; tuples as arrays; dataclasses, torch
    dtypes, :class:`LayoutMap`, :class:`PlanError` and read-only mappings of numbers as objects
    tagged ``"@"``. Anything else (a list, a dict: read back, they would not be what was stored)
    is a ``TypeError``.

    >>> encode((1, "a", None, 2.5))
    [1, 'a', None, 2.5]
    """
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return [encode(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"@": "dtype", "name": str(value).removeprefix("torch.")}
    if isinstance(value, LayoutMap):
        return {"@": "LayoutMap", "rules": value.to_list(), "strict": value.strict}
    if isinstance(value, PlanError):
        return {"@": "PlanError", "problems": list(value.problems)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"@": type(value).__name__, **{f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, Mapping) and not isinstance(value, dict):
        if not all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in value.items()):
            raise TypeError(f"encode(): a mapping of {type(value).__name__} holds more than names to numbers")
        return {"@": type(value).__name__, "items": dict(value)}
    raise TypeError(f"encode(): {type(value).__name__} has no shipped form")


def decode(data: Any, types: Iterable[type] = ()) -> Any:
    """What :func:`encode` wrote, with tagged objects built only as one of ``types`` (dataclasses,
    or mappings built from a dict) by class name, besides dtypes, layout maps and plan errors.

    >>> from shardkit.planner.experts import ExpertsLayer
    >>> decode(encode(ExpertsLayer("experts", 4, ("gate_up_proj",))), [ExpertsLayer])
    ExpertsLayer(name='experts', num_experts=4, params=('gate_up_proj',))
    """
    import torch

    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return tuple(decode(v, types) for v in data)
    if not isinstance(data, dict) or not isinstance(data.get("@"), str):
        raise ValueError(f"decode(): {data!r} is not an encoded value")
    tag = data["@"]
    if tag == "dtype":
        dtype = getattr(torch, data["name"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"decode(): {data['name']!r} is not a torch dtype")
        return dtype
    if tag == "LayoutMap":
        return LayoutMap.from_list(data["rules"], strict=data["strict"])
    if tag == "PlanError":
        return PlanError(data["problems"])
    known = {t.__name__: t for t in types}
    if tag not in known:
        raise ValueError(f"decode(): {tag!r} is not one of the types asked for ({sorted(known)})")
    if "items" in data and not dataclasses.is_dataclass(known[tag]):
        return known[tag](data["items"])
    return known[tag](**{k: decode(v, types) for k, v in data.items() if k != "@"})


__all__ = ["FOLDER", "MEASUREMENT", "MISSING", "decode", "encode", "path_of", "shipped_value", "versions"]
