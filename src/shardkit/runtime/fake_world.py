"""One rank of an N-process world in this process, on torch's fake process group and fake
tensors (``sk.dry_run``): no memory is allocated and no collective moves data.

torch gives both halves: the ``"fake"`` backend (``FakeStore``: every collective returns at
once, the rank and world size are whatever we say) and ``FakeTensorMode`` (tensors with shapes,
dtypes and devices but no storage). What it lacks, and :class:`DryRunMode` adds: DeviceMesh,
DTensor and FSDP2 compute rank coordinates, shard sizes and offsets with small integer tensors
(``(mesh == rank).nonzero()``, ``arange(n).tolist()``), which fake tensors cannot answer. So an
op whose tensor inputs are all real runs for real, and a factory op (no tensor input) that makes
integers (indices, token ids, positions) makes a real tensor; every floating-point tensor the
model, FSDP2 or the optimizer makes stays fake, the model's parameters too: a model built on the
meta device is materialised into fake tensors (an op taking meta tensors to another device makes
fake ones), while its ops on meta run for real (cheaper than fake ones, and free).

>>> with fake_world(rank=5, world_size=64) as ctx:     # doctest: +SKIP
...     model = sk.shard(sk.meta_model(build), plan, ctx)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

from ..plan import Plan, UsageError
from . import meshes
from .context import Context


class DryRunMode(FakeTensorMode):
    """torch's ``FakeTensorMode`` where real integer bookkeeping, and work on the meta device,
    stay real (module docstring)."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors) and not _off_meta(tensors, kwargs):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if not tensors and _device_type(kwargs) == "meta":
            with unset_fake_temporarily():  # a meta tensor costs nothing, and its ops run faster than fake ones
                return func(*args, **kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not tensors and isinstance(out, torch.Tensor) and not (out.is_floating_point() or out.is_complex()):
            with unset_fake_temporarily():  # indices, token ids, positions: values the bookkeeping reads
                return func(*args, **kwargs)
        return out


def _tensors(args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an ATen op takes (its arguments are tensors, lists of tensors, or neither):
    ``tree_leaves`` without its per-op cost."""
    found = []
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found += [a for a in arg if isinstance(a, torch.Tensor)]
    return found


def _device_type(kwargs: dict[str, Any]) -> str | None:
    device = kwargs.get("device")
    return None if device is None else torch.device(device).type


def _off_meta(tensors: list[torch.Tensor], kwargs: dict[str, Any]) -> bool:
    """Whether an op takes meta tensors to another device (``to_empty``'s ``empty_like``, a copy):
    the model's parameters and buffers, materialised on this rank, must become fake, not real."""
    device = _device_type(kwargs)
    return device is not None and device != "meta" and any(t.is_meta for t in tensors)


def _forget_groups() -> None:
    """Drop the meshes and process groups cached for the world being left (they belong to its
    process group), shardkit's and DTensor's: DTensor caches sharding decisions by mesh, and a
    mesh of the next world equals this one's, so a cached decision would name this world's groups."""
    from torch.distributed.tensor import DTensor, _redistribute

    meshes._MESHES.clear()
    meshes._GROUPS.clear()  # replica groups' too: groups.py makes them through meshes.py
    meshes._USED.clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute._planner_cache.clear()


class StageSent(Exception):
    """Raised in a fake world once the stage :attr:`StageMetas.stop_after` has sent its outputs'
    shapes forward: the caller needed that and nothing after it."""


@dataclass
class StageMetas:
    """What the pipeline stages of a dry run send forward, by sending stage: ``sent`` holds torch's
    ``_StageForwardMeta`` (each output's shape, stride, dtype, ``requires_grad``) of every stage
    run in this process so far; a stage whose input comes from another rank receives the entry
    of the stage before it. With ``stop_after``, the run stops (:class:`StageSent`) once that
    stage has sent its entry."""

    sent: dict[int, Any] = field(default_factory=dict)
    stop_after: int | None = None


@contextmanager
def _pipeline_neighbours(metas: StageMetas) -> Iterator[None]:
    """torch's pipeline stages learn their neighbours' shapes on the first step, by P2P objects (and a
    vote on whether shapes change, by P2P tensors); in a fake world nothing arrives. While entered, a
    stage sends nothing, and receives what a real neighbour would send: from the stage before it,
    that stage's outputs' shapes (``metas.sent``, recorded when its rank ran in an earlier fake world
    of this process: ``sk.dry_run`` runs the earlier stages' ranks first); from the stage after it,
    the gradients' shapes of its own outputs; and, in the vote, its own rank's result (every
    stage votes alike: shardkit gives torch no shapes, so each stage infers them). Replaced only
    inside :func:`fake_world` (torch has no hook for it)."""
    from torch.distributed.pipelining import stage
    from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta

    def recv_meta(self: Any, src_stage: int) -> Any:
        if src_stage > self.stage_index:
            return _StageBackwardMeta(backward_metas=self._stage_meta.outputs)
        if src_stage not in metas.sent:
            raise UsageError(f"pipeline stage {self.stage_index} receives its input from stage {src_stage}, whose "
                             f"outputs' shapes this fake world was not given: run stage {src_stage}'s rank first "
                             f"(sk.dry_run does)")
        return metas.sent[src_stage]

    def send_meta(self: Any, meta: Any, dst_stage: int) -> None:
        if isinstance(meta, _StageForwardMeta):
            metas.sent[self.stage_index] = meta
            if self.stage_index == metas.stop_after:
                raise StageSent

    def backward_result(self: Any, received_result: torch.Tensor | None = None) -> torch.Tensor:
        assert received_result is not None  # torch passes the rank's own product of votes
        return received_result

    base = stage.PipelineStage
    saved = base._recv_meta, base._send_meta, base._warmup_backward_result
    base._recv_meta, base._send_meta, base._warmup_backward_result = recv_meta, send_meta, backward_result
    try:
        yield
    finally:
        base._recv_meta, base._send_meta, base._warmup_backward_result = saved


@contextmanager
def _ddp_answered() -> Iterator[None]:
    """DDP (``Plan(zero=1)`` and plain ``dp``: torch's composable ``replicate``) all-reduces each
    gradient bucket with its built-in hook, which hands the reducer the collective's future; the
    fake group's future holds nothing, and the reducer asserts on it (``comm.cpp``: "expected the
    hook result is either a Tensor or a TensorList found None"). While entered, every DDP made
    registers :func:`_all_reduce_bucket` instead, the built-in hook's work (divide by the group's
    size, all-reduce the bucket in place) answered with the bucket itself (torch has no hook for
    it: DDP keeps its reducer's hook in C++)."""
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__

    def answered(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # DDP checks a hook's annotations as objects; this module's are strings (``from __future__``)
        self.register_comm_hook(self.process_group, lambda group, bucket: _all_reduce_bucket(group, bucket))

    DistributedDataParallel.__init__ = answered
    try:
        yield
    finally:
        DistributedDataParallel.__init__ = init


def _all_reduce_bucket(group: Any, bucket: Any) -> torch.futures.Future:
    """DDP's built-in all-reduce of one gradient bucket (the mean over ``group``), its future
    holding the bucket (:func:`_ddp_answered`)."""
    buffer = bucket.buffer()
    buffer.div_(group.size())
    dist.all_reduce(buffer, group=group)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


@contextmanager
def _sharding_apart() -> Iterator[None]:
    """DTensor finds an op's output shape by running the op on fake tensors of the global shapes,
    in the active fake mode if there is one (``ShardingPropagator._propagate_tensor_meta_non_cached``,
    once per op and shapes: the result is cached). In a dry run that is :class:`DryRunMode`, the mode
    torch's memory tracker counts tensors in, so those global tensors were counted as the step's,
    and how many depended on what DTensor had cached before the step. In a real world DTensor
    makes a fake mode of its own, which the tracker skips: while entered, the dry run's DTensor
    gets one too (torch has no hook for it)."""
    from torch.distributed.tensor import _sharding_prop

    apart = FakeTensorMode()
    saved = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: apart
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved


@contextmanager
def fake_world(rank: int, world_size: int, plan: Plan | None = None,
               stages: StageMetas | None = None) -> Iterator[Context]:
    """Rank ``rank`` of a ``world_size``-process world on torch's fake process group, its plan's
    meshes made, under :class:`DryRunMode`; yields the rank's :class:`Context` (CPU device).
    ``stages``: what pipeline stages send forward, given and recorded (:class:`StageMetas`).

    This process must not be in a world already (``sk.launch``'s jobs are).
    """
    if type(world_size) is not int or world_size < 1 or type(rank) is not int or not 0 <= rank < world_size:
        raise UsageError(f"fake_world(rank={rank!r}, world_size={world_size!r}): give world_size >= 1 and a rank "
                         f"from 0 to world_size - 1")
    if dist.is_initialized():
        raise UsageError("a dry run simulates its own world, but this process is already in one (inside sk.launch "
                         "or torchrun); run it from a plain process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    _forget_groups()
    try:
        ctx = Context(rank, world_size, 0, torch.device("cpu"), plan)
        if plan is not None:  # DeviceMesh computes coordinates on real tensors: made before fake mode
            meshes.meshes_for(plan.resolved(world_size), "cpu")
        with DryRunMode(), _pipeline_neighbours(stages or StageMetas()), _ddp_answered(), _sharding_apart():
            yield ctx
    finally:
        _forget_groups()
        dist.destroy_process_group()


__all__ = ["DryRunMode", "StageMetas", "StageSent", "fake_world"]
