"""Timeline: spans, bubble fraction, activation peaks, Chrome trace, PNG; and what real schedules record."""

from __future__ import annotations

import json

import pytest
import torch
from model_zoo import build_gpt4

import shardkit as sk
from shardkit.models.gpt import gpt_loss
from shardkit.observe.timeline import (
    COMPUTE_KINDS,
    bubble_fraction,
    peak_activations,
    to_chrome_trace,
    write_profile,
)
from shardkit.plan import Mesh, Pipeline, Plan
from shardkit.plan.pipeline import theoretical_bubble
from shardkit.runtime import spans as timeline
from shardkit.runtime.spans import Span

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_spans_are_recorded_only_inside_recording():
    with timeline.span("F", 0, 0):
        pass
    assert not timeline.is_recording()
    with timeline.recording(rank=3):
        with timeline.span("step"):
            with timeline.span("F", 1, 2) as record:
                record.bytes = 64
        with timeline.span("step"):
            pass
    spans = timeline.collect()
    assert [(s.kind, s.step, s.rank) for s in spans] == [("F", 0, 3), ("step", 0, 3), ("step", 1, 3)]
    assert spans[0].bytes == 64 and spans[0].end_ns >= spans[0].start_ns
    assert timeline.collect() == []


def test_bubble_fraction_is_idle_time_over_devices_times_step_time():
    steps = {r: [Span(r, "step", 0, 100, step=0), Span(r, "step", 100, 200, step=1)] for r in range(2)}
    steps[0] += [Span(0, "F", 0, 100, step=0), Span(0, "F", 100, 150, step=1), Span(0, "wait", 150, 200, step=1)]
    steps[1] += [Span(1, "B", 120, 180, step=1), Span(1, "W", 170, 200, step=1)]
    # step 0 is left out (shape inference); step 1: busy 50 + 80 (union of B and W) of 2 x 100
    assert bubble_fraction(steps) == pytest.approx(1 - 130 / 200)


def test_peak_activations_follow_forwards_and_the_backwards_that_free_them():
    spans = [Span(0, "F", 0, 1, stage=0, microbatch=0, bytes=10), Span(0, "F", 1, 2, stage=0, microbatch=1, bytes=10),
             Span(0, "B", 2, 3, stage=0, microbatch=0), Span(0, "F", 3, 4, stage=0, microbatch=2, bytes=10),
             Span(0, "I", 4, 5, stage=0, microbatch=1), Span(0, "W", 5, 6, stage=0, microbatch=1),
             Span(0, "B", 6, 7, stage=0, microbatch=2)]
    assert peak_activations(spans) == (20, 2)


def test_chrome_trace_and_png_gantt(tmp_path):
    spans = {r: [Span(r, "step", 0, 4_000_000), Span(r, "F", r * 1_000_000, (r + 1) * 1_000_000, stage=r,
                                                   microbatch=0, bytes=8),
                 Span(r, "wait", 0, r * 1_000_000), Span(r, "B", 3_000_000 - r * 1_000_000, 4_000_000 - r * 1_000_000,
                                                          stage=r, microbatch=0)]
             for r in range(2)}
    trace = to_chrome_trace(spans)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 1}
    assert {e["name"] for e in complete if e["tid"] == 0} == {"F0 s0", "F0 s1", "B0 s0", "B0 s1"}
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0 (stage 0)", "rank 1 (stage 1)"]
    report = write_profile(spans, tmp_path, "sequential", stages=2, microbatches=1)
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    assert report["bubble_theory"] == pytest.approx(0.5)
    assert report["bubble_measured"] == pytest.approx(0.5)
    assert report["peak_activation_bytes"] == {0: 8, 1: 8}
    assert "measured 0.500, theory 0.500" in report["summary"]


# -- recorded by real pipeline runs ---------------------------------------------------------------------
def _record(ctx, steps: int = 2):
    model = sk.shard(build_gpt4(), ctx.plan, ctx)
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (8, 16), generator=generator)
    inputs, targets = ctx.shard_batch(x, x)
    with timeline.recording(ctx.rank):
        for _ in range(steps):
            model.step(inputs, targets, gpt_loss)
        return timeline.collect()


def _compute(spans, step):
    return [s for s in spans if s.kind in COMPUTE_KINDS and s.step == step]


@pytest.mark.world
def test_sequential_keeps_one_device_busy_at_a_time(world, tmp_path):
    plan = Plan(mesh=Mesh(pp=4), pipeline=Pipeline(schedule="sequential"))
    per_rank = dict(enumerate(world(4).run(_record, plan=plan)))
    busy = sorted((s.start_ns, s.end_ns, r) for r, spans in per_rank.items() for s in _compute(spans, 1))
    assert len(busy) == 8  # one forward and one backward per stage
    assert all(a[1] <= b[0] for a, b in zip(busy, busy[1:])), "two devices computed at the same time"
    assert [r for *_, r in busy] == [0, 1, 2, 3, 3, 2, 1, 0]
    report = write_profile(per_rank, tmp_path, "sequential", stages=4, microbatches=1)
    assert report["bubble_theory"] == pytest.approx(0.75)
    assert report["bubble_measured"] >= 0.75 - 1e-9  # non-overlapping busy spans cannot do better than 1 - 1/p
    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    assert any(s.kind == "wait" for s in per_rank[3])  # the last stage waits for its input


def one_f_one_b_order(stage: int, stages: int, microbatches: int) -> list[str]:
    """The 1F1B definition: warm up with (stages - stage) forwards, alternate B/F, drain the backwards."""
    warmup = min(microbatches, stages - stage)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [f"B{i}", f"F{warmup + i}"]
    return order + [f"B{i}" for i in range(microbatches - warmup, microbatches)]


@pytest.mark.world
def test_1f1b_ramps_up_alternates_and_drains_and_holds_fewer_microbatches_than_gpipe(world, tmp_path):
    spans = {}
    for schedule in ("1f1b", "gpipe"):
        plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule=schedule, microbatches=4))
        spans[schedule] = dict(enumerate(world(2).run(_record, plan=plan)))
    for rank, recorded in spans["1f1b"].items():
        order = [f"{s.kind}{s.microbatch}" for s in sorted(_compute(recorded, 1), key=lambda s: s.start_ns)]
        assert order == one_f_one_b_order(rank, 2, 4)
    peaks = {name: {r: peak_activations([s for s in sp if s.step == 1]) for r, sp in by_rank.items()}
             for name, by_rank in spans.items()}
    assert peaks["1f1b"][0][1] == 2 and peaks["gpipe"][0][1] == 4  # micro-batches held by stage 0
    assert peaks["1f1b"][0][0] * 2 == pytest.approx(peaks["gpipe"][0][0])
    report = write_profile(spans["1f1b"], tmp_path, "1f1b", stages=2, microbatches=4)
    assert report["bubble_theory"] == pytest.approx(theoretical_bubble("1f1b", 2, 4))
    assert 0.0 <= report["bubble_measured"] < 1.0
