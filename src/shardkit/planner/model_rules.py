"""The layout rules the planner prices a model with, and what one tensor-parallel rank of them holds.

:func:`default_rules` are the rules shardkit knows for a model (the reference GPT's, GPT-2's,
transformers' own plan, else those inferred from its dataflow); :func:`axis_plan` is one ``tp``
rank's plan from rules, checked as the validator checks it; :func:`fsdp_dims` the dims FSDP
shards where a layout names one. :func:`shardkit.planner.analysis.analyse` measures a rank with them.
"""

from __future__ import annotations

from torch import nn

from ..families import Family
from ..families.modules import is_linear
from ..plan import LayoutMap, Mesh, PlanError, UsageError, param_shapes, resolve_layouts
from ..plan.hf_plan import hf_tp_plan
from .dataflow import trace
from .experts import find_experts
from .split_params import follow_axis
from .tensor_parallel import AxisPlan, plan_axis, tensor_parallel_problems


def default_rules(model: nn.Module, family: Family) -> LayoutMap | None:
    """The rules shardkit knows for ``model``: the reference GPT's, GPT-2's, transformers' own plan
    (with its expert-parallel plan for a mixture of experts: experts whole over ``tp``), else the
    rules inferred from its dataflow (``sk.infer_tp_rules``; ``None`` if nothing pairs)."""
    from ..models.gpt import GPT_RULES
    from ..models.hf import GPT2_RULES
    from .tp_infer import infer_tp_rules

    if family.name == "gpt":
        return GPT_RULES
    if family.name == "gpt2" and any(n.startswith("transformer.h.") for n, _ in model.named_parameters()):
        return GPT2_RULES
    if hf_tp_plan(model):
        if hf_tp_plan(model, "ep") and find_experts(model):  # experts whole over tp (no style splits them; ep does)
            try:
                return LayoutMap.from_hf(model, ep=True)
            except (PlanError, UsageError):  # a style of its ep plan shardkit does not take: its tp plan's rules
                pass
        return LayoutMap.from_hf(model)
    try:
        return infer_tp_rules(model)
    except (PlanError, UsageError):  # nothing pairs: tp > 1 is then refused, naming the model
        return None


def axis_plan(model: nn.Module, family: Family, rules: LayoutMap | None, tp: int) -> AxisPlan:
    """The tensor-parallel plan of one ``tp`` rank, checked as the validator checks it."""
    where = f"analyse(tp={tp})"
    if rules is None or "tp" not in rules.axes():
        raise PlanError(f"{where}: no layout rules split {type(model).__name__} over 'tp' "
                        f"({'none known' if rules is None else f'the rules use axes {sorted(rules.axes())}'}); "
                        f"pass rules=LayoutMap([...]) with 'tp' in them, or tp=1")
    try:
        layouts = resolve_layouts(param_shapes(model), rules, rules_mesh(rules, tp)).params
    except PlanError as exc:  # sizes tp does not divide; head counts too, so one error names every size
        raise PlanError([f"{where}: {p}" for p in exc.problems + tensor_parallel_problems(model, tp)]) from None
    inputs = family.example_inputs(model, seq_len=8)
    try:
        flow = trace(model, inputs, {n for n, m in model.named_modules() if is_linear(m)})
        plan = plan_axis(model, layouts, "tp", tp, family, flow)
    except PlanError as exc:
        raise PlanError([f"{where}: {p}" for p in exc.problems]) from None
    if flow.ran:  # parameters sliced with the activations they act on (GPT-OSS' sinks) are local too; what
        plan, _ = follow_axis(model, plan, layouts, inputs, flow.dtype)  # it refuses, validate refuses
    if not plan.splits:
        raise PlanError(f"{where}: the rules split no parameter of {type(model).__name__} over 'tp'")
    return plan


def rules_mesh(rules: LayoutMap, tp: int) -> Mesh:
    """The mesh ``rules`` are resolved on for one rank of ``tp``: their other axes (``fsdp``, user
    axes) at size 1, as they do not change a ``tp`` rank's shapes."""
    return Mesh(**{axis: 1 for axis in sorted(rules.axes() - {"tp"})}, tp=tp)


def fsdp_dims(model: nn.Module, rules: LayoutMap | None) -> dict[str, int]:
    """The dims FSDP shards where a layout names one (every other parameter: dim 0)."""
    if rules is None or "fsdp" not in rules.axes():
        return {}
    layouts = resolve_layouts(param_shapes(model), rules, rules_mesh(rules, 1)).params
    return {name: dim for name, layout in layouts.items() if (dim := layout.axis_dim("fsdp")) is not None}


__all__ = ["axis_plan", "default_rules", "fsdp_dims", "rules_mesh"]
