"""Automatic split: measured costs, and the exact optimum against brute force on small cases."""

from __future__ import annotations

from itertools import combinations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardkit.families import model_layout
from shardkit.models.gpt import GPT, GPTConfig
from shardkit.plan import Mesh, Pipeline, PlanError
from shardkit.planner.autosplit import (
    DeviceModel,
    UnitCost,
    auto_split,
    stage_memory_fn,
    unit_costs,
)
from shardkit.planner.meta import meta_model
from shardkit.planner.stages import assign_stages, layout_costs

UNIT = DeviceModel(flops_per_s=3.0, bytes_per_s=float("inf"))  # time == forward FLOPs


def brute_force(costs, stages, objective="time", limit=None, inflight=None, device=UNIT):
    """The best largest-stage value over every way to place stages-1 boundaries (None if none fits)."""
    inflight = inflight or [1] * stages
    memory = stage_memory_fn(costs, inflight)
    best = None
    for cuts in combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        segments = list(zip(bounds, bounds[1:]))
        if limit is not None and any(memory(s, a, b) > limit for s, (a, b) in enumerate(segments)):
            continue
        values = [sum(device.time(c) for c in costs[a:b]) if objective == "time" else memory(s, a, b)
                  for s, (a, b) in enumerate(segments)]
        best = max(values) if best is None else min(best, max(values))
    return best


unit_lists = st.lists(st.builds(UnitCost, st.just("u"), st.integers(0, 1000), st.integers(0, 500),
                                st.integers(0, 500)), min_size=1, max_size=9)


@settings(max_examples=150, deadline=None)
@given(unit_lists, st.integers(1, 5), st.sampled_from(["time", "memory"]), st.none() | st.integers(0, 4000))
def test_auto_split_equals_the_brute_force_optimum(costs, stages, objective, limit):
    if stages > len(costs):
        with pytest.raises(PlanError, match=f"cannot split {len(costs)} pipeline units into {stages} stages"):
            auto_split(costs, stages, device=UNIT)
        return
    inflight = [stages - s for s in range(stages)]  # 1F1B: earlier stages hold more micro-batches
    expected = brute_force(costs, stages, objective, limit, inflight)
    if expected is None:
        with pytest.raises(PlanError, match="smallest possible peak stage memory is"):
            auto_split(costs, stages, objective=objective, memory_limit=limit, inflight=inflight, device=UNIT)
        return
    result = auto_split(costs, stages, objective=objective, memory_limit=limit, inflight=inflight, device=UNIT)
    value = max(result.stage_time) if objective == "time" else max(result.stage_memory)
    assert value == pytest.approx(expected)
    assert len(result.starts) == stages and result.starts[0] == 0 and list(result.starts) == sorted(set(result.starts))
    if limit is not None:
        assert max(result.stage_memory) <= limit


class Uneven(nn.Module):
    """A chain with deliberately unequal blocks: the widths make the FLOPs differ by up to 16x."""

    WIDTHS = (8, 32, 8, 8, 64, 8, 16, 8)

    def __init__(self):
        super().__init__()
        w = self.WIDTHS
        self.blocks = nn.Sequential(*[nn.Linear(w[i], w[(i + 1) % len(w)]) for i in range(len(w))])

    def forward(self, x):
        return self.blocks(x)


def test_unit_costs_are_measured_flops_and_bytes_on_meta_tensors():
    model = meta_model(Uneven)
    layout = model_layout(model)
    costs = layout_costs(model, layout)
    w = Uneven.WIDTHS
    assert [c.flops for c in costs] == [2 * w[i] * w[(i + 1) % len(w)] for i in range(len(w))]  # batch of 1
    assert [c.param_bytes for c in costs] == [4 * (w[i] + 1) * w[(i + 1) % len(w)] for i in range(len(w))]
    assert [c.act_bytes for c in costs] == [4 * w[i] for i in range(len(w))]  # the saved input, not the weight


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_auto_split_of_an_uneven_model_is_the_brute_force_optimum(stages):
    model = meta_model(Uneven)
    pipeline = Pipeline(split="auto", schedule="gpipe", microbatches=2)
    a = assign_stages(model, pipeline, Mesh(pp=stages), device=UNIT)
    assert max(a.split.stage_time) == pytest.approx(brute_force(list(a.costs), stages))
    even = assign_stages(model, Pipeline(schedule="gpipe"), Mesh(pp=stages))
    even_worst = max(sum(UNIT.time(a.costs[i]) for i in units) for units in even.stages)
    assert max(a.split.stage_time) <= even_worst
    assert a.split.balance == pytest.approx(max(a.split.stage_time) * stages / sum(a.split.stage_time))


def test_memory_objective_and_limit_on_a_model():
    model = meta_model(Uneven)
    by_memory = assign_stages(model, Pipeline(split="auto", objective="memory", schedule="gpipe"), Mesh(pp=2))
    assert max(by_memory.split.stage_memory) == brute_force(list(by_memory.costs), 2, "memory")
    tight = max(by_memory.split.stage_memory)
    fitted = assign_stages(model, Pipeline(split="auto", memory_limit=tight, schedule="gpipe"), Mesh(pp=2))
    assert max(fitted.split.stage_memory) <= tight
    with pytest.raises(PlanError, match=f"smallest possible peak stage memory is {tight} bytes"):
        assign_stages(model, Pipeline(split="auto", memory_limit=tight - 1, schedule="gpipe"), Mesh(pp=2))


def test_auto_split_of_the_gpt_balances_stages():
    model = meta_model(GPT, GPTConfig(layers=6, dim=32, heads=2, seq_len=16))
    a = assign_stages(model, Pipeline(split="auto", schedule="1f1b", microbatches=4), Mesh(pp=3))
    assert a.unit_names(0)[0] == "embed" and a.unit_names(2)[-1] == "lm_head"
    assert a.split.balance >= 1.0
    assert max(a.split.stage_time) == pytest.approx(brute_force(list(a.costs), 3, device=DeviceModel()))


def test_unit_costs_count_a_linear_layer_exactly():
    seq = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    costs = unit_costs(seq, [("0", ["0"]), ("1", ["1"])], (torch.zeros(3, 4),))
    assert [c.flops for c in costs] == [2 * 3 * 4 * 8, 2 * 3 * 8 * 2]
