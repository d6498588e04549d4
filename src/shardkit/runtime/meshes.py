"""Every DeviceMesh and process group a job makes, in one place (torchtitan's ``ParallelDims`` idea).

Creating a DeviceMesh or a process group is a collective over every rank, so each is made
once per process and cached here; callers ask by axis name:

- :func:`meshes_for` ``(plan).device_mesh``: the plan's mesh, named as the plan names it (what
  ``ctx.mesh`` gives a job). When the plan asks for mixed precision but has no data axis, a
  leading ``dp`` dim of size 1 is added: torch applies mixed precision through FSDP2's
  wrappers, which need a data mesh (on one device it reduces nothing);
- ``.root``: the mesh parameters are split on. With replica groups, ``dp`` becomes three dims
  ``dp_outer, dp_replica, dp_inner`` so that one replica group is one slice of ``dp_replica``
  (:func:`grouped_mesh_ranks`);
- ``.axis(name)``: the 1-D mesh of one axis (tensor parallel, pipeline, sequence);
- ``.data()``: the mesh FSDP2 / DDP reduce gradients over and whether it shards: ``fsdp``
  (with ``dp`` in front: HSDP), and ``sp`` joins the reduction, since context-parallel ranks
  see different tokens of the same samples; so does ``ep``, whose ranks see different samples;
- ``.expert_data()``: the same without ``ep``, for the experts ``ep`` splits (each rank's
  experts are reduced over the data ranks that hold the same experts; ``None`` when there are none);
- :func:`process_group`: a group for an arbitrary list of ranks (replica groups).

Every group gets the world's timeout (devices.py's :func:`group_timeout`: the job's plus a margin).
The groups of :func:`process_group` a job did not use are freed when it ends
(:func:`release_unused`); the plans' DeviceMeshes are kept for the process's life, as torch's
DTensor caches assume (see there).

Axis roles themselves are stated once, in :mod:`shardkit.plan.mesh`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..plan import Mesh, Plan, PlanError, ReplicaGrouping, UsageError
from ..plan.replicas import GROUPED_DP_DIMS
from .devices import group_timeout, group_timeout_for, set_group_timeout


def grouped_mesh_ranks(mesh: Mesh, grouping: ReplicaGrouping) -> tuple[tuple[str, ...], torch.Tensor]:
    """Names and rank layout of ``mesh`` with ``dp`` replaced by ``dp_outer, dp_replica, dp_inner``.

    For a constant grouping the sizes are ``(dp // (stride * group_size), group_size, stride)``
    (a reshape of ``dp``); other equal-size groupings get ``(num_groups, group_size, 1)`` with
    the dp coordinates reordered. Either way the ranks of one replica group differ only
    along ``dp_replica``. Pure: no processes.

    >>> names, ranks = grouped_mesh_ranks(Mesh(dp=4, tp=2), ReplicaGrouping(4, group_size=2, stride=2))
    >>> names, tuple(ranks.shape)
    (('dp_outer', 'dp_replica', 'dp_inner', 'tp'), (1, 2, 2, 2))
    """
    problems = grouping.check_mesh(mesh)
    if problems:
        raise PlanError(problems)
    axis = mesh.names.index("dp")
    ranks = torch.arange(mesh.size).reshape(mesh.shape)
    if grouping.is_constant:
        stride, size = grouping.stride, grouping.group_size
        assert stride is not None and size is not None
        dims = (mesh["dp"] // (stride * size), size, stride)
    else:
        order = [r for members in grouping.groups for r in members]
        ranks = ranks.index_select(axis, torch.tensor(order))
        dims = (grouping.num_groups, grouping.group_size or 1, 1)
    shape = mesh.shape[:axis] + dims + mesh.shape[axis + 1:]
    names = mesh.names[:axis] + GROUPED_DP_DIMS + mesh.names[axis + 1:]
    return names, ranks.reshape(shape)


def needs_unit_data_dim(plan: Plan) -> bool:
    """Whether mixed precision needs a ``dp`` dim of size 1 (the plan has no data axis of its own)."""
    m = plan.mesh
    return plan.fsdp.mixed_precision and "dp" not in m and m.data_size == 1 and m.size_of("sp") == 1


@dataclass(frozen=True)
class DataMesh:
    """The mesh gradients are reduced over and whether parameters are sharded on it (FSDP) or not."""

    mesh: Any
    shards: bool


class Meshes:
    """The DeviceMeshes of one plan in this process; made once by :func:`meshes_for`."""

    def __init__(self, plan: Plan, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        mesh = plan.mesh if plan.mesh.is_resolved else plan.mesh.resolved(dist.get_world_size())
        self.plan = plan
        if needs_unit_data_dim(plan):
            self.device_mesh = init_device_mesh(device_type, (1, *mesh.shape), mesh_dim_names=("dp", *mesh.names))
        else:
            self.device_mesh = init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.names)
        #: The mesh parameters are split on (tensor parallel and data parallel must share one root):
        #: the plan's mesh, or with replica groups the one whose ``dp_replica`` dim is a group.
        self.root = self.device_mesh
        if plan.replicas is not None:
            names, ranks = grouped_mesh_ranks(mesh, plan.replicas)
            self.root = DeviceMesh(device_type, ranks, mesh_dim_names=names)
        self._data: dict[str, DataMesh | None] = {}
        _set_timeout(self.device_mesh, self.root)

    def groups(self) -> list[Any]:
        """Every process group of this plan's meshes (the world's included, where a dim spans it)."""
        meshes = [self.device_mesh, self.root, *(d.mesh for d in self._data.values() if d is not None)]
        return [g for m in meshes for g in m.get_all_groups()]

    def axis(self, name: str):
        """The 1-D mesh of axis ``name`` on :attr:`root`; :class:`PlanError` naming the valid axes otherwise."""
        names = self.root.mesh_dim_names or ()
        if name not in names:
            raise UsageError(f"the job's mesh has no axis {name!r}; its axes: {list(names)}")
        return self.root[name]

    def data(self) -> DataMesh | None:
        """FSDP2 / DDP's mesh (``None`` when there is nothing to reduce and no mixed precision)."""
        if "all" not in self._data:
            self._data["all"] = self._make_data(("fsdp", "sp", "ep"))
        return self._data["all"]

    def expert_data(self) -> DataMesh | None:
        """The mesh the experts ``ep`` splits are reduced (or FSDP-sharded) over: :meth:`data`'s
        without ``ep`` (``None`` when ``ep`` is the only data axis: nothing else holds the same experts)."""
        if "experts" not in self._data:
            self._data["experts"] = self._make_data(("fsdp", "sp"))
        return self._data["experts"]

    def _make_data(self, split_axes: tuple[str, ...]) -> DataMesh | None:
        data = self._data_mesh(split_axes)
        if data is not None:
            _set_timeout(data.mesh)  # a flattened dim is a new group
        return data

    def _data_mesh(self, split_axes: tuple[str, ...]) -> DataMesh | None:
        mesh, m = self.root, self.plan.mesh
        dims = mesh.mesh_dim_names
        if self.plan.replicas is not None:
            replicate = ["dp_replica"]
        elif m.size_of("dp") > 1 or (self.plan.fsdp.mixed_precision and "dp" in dims and m.data_size == 1
                                     and m.size_of("sp") == 1):
            replicate = ["dp"]  # of size 1 only for mixed precision, applied through FSDP2's replicate
        else:
            replicate = []
        others = sorted((a for a in split_axes if m.size_of(a) > 1), key=dims.index)
        if m.size_of("fsdp") > 1:
            if not replicate:
                return DataMesh(mesh[others[0]] if len(others) == 1 else mesh[tuple(others)]._flatten("_".join(others)),
                                True)
            if len(others) == 1:
                return DataMesh(mesh[(*replicate, others[0])], True)
            flat = mesh[tuple(others)]._flatten("_".join(others))
            with warnings.catch_warnings():  # torch has no other way yet to pair a flattened dim with dp
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                return DataMesh(mesh[(*replicate, flat.mesh_dim_names[0])], True)
        replicate = sorted(replicate + others, key=dims.index)
        if not replicate:
            return None
        if len(replicate) == 1:
            return DataMesh(mesh[replicate[0]], False)
        return DataMesh(mesh[tuple(replicate)]._flatten("_".join(replicate)), False)


