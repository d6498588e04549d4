"""Per-device timeline: every rank's spans (:mod:`shardkit.runtime.spans`) as a Chrome/Perfetto
trace, a PNG Gantt chart (one row per device) and the measured bubble fraction beside the
theoretical ``(p-1)/(v*m+p-1)``; :func:`profile` records a few pipeline steps and writes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..plan.pipeline import theoretical_bubble
from ..runtime.spans import Span, collect, recording

#: Kinds of span that count as a device being busy.
COMPUTE_KINDS = ("F", "B", "I", "W")
COLORS = {"F": "#4C8BF5", "B": "#F28C28", "I": "#F2B628", "W": "#3AAA5C", "wait": "#BBBBBB", "sync": "#888888"}
LABELS = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)",
          "wait": "P2P wait", "sync": "loss sync"}


# -- analysis -----------------------------------------------------------------------------------
def _union_ns(intervals: Sequence[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _steps(spans_by_rank: Mapping[int, Sequence[Span]]) -> list[int]:
    steps = sorted({s.step for spans in spans_by_rank.values() for s in spans if s.kind == "step"})
    return steps[1:] if len(steps) > 1 else steps  # the first step also infers shapes: skip it


def bubble_fraction(spans_by_rank: Mapping[int, Sequence[Span]]) -> float:
    """Measured idle fraction: ``1 - busy / (devices x step time)``, averaged over steps.

    A step lasts from the first rank's step start to the last rank's step end; busy time is
    the union of a rank's compute spans. With several steps the first (shape inference) is
    left out.

    >>> a = [Span(0, "step", 0, 10), Span(0, "F", 0, 5)]
    >>> b = [Span(1, "step", 0, 10), Span(1, "F", 5, 10)]
    >>> bubble_fraction({0: a, 1: b})
    0.5
    """
    fractions = []
    for step in _steps(spans_by_rank):
        marks = [s for spans in spans_by_rank.values() for s in spans if s.kind == "step" and s.step == step]
        start, end = min(s.start_ns for s in marks), max(s.end_ns for s in marks)
        if end <= start:
            continue
        busy = sum(_union_ns([(s.start_ns, s.end_ns) for s in spans if s.kind in COMPUTE_KINDS and s.step == step])
                   for spans in spans_by_rank.values())
        fractions.append(1 - busy / (len(spans_by_rank) * (end - start)))
    if not fractions:
        raise ValueError("no 'step' spans recorded; record a step with recording() around model.step(...)")
    return sum(fractions) / len(fractions)


def peak_activations(spans: Sequence[Span]) -> tuple[int, int]:
    """(peak activation bytes, peak micro-batches) held at once by one rank, from its spans.

    A forward ``F`` adds the bytes it saved; the backward that finishes that micro-batch on
    that stage (``B``, or ``W`` after ``I``) frees them.
    """
    events = []
    for s in spans:
        if s.kind == "F":
            events.append((s.end_ns, 1, s.bytes, (s.step, s.stage, s.microbatch)))
        elif s.kind in ("B", "W"):
            events.append((s.end_ns, -1, 0, (s.step, s.stage, s.microbatch)))
    live: dict[tuple, int] = {}
    peak_bytes = peak_count = 0
    for _, sign, nbytes, key in sorted(events, key=lambda e: (e[0], e[1])):
        if sign > 0:
            live[key] = nbytes
        else:
            live.pop(key, None)
        peak_bytes = max(peak_bytes, sum(live.values()))
        peak_count = max(peak_count, len(live))
    return peak_bytes, peak_count


def to_chrome_trace(spans_by_rank: Mapping[int, Sequence[Span]]) -> dict[str, Any]:
    """Chrome/Perfetto trace events: one process per rank, compute and communication on two threads."""
    events: list[dict[str, Any]] = []
    origin = min((s.start_ns for spans in spans_by_rank.values() for s in spans), default=0)
    for rank, spans in sorted(spans_by_rank.items()):
        stages = sorted({s.stage for s in spans if s.stage is not None})
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}" + (f" (stage {', '.join(map(str, stages))})" if stages else "")}})
        for tid, name in ((0, "compute"), (1, "communication"), (2, "steps")):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        for s in spans:
            tid = 0 if s.kind in COMPUTE_KINDS else 2 if s.kind == "step" else 1
            name = s.kind if s.microbatch is None else f"{s.kind}{s.microbatch}"
            if s.stage is not None and s.kind in COMPUTE_KINDS:
                name += f" s{s.stage}"
            events.append({"name": name, "cat": LABELS.get(s.kind, s.kind), "ph": "X", "pid": rank, "tid": tid,
                           "ts": (s.start_ns - origin) / 1e3, "dur": max(s.duration_ns, 1) / 1e3,
                           "args": {k: v for k, v in asdict(s).items() if k not in ("start_ns", "end_ns", "rank")}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot_gantt(spans_by_rank: Mapping[int, Sequence[Span]], path: str | Path, title: str = "",
               step: int | None = None) -> Path:
    """A PNG Gantt chart: one row per device, coloured busy spans on white (idle), waits in grey.

    ``step``: draw only that step (default: every span recorded).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if step is not None:
        spans_by_rank = {r: [s for s in spans if s.step == step] for r, spans in spans_by_rank.items()}
    ranks = sorted(spans_by_rank)
    origin = min((s.start_ns for r in ranks for s in spans_by_rank[r]), default=0)
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(ranks) + 1.6))
    kinds_seen = set()
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for s in spans_by_rank[rank]:
            if s.kind == "step":
                continue
            kinds_seen.add(s.kind)
            start, width = (s.start_ns - origin) / 1e6, s.duration_ns / 1e6
            compute = s.kind in COMPUTE_KINDS
            height = 0.8 if compute else 0.3
            ax.broken_barh([(start, width)], (y - height / 2, height), facecolors=COLORS.get(s.kind, "#999999"),
                           edgecolor="black" if compute else "none", linewidth=0.3)
            if compute and s.microbatch is not None:
                ax.text(start + width / 2, y, str(s.microbatch), ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([_row_label(r, spans_by_rank[r]) for r in reversed(ranks)])
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS if k in kinds_seen],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6, fontsize=7, frameon=False)
    ax.set_facecolor("white")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _row_label(rank: int, spans: Sequence[Span]) -> str:
    stages = sorted({s.stage for s in spans if s.stage is not None})
    return f"rank {rank}" + (f"\nstage {','.join(map(str, stages))}" if stages else "")


