"""Mesh: named axes with sizes. Pure data; becomes a torch DeviceMesh when applied."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from .errors import PlanError

#: Axes with a fixed meaning (the one place that says which axis does what). Any other
#: name is a *user axis*: a model axis that splits the tensors its layout rules name, like ``tp``.
AXIS_ROLES: dict[str, str] = {
    "dp": "data parallel: parameters replicated, gradients all-reduced",
    "fsdp": "fully sharded data parallel: parameters, gradients and optimizer state sharded (FSDP2)",
    "tp": "tensor parallel: weights split by layout rules, partial results combined",
    "pp": "pipeline parallel: layers split into stages",
    "sp": "sequence / context parallel: the sequence dim split across devices",
    "ep": "expert parallel: each MoE layer's experts split over it (E / ep whole experts per rank), "
          "tokens sent to their experts by all-to-all; a data axis for everything else",
}
USER_AXIS_ROLE = "user axis: splits the tensors its layout rules name (like tp)"
#: Axes over which the batch is split (each coordinate sees different samples). ``ep`` is one:
#: its ranks see different tokens, and everything but the experts is reduced over it.
DATA_AXES = ("dp", "fsdp", "ep")
#: Axes that must never appear in a parameter layout, with the reason. (``fsdp`` may: it
#: chooses the dim FSDP2 shards.)
NOT_FOR_LAYOUTS: dict[str, str] = {
    "dp": "'dp' replicates parameters; to shard a parameter over the data axis use 'fsdp'",
    "pp": "'pp' splits layers into pipeline stages, not tensors; use Plan(pipeline=...)",
    "sp": "'sp' splits the sequence of activations, not parameters",
    "ep": "'ep' splits every MoE layer's experts by itself (the expert dim of their stacked weights); "
          "no layout rule names it",
}


def is_model_axis(axis: str) -> bool:
    """Whether ``axis`` splits parameters by layout into pieces that compute separately (tensor
    parallelism): ``tp`` and every user axis, not the data, pipeline or sequence axes.

    >>> [a for a in ("dp", "fsdp", "tp", "pp", "sp", "ep", "expert") if is_model_axis(a)]
    ['tp', 'expert']
    """
    return axis not in DATA_AXES and axis not in NOT_FOR_LAYOUTS


def axis_role(axis: str) -> str:
    """What ``axis`` does, in words (for tables and messages)."""
    return AXIS_ROLES.get(axis, USER_AXIS_ROLE)


class Mesh(Mapping[str, int]):
    """Named mesh axes, outermost first; at most one size may be ``-1`` (inferred).

    >>> Mesh(dp=2, tp=2).shape
    (2, 2)
    >>> Mesh(fsdp=-1, tp=2, world_size=8)
    Mesh(fsdp=4, tp=2)
    >>> Mesh.parse("fsdp=2,tp=2").names
    ('fsdp', 'tp')
    """

    def __init__(self, axes: Mapping[str, int] | None = None, /, *, world_size: int | None = None, **sizes: int):
        given = dict(axes or {})
        overlap = set(given) & set(sizes)
        if overlap:
            raise PlanError(f"mesh axis {sorted(overlap)} given twice")
        given.update(sizes)
        problems = []
        if not given:
            problems.append("a mesh needs at least one axis, for example Mesh(dp=2)")
        for name, size in given.items():
            if not isinstance(name, str) or not name.isidentifier():
                problems.append(f"mesh axis name {name!r} must be an identifier such as 'dp' or 'tp'")
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                problems.append(f"mesh axis {name!r} has size {size!r}; valid sizes are integers >= 1, or -1 to infer it")
        inferred = [n for n, s in given.items() if s == -1]
        if len(inferred) > 1:
            problems.append(f"mesh axes {inferred} are all -1; at most one size can be inferred from the world size")
        if problems:
            raise PlanError(problems)
        self._axes = given
        if world_size is not None:
            self._axes = self.resolved(world_size)._axes

    # -- mapping protocol -------------------------------------------------------------
    def __getitem__(self, name: str) -> int:
        return self._axes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._axes)

    def __len__(self) -> int:
        return len(self._axes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and list(self._axes.items()) == list(other._axes.items())

    def __hash__(self) -> int:
        return hash(tuple(self._axes.items()))

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self._axes.items()) + ")"

    # -- queries ------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._axes.values())

    @property
    def is_resolved(self) -> bool:
        return -1 not in self._axes.values()

    @property
    def size(self) -> int:
        """Number of devices; only defined once no axis is ``-1``."""
        if not self.is_resolved:
            raise PlanError(f"{self!r} has an inferred (-1) axis; call .resolved(world_size) first")
        return math.prod(self.shape)

    def size_of(self, axis: str) -> int:
        """Size of ``axis``, or 1 when the mesh has no such axis."""
        return self._axes.get(axis, 1)

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The axes of size > 1 that split parameters by layout (``tp`` and user axes), in mesh order.

        >>> Mesh(dp=2, tp=2, expert=1).model_axes
        ('tp',)
        """
        return tuple(a for a, s in self._axes.items() if is_model_axis(a) and s != 1)

    @property
    def data_size(self) -> int:
        """How many data-parallel replicas see different samples: the product of the data axes.

        >>> Mesh(dp=2, fsdp=2, tp=2).data_size
        4
        >>> Mesh(fsdp=2, ep=2).data_size
        4
        """
        return math.prod(self.size_of(a) for a in DATA_AXES)

    def data_index(self, rank: int) -> int:
        """Which data-parallel replica ``rank`` is (ranks differing only on other axes share it).

        >>> [Mesh(dp=2, tp=2).data_index(r) for r in range(4)]
        [0, 0, 1, 1]
        """
        coords, index = self.coordinates(rank), 0
        for axis in DATA_AXES:
            if axis in self._axes:
                index = index * self._axes[axis] + coords[axis]
        return index

    def resolved(self, world_size: int) -> Mesh:
        """This mesh with its ``-1`` axis inferred; checks the product equals ``world_size``.

        >>> Mesh(fsdp=-1).resolved(0)
        Traceback (most recent call last):
            ...
        shardkit.plan.errors.PlanError: world size 0: the number of devices, a whole number >= 1
        """
        if type(world_size) is not int or world_size < 1:
            raise PlanError(f"world size {world_size!r}: the number of devices, a whole number >= 1")
        known = math.prod(s for s in self._axes.values() if s != -1)
        axes = dict(self._axes)
        inferred = [n for n, s in axes.items() if s == -1]
        if inferred:
            if world_size % known:
                raise PlanError(
                    f"cannot infer mesh axis {inferred[0]!r}: world size {world_size} is not divisible by "
                    f"the product {known} of the other axes {self._fixed_text()}; valid world sizes are multiples of {known}"
                )
            axes[inferred[0]] = world_size // known
        elif known != world_size:
            raise PlanError(
                f"mesh {self!r} has {known} devices but the world has {world_size}; "
                f"the product of the axis sizes must equal the world size"
                + (" (for example make one axis -1 to infer it)" if len(axes) > 1 else f" (valid: Mesh({self.names[0]}={world_size}))")
            )
        return Mesh(axes)

    def _fixed_text(self) -> str:
        return "(" + ", ".join(f"{n}={s}" for n, s in self._axes.items() if s != -1) + ")"

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every axis (row-major, last axis fastest).

        >>> Mesh(dp=2, tp=2).coordinates(3)
        {'dp': 1, 'tp': 1}
        """
        coords = {}
        for name, size in reversed(self._axes.items()):
            coords[name] = rank % size
            rank //= size
        return dict(reversed(coords.items()))

    # -- text forms -----------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, world_size: int | None = None) -> Mesh:
        """Parse ``"fsdp=2,tp=2"`` (as on the command line); an empty text or an axis given twice is an error.

        >>> Mesh.parse("fsdp=2,fsdp=4")
        Traceback (most recent call last):
            ...
        shardkit.plan.errors.PlanError: mesh 'fsdp=2,fsdp=4' gives axis 'fsdp' twice (fsdp=2 and fsdp=4); give each axis once
        """
        if not isinstance(text, str) or not text.strip():
            raise PlanError(f"mesh {text!r} is empty; give axes as axis=size pairs, for example 'fsdp=2,tp=2'")
        axes: dict[str, int] = {}
        for part in (p.strip() for p in text.split(",")):
            name, sep, size = part.partition("=")
            name = name.strip()
            if not sep or not name:
                raise PlanError(f"mesh entry {part!r} in {text!r} is not of the form axis=size (for example 'fsdp=2,tp=2')")
            try:
                value = int(size)
            except ValueError:
                raise PlanError(f"mesh axis {name!r} has size {size.strip()!r} in {text!r}; sizes are integers >= 1, "
                                f"or -1 to infer one") from None
            if name in axes:
                raise PlanError(f"mesh {text!r} gives axis {name!r} twice ({name}={axes[name]} and {name}={value}); "
                                f"give each axis once")
            axes[name] = value
        return cls(axes, world_size=world_size)

    def to_dict(self) -> dict[str, int]:
        return dict(self._axes)

    @classmethod
    def from_dict(cls, data: Mapping[str, int]) -> Mesh:
        return cls(dict(data))
