"""What leaves a sharded model is a plain, finished tensor: forward outputs (a row-parallel layer's
``AsyncCollectiveTensor``, DTensors, inside containers), ``model.step``'s loss, and whatever a job
sends back to the parent."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardkit as sk
from shardkit.runtime.outputs import plain
from shardkit.runtime.results import dumps, loads

ROWWISE_LAST = sk.Plan(sk.Mesh(tp=2), sk.LayoutMap([("0.weight", ("tp", None)), ("0.bias", ("tp",)),
                                                    ("2.weight", (None, "tp")), (".*", None)]))
X = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
Pair = namedtuple("Pair", "first second")


def build_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 16))


def _raw_outputs(ctx) -> tuple[list[str], list[torch.Tensor], str]:
    model = sk.shard(build_mlp(), ctx.plan)
    outputs = [model(X) for _ in range(20)]  # returned as they leave the model, not cloned
    loss = model.step(X, torch.zeros(64, 16), F.mse_loss)
    return [type(o).__name__ for o in outputs], outputs, type(loss).__name__


def test_a_row_parallel_output_reaches_the_parent_whole(world):
    # Before: each output was an AsyncCollectiveTensor, pickled before its all-reduce finished (off by up to 0.56).
    expected = build_mlp()(X).detach()
    for kinds, outputs, loss_kind in world(2).run(_raw_outputs, plan=ROWWISE_LAST):
        assert set(kinds) == {"Tensor"} and loss_kind == "Tensor"
        for output in outputs:
            assert type(output) is torch.Tensor
            torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


@dataclass
class Holder:
    value: torch.Tensor


def _collectives(ctx) -> dict:
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    group = mesh.get_group()
    big = torch.full((512, 512), float(ctx.rank + 1))
    summed = [funcol.all_reduce(big, "sum", group) for _ in range(8)]  # AsyncCollectiveTensors, unfinished
    weight = torch.ones(4, requires_grad=True)
    acts = funcol.all_reduce(weight * 2, "sum", group)
    whole = DTensor.from_local(torch.full((2,), float(ctx.rank)), mesh, [Shard(0)])
    made = plain({"pair": Pair(acts, [whole]), "rep": distribute_tensor(torch.ones(3), mesh, [Replicate()])})
    made["pair"].first.sum().backward()  # gradients flow through the waited tensor
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    try:
        dumps(partial)
        refused = ""
    except sk.UsageError as exc:
        refused = str(exc)
    return {"summed": summed, "held": Holder(funcol.all_reduce(big, "sum", group)), "made": made,
            "made_kinds": [type(made["pair"].first).__name__, type(made["pair"].second[0]).__name__,
                           type(made["rep"]).__name__], "grad": weight.grad.clone(), "refused": refused,
            "shard": whole}


def test_collective_results_are_finished_before_they_leave_the_job(world):
    for rank, result in enumerate(world(2).run(_collectives)):
        for value in [*result["summed"], result["held"].value]:
            assert type(value) is torch.Tensor and torch.equal(value, torch.full((512, 512), 3.0))
        assert result["made_kinds"] == ["Tensor", "Tensor", "Tensor"]
        assert result["made"]["pair"].second[0].tolist() == [0.0, 0.0, 1.0, 1.0]  # a Shard(0) DTensor made whole
        assert result["made"]["pair"].first.tolist() == [4.0] * 4 and result["grad"].tolist() == [4.0] * 4  # 2 per rank, summed
        assert "not yet reduced" in result["refused"] and "full_tensor()" in result["refused"]
        assert type(result["shard"]) is torch.Tensor and result["shard"].tolist() == [float(rank)] * 2


def test_plain_values_pass_unchanged():
    value = {"a": (torch.ones(2), [torch.zeros(1)]), "b": Pair(torch.ones(1), 3)}
    assert plain(value) is value and loads(dumps(value))["b"].second == 3


@pytest.mark.parametrize("tensor", [torch.ones(2, 2).t(), nn.Parameter(torch.ones(2))])
def test_a_plain_cpu_tensor_is_sent_as_it_is(tensor):
    back = loads(dumps(tensor))
    assert type(back) is type(tensor) and torch.equal(back, tensor)