def write_profile(spans_by_rank: Mapping[int, Sequence[Span]], out_dir: str | Path, schedule: str, stages: int,
                  microbatches: int, virtual_stages: int = 1) -> dict[str, Any]:
    """Write ``timeline.json`` (Chrome/Perfetto, every step) and ``timeline.png`` (the last step).

    ``stages`` is the total stage count; pipeline devices are ``stages // virtual_stages``.
    Returned keys: ``trace``, ``png``, ``bubble_measured``, ``bubble_theory`` (``None`` where no
    closed form), ``peak_activation_bytes`` and ``peak_microbatches`` (per rank), ``summary`` (text).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    devices = max(1, stages // virtual_stages)
    measured = bubble_fraction(spans_by_rank)
    theory = theoretical_bubble(schedule, devices, microbatches, virtual_stages)
    trace = out / "timeline.json"
    trace.write_text(json.dumps(to_chrome_trace(spans_by_rank)))
    theory_text = "n/a" if theory is None else f"{theory:.3f}"
    title = (f"{schedule}: {devices} pipeline devices, {microbatches} micro-batches"
             + (f", {virtual_stages} stages/device" if virtual_stages > 1 else "")
             + f" | bubble measured {measured:.3f}, theory (p-1)/(v*m+p-1) = {theory_text}")
    last = max(_steps(spans_by_rank))
    png = plot_gantt(spans_by_rank, out / "timeline.png", f"{title}\nstep {last}", step=last)
    peaks = {rank: peak_activations(spans) for rank, spans in spans_by_rank.items()}
    summary = (f"bubble fraction: measured {measured:.3f}, theory {theory_text} ({schedule}, p={devices}, "
               f"m={microbatches}{f', v={virtual_stages}' if virtual_stages > 1 else ''})\n"
               f"trace: {trace}\nchart: {png}")
    return {"trace": str(trace), "png": str(png), "bubble_measured": measured, "bubble_theory": theory,
            "peak_activation_bytes": {r: p[0] for r, p in peaks.items()},
            "peak_microbatches": {r: p[1] for r, p in peaks.items()}, "summary": summary}


def _profile_job(ctx: Any, build_model: Any, batch: tuple, loss_fn: Any, steps: int) -> list[Span]:
    from ..runtime.apply import shard

    model = shard(build_model(), ctx.plan, ctx)
    inputs, targets = ctx.shard_batch(*batch)
    with recording(ctx.rank):
        for _ in range(steps):
            model.step(inputs, targets, loss_fn)
            model.zero_grad(set_to_none=True)
        return collect()


def profile(build_model: Any, plan: Any, batch: tuple, loss_fn: Any, out_dir: str | Path, steps: int = 3,
            world: Any = None) -> dict[str, Any]:
    """Run ``steps`` pipeline steps of ``build_model()`` under ``plan`` and :func:`write_profile` them.

    >>> report = profile(build_tiny_gpt, plan, (x, y), gpt_loss, "prof")   # doctest: +SKIP
    >>> print(report["summary"])                                           # doctest: +SKIP
    """
    from ..runtime.world import launch

    pipeline = plan.pipeline
    if pipeline is None:
        raise ValueError("profile() draws a pipeline timeline; the plan has no pipeline")
    spans = launch(_profile_job, plan, build_model, batch, loss_fn, steps, world=world)
    mesh = plan.mesh if world is None else plan.mesh.resolved(world.size)
    return write_profile(dict(enumerate(spans)), out_dir, pipeline.schedule, pipeline.num_stages(mesh),
                         pipeline.microbatches, pipeline.virtual_stages)


__all__ = ["bubble_fraction", "peak_activations", "plot_gantt", "profile",
           "to_chrome_trace", "write_profile"]
