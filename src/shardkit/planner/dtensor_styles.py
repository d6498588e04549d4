"""Where a tensor-parallel rank's tensors are DTensors, marked on the planner's stand-ins
(:mod:`shardkit.planner.measure`): the parameters torch's styles distribute and the inputs and
outputs its hooks turn into DTensors and back, with and without Megatron SP, so that
:class:`~shardkit.planner.counters.DTensorPaths` follows the operators a rank runs on DTensors; and a
row-parallel output reduced out of place, as torch's styles reduce it (:func:`reduced_out_of_place`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..families.modules import is_norm
from .counters import DTensorPaths, OpCounter
from .tensor_parallel import COLWISE, DTENSOR, ROWWISE, AxisPlan, InputScope, input_scopes

#: The tensor-parallel runs whose DTensor operators are counted: torch's styles handing local
#: tensors between modules (``tp``), and Megatron SP, whose residual stream, norms and their
#: parameters are DTensors too (``sp``).
DTENSOR_VARIANTS = ("tp", "sp")


def distributed_parameters(model: nn.Module, plan: AxisPlan | None,
                           canonical: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """``{canonical parameter name: the variants in which it is a DTensor}``: a split module's in
    both, a norm's under Megatron SP (torch's ``SequenceParallel`` replicates them as DTensors)."""
    if plan is None:
        return {}
    out: dict[str, tuple[str, ...]] = {}
    for name, module in model.named_modules():
        variants = DTENSOR_VARIANTS if name in plan.splits else ("sp",) if is_norm(module) else ()
        for pname, _ in module.named_parameters(recurse=False):
            out.setdefault(canonical[f"{name}.{pname}" if name else pname], variants)
    return {name: variants for name, variants in out.items() if variants}


@contextmanager
def dtensor_styles(model: nn.Module, plan: AxisPlan, paths: DTensorPaths, ops: OpCounter,
                   boundary: Callable[[str], None]) -> Iterator[None]:
    """Where torch's styles turn tensors into DTensors and back (:mod:`shardkit.runtime.tensor_parallel`),
    the same marks on the stand-ins: a split module's input becomes a DTensor in both variants; its
    output goes back local, but under Megatron SP a row-parallel or embedding output stays one
    (``use_local_output=False``: the residual stream is sequence-sharded), as does a replicated
    embedding's output; a module with parameters that is neither split, a norm nor an embedding
    (a replicated head) takes its input local. ``boundary(kind)`` is called for each input of the
    column-parallel modules (``colwise``: replicated, or all-gathered under SP, its gradient reduced;
    once for the modules of one parent call reading the same tensor, which share its conversion as the
    runtime's do: :func:`~shardkit.planner.tensor_parallel.shared_input_scopes`)
    and each row-parallel output (``rowwise``: partial sums reduced)."""
    modules = dict(model.named_modules())
    scopes, handles = input_scopes(modules, plan)

    def set_input(variants: tuple[str, ...], kind: str | None = None, scope: InputScope | None = None):
        def hook(_module, args):
            if kind is not None and not (scope is not None and args and scope.get(args[0])):
                boundary(kind)
                if scope is not None and args:
                    scope.keep(args[0], True)
            if not args:
                return None
            with ops.pause():
                return (paths.alias(args[0], variants), *args[1:])
        return hook

    def set_output(variants: tuple[str, ...], kind: str | None = None):
        def hook(_module, _args, out):
            if kind is not None:
                boundary(kind)
            with ops.pause():
                return paths.alias(out, variants)
        return hook

    for name, module in modules.items():
        split = plan.splits.get(name)
        embedding = isinstance(module, nn.Embedding)
        if split is not None:
            handles.append(module.register_forward_pre_hook(set_input(
                DTENSOR_VARIANTS, COLWISE if split.kind == COLWISE else None, scopes.get(name))))
            local = split.kind in (COLWISE, DTENSOR) or (split.kind != ROWWISE and not embedding)
            handles.append(module.register_forward_hook(set_output(
                () if local else ("sp",), ROWWISE if split.kind == ROWWISE else None)))
        elif embedding:
            handles.append(module.register_forward_hook(set_output(("sp",))))
        elif not is_norm(module) and next(module.parameters(recurse=False), None) is not None:
            handles.append(module.register_forward_pre_hook(set_input(())))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def reduced_out_of_place(model: nn.Module, plan: AxisPlan, bridge: Callable[[], Any]) -> Iterator[None]:
    """A row-parallel output reduced as torch's styles reduce it: out of place (a functional all-reduce's
    output, alive beside its input until that is dropped)."""
    def reduced(_module: nn.Module, _args: Any, out: Any) -> Any:
        with bridge():
            return out.clone() if isinstance(out, torch.Tensor) else out

    handles = [model.get_submodule(split.name).register_forward_hook(reduced) for split in plan.splits.values()
               if split.kind == ROWWISE]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["DTENSOR_VARIANTS", "distributed_parameters", "dtensor_styles", "reduced_out_of_place"]
