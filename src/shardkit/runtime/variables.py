"""Grouped variables: one value per replica group, read back one per group or one per replica.

PopXL's ``popxl.variable(host_data, replica_grouping=..., retrieval_mode=...)`` for PyTorch.
Host data has shape ``[num_groups] + shape`` when the grouping has more than one group,
else ``shape``; every replica holds its group's slice. By default the host data of world
rank 0 is used (scattered to every rank), so ranks that computed different host data, for
example from unseeded randomness, still start as the grouping says.

Reading is a collective (every rank must call it) and returns, on every rank,
``[num_groups] + shape`` with ``"one_per_group"`` (each group's first replica) or
``[replication_factor] + shape`` with ``"all_replicas"`` (in replica order); a leading dim
of 1 is dropped, so what ``read`` returns can be written back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..plan import ReplicaGrouping, UsageError
from .collectives import average_gradients, broadcast, check_same_layout
from .context import Context, current_context
from .groups import replicas_of

RETRIEVAL_MODES = ("one_per_group", "all_replicas")


class ReplicaDisagreement(RuntimeError):
    """Replicas of a group hold different values; ``disagreements`` is ``{group: [replicas]}``."""

    def __init__(self, name: str, disagreements: dict[int, list[int]]):
        self.disagreements = disagreements
        rows = "; ".join(f"group {g}: replicas {rs} differ from the group's first replica"
                         for g, rs in disagreements.items())
        super().__init__(f"{name}: {rows}")


class Variable:
    """A tensor whose value the replicas of one group share (one value per group).

    ``value`` is this rank's tensor (an ``nn.Parameter`` when it requires grad); use it in
    the model like any tensor. Make one with :func:`variable`.
    """

    def __init__(self, value: torch.Tensor, grouping: ReplicaGrouping, retrieval_mode: str = "one_per_group",
                 name: str = "variable", ctx: Context | None = None):
        if retrieval_mode not in RETRIEVAL_MODES:
            raise UsageError(f"retrieval_mode={retrieval_mode!r} is unknown; valid: {list(RETRIEVAL_MODES)}")
        self.value = value
        self.grouping = grouping
        self.retrieval_mode = retrieval_mode
        self.name = name
        self._ctx = ctx or current_context()

    def __repr__(self) -> str:
        return (f"Variable({self.name}, shape={tuple(self.value.shape)}, grouping={self.grouping!r}, "
                f"retrieval_mode={self.retrieval_mode!r})")

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape each replica holds."""
        return tuple(self.value.shape)

    @property
    def host_shape(self) -> tuple[int, ...]:
        """The shape of host data: ``(num_groups, *shape)``, or ``shape`` for one group."""
        return _host_shape(self.grouping, self.shape)

    @property
    def group(self) -> int:
        """The group of this rank's replica."""
        return self.grouping.group_of(replicas_of(self._ctx).replica)

    def write(self, host_data: Any, src: int | None = 0) -> None:
        """Set every replica to its group's slice of ``host_data`` (a collective unless ``src=None``)."""
        local = _local_slice(host_data, self.grouping, self.shape, self.value.dtype, src, self._ctx, self.name)
        with torch.no_grad():
            self.value.copy_(local)

    def read(self, check: bool = False, atol: float = 0.0) -> torch.Tensor:
        """The values, per the retrieval mode (a collective; every rank gets the result).

        ``check=True`` raises :class:`ReplicaDisagreement` naming the replicas whose value
        differs (by more than ``atol``) from their group's first replica.
        """
        values = self._gather()
        if check:
            found = _disagreements(values, self.grouping, atol, self._ctx)
            if found:
                raise ReplicaDisagreement(self.name, found)
        replicas = replicas_of(self._ctx)
        if self.retrieval_mode == "one_per_group":
            picked = [values[replicas.ranks[members[0]][0]] for members in self.grouping.groups]
        else:
            picked = [values[replicas.ranks[r][0]] for r in range(self.grouping.replication_factor)]
        return picked[0].clone() if len(picked) == 1 else torch.stack(picked)

    def disagreements(self, atol: float = 0.0) -> dict[int, list[int]]:
        """``{group: [replicas]}`` whose value differs from the group's first replica (a collective)."""
        return _disagreements(self._gather(), self.grouping, atol, self._ctx)

    def _gather(self) -> list[torch.Tensor]:
        """This variable's value on every world rank, in rank order."""
        local = self.value.detach().contiguous()
        world = dist.get_world_size()
        if world == 1:
            return [local.clone()]
        check_same_layout(local, None, [f"rank {r}" for r in range(world)], f"reading {self.name}: every rank must hold")
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        return parts


