"""Layout rules: which tensor dim of which parameter is split over which mesh axis.

A *layout* has one entry per tensor dim: ``None`` (not split), an axis name, or a tuple of
axis names (split over their product, outer axis first). A layout of ``None`` as a whole
means fully replicated over the model axes. A :class:`LayoutMap` is an ordered list of
``(regex, layout)`` rules: the first rule whose regex ``re.fullmatch``-es the parameter's
dotted name wins.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass

from .errors import PlanError
from .mesh import NOT_FOR_LAYOUTS, Mesh

DimEntry = str | tuple[str, ...] | None
Layout = tuple[DimEntry, ...] | None

def normalize_layout(layout: object, where: str = "layout") -> Layout:
    """Check a layout's form and return it as a tuple (lists from JSON become tuples).

    >>> normalize_layout(["tp", None])
    ('tp', None)
    >>> normalize_layout([["fsdp", "tp"], None])
    (('fsdp', 'tp'), None)
    """
    if layout is None:
        return None
    if isinstance(layout, (str, bytes, Mapping, set, frozenset)) or not isinstance(layout, Iterable):
        raise PlanError(
            f"{where}: {layout!r} is not a layout; a layout is None (replicated) or a sequence with "
            f"one entry per tensor dim, each None, an axis name or a tuple of axis names, e.g. ('tp', None)"
            + (f" (for a 1-D tensor: ({layout!r},))" if isinstance(layout, str) else "")
        )
    entries: list[DimEntry] = []
    for dim, entry in enumerate(layout):
        if entry is None or (isinstance(entry, str) and entry):
            entries.append(entry)
        elif (isinstance(entry, (list, tuple)) and entry and all(isinstance(a, str) and a for a in entry)
              and len(set(entry)) == len(entry)):
            entries.append(tuple(entry))
        else:
            raise PlanError(f"{where}: dim {dim} entry {entry!r} must be None, an axis name or a non-empty tuple of "
                            f"distinct axis names")
    return tuple(entries)


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending (the axis sizes that split a dim of ``n`` evenly).

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def axes_of(entry: DimEntry) -> tuple[str, ...]:
    """The axis names one dim entry splits over."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


