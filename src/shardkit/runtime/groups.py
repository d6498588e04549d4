"""Replica groups on torch.distributed: where the replicas of a job live and each group's process group.

A replica is one coordinate of the plan's ``dp`` axis (every rank is a replica when a job has
no plan). A replica spans the ranks of its other mesh axes (``tp``, ``fsdp``, ``pp``, ...), so
a replica group becomes one torch process group per position on those axes: the ranks of
the group's replicas that share their other coordinates. The groups are made with
``dist.new_group``, in the same order on every rank, once per process.

The collectives over these groups are in :mod:`shardkit.runtime.collectives`; the plan's
mesh with ``dp`` split into groups (how ``sk.shard`` reduces gradients within groups) is
:mod:`shardkit.runtime.meshes`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..plan import ReplicaGrouping, UsageError
from .context import Context, current_context
from .meshes import process_group


@dataclass(frozen=True)
class Replicas:
    """Where the replicas of a job live.

    ``ranks[replica][slot]`` is a world rank: ``slot`` runs over the replica's positions on
    the other mesh axes (in rank order), so ranks with the same slot hold the same part of
    the model. ``replica`` and ``slot`` locate the calling rank.
    """

    ranks: tuple[tuple[int, ...], ...]
    replica: int
    slot: int
    where: str  # for messages: how the replicas were found

    @property
    def count(self) -> int:
        return len(self.ranks)


def replicas_of(ctx: Context | None = None) -> Replicas:
    """The replicas of the running job: the ``dp`` coordinates of its plan, else every rank."""
    ctx = ctx or current_context()
    plan = ctx.plan
    if plan is None or "dp" not in plan.mesh:
        if plan is not None:
            ranks: tuple[tuple[int, ...], ...] = (tuple(range(ctx.world_size)),)
            return Replicas(ranks, 0, ctx.rank, f"one replica: {plan.mesh!r} has no 'dp' axis")
        ranks = tuple((r,) for r in range(ctx.world_size))
        return Replicas(ranks, ctx.rank, 0, f"a world of {ctx.world_size} ranks with no plan, one replica per rank")
    mesh = plan.mesh
    by_replica: list[list[int]] = [[] for _ in range(mesh["dp"])]
    for rank in range(mesh.size):
        by_replica[mesh.coordinates(rank)["dp"]].append(rank)
    replica = mesh.coordinates(ctx.rank)["dp"]
    return Replicas(tuple(map(tuple, by_replica)), replica, by_replica[replica].index(ctx.rank),
                    f"mesh axis 'dp' of {mesh!r}")


def replica_index(ctx: Context | None = None) -> int:
    """This rank's replica (its ``dp`` coordinate, or its rank when the job has no plan)."""
    return replicas_of(ctx).replica


def group_index(grouping: ReplicaGrouping, ctx: Context | None = None) -> int:
    """The group of this rank's replica in ``grouping``."""
    replicas = replicas_of(ctx)
    return _checked(grouping, replicas).group_of(replicas.replica)


def _checked(grouping: ReplicaGrouping | None, replicas: Replicas) -> ReplicaGrouping:
    if grouping is None:
        return ReplicaGrouping(replicas.count)
    if not isinstance(grouping, ReplicaGrouping):
        raise UsageError(f"grouping must be a ReplicaGrouping or None (all replicas), got {type(grouping).__name__}")
    if grouping.replication_factor != replicas.count:
        raise UsageError(f"{grouping!r} has replication_factor={grouping.replication_factor} but this job has "
                        f"{replicas.count} replicas ({replicas.where}); use replication_factor={replicas.count}")
    return grouping


@lru_cache(maxsize=256)
def _transposed(grouping: ReplicaGrouping) -> ReplicaGrouping:
    return grouping.transpose()


# -- process groups -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaGroup:
    """This rank's group in a grouping: its process group and members.

    ``members`` are the replicas of the group, ``ranks`` their world ranks at this rank's
    slot, ``index`` this rank's position among them. ``process_group`` is ``None`` for a
    group of one (nothing to communicate).
    """

    grouping: ReplicaGrouping
    group: int
    members: tuple[int, ...]
    ranks: tuple[int, ...]
    index: int
    process_group: Any

    @property
    def size(self) -> int:
        return len(self.members)


def replica_group(grouping: ReplicaGrouping | None = None, *, transpose: bool = False,
                  ctx: Context | None = None) -> ReplicaGroup:
    """This rank's group of ``grouping`` (or of its transpose), with a torch process group.

    The first call for a grouping creates its process groups on every rank (a collective:
    every rank of the world must make it); later calls reuse them (within a job and from the
    job before: meshes.py frees what a job did not ask for).
    """
    replicas = replicas_of(ctx)
    grouping = _checked(grouping, replicas)
    if transpose:
        grouping = _transposed(grouping)
    # one group per (slot, group), asked for in the same order on every rank (made once, in meshes.py;
    # asking again marks them used by this job)
    groups = {ranks: process_group(ranks) for slot in range(len(replicas.ranks[0]))
              for ranks in (tuple(replicas.ranks[m][slot] for m in members) for members in grouping.groups)}
    group = grouping.group_of(replicas.replica)
    members = tuple(grouping.groups[group])
    ranks = tuple(replicas.ranks[m][replicas.slot] for m in members)
    return ReplicaGroup(grouping, group, members, ranks, members.index(replicas.replica), groups[ranks])


__all__ = ["ReplicaGroup", "Replicas", "group_index", "replica_group", "replica_index", "replicas_of"]
