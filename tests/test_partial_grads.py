"""runtime/partial_grads.py on its own: ``Partial`` gradients made whole on a gloo world of 4 (a 2 x 2 mesh).

Each case builds the situation directly: a replicated DTensor parameter whose gradient is a DTensor
``Partial`` on ``tp`` (as tensor parallel leaves it with no data axis), each rank's local value
known, then :func:`reduce_partial_grads` and the end-of-backward hook of :class:`PartialGradients`.
The sum path (one flat all-reduce per mesh dims and dtype) and the other reductions (``max``,
``avg``: DTensor's own ``redistribute``, one gradient at a time) are each checked against the value
the reduction must give, the placements left, and the collectives issued.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.observe.comm import CommCounter
from shardkit.runtime.partial_grads import PartialGradients, reduce_partial_grads

MESH = ("dp", "tp")  # 2 x 2: ranks 0 and 1 share dp coordinate 0, so tp groups are {0, 1} and {2, 3}


def _local(rank: int, size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's part of a gradient: distinct on every rank, so each reduction gives its own answer."""
    return (torch.arange(size, dtype=dtype) + 1) * (rank + 1) - 2 * rank


def _case(ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH)

    def param(size: int, placements, dtype=torch.float32) -> torch.nn.Parameter:
        return torch.nn.Parameter(distribute_tensor(torch.zeros(size, dtype=dtype), mesh, placements))

    def partial(p: torch.nn.Parameter, op: str) -> None:
        p.grad = DTensor.from_local(_local(ctx.rank, p.to_local().numel(), p.dtype), mesh,
                                    [pl if pl.is_shard() else Partial(op) if i == 1 else Replicate()
                                     for i, pl in enumerate(p.placements)], run_check=False)

    found = {}
    # the sum path: three gradients of two dtypes, one left whole already, one plain: 2 flat all-reduces
    sums = {"a": param(3, [Replicate(), Replicate()]), "b": param(5, [Replicate(), Replicate()]),
            "wide": param(2, [Replicate(), Replicate()], torch.float64), "whole": param(4, [Replicate(), Replicate()]),
            "plain": torch.nn.Parameter(torch.zeros(2))}
    for name in ("a", "b", "wide"):
        partial(sums[name], "sum")
    sums["whole"].grad = DTensor.from_local(torch.full((4,), 7.0), mesh, [Replicate(), Replicate()])
    sums["plain"].grad = torch.full((2,), float(ctx.rank))
    with CommCounter() as counted:
        found["sum reduced"] = reduce_partial_grads(list(sums.values()))
    found["sum collectives"] = counted.summary()
    found["sum"] = {n: _seen(p.grad) for n, p in sums.items()}
    # other reductions: DTensor's redistribute, one gradient at a time; a Shard(0) on dp is kept
    others = {"max": param(4, [Replicate(), Replicate()]), "avg": param(4, [Replicate(), Replicate()]),
              "max sharded": param(8, [Shard(0), Replicate()])}
    partial(others["max"], "max")
    partial(others["avg"], "avg")
    partial(others["max sharded"], "max")
    with CommCounter() as counted:
        found["other reduced"] = reduce_partial_grads(list(others.values()))
    found["other collectives"] = counted.summary()
    found["other"] = {n: _seen(p.grad) for n, p in others.items()}
    # the hook: a backward that leaves a Partial(max) and a Partial(sum) gradient ends with both whole
    hooked = {"max": param(4, [Replicate(), Replicate()]), "sum": param(4, [Replicate(), Replicate()])}
    reducer = PartialGradients(list(hooked.values()))
    for op, p in hooked.items():
        p.register_hook(lambda grad, op=op: DTensor.from_local(
            _local(ctx.rank, 4), mesh, [Replicate(), Partial(op)], run_check=False))
    (hooked["max"] * 1.0).sum().add((hooked["sum"] * 1.0).sum()).backward()
    found["hooked"] = {n: _seen(p.grad) for n, p in hooked.items()}
    reducer.deferred = True  # gradient accumulation: the sums stay pending until the last backward
    for p in hooked.values():
        p.grad = None
    (hooked["max"] * 1.0).sum().add((hooked["sum"] * 1.0).sum()).backward()
    found["deferred"] = {n: _seen(p.grad) for n, p in hooked.items()}
    return found


def _seen(grad) -> tuple:
    """``(placements, local values)`` of a gradient (a plain tensor: ``None`` placements)."""
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor):
        return [repr(p) for p in grad.placements], grad.to_local().tolist()
    return None, grad.tolist()


@pytest.fixture(scope="module")
def found(world):
    return world(4).run(_case)


def _over_tp(rank: int, size: int, reduce, dtype=torch.float32) -> list:
    """The reduction of every tp peer's local value (ranks ``2d`` and ``2d+1``)."""
    first = rank - rank % 2
    return reduce(torch.stack([_local(first, size, dtype), _local(first + 1, size, dtype)])).tolist()


def test_partial_sums_are_reduced_in_one_flat_all_reduce_per_dtype(found):
    for rank, got in enumerate(found):
        assert got["sum reduced"] == 3
        assert got["sum collectives"]["all_reduce"] == (2, (3 + 5) * 4 + 2 * 8), got["sum collectives"]
        for name, size in (("a", 3), ("b", 5)):
            assert got["sum"][name] == (["Replicate()", "Replicate()"], _over_tp(rank, size, lambda t: t.sum(0)))
        assert got["sum"]["wide"] == (["Replicate()", "Replicate()"],
                                      _over_tp(rank, 2, lambda t: t.sum(0), torch.float64))
        assert got["sum"]["whole"] == (["Replicate()", "Replicate()"], [7.0] * 4)
        assert got["sum"]["plain"] == (None, [float(rank)] * 2)


def test_partial_of_another_reduction_is_made_whole_by_dtensor(found):
    for rank, got in enumerate(found):
        assert got["other reduced"] == 3
        assert sum(calls for calls, _ in got["other collectives"].values()) == 3, got["other collectives"]
        assert got["other"]["max"] == (["Replicate()", "Replicate()"], _over_tp(rank, 4, lambda t: t.amax(0)))
        assert got["other"]["avg"] == (["Replicate()", "Replicate()"], _over_tp(rank, 4, lambda t: t.mean(0)))
        assert got["other"]["max sharded"] == (["Shard(dim=0)", "Replicate()"],
                                               _over_tp(rank, 4, lambda t: t.amax(0)))


def test_the_end_of_backward_makes_every_partial_whole_unless_deferred(found):
    for rank, got in enumerate(found):
        assert got["hooked"] == {"max": (["Replicate()", "Replicate()"], _over_tp(rank, 4, lambda t: t.amax(0))),
                                 "sum": (["Replicate()", "Replicate()"], _over_tp(rank, 4, lambda t: t.sum(0)))}
        pending = _local(rank, 4).tolist()
        assert got["deferred"] == {"max": (["Replicate()", "Partial(max)"], pending),
                                   "sum": (["Replicate()", "Partial(sum)"], pending)}
