"""What a job sees in each process: :class:`Context` (rank, device, plan, mesh); the device is chosen in devices.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..plan import Plan, PlanError, UsageError
from .devices import to_device


@dataclass
class Context:
    """What a job sees in every process: its rank, device, plan and (lazily) the DeviceMesh.

    ``data_rank`` / ``data_world`` place this process among the data-parallel replicas (the
    ``dp`` x ``fsdp`` coordinates); ranks that differ only on model axes (and ``sp``) share a
    data rank.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    plan: Plan | None = None

    @property
    def mesh(self):
        """The plan's mesh as a torch ``DeviceMesh`` (created once per shape in a process)."""
        if self.plan is None:
            raise UsageError("this job was started without a plan, so it has no mesh; pass a Plan to launch/run")
        from .meshes import meshes_for

        return meshes_for(self.plan, self.device.type).device_mesh

    def coordinates(self) -> dict[str, int]:
        return {} if self.plan is None else self.plan.mesh.coordinates(self.rank)

    @property
    def data_rank(self) -> int:
        return self.rank if self.plan is None else self.plan.mesh.data_index(self.rank)

    @property
    def data_world(self) -> int:
        return self.world_size if self.plan is None else self.plan.mesh.data_size

    def shard_batch(self, *tensors: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """This rank's part of each tensor: an equal slice of the batch (``dim``) per data rank,
        and, on a mesh with ``sp`` > 1, this sp rank's load-balanced chunks of the sequence
        (``dim + 1``) — inputs and targets are split identically."""
        sp = 1 if self.plan is None else self.plan.mesh.size_of("sp")
        out = []
        for t in tensors:
            if t.shape[dim] % self.data_world:
                raise PlanError(self.plan.batch_problems(t.shape[dim]) if self.plan else
                                f"batch of {t.shape[dim]} samples does not split over {self.data_world} ranks")
            part = t.chunk(self.data_world, dim=dim)[self.data_rank]
            if sp > 1:
                from .ring_attention import shard_sequence

                part = shard_sequence(part, self.coordinates()["sp"], sp, dim=dim + 1)
            out.append(to_device(part, self.device))  # pinned and asynchronous to a GPU
        return out[0] if len(out) == 1 else tuple(out)


_CURRENT: list[Context] = []


def current_context() -> Context:
    """The Context of the job running in this process (inside ``launch`` / ``LocalWorld.run``)."""
    if not _CURRENT:
        raise RuntimeError("no shardkit job is running in this process; call this inside a function passed to "
                           "sk.launch(...) or LocalWorld.run(...)")
    return _CURRENT[-1]


def run_job(ctx: Context, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn(ctx, *args, **kwargs)`` with ``ctx`` as :func:`current_context` while it runs."""
    _CURRENT.append(ctx)
    try:
        return fn(ctx, *args, **kwargs)
    finally:
        _CURRENT.pop()


__all__ = ["Context", "current_context", "run_job"]