class LayoutMap(MutableMapping[str, Layout]):
    """Ordered ``regex -> layout`` rules; the first ``re.fullmatch`` wins.

    >>> rules = LayoutMap([(r".*\\.q_proj\\.weight", ("tp", None)), (r".*", None)])
    >>> rules.lookup("layers.0.q_proj.weight")
    (0, ('tp', None))
    >>> rules["lm_head.weight"] = (None, "tp")   # Keras style: appended as a new rule
    >>> len(rules)
    3
    """

    def __init__(self, rules: Iterable[tuple[str, object]] | Mapping[str, object] = (), *, strict: bool = True):
        if not isinstance(strict, bool):
            raise PlanError(f"LayoutMap(strict=...) must be True or False, got {type(strict).__name__} {strict!r}")
        self.strict = strict
        self._rules: dict[str, Layout] = {}
        self._compiled: dict[str, re.Pattern[str]] = {}
        if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
            raise PlanError(f"layout rules must be a list of (regex, layout) pairs, got {type(rules).__name__}")
        items = rules.items() if isinstance(rules, Mapping) else rules
        for index, item in enumerate(items):
            if isinstance(item, (str, bytes, Mapping)) or not isinstance(item, (list, tuple)) or len(item) != 2:
                raise PlanError(f"layout rule #{index} {item!r} must be a (regex, layout) pair, "
                                f"e.g. ('lm_head\\\\.weight', ('tp', None))")
            self[item[0]] = item[1]

    def __setitem__(self, pattern: str, layout: object) -> None:
        """Append a rule (Keras style). A pattern already present is an error: rules are ordered and
        the first match wins, so replacing one in place would silently change what matches first."""
        if not isinstance(pattern, str):
            raise PlanError(f"layout rule pattern {pattern!r} must be a string (a regex)")
        if pattern in self._rules:
            position = list(self._rules).index(pattern)
            raise PlanError(f"layout rule pattern {pattern!r} is given twice (first as rule #{position} with layout "
                            f"{self._rules[pattern]!r}); each pattern may appear once: delete the first "
                            f"(del rules[pattern]) to replace it")
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise PlanError(f"layout rule {pattern!r} is not a valid regex: {exc}") from None
        self._rules[pattern] = normalize_layout(layout, where=f"rule {pattern!r}")
        self._compiled[pattern] = compiled

    def __getitem__(self, pattern: str) -> Layout:
        return self._rules[pattern]

    def __delitem__(self, pattern: str) -> None:
        del self._rules[pattern]
        del self._compiled[pattern]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __repr__(self) -> str:
        return f"LayoutMap({list(self._rules.items())!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayoutMap) and list(self.items()) == list(other.items()) and self.strict == other.strict

    def lookup(self, name: str) -> tuple[int, Layout] | None:
        """``(rule index, layout)`` of the first rule matching ``name``, else ``None``."""
        for index, (pattern, compiled) in enumerate(self._compiled.items()):
            if compiled.fullmatch(name):
                return index, self._rules[pattern]
        return None

    def matches(self, index: int, name: str) -> bool:
        """Whether rule ``index`` (whatever rules come before it) matches ``name``."""
        return list(self._compiled.values())[index].fullmatch(name) is not None

    def axes(self) -> set[str]:
        """Every axis name some rule uses."""
        return {a for layout in self._rules.values() if layout for e in layout for a in axes_of(e)}

    def to_list(self) -> list[list[object]]:
        return [[p, None if lay is None else [list(e) if isinstance(e, tuple) else e for e in lay]]
                for p, lay in self._rules.items()]

    @classmethod
    def from_hf(cls, model: object, axis: str = "tp", ep: bool = False) -> LayoutMap:
        """Rules from transformers' own tensor-parallel plan of ``model`` (its config's
        ``base_model_tp_plan`` and the head's ``_tp_plan``), over ``axis``; packed and
        gather-output entries included. A model with no plan is a :class:`PlanError` saying to
        write rules. ``ep=True``: a mixture of experts' rules beside an ``ep`` axis, from its
        ``base_model_ep_plan`` (experts whole over ``axis``: ``ep`` splits them). See
        :mod:`shardkit.plan.hf_plan` for the style -> layout table.

        >>> from shardkit.models.hf import LLAMA_RULES, build_tiny_llama
        >>> LayoutMap.from_hf(build_tiny_llama()) == LLAMA_RULES
        True
        """
        from .hf_plan import rules_from_hf

        return cls(rules_from_hf(model, axis, ep))

    @classmethod
    def from_list(cls, data: Iterable[Iterable[object]], strict: bool = True) -> LayoutMap:
        return cls(data, strict=strict)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is laid out: the rule that matched and the shard each device holds."""

    name: str
    shape: tuple[int, ...]
    rule: int | None  # index of the matching rule; None when no rules were given
    pattern: str | None
    layout: Layout

    def split(self, mesh: Mesh) -> tuple[int, ...]:
        """Per dim, how many pieces the layout cuts it into."""
        if self.layout is None:
            return (1,) * len(self.shape)
        return tuple(math.prod(mesh.size_of(a) for a in axes_of(e)) for e in self.layout)

    def local_shape(self, mesh: Mesh) -> tuple[int, ...]:
        return tuple(d // s for d, s in zip(self.shape, self.split(mesh)))

    def axis_dim(self, axis: str) -> int | None:
        """The tensor dim split over ``axis``, if any."""
        for dim, entry in enumerate(self.layout or ()):
            if axis in axes_of(entry):
                return dim
        return None


@dataclass(frozen=True)
class LayoutResolution:
    params: dict[str, ParamLayout]
    unused_rules: list[str]


def resolve_layouts(shapes: Mapping[str, tuple[int, ...]], rules: LayoutMap | None, mesh: Mesh) -> LayoutResolution:
    """Match every parameter against ``rules`` and check the result against ``mesh``.

    Raises :class:`PlanError` listing every problem: unmatched parameters (strict maps),
    unknown or forbidden axes, wrong layout length, an axis used twice, indivisible dims.
    """
    problems: list[str] = []
    params: dict[str, ParamLayout] = {}
    used: set[int] = set()
    unmatched: list[str] = []
    patterns = list(rules) if rules is not None else []
    for name, shape in shapes.items():
        shape = tuple(int(d) for d in shape)
        if rules is None:
            params[name] = ParamLayout(name, shape, None, None, None)
            continue
        hit = rules.lookup(name)
        if hit is None:
            if rules.strict:
                unmatched.append(name)
            params[name] = ParamLayout(name, shape, None, None, None)
            continue
        index, layout = hit
        used.add(index)
        params[name] = entry = ParamLayout(name, shape, index, patterns[index], layout)
        problems.extend(_check_layout(entry, mesh))
    if unmatched:
        shown = ", ".join(unmatched[:20]) + (f", ... ({len(unmatched) - 20} more)" if len(unmatched) > 20 else "")
        problems.append(
            f"{len(unmatched)} parameter(s) match no layout rule: {shown}. Add a rule for them, "
            f"or an explicit catch-all (r'.*', None) to replicate the rest, or LayoutMap(..., strict=False)"
        )
    unused = [p for i, p in enumerate(patterns) if i not in used]
    if problems:
        raise PlanError(problems)
    return LayoutResolution(params, unused)


def _check_layout(p: ParamLayout, mesh: Mesh) -> list[str]:
    if p.layout is None:
        return []
    problems = []
    where = f"parameter {p.name!r} (shape {list(p.shape)}, rule {p.pattern!r})"
    if len(p.layout) != len(p.shape):
        return [f"{where}: layout {p.layout!r} has {len(p.layout)} entries but the tensor has {len(p.shape)} dims; "
                f"give one entry per dim, e.g. {tuple([None] * len(p.shape))!r}"]
    seen: dict[str, int] = {}
    for dim, entry in enumerate(p.layout):
        for axis in axes_of(entry):
            if axis in NOT_FOR_LAYOUTS:
                problems.append(f"{where}: dim {dim} uses axis {axis!r}: {NOT_FOR_LAYOUTS[axis]}")
            elif axis not in mesh:
                problems.append(f"{where}: dim {dim} uses axis {axis!r}, which the mesh {mesh!r} does not have; "
                                f"valid axes: {[a for a in mesh.names if a not in NOT_FOR_LAYOUTS]}")
            if axis in seen:
                problems.append(f"{where}: axis {axis!r} splits both dim {seen[axis]} and dim {dim}; an axis can split one dim only")
            seen[axis] = dim
    if problems or not mesh.is_resolved:
        return problems
    for dim, (size, pieces) in enumerate(zip(p.shape, p.split(mesh))):
        if size % pieces:
            axes = axes_of(p.layout[dim])
            sizes = " x ".join(f"{a}={mesh.size_of(a)}" for a in axes)
            valid = divisors(size)
            problems.append(f"{where}: dim {dim} has size {size}, not divisible by {sizes} ({pieces}); "
                            f"axis sizes that divide it: {valid}")
    return problems
