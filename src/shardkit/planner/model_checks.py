"""Checks of a plan against a model on the meta device (composed by :mod:`shardkit.planner.validate`).

:func:`analyse_model` runs the model once on meta tensors (:mod:`shardkit.planner.dataflow`),
plans tensor parallelism per model axis (:mod:`shardkit.planner.tensor_parallel`), follows
the split outputs of column-parallel layers to catch an op over their whole features (a norm,
softmax or one-head attention) and to decide the parameters acting on them
(:mod:`shardkit.planner.split_params`), runs one tensor-parallel shard of the
model at its local shapes to catch code that reshapes with global sizes, and checks context
parallel against the model's family. It returns what the runtime needs (:class:`ModelFacts`)
and one line per problem.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..families import Family, family_of
from ..families.modules import is_linear
from ..families.on_meta import module_stack
from ..plan import Plan, PlanError
from ..plan.layout import ParamLayout
from .dataflow import Dataflow, meta_tensors, run_on_meta, trace
from .experts import ExpertsLayer, find_experts
from .one_rank import one_rank
from .sequence_checks import CausalConv, context_parallel_checks, sequence_parallel_checks
from .split_params import follow_axis
from .tensor_parallel import (
    AxisPlan,
    axis_problems,
    plan_axis,
)


@dataclass(frozen=True)
class ModelFacts:
    """What the checks learned that the runtime applies: the family, the tensor-parallel plan of
    every model axis, the parameters no forward uses (``None`` when the forward could not be
    run on meta: no example input known), and what activation recompute applies to: the
    repeated blocks and the attention modules inside them (:func:`recompute_targets`), the causal
    convolutions context parallel gives their neighbours' positions (``causal_convs``), and the
    experts modules ``ep`` splits (:mod:`shardkit.planner.experts`; empty without ``ep``)."""

    family: str
    tensor_parallel: dict[str, AxisPlan] = field(default_factory=dict)
    unused_parameters: tuple[str, ...] | None = None
    blocks: tuple[str, ...] = ()
    attentions: tuple[str, ...] = ()
    causal_convs: tuple[CausalConv, ...] = ()
    experts: tuple[ExpertsLayer, ...] = ()


#: While :func:`shared_traces` is open, the traces :func:`trace_model` made of the family's example, per model.
_SHARED: ContextVar[weakref.WeakKeyDictionary[nn.Module, Dataflow] | None] = ContextVar("shared_traces", default=None)


@contextmanager
def shared_traces(traces: weakref.WeakKeyDictionary[nn.Module, Dataflow]) -> Iterator[None]:
    """While open, :func:`trace_model` of a model with the family's example input is read from and
    kept in ``traces``: for a caller validating many plans of one model that nothing changes in
    between (the planner's probe model), which every validation otherwise traces again."""
    token = _SHARED.set(traces)
    try:
        yield
    finally:
        _SHARED.reset(token)


def trace_model(model: nn.Module, example_inputs: tuple | None = None) -> Dataflow:
    """The dataflow trace :func:`analyse_model` reads: one forward and backward of ``example_inputs``
    (or the family's example) on meta, the outputs of the linear layers watched."""
    shared = _SHARED.get() if example_inputs is None else None
    if shared is not None and model in shared:
        return shared[model]
    inputs = example_inputs or family_of(model).example_inputs(model)
    flow = trace(model, inputs, {name for name, module in model.named_modules() if is_linear(module)})
    if shared is not None:
        shared[model] = flow
    return flow


def analyse_model(plan: Plan, model: nn.Module, layouts: dict[str, ParamLayout],
                  example_inputs: tuple | None = None, flow: Dataflow | None = None) -> tuple[ModelFacts, list[str]]:
    """Every problem of ``plan`` on ``model`` beyond the layouts' shapes and the pipeline stages.
    ``flow``: :func:`trace_model`'s trace of the same inputs, when the caller has it already."""
    family = family_of(model)
    inputs = example_inputs or family.example_inputs(model)
    mesh = plan.mesh
    flow = flow or trace_model(model, example_inputs)
    problems = axis_problems(layouts, model)
    axis_plans: dict[str, AxisPlan] = {}
    routed = tuple(e.name for e in find_experts(model)) if plan.sequence_parallel and mesh.size_of("ep") > 1 else ()
    if not problems:
        for axis in mesh.model_axes:
            try:
                axis_plans[axis] = plan_axis(model, layouts, axis, mesh[axis], family, flow, plan.sequence_parallel,
                                             routed)
            except PlanError as exc:
                problems += exc.problems
    if axis_plans and not problems and flow.ran:
        for axis, axis_plan in axis_plans.items():  # split activations followed: ops across them, parameters on them
            axis_plans[axis], found = follow_axis(model, axis_plan, layouts, inputs, flow.dtype)
            problems += found
    if axis_plans and not problems and flow.ran:
        problems += shard_problems(model, family, layouts, list(axis_plans.values()), example_inputs, flow.dtype)
    convs, found = context_parallel_checks(model, family, mesh.size_of("sp"), example_inputs)
    problems += found + sequence_parallel_checks(model, family, list(axis_plans.values()), example_inputs)
    unused = tuple(flow.unused) if flow.ran else None
    blocks, attentions = recompute_targets(model, family) if plan.recompute != "none" else ((), ())
    return ModelFacts(family.name, axis_plans, unused, blocks, attentions, convs), problems


# -- activation recompute ------------------------------------------------------------------------------
def recompute_targets(model: nn.Module, family: Family | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(blocks, attentions)``: the model's repeated blocks, the children of its outermost
    ``nn.ModuleList``s (the layers FSDP also wraps one by one; for the reference GPT and
    transformers' causal LMs, the family's block units), and the attention modules the
    family knows inside them.

    >>> from shardkit.models.gpt import build_tiny_gpt
    >>> recompute_targets(build_tiny_gpt())
    (('layers.0', 'layers.1'), ('layers.0.attn', 'layers.1.attn'))
    """
    blocks: list[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{b}.") for b in blocks)
        if isinstance(module, nn.ModuleList) and not inside:
            blocks += [f"{name}.{child}" if name else child for child, _ in module.named_children()]
    family = family or family_of(model)
    attentions = [a.name for a in family.attentions(model) if any(a.name.startswith(f"{b}.") for b in blocks)]
    return tuple(blocks), tuple(attentions)


def recompute_problems(model: nn.Module, mode: str, family: Family | None = None) -> list[str]:
    """Why ``Plan(recompute=mode)`` cannot apply to ``model``: no repeated blocks, or for
    ``"selective"`` no attention shardkit knows inside them (empty: it can).

    >>> recompute_problems(nn.Sequential(nn.Linear(2, 2)), "selective")[0][:46]
    "recompute='selective' needs repeated blocks (t"
    """
    if mode == "none":
        return []
    family = family or family_of(model)
    blocks, attentions = recompute_targets(model, family)
    name = type(model).__name__
    if not blocks:
        return [f"recompute={mode!r} needs repeated blocks (the children of an nn.ModuleList, such as a "
                f"transformer's layers), but {name} has none; use recompute='none' or keep the layers in an "
                f"nn.ModuleList"]
    if mode == "selective" and not attentions:
        return [f"recompute='selective' recomputes the attention core of each block, but shardkit knows no "
                f"attention module in the blocks of {name} (family {family.name!r}; known: the reference GPT's "
                f"attention with attention_fn, transformers' *Attention modules); use recompute='full', which "
                f"recomputes whole blocks"]
    return []


# -- one shard at its local shapes ------------------------------------------------------------------
def _coprime_length(limit: int, product: int) -> int:
    """The longest sequence <= ``limit`` sharing no factor with ``product`` (so a reshape that wrongly
    folds a split into the sequence cannot divide evenly and fails)."""
    for length in range(min(limit, 64), 1, -1):
        if math.gcd(length, product) == 1:
            return length
    return 1




def shard_problems(model: nn.Module, family: Family, layouts: dict[str, ParamLayout], plans: list[AxisPlan],
                   example_inputs: tuple | None = None, dtype: torch.dtype | None = None) -> list[str]:
    """Run one tensor-parallel shard of ``model`` on meta tensors at its local shapes.

    Code that reshapes with a global size (OPT's ``view(bsz, -1, self.num_heads, head_dim)``)
    either fails here or, worse, silently folds the split into another dim on the real run; the
    example sequence length shares no factor with the axis sizes, so such a reshape cannot
    divide evenly and fails here, before launch (given ``example_inputs`` are used as they are).
    ``dtype``: the floating dtype of the stand-ins, where the model's own fails on meta.
    """
    product = math.prod(p.size for p in plans)
    length = _coprime_length(family.max_positions(model) or 64, product)
    inputs = example_inputs or family.example_inputs(model, seq_len=length)
    if inputs is None:
        return []
    tensors = meta_tensors(model, dtype)
    for plan in plans:
        for name, dim in plan.sliced:  # each rank holds its slice
            shape = list(tensors[name].shape)
            shape[dim] //= plan.size
            tensors[name] = torch.empty(shape, dtype=tensors[name].dtype, device="meta", requires_grad=True)
    stack: list[str] = []
    axes = ", ".join(f"{p.axis}={p.size}" for p in plans)
    try:
        with one_rank(model, plans, local_weights=False), module_stack(model, stack):
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


__all__ = ["ModelFacts", "analyse_model", "recompute_problems", "recompute_targets", "shard_problems", "trace_model"]
