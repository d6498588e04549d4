"""Measure the catalogue's models as ``sk.autoshard`` does and write what it stored, the files of
:mod:`shardkit.planner.shipped`::

    python -m shardkit.planner.ship [NAME ...]     # or: make shipped

The grid: each model at its own context length (the length it was trained at, what the docs and
benchmarks plan it with), every tensor-parallel degree a node of 8 allows: a search over 8 devices
(the kinds of plan the model allows, its experts, tp 1, 2, 4, 8) and one of ``tp`` alone over
:data:`DEVICES` (tp 3, 5, 6, 7 where the model's sizes take them). A search of any device count at
that length then reads every answer it needs. ``tests/test_shipped.py`` measures the same grid
and compares it with the files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..families import family_of
from ..plan import PlanError
from . import analysis
from .autoshard import autoshard
from .catalogue import CATALOGUE
from .shipped import encode, path_of, versions
from .stored import recording

#: Devices of the ``tp``-only search: 840 = 8 x 7 x 5 x 3, divisible by every degree from 1 to 8.
DEVICES = 840


def seq_len_of(name: str) -> int:
    """The sequence length shipped for catalogue model ``name``: its context length."""
    model = analysis.probe_model(name)
    return family_of(model).max_positions(model)


def measured(name: str) -> dict[str, dict[str, Any]]:
    """Every entry ``sk.autoshard`` stores for ``name`` over the grid, measured in this process
    (no store read), encoded: ``{kind: {key: value}}``."""
    seq_len = seq_len_of(name)
    analysis._from_config.cache_clear()  # measured, not taken from this process's cache
    with recording() as record:
        for devices, axes in ((8, None), (DEVICES, ("tp",))):
            try:
                autoshard(name, devices=devices, global_batch=devices, seq_len=seq_len, axes=axes)
            except PlanError:
                pass  # nothing fits: what the search measured is recorded all the same
    return {kind: {key: encode(value) for key, value in sorted(entries.items())}
            for kind, entries in sorted(record.get(name, {}).items())}


def file_text(name: str, entries: dict[str, dict[str, Any]]) -> str:
    """The file of ``name``: what its entries were measured with, then the entries, one a line (diffable)."""
    def dump(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

    kinds = [f" {dump(kind)}: {{\n" + ",\n".join(f"  {dump(key)}: {dump(value)}" for key, value in found.items())
             + "\n }" for kind, found in entries.items()]
    header = "".join(f"{dump(k)}: {dump(v)}, " for k, v in {"model": name, **versions()}.items())
    return "{" + header + '"entries": {\n' + ",\n".join(kinds) + "\n}}\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Measure the catalogue's models and write planner/shipped/*.json.")
    parser.add_argument("names", nargs="*", help="catalogue models (default: all)")
    args = parser.parse_args(argv)
    for name in args.names or list(CATALOGUE):
        path, entries = path_of(name), measured(name)
        path.parent.mkdir(exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(file_text(name, entries))
        os.replace(partial, path)  # a killed run leaves the old file whole, never half a new one
        print(f"{path}: {sum(len(found) for found in entries.values())} entries", file=sys.stderr)


if __name__ == "__main__":
    main()
