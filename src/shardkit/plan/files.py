"""Reading plan data from files and from parsed JSON/YAML, strictly: the one copy of file loading.

What a user wrote is never coerced or silently replaced: a key given twice is an error (PyYAML
and ``json`` keep the last one), a boolean must be ``true``/``false`` (not ``"false"``, which
Python's ``bool()`` turns into ``True``), ``null`` or a list where a mapping belongs is an
error naming the field, and unknown keys are named with the valid ones.

>>> read_text('{"mesh": {"dp": 2}}', "plan")
{'mesh': {'dp': 2}}
>>> read_text("mesh: {dp: 2}\\nmesh: {tp: 2}", "plan", yaml=True)
Traceback (most recent call last):
    ...
shardkit.plan.errors.PlanError: plan: key 'mesh' is given twice (line 2); each key may appear once
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .errors import PlanError


def _yaml_loader():
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """SafeLoader that refuses a mapping key given twice."""

    def construct_mapping(loader: StrictLoader, node: Any, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise PlanError(f"{loader.what}: key {key!r} is given twice (line {key_node.start_mark.line + 1}); "
                                f"each key may appear once")
            seen[key] = key_node.start_mark.line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return StrictLoader


def _json_object(what: str):
    def pairs_to_dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise PlanError(f"{what}: key {key!r} is given twice; each key may appear once")
            out[key] = value
        return out

    return pairs_to_dict


def read_text(text: str, what: str, *, yaml: bool = False) -> Any:
    """Parse JSON (or YAML when ``yaml``), refusing duplicate keys; :class:`PlanError` on bad syntax."""
    if yaml:
        import yaml as pyyaml

        loader = _yaml_loader()
        try:
            stream = loader(text)
            stream.what = what
            try:
                return stream.get_single_data()
            finally:
                stream.dispose()
        except pyyaml.YAMLError as exc:
            raise PlanError(f"{what} is neither JSON nor YAML: {exc}") from None
    try:
        return json.loads(text, object_pairs_hook=_json_object(what))
    except json.JSONDecodeError as exc:
        raise PlanError(f"{what} is not valid JSON: {exc}") from None


def read_file(path: str | Path, what: str) -> Any:
    """Parse a ``.json`` file, or a ``.yaml`` / ``.yml`` one (any other suffix is read as YAML,
    which also reads JSON). An unreadable path is a :class:`PlanError` too: the plan cannot be used."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanError(f"cannot read {what} file {str(path)!r}: {exc.strerror or exc}") from None
    return read_text(text, f"{what} file {str(path)!r}", yaml=path.suffix != ".json")


# -- typed fields ------------------------------------------------------------------------------
def mapping(value: Any, where: str, example: str) -> Mapping[str, Any]:
    """``value`` if it is a mapping, else a :class:`PlanError` naming ``where`` and an example."""
    if not isinstance(value, Mapping):
        raise PlanError(f"{where} must be a mapping such as {example}, got {_describe(value)}")
    return value


def known_keys(data: Mapping[str, Any], valid: Iterable[str], where: str, required: Iterable[str] = ()) -> None:
    """Refuse keys outside ``valid`` and missing ``required`` ones, naming both sets."""
    valid = list(valid)
    unknown = [k for k in data if k not in valid]
    problems = []
    if unknown:
        problems.append(f"{where} has unknown keys {unknown}; valid keys: {valid}")
    missing = [k for k in required if k not in data]
    if missing:
        problems.append(f"{where} is missing required keys {missing}")
    if problems:
        raise PlanError(problems)


def boolean(value: Any, where: str) -> bool:
    """``value`` if it is exactly ``True`` or ``False`` (``"false"``, ``0`` or ``"no"`` are errors)."""
    if not isinstance(value, bool):
        raise PlanError(f"{where} must be true or false, got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}" if value is not None else "null"


__all__ = ["boolean", "known_keys", "mapping", "read_file", "read_text"]