def _set_timeout(*meshes: Any) -> None:
    """Give every group of ``meshes`` the world's timeout. torch's DeviceMesh takes a timeout only
    inside backend-specific options (``backend_override``, which also stops it reusing the world's
    group), so it is set on the groups once made, as ``dist.new_group(timeout=...)`` would have."""
    timeout = group_timeout()
    if timeout is None:
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    for mesh in meshes:
        for group in mesh.get_all_groups():
            _set_pg_timeout(timeout, group)


_MESHES: dict[tuple, Meshes] = {}
_USED: set[tuple] = set()  # the keys of _GROUPS the running job asked for


def meshes_for(plan: Plan, device_type: str) -> Meshes:
    """The :class:`Meshes` of ``plan`` in this process (made on first use: a collective on every rank)."""
    mesh = plan.mesh
    key = (device_type, mesh.names, mesh.shape, plan.replicas, needs_unit_data_dim(plan))
    if key not in _MESHES:
        _MESHES[key] = Meshes(plan, device_type)
    return _MESHES[key]


_GROUPS: dict[tuple[int, ...], Any] = {}


def use_timeout(job_timeout: float | None) -> None:
    """Before a job: the world's group and every group made here wait as long as the job may run
    (``job_timeout`` seconds, ``None``: no limit) plus devices.py's margin, and so do groups made later."""
    timeout = group_timeout_for(job_timeout)
    if timeout == group_timeout() or not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    set_group_timeout(timeout)
    groups = [dist.group.WORLD, *(g for m in _MESHES.values() for g in m.groups()), *_GROUPS.values()]
    for group in {id(g): g for g in groups if isinstance(g, dist.ProcessGroup)}.values():
        _set_pg_timeout(timeout, group)


