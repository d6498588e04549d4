"""Automatic stage split: per-unit costs on the meta device, then an exact contiguous partition.

Costs (per pipeline unit, for one example micro-batch): forward FLOPs from torch's
``FlopCounterMode``, parameter bytes, and activation bytes (tensors autograd saves for the
backward, counted by :func:`~shardkit.planner.counters.saved_storages`, parameters excluded). All measured with meta
tensors substituted (:func:`shardkit.families.on_meta.swapped`): no memory, no real compute.

The split minimises the largest stage time (or, with ``objective="memory"``, the largest
stage memory) over contiguous partitions, under a per-device memory limit, by dynamic
programming in O(stages * units^2): exact, no enumeration of combinations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..families.on_meta import meta_kernels, swapped
from ..plan import PlanError
from .counters import EXTRA_FLOPS, saved_storages

#: Bytes of training state per parameter byte: the parameter, its gradient, two Adam moments.
STATE_FACTOR = 4


@dataclass(frozen=True)
class DeviceModel:
    """A nominal device for turning costs into seconds: ``time = 3*flops/F + traffic/B``.

    The backward costs about twice the forward (so 3x forward FLOPs in all); traffic reads the
    weights three times (forward, input grad, weight grad) and writes then reads activations.
    """

    flops_per_s: float = 1e12
    bytes_per_s: float = 1e11

    def time(self, cost: UnitCost) -> float:
        return 3 * cost.flops / self.flops_per_s + (3 * cost.param_bytes + 2 * cost.act_bytes) / self.bytes_per_s


@dataclass(frozen=True)
class UnitCost:
    """What one pipeline unit costs for one example micro-batch."""

    name: str
    flops: int
    param_bytes: int
    act_bytes: int


@dataclass(frozen=True)
class SplitResult:
    """An optimal split: where each stage begins and what each stage costs.

    >>> r = auto_split([UnitCost(str(i), f, 0, 0) for i, f in enumerate([4, 1, 1, 2, 2])], 2,
    ...                device=DeviceModel(flops_per_s=3, bytes_per_s=1))
    >>> r.starts, r.stage_time, round(r.balance, 3)
    ((0, 2), (5.0, 5.0), 1.0)
    """

    starts: tuple[int, ...]
    stage_time: tuple[float, ...]
    stage_memory: tuple[int, ...]
    objective: str

    @property
    def balance(self) -> float:
        """Largest stage time over the mean stage time (1.0 is perfect balance)."""
        mean = sum(self.stage_time) / len(self.stage_time)
        return max(self.stage_time) / mean if mean else 1.0

    def ranges(self, n_units: int) -> list[range]:
        ends = [*self.starts[1:], n_units]
        return [range(a, b) for a, b in zip(self.starts, ends)]


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def stage_memory_fn(costs: Sequence[UnitCost], inflight: Sequence[int]) -> Callable[[int, int, int], int]:
    """``memory(stage, i, j)``: training state of units ``i..j-1`` plus ``inflight[stage]`` micro-batches."""
    params = _prefix([c.param_bytes for c in costs])
    acts = _prefix([c.act_bytes for c in costs])

    def memory(stage: int, i: int, j: int) -> int:
        return int(STATE_FACTOR * (params[j] - params[i]) + inflight[stage] * (acts[j] - acts[i]))

    return memory


def auto_split(costs: Sequence[UnitCost], stages: int, *, objective: str = "time", memory_limit: int | None = None,
               inflight: Sequence[int] | None = None, device: DeviceModel | None = None) -> SplitResult:
    """Contiguous split of ``costs`` into ``stages`` minimising the largest stage time (or memory).

    ``inflight[s]``: micro-batches whose activations stage ``s`` holds at its peak (default 1).
    ``memory_limit``: bytes per stage no split may exceed. Raises :class:`PlanError` if
    ``stages > len(costs)`` or no split fits the limit (naming the smallest feasible peak).
    """
    n = len(costs)
    if stages < 1 or stages > n:
        raise PlanError(f"cannot split {n} pipeline units into {stages} stages; valid: 1..{n} stages")
    if objective not in ("time", "memory"):
        raise PlanError(f"auto split objective {objective!r} is unknown; valid: 'time', 'memory'")
    device = device or DeviceModel()
    inflight = list(inflight) if inflight is not None else [1] * stages
    times = _prefix([device.time(c) for c in costs])
    memory = stage_memory_fn(costs, inflight)

    def value(s: int, i: int, j: int) -> float:
        return times[j] - times[i] if objective == "time" else memory(s, i, j)

    inf = float("inf")
    # best[s][j]: smallest possible largest-stage value covering units[:j] with s stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or (memory_limit is not None and memory(s - 1, i, j) > memory_limit):
                    continue
                candidate = max(best[s - 1][i], value(s - 1, i, j))
                if candidate < best[s][j]:
                    best[s][j], cut[s][j] = candidate, i
    if best[stages][n] == inf:
        fit = auto_split(costs, stages, objective="memory", inflight=inflight, device=device)
        raise PlanError(f"no split of {n} units into {stages} stages keeps every stage under memory_limit="
                        f"{memory_limit} bytes; the smallest possible peak stage memory is {max(fit.stage_memory)} "
                        f"bytes: raise the limit to at least that, or add pipeline devices")
    starts, j = [], n
    for s in range(stages, 0, -1):
        j = cut[s][j]
        starts.append(j)
    starts.reverse()
    ends = [*starts[1:], n]
    return SplitResult(
        starts=tuple(starts),
        stage_time=tuple(times[b] - times[a] for a, b in zip(starts, ends)),
        stage_memory=tuple(memory(s, a, b) for s, (a, b) in enumerate(zip(starts, ends))),
        objective=objective,
    )


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)


def unit_costs(model: nn.Module, units: Sequence[tuple[str, Sequence[str]]], example_inputs: tuple) -> list[UnitCost]:
    """Measure every unit ``(name, module paths)`` for one forward of ``example_inputs`` on meta tensors.

    Operators whose meta kernel takes fewer dtypes than the model's (a float32 mixture of
    experts) run as :func:`shardkit.families.on_meta.meta_call` says.

    >>> seq = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    >>> [c.flops for c in unit_costs(seq, [("0", ["0"]), ("1", ["1"])], (torch.zeros(3, 4),))]
    [192, 96]
    """
    try:
        flops, acts = _measure(model, units, example_inputs)
    except Exception as exc:  # the model's own error on meta tensors
        raise PlanError(f"cannot measure the pipeline units of {type(model).__name__} for the automatic split: "
                        f"its forward does not run on meta tensors ({type(exc).__name__}: {exc}); split it "
                        f"with split_points, stage_modules or the even split instead") from None
    out = []
    for index, (name, paths) in enumerate(units):
        seen: dict[int, int] = {}
        for path in paths:
            for p in model.get_submodule(path).parameters():
                seen[id(p)] = p.numel() * p.element_size()
        out.append(UnitCost(name, int(flops[index]), sum(seen.values()), int(acts[index])))
    return out


def _measure(model: nn.Module, units: Sequence[tuple[str, Sequence[str]]], example_inputs: tuple
             ) -> tuple[list[float], list[int]]:
    """Forward FLOPs and saved activation bytes of every unit, on meta stand-ins."""
    from torch.utils.flop_counter import FlopCounterMode

    tensors = {n: _meta_like(p) for n, p in model.named_parameters()}
    tensors.update({n: _meta_like(b) for n, b in model.named_buffers()})
    excluded = {t.untyped_storage()._cdata for t in tensors.values()}
    flops = [0.0] * len(units)
    acts = [0] * len(units)
    current: list[int] = []
    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS)
    booked: list[set[int]] = [set() for _ in units]

    def on_saved(key: int, nbytes: int, _dtype: torch.dtype) -> None:
        if current and key not in booked[current[-1]]:
            booked[current[-1]].add(key)
            acts[current[-1]] += nbytes

    handles = []
    for index, (_, paths) in enumerate(units):
        for path in paths:
            module = model.get_submodule(path)

            def pre(_m: nn.Module, _a: tuple, index: int = index) -> None:
                current.append(index)
                flops[index] -= counter.get_total_flops()

            def post(_m: nn.Module, _a: tuple, _o: object, index: int = index) -> None:
                flops[index] += counter.get_total_flops()
                current.pop()

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    meta_inputs = tuple(_meta_like(x) if isinstance(x, torch.Tensor) else x for x in example_inputs)
    try:
        with counter, saved_storages(on_saved, excluded), swapped(model, tensors), meta_kernels():
            model(*meta_inputs)
    finally:
        for handle in handles:
            handle.remove()
    return flops, acts


__all__ = ["STATE_FACTOR", "DeviceModel", "SplitResult", "UnitCost", "auto_split", "stage_memory_fn", "unit_costs"]
