"""``explain_stages``: a plan's pipeline stages as a table (device, modules, parameters, cost).

Costs are measured on the meta device (:mod:`shardkit.planner.autosplit`) for one sample of
the model's example input on a nominal :class:`DeviceModel`. Memory per device is not
repeated here: it is the estimate's (``sk.estimate``, :mod:`shardkit.planner.memory`), which
``shardkit explain`` prints after the tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..plan import PlanError
from ..plan.pipeline import Pipeline
from ..plan.text import format_bytes, format_seconds, format_si
from .autosplit import DeviceModel
from .stages import assign_stages, layout_costs


def _compress(names: Sequence[str]) -> str:
    """``['layers.0', 'layers.1', 'layers.2', 'norm_f']`` -> ``'layers.0-2, norm_f'``."""
    out: list[str] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if run:
            prefix, first, last = run[0][0] and run[0][0] + ".", run[0][1], run[-1][1]
            out.append(f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}")
            run.clear()

    for name in names:
        prefix, _, tail = name.rpartition(".")
        if tail.isdigit() and run and run[-1][0] == prefix and run[-1][1] + 1 == int(tail):
            run.append((prefix, int(tail)))
            continue
        flush()
        if tail.isdigit():
            run.append((prefix, int(tail)))
        else:
            out.append(name)
    flush()
    return ", ".join(out)


def explain_stages(plan: Any, model: nn.Module, example_inputs: tuple | None = None,
                   device: DeviceModel | None = None, world_size: int | None = None) -> str:
    """A table of the plan's stages: device, modules, parameter bytes, estimated cost; plus the balance.

    Costs are for one sample of the model's example input on :class:`DeviceModel` (a nominal
    device); the balance is the slowest stage's time over the mean.

    >>> from shardkit.plan import Mesh, Pipeline, Plan
    >>> seq = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    >>> print(explain_stages(Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="gpipe")), seq))  # doctest: +ELLIPSIS
    pipeline: 2 stages on pp=2, schedule gpipe, 1 micro-batches, stages by even split
    stage  device  modules  params  param bytes  FLOP/sample  est. time
        0       0  0-1         144        576 B  768          19.3 ns
        1       1  2-3         144        576 B  768          19.3 ns
    balance (slowest / mean stage time): 1.000
    """
    pipeline: Pipeline = plan.pipeline
    if pipeline is None:
        return "no pipeline: every device holds all layers"
    if world_size is not None:
        plan = plan.resolved(world_size)
    elif not plan.mesh.is_resolved:
        raise PlanError(f"{plan.mesh!r} has an inferred (-1) axis; pass world_size= to explain its stages")
    problems = pipeline.check_mesh(plan.mesh)
    if problems:
        raise PlanError(problems)
    device = device or DeviceModel()
    assignment = assign_stages(model, pipeline, plan.mesh, example_inputs, device)
    layout = assignment.layout
    costs = assignment.costs
    if costs is None and layout.example_inputs is not None:
        costs = tuple(layout_costs(model, layout))
    devices = plan.mesh.size_of("pp")
    header = (f"pipeline: {assignment.num_stages} stages on pp={devices}, schedule {pipeline.schedule}, "
              f"{pipeline.microbatches} micro-batches, stages by {_METHOD_TEXT[assignment.method]}")
    rows = [("stage", "device", "modules", "params", "param bytes", "FLOP/sample", "est. time")]
    times = []
    for s in range(assignment.num_stages):
        params = {id(p): p for path in assignment.modules(s) for p in model.get_submodule(path).parameters()}
        numel = sum(p.numel() for p in params.values())
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
        if costs is not None:
            stage_costs = [costs[i] for i in assignment.stages[s]]
            t = sum(device.time(c) for c in stage_costs)
            times.append(t)
            extra = (format_si(3 * sum(c.flops for c in stage_costs)), format_seconds(t))
        else:
            extra = ("?", "?")
        rows.append((str(s), str(assignment.ranks[s]), _compress(assignment.unit_names(s)), str(numel),
                     format_bytes(nbytes), *extra))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [header] + ["  ".join(cell.rjust(w) if c in (0, 1, 3, 4) else cell.ljust(w)
                                  for c, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    if times:
        mean = sum(times) / len(times)
        lines.append(f"balance (slowest / mean stage time): {max(times) / mean if mean else 1.0:.3f}")
    return "\n".join(lines)






_METHOD_TEXT = {"split_points": "split points", "stage_modules": "module lists", "even": "even split",
                "auto": "auto split", "scopes": "sk.stage scopes"}


__all__ = ["explain_stages"]
