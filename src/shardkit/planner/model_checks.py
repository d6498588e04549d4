"""Checks of a plan against a model on the meta device (composed by :mod:`shardkit.planner.validate`).

:func:`analyse_model` runs the model once on meta tensors (:mod:`shardkit.planner.dataflow`),
plans tensor parallelism per model axis (:mod:`shardkit.planner.tensor_parallel`), follows
the split outputs of column-parallel layers to catch an op over their whole features (a norm,
softmax or one-head attention: :func:`mixing_problems`), runs one tensor-parallel shard of the
model at its local shapes to catch code that reshapes with global sizes, and checks context
parallel against the model's family. It returns what the runtime needs (:class:`ModelFacts`)
and one line per problem.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..families import Family, family_of
from ..families.modules import is_linear
from ..plan import Plan, PlanError
from ..plan.layout import ParamLayout
from .dataflow import Mixes, Split, follow_split, meta_tensors, run_on_meta, trace
from .experts import ExpertsLayer
from .sequence_checks import CausalConv, context_parallel_checks, sequence_parallel_checks
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
        problems += mixing_problems(model, inputs, list(axis_plans.values()))
    if axis_plans and not problems and flow.ran:
        problems += shard_problems(model, family, layouts, list(axis_plans.values()), example_inputs)
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


# -- ops over the split features -----------------------------------------------------------------------
class _MixWatch(TorchFunctionMode):
    """Follows where column-parallel outputs that stay split hold their features through the
    forward (:func:`~shardkit.planner.dataflow.follow_split`) and records, per column layer, the
    first op certain to compute across them. Tracking stops at any op it cannot follow (a
    collective the code runs itself, say) and at split parameters (DTensors at run time)."""

    def __init__(self, split_params: set[int]):
        super().__init__()
        self.split_params = split_params
        self.splits: dict[int, tuple[torch.Tensor, Split, str]] = {}  # the tensor is kept so no other reuses its id
        self.inside = 0  # split modules running: torch's styles compute there
        self.found: dict[str, str] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        known = {id(t): self.splits[id(t)] for t in tensors if id(t) in self.splits}
        if self.inside or not known or any(id(t) in self.split_params for t in tensors):
            return out
        layers = sorted({name for _, _, name in known.values()})
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for tensor in outs:
            self.splits.pop(id(tensor), None)
        try:
            found = follow_split(func, args, kwargs, out, {i: split for i, (_, split, _) in known.items()})
        except Mixes as exc:
            for layer in layers if exc.certain else ():
                self.found.setdefault(layer, str(exc))
            return out
        except Exception:  # arguments follow_split does not read: not followed
            return out
        self.splits.update({id(t): (t, found[id(t)], layers[0]) for t in outs if id(t) in found})
        return out


def mixing_problems(model: nn.Module, inputs: tuple, plans: list[AxisPlan]) -> list[str]:
    """One line per column-parallel layer whose output, kept split, reaches an op that computes
    across its features (a norm, softmax or sum over them, a matmul contracting over them,
    attention over one head): each rank would compute it from its part only, silently wrong.
    Only ops shardkit follows count (elementwise ops, reshapes, cuts, attention between heads),
    so no correct plan is refused; the forward runs once at global shapes on meta tensors."""
    tensors = meta_tensors(model)
    modules = dict(model.named_modules())
    split_params = {id(tensors[f"{plan_split.name}.{p}"]) for plan in plans for plan_split in plan.splits.values()
                    for p, dim in plan_split.placements.items()
                    if dim is not None and f"{plan_split.name}.{p}" in tensors}
    watch = _MixWatch(split_params)
    local = set().union(*(plan.local_outputs() for plan in plans))
    handles = []

    def enter(_m: nn.Module, _a: tuple) -> None:
        watch.inside += 1

    def leave(_m: nn.Module, _a: tuple, out: Any, name: str) -> None:
        split = Split.of_output(out) if name in local and isinstance(out, torch.Tensor) and out.dim() else None
        watch.inside -= 1
        if split is not None:
            watch.splits[id(out)] = (out, split, name)

    for name in {n for plan in plans for n in plan.splits}:
        handles += [modules[name].register_forward_pre_hook(enter),
                    modules[name].register_forward_hook(lambda m, a, out, name=name: leave(m, a, out, name))]
    try:
        with watch:
            run_on_meta(model, tensors, inputs)
    except Exception:  # the model's own error: the other checks report it
        return []
    finally:
        for handle in handles:
            handle.remove()
    return [f"column-parallel layer {layer!r}: its output, split over the tensor-parallel axis, {why}, so each rank "
            f"would compute it from its part of the features alone (no error, wrong numbers); replicate {layer!r} "
            f"and the row-parallel layer it feeds (layout None)" for layer, why in sorted(watch.found.items())]


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


__all__ = ["ModelFacts", "analyse_model", "mixing_problems", "recompute_problems", "recompute_targets",
           "shard_problems"]