def _disagreements(values: list[torch.Tensor], grouping: ReplicaGrouping, atol: float,
                   ctx: Context) -> dict[int, list[int]]:
    replicas = replicas_of(ctx)
    found: dict[int, list[int]] = {}
    for group, members in enumerate(grouping.groups):
        reference = values[replicas.ranks[members[0]][0]]
        bad = [m for m in members
               if not all(torch.allclose(values[rank], reference, rtol=0.0, atol=atol) for rank in replicas.ranks[m])]
        if bad:
            found[group] = bad
    return found


def _host_shape(grouping: ReplicaGrouping, shape: Sequence[int]) -> tuple[int, ...]:
    return (grouping.num_groups, *shape) if grouping.num_groups > 1 else tuple(shape)


def _local_slice(host_data: Any, grouping: ReplicaGrouping, shape: Sequence[int] | None, dtype: torch.dtype | None,
                 src: int | None, ctx: Context, name: str) -> torch.Tensor:
    """This rank's group slice of ``host_data``, taken from rank ``src``'s host data (``None``: its own)."""
    host = torch.as_tensor(host_data, dtype=dtype)
    replicas = replicas_of(ctx)
    if grouping.replication_factor != replicas.count:
        raise UsageError(f"{name}: {grouping!r} has replication_factor={grouping.replication_factor} but this job has "
                        f"{replicas.count} replicas ({replicas.where}); use replication_factor={replicas.count}")
    n = grouping.num_groups
    if shape is not None and tuple(host.shape) != _host_shape(grouping, shape):
        raise UsageError(f"{name}: host data has shape {tuple(host.shape)}; this variable takes "
                        f"{list(_host_shape(grouping, shape))} ([num_groups] + shape when there are several groups)")
    if n > 1 and (host.dim() == 0 or host.shape[0] != n):
        raise UsageError(f"{name}: host data has shape {tuple(host.shape)} but {grouping!r} has {n} groups; give "
                        f"shape [num_groups] + shape = [{n}, ...], one slice per group")
    world = ctx.world_size
    if src is None or world == 1:
        return (host[grouping.group_of(replicas.replica)] if n > 1 else host).clone().to(ctx.device)
    if not 0 <= src < world:
        raise UsageError(f"{name}: src={src} is the world rank whose host data is used; valid: 0..{world - 1} or None")
    host = host.to(ctx.device)
    check_same_layout(host, None, [f"rank {r}" for r in range(world)], f"{name}: every rank must pass host data of")
    part_shape = host.shape[1:] if n > 1 else host.shape
    out = torch.empty(part_shape, dtype=host.dtype, device=ctx.device)
    parts = None
    if ctx.rank == src:
        slot_replica = {rank: r for r, ranks in enumerate(replicas.ranks) for rank in ranks}
        parts = [(host[grouping.group_of(slot_replica[rank])] if n > 1 else host).contiguous() for rank in range(world)]
    dist.scatter(out, parts, src=src)
    return out