def release_unused() -> None:
    """At the end of a job (every rank, in the same order): destroy the groups of :func:`process_group`
    the job did not ask for. Never the world's group (nor one named as it), nor a DeviceMesh's: torch's
    DTensor caches (sharding propagation, redistribution plans) key on a mesh's layout, not on its
    groups, so a mesh destroyed and made again with the same layout would be served the destroyed
    groups' names (seen in tests/test_sequence_parallel.py); the plans' meshes live as long as the process."""
    gone = [k for k in _GROUPS if k not in _USED]
    _USED.clear()
    if not gone or not dist.is_initialized():
        return
    # a rank outside a group holds a marker (torch's NON_GROUP_MEMBER), no group
    dropped = [g for g in (_GROUPS.pop(key) for key in gone) if isinstance(g, dist.ProcessGroup)]
    kept = [g for m in _MESHES.values() for g in m.groups()] + [g for g in _GROUPS.values()
                                                                 if isinstance(g, dist.ProcessGroup)]
    kept.append(dist.group.WORLD)
    kept_names = {g.group_name for g in kept}
    for group in dropped:  # in the order made
        if group.group_name not in kept_names and not any(group is g for g in kept):
            dist.destroy_process_group(group)


def process_group(ranks: tuple[int, ...]) -> Any:
    """The process group of ``ranks`` (``None`` for one rank, the world for all), made once.

    Every rank of the world must ask for the same rank lists in the same order (``new_group``
    is a collective over the whole world).
    """
    if ranks not in _GROUPS:
        if len(ranks) == 1:
            _GROUPS[ranks] = None
        elif len(ranks) == dist.get_world_size():
            _GROUPS[ranks] = dist.group.WORLD
        else:
            _GROUPS[ranks] = dist.new_group(list(ranks), timeout=group_timeout())
    _USED.add(ranks)
    return _GROUPS[ranks]


__all__ = ["DataMesh", "Meshes", "grouped_mesh_ranks", "meshes_for", "needs_unit_data_dim", "process_group",
           "release_unused", "use_timeout"]
