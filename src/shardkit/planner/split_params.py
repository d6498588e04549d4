"""Parameters outside the split layers that act on split activations, found on meta and decided.

torch's tensor-parallel styles split the parameters of Linear and Embedding layers. Every
other parameter is replicated, but may still act on an activation split over the axis (see
:mod:`shardkit.planner.split_activations`); what it needs depends on how it meets that split:

===============================================  ===========================================
how the forward uses it (every use)               what shardkit does
===============================================  ===========================================
broadcast across the split features: a            ``summed``: each rank's gradient covers its
learnable scalar (Apertus' xIELU ``alpha_p``),    part of the features only, so it is summed
a norm over each head of split heads (Qwen 3's    over the axis in the backward
``q_norm``), a matrix applied to each split head
lined up with the split along one of its dims:    ``sliced``: each rank keeps its slice (a
one value per head (GPT-OSS' ``sinks``)           DTensor ``Shard(dim)``) and uses it locally
on whole activations only                         nothing: replicated as it is
both ways, or combined with split features in     refused by :func:`shardkit.validate`, naming
a way no slicing makes right                      the parameter, the op and the axis
===============================================  ===========================================
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..families.on_meta import meta_tensors, swapped
from ..plan.layout import ParamLayout
from .split_activations import MIXED, SLICED, SUMMED, WHOLE, Use, follow_splits
from .tensor_parallel import DTENSOR, AxisPlan, aliases


def follow_axis(model: nn.Module, plan: AxisPlan, layouts: dict[str, ParamLayout], inputs: tuple,
                dtype: torch.dtype | None = None) -> tuple[AxisPlan, list[str]]:
    """``plan`` with the parameters acting on its split activations decided (``summed``,
    ``sliced``), and one line per problem: an op computing across split features, a parameter
    that cannot be made right."""
    canonical = aliases(model)
    styled = {n for n, s in plan.splits.items() if s.kind != DTENSOR}
    stopped = {canonical.get(f"{n}.{p}" if n else p, p) for n in styled for p in plan.splits[n].placements}
    flow = follow_splits(model, inputs, plan.local_outputs(), styled, stopped, dtype)
    if not flow.ran:
        return plan, []
    problems = [f"column-parallel layer {layer!r}: its output, split over the tensor-parallel axis, {why}, so each rank "
                f"would compute it from its part of the features alone (no error, wrong numbers); replicate {layer!r} "
                f"and the row-parallel layer it feeds (layout None)" for layer, why in sorted(flow.mixing.items())]
    params = dict(model.named_parameters())
    summed, sliced = [], {}
    for name, uses in sorted(flow.uses.items()):
        kind, found = _decide(name, uses, params[name].shape, layouts.get(name), plan.axis, plan.size)
        if kind is not None and name in flow.outside:
            found = [f"parameter {name!r} acts on activations split over {plan.axis!r} ({kind}), but the forward reads "
                     f"it outside its module's forward (in {repr(flow.outside[name]) if flow.outside[name] else 'the root'}), where shardkit cannot "
                     f"hand it over {'with its gradient summed' if kind == SUMMED else 'sliced'}; valid: replicate the "
                     f"layers whose split activations it meets (layout None), or drop {plan.axis!r}"]
            kind = None
        problems += found
        if kind == SUMMED:
            summed.append(name)
        elif kind == SLICED:
            sliced[name] = next(u.dim for u in uses if u.kind == SLICED)
    splits = dict(plan.splits)
    for module, split in plan.splits.items():
        if split.kind != DTENSOR:
            continue
        prefix = f"{module}." if module else ""
        layout_split = {prefix + p: d for p, d in split.placements.items() if d is not None}
        if layout_split and all(sliced.get(p) == d for p, d in layout_split.items()):
            del splits[module]  # split only where the forward lines it up: sliced, not a DTensor module
        elif found := sorted(p for p in layout_split if p in sliced):
            problems.append(f"module {module!r} ({type(model.get_submodule(module)).__name__}) has parameters split "
                            f"over {plan.axis!r} that no tensor-parallel style covers (run on DTensors with whole "
                            f"inputs) and {found} lined up with activations split over {plan.axis!r}; valid: split "
                            f"only those (their other parameters layout None)")
    problems += _dtensor_problems(model, [n for n, s in splits.items() if s.kind == DTENSOR], layouts, plan.axis,
                                  inputs, dtype)
    return replace(plan, splits=splits, summed=tuple(dict.fromkeys([*plan.summed, *summed])), sliced=tuple(sorted(sliced.items()))), problems


class _AtenOps(TorchDispatchMode):
    """The aten ops each of some modules runs (with a tensor argument), by module name."""

    def __init__(self) -> None:
        super().__init__()
        self.module: str | None = None
        self.ops: dict[str, list[Any]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.module is not None and any(isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0]):
            found = self.ops.setdefault(self.module, [])
            if func not in found:
                found.append(func)
        return func(*args, **(kwargs or {}))


def _has_strategy(op: Any) -> bool:
    """Whether torch's DTensor runs ``op`` by a sharding strategy, one that weighs every argument's
    placement. Its convolution goes to a handler of its own (``_tp_conv``), made for an input split
    along a spatial dim: a split weight reaches the local kernel at a wrong shape."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    return op not in dispatcher._custom_op_handlers and (
        op in propagator.op_strategy_funcs or op in getattr(propagator, "op_single_dim_strategy_funcs", {}))