def variable(host_data: Any, grouping: ReplicaGrouping | None = None, retrieval_mode: str = "one_per_group", *,
             requires_grad: bool = False, dtype: torch.dtype | None = None, src: int | None = 0,
             name: str = "variable") -> Variable:
    """A variable whose replicas of one group share a value (PopXL's ``popxl.variable``).

    ``host_data``: ``[num_groups] + shape`` when ``grouping`` has several groups, else
    ``shape``. ``grouping=None``: one group of all replicas. ``src``: the world rank whose
    host data is used (``None``: each rank's own, no communication). Call on every rank.

    >>> v = variable(np.zeros([4, 3, 3]), ReplicaGrouping(8, group_size=2))   # doctest: +SKIP
    >>> v.value.shape, v.read().shape                                           # doctest: +SKIP
    (torch.Size([3, 3]), torch.Size([4, 3, 3]))
    """
    ctx = current_context()
    if grouping is None:
        grouping = ReplicaGrouping(replicas_of(ctx).count)
    if retrieval_mode not in RETRIEVAL_MODES:
        raise UsageError(f"retrieval_mode={retrieval_mode!r} is unknown; valid: {list(RETRIEVAL_MODES)}")
    local = _local_slice(host_data, grouping, None, dtype, src, ctx, name)
    value = nn.Parameter(local, requires_grad=True) if requires_grad else local
    return Variable(value, grouping, retrieval_mode, name, ctx)


class GroupedModule:
    """A module whose parameters are grouped variables: one model per replica group.

    ``group_size=1`` gives every replica its own model; ``group_size=replication_factor`` is
    plain data parallelism. Make one with :func:`group_module`.
    """

    def __init__(self, module: nn.Module, grouping: ReplicaGrouping, retrieval_mode: str, ctx: Context):
        self.module = module
        self.grouping = grouping
        self.variables = {name: Variable(p, grouping, retrieval_mode, name, ctx)
                          for name, p in module.named_parameters()}

    def load_state(self, host_state: Mapping[str, Any], src: int | None = 0) -> None:
        """Write ``{name: host data [num_groups, ...]}`` into the parameters (a collective)."""
        missing = sorted(set(self.variables) - set(host_state))
        unexpected = sorted(set(host_state) - set(self.variables))
        if missing or unexpected:
            raise UsageError(f"host state does not match the module's parameters: missing {missing}, "
                            f"unexpected {unexpected}")
        for name, var in self.variables.items():
            var.write(host_state[name], src=src)

    def read_state(self, check: bool = False, atol: float = 0.0) -> dict[str, torch.Tensor]:
        """``{name: values}`` per the retrieval mode (a collective)."""
        return {name: var.read(check=check, atol=atol) for name, var in self.variables.items()}

    def disagreements(self, atol: float = 0.0) -> dict[str, dict[int, list[int]]]:
        """``{parameter: {group: [replicas]}}`` for the parameters whose groups disagree."""
        found = {name: var.disagreements(atol) for name, var in self.variables.items()}
        return {name: d for name, d in found.items() if d}

    def average_gradients(self) -> None:
        """Average gradients within each group (call after ``backward``)."""
        average_gradients(self.module, self.grouping)


def group_module(module: nn.Module, grouping: ReplicaGrouping | None = None,
                 host_state: Mapping[str, Any] | None = None, *, retrieval_mode: str = "one_per_group",
                 src: int | None = 0) -> GroupedModule:
    """Group a module's parameters: the replicas of each group share one set of values.

    With ``host_state`` (``{name: [num_groups, ...]}``, see :func:`stack_states`) every
    replica loads its group's slice; without, each group takes the values of its first
    replica (so build the module per group, e.g. seeded by ``group_index``). Call on every rank.

    >>> grouped = group_module(model, ReplicaGrouping(8, group_size=1))   # doctest: +SKIP
    >>> loss.backward(); grouped.average_gradients(); optimizer.step()       # doctest: +SKIP
    """
    ctx = current_context()
    if grouping is None:
        grouping = ReplicaGrouping(replicas_of(ctx).count)
    grouped = GroupedModule(module, grouping, retrieval_mode, ctx)
    if host_state is not None:
        grouped.load_state(host_state, src=src)
    elif grouping.group_size != 1:
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(broadcast(p.detach(), grouping))
    return grouped


def stack_states(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Host state for :func:`group_module` from one state dict per group: ``{name: [num_groups, ...]}``."""
    if not states:
        raise UsageError("stack_states needs one state dict per group, got none")
    if len(states) == 1:
        return {name: t.detach().clone() for name, t in states[0].items()}
    return {name: torch.stack([s[name].detach() for s in states]) for name in states[0]}


__all__ = ["RETRIEVAL_MODES", "GroupedModule", "ReplicaDisagreement", "Variable", "group_module", "stack_states",
           "variable"]
