"""Checks of a plan against a model on the meta device (composed by :mod:`shardkit.planner.validate`).

:func:`analyse_model` runs the model once on meta tensors (:mod:`shardkit.planner.dataflow`),
plans tensor parallelism per model axis (:mod:`shardkit.planner.tensor_parallel`), runs one
tensor-parallel shard of the model at its local shapes to catch code that reshapes with
global sizes, and checks context parallel against the model's family. It returns what the
runtime needs (:class:`ModelFacts`) and one line per problem.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..families import Family, family_of
from ..families.modules import is_linear
from ..plan import Plan, PlanError
from ..plan.layout import ParamLayout
from .dataflow import meta_tensors, run_on_meta, trace
from .tensor_parallel import (
    COLWISE,
    ROWWISE,
    AxisPlan,
    axis_problems,
    plan_axis,
)


@dataclass(frozen=True)
class ModelFacts:
    """What the checks learned that the runtime applies: the family, the tensor-parallel plan of
    every model axis, and the parameters no forward uses (``None`` when the forward could not be
    run on meta: no example input known)."""

    family: str
    tensor_parallel: dict[str, AxisPlan] = field(default_factory=dict)
    unused_parameters: tuple[str, ...] | None = None


def analyse_model(plan: Plan, model: nn.Module, layouts: dict[str, ParamLayout],
                  example_inputs: tuple | None = None) -> tuple[ModelFacts, list[str]]:
    """Every problem of ``plan`` on ``model`` beyond the layouts' shapes and the pipeline stages."""
    family = family_of(model)
    inputs = example_inputs or family.example_inputs(model)
    mesh = plan.mesh
    watch = {name for name, module in model.named_modules() if is_linear(module)}
    flow = trace(model, inputs, watch)
    problems = axis_problems(layouts, model)
    axis_plans: dict[str, AxisPlan] = {}
    if not problems:
        for axis in mesh.model_axes:
            try:
                axis_plans[axis] = plan_axis(model, layouts, axis, mesh[axis], family, flow, plan.sequence_parallel)
            except PlanError as exc:
                problems += exc.problems
    if axis_plans and not problems and flow.ran:
        problems += shard_problems(model, family, layouts, list(axis_plans.values()), example_inputs)
    if mesh.size_of("sp") > 1:
        problems += family.context_parallel_problems(model)
    unused = tuple(flow.unused) if flow.ran else None
    return ModelFacts(family.name, axis_plans, unused), problems


# -- one shard at its local shapes ------------------------------------------------------------------
def _coprime_length(limit: int, product: int) -> int:
    """The longest sequence <= ``limit`` sharing no factor with ``product`` (so a reshape that wrongly
    folds a split into the sequence cannot divide evenly and fails)."""
    for length in range(min(limit, 64), 1, -1):
        if math.gcd(length, product) == 1:
            return length
    return 1


@contextmanager
def _as_one_shard(model: nn.Module, plans: list[AxisPlan], stack: list[str]) -> Iterator[None]:
    """Set the attribute changes and hook what torch's styles do at the boundaries of split modules.

    Inside a split module torch computes on DTensors, whose shapes are global (GPT-2's Conv1D
    reshapes with its global width), so the module keeps its full weights here; what the rest
    of the model sees is local: a column-parallel output that stays split is this rank's
    slice, and a row-parallel layer fed by one takes that slice in."""
    modules = dict(model.named_modules())
    saved = []
    handles = []
    for plan in plans:
        for change in plan.changes:
            module = modules[change.module]
            saved.append((module, change.attribute, getattr(module, change.attribute)))
            setattr(module, change.attribute, change.local)
        for name, split in plan.splits.items():
            if split.kind == COLWISE and not split.gather_output:
                handles.append(modules[name].register_forward_hook(
                    lambda _m, _a, out, n=plan.size: out.narrow(-1, 0, out.shape[-1] // n)))
            elif split.kind == ROWWISE and not split.replicated_input:
                handles.append(modules[name].register_forward_pre_hook(
                    lambda _m, args, n=plan.size: (args[0].repeat(*([1] * (args[0].dim() - 1)), n), *args[1:])))
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda _m, _a, n=name: stack.append(n)))
        handles.append(module.register_forward_hook(lambda _m, _a, _o: stack.pop() and None))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, attribute, value in saved:
            setattr(module, attribute, value)


def shard_problems(model: nn.Module, family: Family, layouts: dict[str, ParamLayout], plans: list[AxisPlan],
                   example_inputs: tuple | None = None) -> list[str]:
    """Run one tensor-parallel shard of ``model`` on meta tensors at its local shapes.

    Code that reshapes with a global size (OPT's ``view(bsz, -1, self.num_heads, head_dim)``)
    either fails here or, worse, silently folds the split into another dim on the real run; the
    example sequence length shares no factor with the axis sizes, so such a reshape cannot
    divide evenly and fails here, before launch (given ``example_inputs`` are used as they are).
    """
    product = math.prod(p.size for p in plans)
    length = _coprime_length(family.max_positions(model) or 64, product)
    inputs = example_inputs or family.example_inputs(model, seq_len=length)
    if inputs is None:
        return []
    tensors = meta_tensors(model)
    stack: list[str] = []
    axes = ", ".join(f"{p.axis}={p.size}" for p in plans)
    try:
        with _as_one_shard(model, plans, stack):
            run_on_meta(model, tensors, inputs)
    except Exception as exc:
        where = stack[-1] if stack else ""
        module = model.get_submodule(where) if where else model
        return [f"the model's forward fails on one tensor-parallel shard ({axes}) in module {where or '(root)'!r} "
                f"({type(module).__name__}): {type(exc).__name__}: {_first_line(exc)}. A reshape there needs a size the "
                f"shard does not have: either the code holds a global size (a head count or a width) that shardkit "
                f"knows no adaptation for (family {family.name!r}), or the split cuts a head in two (more ranks than "
                f"heads, or a width that does not split into whole heads). Use fewer ranks on that axis, replicate the "
                f"parameters of {where or 'that module'!r} and its partners (layout None), or make the code read the "
                f"size from the tensor (-1 in reshapes)"]
    return []


def _first_line(exc: BaseException) -> Any:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


__all__ = ["ModelFacts", "analyse_model", "shard_problems"]
