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
At the end of a job, the meshes and groups no job asked for since the last release and that
nothing holds any more are destroyed on every rank (:func:`release_unused`; why this is safe with
torch's DTensor caches: docs/devices.md, "Process groups over a world's life").

Axis roles themselves are stated once, in :mod:`shardkit.plan.mesh`.
"""

from __future__ import annotations

import gc
import sys
import warnings
from collections import Counter
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
        return [g for m in self._device_meshes() for g in m.get_all_groups()]

    def _device_meshes(self) -> list[Any]:
        """Every DeviceMesh made here: the plan's, the root, the data meshes and the flattened dims
        torch keeps in a root's ``_flatten_mapping`` (each once)."""
        meshes = [self.device_mesh, self.root, *(d.mesh for d in self._data.values() if d is not None)]
        meshes += [f for m in (self.device_mesh, self.root) for f in m._flatten_mapping.values()]
        return list({id(m): m for m in meshes}.values())

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
_USED: set[tuple] = set()  # the keys of _MESHES and _GROUPS asked for since the last release


def meshes_for(plan: Plan, device_type: str) -> Meshes:
    """The :class:`Meshes` of ``plan`` in this process (made on first use: a collective on every rank)."""
    mesh = plan.mesh
    key = (device_type, mesh.names, mesh.shape, plan.replicas, needs_unit_data_dim(plan))
    if key not in _MESHES:
        _MESHES[key] = Meshes(plan, device_type)
    _USED.add(key)
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


def release_unused(device: torch.device) -> None:
    """At the end of a job, on every rank at the same point (a collective over the world): destroy the
    replica groups no job asked for since the last release, and the groups of the meshes no job asked
    for that nothing holds any more (``device``: this rank's, for the one all-reduce that agrees on them).

    A plan's meshes are held while anything refers to one of them: a model's DTensors or FSDP / DDP
    state, a pipeline, a mesh a job kept (``ctx.mesh``), or a sharding decision torch cached on
    another thread. torch's DTensor caches are emptied first (:func:`_forget_dtensor_caches`), so
    that a mesh freed here is referred to by no cache: the next job with the same plan makes new
    meshes and gets decisions on them (see docs/devices.md). Every rank destroys the same groups, in
    the order they were made; never the world's group (nor one named as it)."""
    used = set(_USED)
    _USED.clear()
    if not dist.is_initialized() or not (_MESHES or _GROUPS):  # the same on every rank: made collectively
        return
    mesh_keys, group_keys = list(_MESHES), list(_GROUPS)
    unused = [key for key in mesh_keys if key not in used]
    if unused:
        _forget_dtensor_caches(device)
        if any(map(_held, unused)):  # perhaps by a dead model's cycles (a module and its FSDP state)
            gc.collect()
    local = [key in used or _held(key) for key in mesh_keys] + [key in used for key in group_keys]
    keep = torch.tensor(local, dtype=torch.int32, device=device)
    dist.all_reduce(keep, op=dist.ReduceOp.MAX)  # kept where any rank holds it
    kept_meshes = keep[:len(mesh_keys)].tolist()
    kept_groups = keep[len(mesh_keys):].tolist()
    released = [_MESHES.pop(key) for key, k in zip(mesh_keys, kept_meshes) if not k]
    gone = [g for meshes in released for g in meshes.groups()]
    for mesh in (mesh for meshes in released for mesh in meshes._device_meshes()):
        mesh._flatten_mapping.clear()  # a root and its flattened dims refer to each other: go now, not at a collection
    del released
    # a rank outside a group holds a marker (torch's NON_GROUP_MEMBER), no group
    gone += [g for key, k in zip(group_keys, kept_groups) if not k
             for g in [_GROUPS.pop(key)] if isinstance(g, dist.ProcessGroup)]
    if not gone:
        return
    kept = [g for m in _MESHES.values() for g in m.groups()] + [g for g in _GROUPS.values()
                                                                 if isinstance(g, dist.ProcessGroup)]
    kept.append(dist.group.WORLD)
    kept_names = {g.group_name for g in kept}
    made = {g: i for i, g in enumerate(dist.distributed_c10d._world.pg_map)}  # the order they were made
    for group in sorted({id(g): g for g in gone}.values(), key=made.__getitem__):
        if group.group_name not in kept_names and not any(group is g for g in kept):
            dist.destroy_process_group(group)


def _links(obj: Any) -> list[Any]:
    """The objects of one plan's meshes that ``obj`` (a :class:`Meshes`, :class:`DataMesh` or
    DeviceMesh of it) refers to."""
    if isinstance(obj, Meshes):
        return [obj.device_mesh, obj.root, *(d for d in obj._data.values() if d is not None)]
    if isinstance(obj, DataMesh):
        return [obj.mesh]
    return [m for m in (obj._root_mesh, *obj._flatten_mapping.values()) if m is not None]


def _held(key: tuple) -> bool:
    """Whether anything but the registry and the plan's meshes themselves refers to the :class:`Meshes`
    of ``key``, one of its :class:`DataMesh` or one of its DeviceMeshes: a reference count above the
    links among them (a DTensor refers to its mesh, a mesh sliced from a root to the root, FSDP's state
    to its mesh; Python or C++, so a sharding decision cached on another thread counts too)."""
    objects = [_MESHES[key]]
    objects += [d for d in objects[0]._data.values() if d is not None] + objects[0]._device_meshes()
    objects = list({id(obj): obj for obj in objects}.values())  # each once (the Meshes stays first)
    internal = Counter(id(ref) for obj in objects for ref in _links(obj))
    internal[id(objects[0])] += 1  # the registry's
    counts = _reference_counts(objects)
    here = _reference_counts([object()])[0]  # a list's only element: the references counting makes
    return any(count - here > internal[id(obj)] for obj, count in zip(objects, counts))


def _reference_counts(objects: list[Any]) -> list[int]:
    return [sys.getrefcount(obj) for obj in objects]


class _ForgetFastPath(torch.autograd.Function):
    """The identity, whose backward empties the DTensor dispatch fast path's cache of the thread
    running it: on an accelerator, autograd's thread for the device (where the DTensor operators of
    every backward run), on the CPU the caller's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        torch._C._clear_DTensor_sharding_propagator_cache()
        return grad


def _forget_dtensor_caches(device: torch.device) -> None:
    """Empty torch's DTensor caches (torch 2.13; private, read in its source), each of which keeps the
    meshes of its entries alive and, keyed on a mesh's layout, would serve a mesh made again with
    the same layout the entries of the old one: sharding propagation (``LocalLRUCache``, one per
    thread: replaced, which empties every thread's; the C++ fast path's, one per thread too: emptied
    on this thread and on autograd's thread for ``device``), tensor metadata, redistribution plans
    and planners, and the mesh topology of cost estimates. Nothing to do before DTensor is imported."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding = LocalLRUCache(propagator.propagate_op_sharding_non_cached)
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    with torch.enable_grad():
        _ForgetFastPath.apply(torch.zeros((), device=device, requires_grad=True)).backward()


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
