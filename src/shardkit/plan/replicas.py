"""Replica groups: which data-parallel replicas share a variable's value and communicate.

A *replica* is one copy of the model (one coordinate of the ``dp`` mesh axis). A
:class:`ReplicaGrouping` splits the ``replication_factor`` replicas into groups of
``group_size`` replicas, ``stride`` apart, with the semantics of PopXL's replica groupings
(``shared/seeds/001_*``). Pure data: no processes, no torch.

Validation. PopXL documents two rules: with ``stride == 1``, ``replication_factor %
group_size == 0``; with ``stride != 1``, ``stride * group_size == replication_factor``.
shardkit accepts the general rule ``replication_factor % (stride * group_size) == 0``, a
strict superset: it also allows several blocks of strided groups, e.g. 16 replicas with
``group_size=2, stride=4`` -> {0,4}, {1,5}, {2,6}, {3,7}, {8,12}, ... (PopXL itself builds
those through ``from_assignment``). :meth:`ReplicaGrouping.popxl_problems` says whether a
grouping also follows the documented rule.

Groupings that no ``(group_size, stride)`` describes come from :meth:`from_assignment`.
PopXL calls the others *constant* (``is_constant``); unlike PopXL, shardkit also accepts
groups of different sizes there (see ``docs/replicas.md`` for what each kind supports).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import PlanError
from .files import mapping
from .mesh import Mesh

#: Mesh dims that replace ``dp`` when a plan has replica groups (see ``runtime.groups``).
GROUPED_DP_DIMS = ("dp_outer", "dp_replica", "dp_inner")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive_int(name: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"ReplicaGrouping {name}={value!r}; valid: an integer >= 1"
    return None


class ReplicaGrouping:
    """Groups of ``group_size`` replicas, ``stride`` apart, among ``replication_factor`` replicas.

    Replica ``r`` belongs to group ``r % stride + stride * (r // (stride * group_size))``.
    ``group_size`` defaults to ``replication_factor // stride``.

    >>> g = ReplicaGrouping(replication_factor=16, group_size=4, stride=4)
    >>> g.groups
    [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    >>> g.assignment[:6], g.num_groups
    ([0, 1, 2, 3, 0, 1], 4)
    >>> g.transpose()
    ReplicaGrouping(replication_factor=16, group_size=4, stride=1)
    >>> ReplicaGrouping.from_assignment([0, 1, 0, 1])
    ReplicaGrouping(replication_factor=4, group_size=2, stride=2)
    """

    __slots__ = ("_replication_factor", "_group_size", "_stride", "_assignment")

    def __init__(self, replication_factor: int, group_size: int | None = None, stride: int = 1):
        problems = [p for p in (_positive_int("replication_factor", replication_factor), _positive_int("stride", stride))
                    if p]
        if group_size is not None and (p := _positive_int("group_size", group_size)):
            problems.append(p)
        if problems:
            raise PlanError(problems)
        if group_size is None:
            if replication_factor % stride:
                raise PlanError(
                    f"ReplicaGrouping(replication_factor={replication_factor}, stride={stride}): the default "
                    f"group_size = replication_factor // stride needs stride to divide replication_factor "
                    f"({replication_factor} % {stride} = {replication_factor % stride}); valid strides: "
                    f"{_divisors(replication_factor)}")
            group_size = replication_factor // stride
        if replication_factor % (stride * group_size):
            raise PlanError(_rule_failure(replication_factor, group_size, stride))
        self._replication_factor = replication_factor
        self._group_size: int | None = group_size
        self._stride: int | None = stride if group_size > 1 else 1  # stride means nothing for groups of one
        self._assignment = tuple(_strided_assignment(replication_factor, group_size, self._stride))

    @classmethod
    def from_assignment(cls, assignment: Sequence[int]) -> ReplicaGrouping:
        """A grouping from ``assignment[replica] = group``; arbitrary groups are allowed.

        Groups are numbered ``0..n-1`` in order of first appearance (so group 0 holds replica
        0), as in PopXL. When a ``(group_size, stride)`` describes the assignment, that
        constant grouping is returned.

        >>> ReplicaGrouping.from_assignment([0, 1, 1, 0]).groups
        [[0, 3], [1, 2]]
        """
        values = list(assignment)
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise PlanError(f"ReplicaGrouping.from_assignment({values!r}): give one group number (an integer >= 0) "
                            f"per replica, e.g. [0, 0, 1, 1]")
        first_seen = list(dict.fromkeys(values))
        if first_seen != list(range(len(first_seen))):
            renumber = {g: i for i, g in enumerate(first_seen)}
            raise PlanError(
                f"ReplicaGrouping.from_assignment({values!r}): groups must be numbered 0, 1, 2, ... in order of "
                f"first appearance (found {first_seen}); the same groups numbered that way: "
                f"{[renumber[v] for v in values]}")
        sizes = [values.count(g) for g in range(len(first_seen))]
        rf = len(values)
        if len(set(sizes)) == 1:
            size = sizes[0]
            members = [r for r, g in enumerate(values) if g == 0]
            stride = members[1] - members[0] if size > 1 else 1
            if rf % (stride * size) == 0 and _strided_assignment(rf, size, stride) == values:
                return cls(rf, size, stride)
        self = cls.__new__(cls)
        self._replication_factor = rf
        self._group_size = sizes[0] if len(set(sizes)) == 1 else None
        self._stride = None
        self._assignment = tuple(values)
        return self

    # -- queries -----------------------------------------------------------------------
    @property
    def replication_factor(self) -> int:
        return self._replication_factor

    @property
    def group_size(self) -> int | None:
        """Replicas per group; ``None`` when groups differ in size (see :attr:`group_sizes`)."""
        return self._group_size

    @property
    def stride(self) -> int | None:
        """Distance between consecutive members of a group; ``None`` unless :attr:`is_constant`."""
        return self._stride

    @property
    def is_constant(self) -> bool:
        """True when one ``(group_size, stride)`` describes the grouping (PopXL's ``is_const``)."""
        return self._stride is not None

    @property
    def has_equal_groups(self) -> bool:
        """True when every group has the same size (needed by all_gather, reduce_scatter, plans)."""
        return self._group_size is not None

    @property
    def num_groups(self) -> int:
        return max(self._assignment) + 1

    @property
    def assignment(self) -> list[int]:
        """``assignment[replica]`` is the replica's group."""
        return list(self._assignment)

    @property
    def groups(self) -> list[list[int]]:
        """The replicas of each group, in group order, each in increasing replica order."""
        out: list[list[int]] = [[] for _ in range(self.num_groups)]
        for replica, group in enumerate(self._assignment):
            out[group].append(replica)
        return out

    @property
    def group_sizes(self) -> list[int]:
        return [len(g) for g in self.groups]

    def group_of(self, replica: int) -> int:
        """The group of ``replica``."""
        self._check_replica(replica)
        return self._assignment[replica]

    def index_in_group(self, replica: int) -> int:
        """Position of ``replica`` among its group's members (0 for the group's first replica)."""
        return self.groups[self.group_of(replica)].index(replica)

    def _check_replica(self, replica: int) -> None:
        if not 0 <= replica < self._replication_factor:
            raise PlanError(f"replica {replica} is out of range; valid: 0..{self._replication_factor - 1}")

    def transpose(self) -> ReplicaGrouping:
        """The orthogonal grouping: the i-th members of every group form group i (as in PopXL).

        Each group of the transpose meets each group of ``self`` in exactly one replica.

        >>> ReplicaGrouping(8, group_size=2).transpose().groups
        [[0, 2, 4, 6], [1, 3, 5, 7]]
        """
        if not self.has_equal_groups:
            raise PlanError(f"{self!r} has groups of different sizes {self.group_sizes}; a transpose takes the i-th "
                            f"member of every group, so it needs groups of equal size")
        assignment = [0] * self._replication_factor
        for group in self.groups:
            for index, replica in enumerate(group):
                assignment[replica] = index
        return ReplicaGrouping.from_assignment(assignment)

    def popxl_problems(self) -> list[str]:
        """Why PopXL's documented rules would reject this grouping (empty when they accept it)."""
        rf, size, stride = self._replication_factor, self._group_size, self._stride
        if size is None:
            return [f"PopXL needs groups of equal size; these have sizes {self.group_sizes}"]
        if stride is None or stride == 1:
            return []  # stride 1 needs rf % group_size == 0, implied by the general rule; assignments are PopXL's own
        if stride * size != rf:
            return [f"PopXL's documented rule for stride != 1 is stride * group_size == replication_factor, "
                    f"but {stride} * {size} = {stride * size} != {rf}; shardkit's general rule "
                    f"replication_factor % (stride * group_size) == 0 holds ({rf // (stride * size)} blocks of "
                    f"strided groups)"]
        return []

    # -- plans ---------------------------------------------------------------------------
    def check_mesh(self, mesh: Mesh) -> list[str]:
        """Problems using this grouping for the ``dp`` axis of ``mesh`` (empty when it fits).

        In a plan, groups become a DeviceMesh dim (``dp_replica``), so they must have equal
        sizes; constant and non-constant ones (from :meth:`from_assignment`) are both supported.
        """
        problems = []
        dp = mesh.size_of("dp")
        if dp != -1 and self._replication_factor != dp:
            problems.append(
                f"replicas.replication_factor={self._replication_factor} but mesh axis 'dp' has size {dp}; replica "
                f"groups split the dp axis, so use replication_factor={dp} or a mesh with dp={self._replication_factor}")
        if not self.has_equal_groups:
            problems.append(
                f"replicas {self!r} has groups of different sizes {self.group_sizes}; a plan turns replica groups "
                f"into a DeviceMesh dim, which needs equal sizes. Use equal groups, or keep this grouping out of the "
                f"plan and call shardkit.runtime.groups.average_gradients(model, grouping) in your training step")
        taken = sorted(set(GROUPED_DP_DIMS) & set(mesh.names))
        if taken:
            problems.append(f"mesh axes {taken} are reserved for replica groups (the dp axis becomes "
                            f"{list(GROUPED_DP_DIMS)}); rename them")
        return problems

    # -- text and serialisation ------------------------------------------------------------
    def __repr__(self) -> str:
        if self.is_constant:
            return (f"ReplicaGrouping(replication_factor={self._replication_factor}, group_size={self._group_size}, "
                    f"stride={self._stride})")
        return f"ReplicaGrouping.from_assignment({list(self._assignment)})"

    def __str__(self) -> str:
        return grouping_table(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplicaGrouping) and self._assignment == other._assignment

    def __hash__(self) -> int:
        return hash(self._assignment)

    def __reduce__(self):
        if self.is_constant:
            return (ReplicaGrouping, (self._replication_factor, self._group_size, self._stride))
        return (ReplicaGrouping.from_assignment, (list(self._assignment),))

    def to_dict(self) -> dict[str, Any]:
        if self.is_constant:
            return {"replication_factor": self._replication_factor, "group_size": self._group_size,
                    "stride": self._stride}
        return {"assignment": list(self._assignment)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaGrouping:
        """Inverse of :meth:`to_dict`: ``{replication_factor, group_size, stride}`` or ``{assignment}``."""
        data = mapping(data, "plan field 'replicas'", "{replication_factor: 4, group_size: 2}")
        keys = set(data)
        if "assignment" in keys:
            if keys - {"assignment", "replication_factor"}:
                raise PlanError(f"replicas {dict(data)!r}: with 'assignment' the only other key allowed is "
                                f"'replication_factor'; got {sorted(keys)}")
            grouping = cls.from_assignment(data["assignment"])
            rf = data.get("replication_factor", grouping.replication_factor)
            if rf != grouping.replication_factor:
                raise PlanError(f"replicas: replication_factor={rf} but the assignment has "
                                f"{grouping.replication_factor} entries (one per replica)")
            return grouping
        valid = {"replication_factor", "group_size", "stride"}
        if keys - valid or "replication_factor" not in keys:
            raise PlanError(f"replicas {dict(data)!r}: valid keys are {sorted(valid)} (replication_factor "
                            f"required) or 'assignment'")
        return cls(data["replication_factor"], data.get("group_size"), data.get("stride", 1))


def _strided_assignment(replication_factor: int, group_size: int, stride: int) -> list[int]:
    block = stride * group_size
    return [r % stride + stride * (r // block) for r in range(replication_factor)]


def _rule_failure(rf: int, group_size: int, stride: int) -> str:
    sizes = [g for g in _divisors(rf) if rf % (stride * g) == 0]
    strides = [s for s in _divisors(rf) if rf % (s * group_size) == 0]
    rule = ("the rule replication_factor % group_size == 0" if stride == 1 else
            "the rule replication_factor % (stride * group_size) == 0")
    return (f"ReplicaGrouping(replication_factor={rf}, group_size={group_size}, stride={stride}) breaks {rule} "
            f"({rf} % {stride * group_size} = "
            f"{rf % (stride * group_size)}); valid group sizes with stride {stride}: {sizes or 'none'}; valid "
            f"strides with group_size {group_size}: {strides or 'none'}")


def grouping_table(grouping: ReplicaGrouping) -> str:
    """The groups as a text table (one row per group), for ``shardkit replicas`` and ``explain``.

    >>> print(grouping_table(ReplicaGrouping(4, group_size=2)))
    ReplicaGrouping(replication_factor=4, group_size=2, stride=1): 2 groups of 2 replicas
    Group  Replicas
        0  0, 1
        1  2, 3
    """
    sizes = grouping.group_sizes
    size_text = f"{sizes[0]} replica{'s' if sizes[0] != 1 else ''}" if grouping.has_equal_groups else \
        f"sizes {sizes}"
    lines = [f"{grouping!r}: {grouping.num_groups} group{'s' if grouping.num_groups != 1 else ''} of {size_text}",
             "Group  Replicas"]
    lines += [f"{g:>5}  {', '.join(map(str, members))}" for g, members in enumerate(grouping.groups)]
    return "\n".join(lines)


__all__ = ["GROUPED_DP_DIMS", "ReplicaGrouping", "grouping_table"]
