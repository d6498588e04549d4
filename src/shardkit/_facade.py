"""How the facade re-exports: each public name is imported from the module that defines it on
first use, so ``import shardkit`` imports no torch; related names are grouped in small lazy
namespaces (``sk.collectives.all_reduce``), each also importable as a module
(``from shardkit.collectives import all_reduce``).

The standard library has no lazy namespace that is also importable by name
(``importlib.util.LazyLoader`` defers one real module's execution), hence :class:`Namespace`.

>>> plan_names = Namespace("shardkit.example", {"Mesh": "shardkit.plan.mesh"}, "An example.")
>>> plan_names.Mesh(dp=2), dir(plan_names)
(Mesh(dp=2), ['Mesh'])
>>> plan_names.Plan
Traceback (most recent call last):
    ...
AttributeError: module 'shardkit.example' has no attribute 'Plan'; it has: Mesh
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping
from typing import Any


def resolve(exports: Mapping[str, str], owner: str, name: str) -> Any:
    """``name`` from the module ``exports`` names for it; ``AttributeError`` listing them when it has none."""
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module {owner!r} has no attribute {name!r}; it has: {', '.join(sorted(exports))}")
    return getattr(importlib.import_module(module), name)


class Namespace(types.ModuleType):
    """A small public namespace: each of its names is imported from its defining module on first use."""

    def __init__(self, name: str, exports: Mapping[str, str], doc: str):
        super().__init__(name, doc)
        self._exports = dict(exports)
        self.__all__ = sorted(exports)

    def __getattr__(self, name: str) -> Any:  # called only for names not yet imported
        if name.startswith("__"):
            raise AttributeError(name)
        value = resolve(self._exports, self.__name__, name)
        setattr(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        return list(self.__all__)


def namespace(name: str, exports: Mapping[str, str], doc: str) -> Namespace:
    """A :class:`Namespace` registered as the module ``name``, so that it can be imported by name."""
    made = Namespace(name, exports, doc)
    sys.modules[name] = made
    return made


__all__ = ["Namespace", "namespace", "resolve"]