def _dtensor_problems(model: nn.Module, names: list[str], layouts: dict[str, ParamLayout], axis: str,
                      inputs: tuple, dtype: torch.dtype | None) -> list[str]:
    """Modules with parameters split by their layout that no tensor-parallel style covers run on
    DTensors (whole inputs, split parameters): refused where an op of their forward, seen on meta,
    has no DTensor sharding strategy (it would fail in the workers, or compute at a wrong shape)."""
    if not names:
        return []
    record = _AtenOps()
    handles = []
    for name in names:
        module = model.get_submodule(name)
        handles += [module.register_forward_pre_hook(lambda _m, _a, name=name: setattr(record, "module", name)),
                    module.register_forward_hook(lambda _m, _a, _o: setattr(record, "module", None))]
    try:
        with swapped(model, meta_tensors(model, dtype)), record:
            model(*(torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in inputs))
    except Exception:  # the model's own error: the other checks report it
        return []
    finally:
        for handle in handles:
            handle.remove()
    problems = []
    for name, ops in record.ops.items():
        missing = [str(op) for op in ops if not _has_strategy(op)]
        if missing:
            module = model.get_submodule(name)
            split = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)
                     if (lay := layouts.get(f"{name}.{p}" if name else p)) is not None and lay.axis_dim(axis) is not None]
            problems.append(f"parameter {split[0]!r} of {name!r} ({type(module).__name__}) is split over {axis!r}, but "
                            f"no tensor-parallel style splits a {type(module).__name__} and torch's DTensor, which "
                            f"would run it on its split parameters, runs {', '.join(missing)} "
                            f"by no sharding strategy that weighs a split parameter (it fails in the workers); valid: layout None for its parameters (FSDP can still shard "
                            f"them), or split the Linear / Embedding layers around it")
    return problems


def _decide(name: str, uses: list[Use], shape: torch.Size, layout: ParamLayout | None, axis: str, size: int
            ) -> tuple[str | None, list[str]]:
    """What one parameter needs given every use the forward makes of it, or the problems."""
    kinds = {u.kind for u in uses}
    split = [u for u in uses if u.kind in (SUMMED, SLICED, MIXED)]
    if not split:
        return None, []
    first = split[0]
    where = f"{first.op} (on activations computed from {first.layer!r}, split over {axis!r})"
    fix = f"valid: replicate {first.layer!r} and the layer it feeds (layout None), or drop {axis!r}"
    layout_dim = None if layout is None else layout.axis_dim(axis)
    mixed = next((u for u in uses if u.kind == MIXED), None)
    if mixed is not None:
        return None, [f"parameter {name!r} is combined with an activation computed from {mixed.layer!r}, split over "
                      f"{axis!r}, in {mixed.op}: {mixed.why}; shardkit can neither sum its gradient over {axis!r} nor "
                      f"split it with that activation, so each rank would train it on its part alone; {fix}"]
    if len(kinds - {WHOLE}) > 1 or WHOLE in kinds or len({u.dim for u in split}) > 1:
        other = next(u for u in uses if u.kind != first.kind or u.dim != first.dim)
        return None, [f"parameter {name!r} is used in {where} as {_what(first)} and in {other.op} as {_what(other)}; "
                      f"one parameter cannot be both (its gradient would be wrong on every rank); {fix}"]
    if first.kind == SUMMED:
        if layout_dim is not None:
            return None, [f"parameter {name!r} has layout {layout.layout!r}, but every rank uses all of it in {where}; "
                          f"valid: layout None (replicated, its gradient summed over {axis!r})"]
        return SUMMED, []
    dim = first.dim
    assert dim is not None
    if layout_dim not in (None, dim):
        return None, [f"parameter {name!r} has layout {layout.layout!r} (dim {layout_dim} split over {axis!r}), but "
                      f"its forward lines its dim {dim} up with the split in {where}; valid: {axis!r} on dim {dim}, "
                      f"or layout None (shardkit splits it with the activation)"]
    if shape[dim] % size:
        valid = [d for d in range(1, shape[dim] + 1) if shape[dim] % d == 0]
        return None, [f"parameter {name!r} (shape {list(shape)}) lines its dim {dim} up with the split in {where}, so "
                      f"each rank holds its slice of it, but {axis}={size} does not divide {shape[dim]}; valid "
                      f"{axis} sizes: {valid}"]
    return SLICED, []


def _what(use: Use) -> str:
    return {SUMMED: "a whole on each rank's part of split features", WHOLE: "a whole on whole activations",
            SLICED: f"sliced along its dim {use.dim} with the split"}[use.kind]


__all__ = ["follow_axis"]
