"""``sk.validate(plan, model)``: every check that can be made before launch, in one place.

The plan layer checks what it knows without a model (:meth:`Plan.problems`: axes, sizes,
schedules, groupings). This module composes those with every check against the model, on
the meta device: layouts on the parameters, pipeline stages, and the model checks of
:mod:`shardkit.planner.model_checks`. It collects every problem and raises once, so one call
reports everything that is wrong. ``sk.shard`` runs the same function, so a plan passed
straight to ``sk.launch`` + ``sk.shard`` gets the same :class:`PlanError` before any weight moves.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from ..plan import Mesh, Plan, PlanError, PlanWarning, UsageError, param_shapes, resolve_layouts
from ..plan.layout import LayoutResolution, axes_of
from ..plan.mesh import is_model_axis
from .batch_stats import BatchStats, batch_stats_problems, classified
from .experts import expert_problems
from .model_checks import ModelFacts, analyse_model, recompute_problems, trace_model
from .routing import routing_problems
from .stages import assign_stages
from .tensor_parallel import aliases


@dataclass(frozen=True)
class ValidationReport:
    """What :func:`validate` found: the resolved mesh and layouts, the warnings it raised, and
    (for an ``nn.Module``) what the runtime applies: :class:`~shardkit.planner.model_checks.ModelFacts`;
    ``batch_stats``: the modules normalising with batch statistics, where its meta forward found them."""

    mesh: Mesh
    layouts: LayoutResolution
    warnings: list[str] = field(default_factory=list)
    facts: ModelFacts | None = None
    batch_stats: BatchStats | None = None


def validate(plan: Plan, model: Any, world_size: int | None = None, *,
             example_inputs: tuple | None = None) -> ValidationReport:
    """Check ``plan`` against ``model`` (an ``nn.Module``, on the meta device is best, or a
    mapping ``{parameter name: shape}`` for the layout checks alone). No processes, no memory.

    Raises :class:`PlanError` listing every problem, each naming the parameter, module, axis
    and sizes and what would be valid. Warns (:class:`PlanWarning`) about rules that match
    no parameter. ``example_inputs``: one micro-batch for the dataflow checks when the model's
    family does not say what it takes.

    >>> from shardkit.plan import LayoutMap, Mesh, Plan
    >>> validate(Plan(Mesh(tp=2), LayoutMap([("w", ("tp", None))])), {"w": (3, 4)})
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.PlanError: parameter 'w' (shape [3, 4], rule 'w'): dim 0 has size 3, not divisible by tp=2 (2); axis sizes that divide it: [1, 3]
    """
    if not isinstance(plan, Plan):
        raise UsageError(f"validate(plan, model): plan must be a shardkit Plan, got {type(plan).__name__}")
    mesh = plan.mesh
    if world_size is not None:
        mesh = mesh.resolved(world_size)
    elif not mesh.is_resolved:
        raise PlanError(f"{mesh!r} has an inferred (-1) axis; pass world_size= to validate it")
    plan = plan.resolved(mesh.size)
    problems = plan.problems()
    try:
        layouts = resolve_layouts(param_shapes(model), plan.rules, mesh)
    except PlanError as exc:
        problems.extend(exc.problems)
        layouts = None
    facts, stats = None, None
    if isinstance(model, nn.Module):
        # one forward on meta serves the model checks and the batch statistics (each forward costs)
        flow = trace_model(model, example_inputs) if layouts is not None else None
        problems += recompute_problems(model, plan.recompute)
        stats = classified(model, flow.batch_norms) if flow is not None and flow.batch_norms is not None else None
        problems += batch_stats_problems(plan, model, example_inputs, stats)
        problems += routing_problems(plan, model, example_inputs)
        if plan.pipeline is not None:
            try:
                assign_stages(model, plan.pipeline, mesh, example_inputs)
            except PlanError as exc:
                problems.extend(exc.problems)
        if layouts is not None:
            layouts, found = _tied_names(plan, model, layouts)
            problems.extend(found)
            problems.extend(_axes_splitting_nothing(plan, layouts))
            facts, found = analyse_model(plan, model, layouts.params, example_inputs, flow)
            problems.extend(found)
        experts, found = expert_problems(plan, model)
        problems.extend(found)
        if facts is not None and experts:
            facts = replace(facts, experts=tuple(experts))
    if problems:
        raise PlanError(problems)
    assert layouts is not None
    found = [f"layout rule {p!r} matches no parameter (a typo or a renamed module?)" for p in layouts.unused_rules]
    for text in found:
        warnings.warn(text, PlanWarning, stacklevel=2)
    return ValidationReport(mesh, layouts, found, facts, stats)


def _axes_splitting_nothing(plan: Plan, layouts: LayoutResolution) -> list[str]:
    """Model axes some rule names but no parameter's layout uses (the rules naming them match no
    parameter, or an earlier rule takes their parameters): every rank of the axis would compute
    the same thing. (An axis no rule names is :meth:`Plan.problems`'.)"""
    used = {axis for lay in layouts.params.values() if lay.layout for entry in lay.layout for axis in axes_of(entry)}
    named = plan.rules.axes() if plan.rules is not None else set()
    problems = []
    for axis in plan.mesh.names:
        if plan.mesh[axis] > 1 and is_model_axis(axis) and axis in named and axis not in used:
            rules = [f"#{i} {pattern!r}" for i, (pattern, layout) in enumerate(plan.rules.items())
                     if layout and any(axis in axes_of(entry) for entry in layout)]
            problems.append(f"mesh axis {axis!r} (size {plan.mesh[axis]}) splits no parameter: the rules naming it "
                            f"({', '.join(rules)}) match none that an earlier rule does not take first (a typo in "
                            f"a module name, or a rule such as '.*' placed before them?), so every {axis} rank "
                            f"would compute the same thing; fix the rules or remove the axis")
    return problems


def _tied_names(plan: Plan, model: nn.Module, layouts: LayoutResolution) -> tuple[LayoutResolution, list[str]]:
    """A tied parameter has one layout, its first name's. A rule written for one of its other
    names (Llama's ``lm_head.weight`` is ``model.embed_tokens.weight`` when tied; a rule that does
    not also match the first name, unlike a catch-all) counts as used, and must give the same
    layout, else the plan is refused: the tie would break or be split two ways."""
    if plan.rules is None:
        return layouts, []
    patterns = list(plan.rules)
    used, problems = set(), []
    for name, first in aliases(model).items():
        hit = plan.rules.lookup(name)
        if name == first or hit is None:
            continue
        index, layout = hit
        if plan.rules.matches(index, first):
            continue  # a rule for both names (a catch-all): the first name's rule decides
        used.add(patterns[index])
        canonical = layouts.params[first]
        if layout != canonical.layout:
            problems.append(f"parameter {name!r} is tied to {first!r} (one tensor), but rule #{index} "
                            f"{patterns[index]!r} gives it layout {layout!r} while {first!r} has {canonical.layout!r} "
                            f"from rule #{canonical.rule}; a tied parameter has one layout: give both names the same "
                            f"layout, or untie them")
    unused = [p for p in layouts.unused_rules if p not in used]
    return LayoutResolution(layouts.params, unused), problems


__all__ = ["ValidationReport", "validate"]
