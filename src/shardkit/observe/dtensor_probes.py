"""The probes of what DTensor adds (``shardkit calibrate``, :mod:`shardkit.observe.calibrate`):
per operator on a DTensor (``Hardware.dtensor_overhead``) and per collective tensor parallel
launches through it (``Hardware.dtensor_collective``). Each is a difference of steps timed in
turn (:func:`~shardkit.observe.probes.seconds_per_steps`), over the operators and collectives
counted as they run (:class:`_DTensorCount`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .probes import seconds_per_steps


class _DTensorCount(TorchDispatchMode):
    """Counts the operators dispatched with a DTensor among their arguments (``operators``; views
    included, as DTensor dispatches them all) and the collectives launched (``collectives``: the
    c10d operators, not their waits or wrappers)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor

        self._dtensor, self.operators, self.collectives = DTensor, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators += any(isinstance(t, self._dtensor) for t in tree_leaves((args, kwargs)))
        name = str(func)
        self.collectives += "c10d" in name and "wait" not in name and "wrap" not in name
        return func(*args, **(kwargs or {}))




def dtensor_overhead_job(ctx, seconds: float) -> tuple[int, float]:
    """``(operators on DTensors per step, seconds each adds)`` of the tiny training step of
    :func:`overhead_job` run twice, on plain tensors and with the layer's parameters and input as
    DTensors replicated over the world (``distribute_module``: no collective runs, so only
    DTensor's dispatch differs), every rank stepping at once, the two timed in turn on the clock of
    compute alone (:func:`~shardkit.observe.probes.seconds_per_steps`): the difference over the operators dispatched on
    DTensors (views included, as DTensor dispatches them all) is what each adds to a plain op's
    cost (``Hardware.dtensor_overhead``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    device = ctx.device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    x = torch.randn(4, 4).to(device)
    plain, layer = torch.nn.Linear(4, 4).to(device), torch.nn.Linear(4, 4).to(device)
    distribute_module(layer, mesh, input_fn=lambda _m, inputs, m: tuple(
        DTensor.from_local(t, m, [Replicate()], run_check=False) for t in inputs))
    times = seconds_per_steps([lambda module=module: module(x).sum().backward() for module in (plain, layer)],
                              device, seconds, busy=True)
    counter = _DTensorCount()
    with counter:
        layer(x).sum().backward()
    return counter.operators, max(0.0, times[1] - times[0]) / counter.operators


def dtensor_collective_job(ctx, seconds: float, dtensor_overhead: float) -> float:
    """Seconds each collective tensor parallel launches through DTensor costs on top of the same
    collective called directly (``Hardware.dtensor_collective``): a tiny sequence-parallel block
    (a layer norm, a column-parallel and a row-parallel linear, a residual add; torch's styles,
    sequence split on dim 1) stepped forward and backward on DTensors against the same block on
    plain tensors of the local shapes, every rank at once in groups of two consecutive ranks
    (tensor parallel's groups; the whole world when it has fewer than four ranks or an odd
    number). The difference, less ``dtensor_overhead`` per operator on a DTensor, is the
    collectives' cost (each a ``redistribute``: its plan, the functional collective, its wrapper,
    the wait and the copies that move the gathered dim); less the raw ``all_gather_into_tensor`` of
    the same bytes, per collective, is what DTensor adds. The tensors are tiny, so compute and
    bandwidth are next to nothing; the three are timed in turn
    (:func:`~shardkit.observe.probes.seconds_per_steps`, on the wall clock: they wait for each other)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    device, world = ctx.device, dist.get_world_size()
    if world >= 4 and world % 2 == 0:
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("rest", "pair"))["pair"]
    else:
        mesh = init_device_mesh(device.type, (world,))
    group, size = mesh.get_group(), mesh.size()

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(self.up(self.norm(x)).relu())

    local = torch.randn(2, 2, 8, device=device)
    plain, split = Block().to(device), Block().to(device)
    parallelize_module(split, mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                     "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    x = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
    whole = torch.empty(size * local.numel(), device=device)

    steps = (lambda: plain(local).sum().backward(), lambda: split(x).to_local().sum().backward(),
             lambda: dist.all_gather_into_tensor(whole, local.flatten(), group=group))
    times = seconds_per_steps(steps, device, seconds)
    counter = _DTensorCount()
    with counter:
        steps[1]()
    plain_step, split_step, raw = times
    launched = split_step - plain_step - counter.operators * dtensor_overhead
    return max(0.0, launched / max(1, counter.collectives) - raw)


__all__ = ["dtensor_collective_job", "dtensor_overhead_job"]
