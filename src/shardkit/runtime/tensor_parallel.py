"""Compile layout rules into torch's tensor-parallel styles.

A layout says which dim of a weight is split over a model axis (``tp`` or a user axis).
This module turns that into torch's own machinery, per module type:

=============================  ==========================  =====================================
module and split               torch mechanism             communication
=============================  ==========================  =====================================
Linear weight ``(axis, None)``  ``ColwiseParallel``         output stays split, or all-gathered
Linear weight ``(None, axis)``  ``RowwiseParallel``         all-reduce of partial outputs
Embedding ``(axis, None)``      ``RowwiseParallel``         vocab-parallel: masked lookup + all-reduce
Embedding ``(None, axis)``      ``ColwiseParallel``         all-gather of the embedding dim
Conv1D (GPT-2, ``[in, out]``)   colwise/rowwise subclasses  as Linear, with the dims swapped
any other parameter             DTensor via distribute_module  inputs replicated, outputs gathered
=============================  ==========================  =====================================

A column-parallel layer keeps its output split when its parent module also holds a
row-parallel layer (attention, MLP pairs); otherwise (an output head) the output is gathered.
A row-parallel layer without a column-parallel sibling takes a replicated input.
With ``sequence_parallel`` (Megatron SP) the residual stream is split along the sequence
(dim 1): column-parallel layers all-gather their input, row-parallel layers reduce-scatter
their output, norms run as torch's ``SequenceParallel`` and embeddings' outputs are split.
The residual stream stays a DTensor (sequence-sharded) so that model code reading
``hidden_states.shape`` (HF Llama's rotary positions and reshapes) sees global shapes; only
the output head returns an ordinary, gathered tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..plan import PlanError
from ..plan.layout import ParamLayout

SEQUENCE_DIM = 1


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a Linear whose weight is stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


class _Conv1DStyle:
    """Mixin for GPT-2's Conv1D (a Linear whose weight is stored ``[in, out]``).

    torch's styles accept only nn.Linear / nn.Embedding; Conv1D computes the same product
    with a transposed weight, so only the partition differs: ``placements`` gives each
    parameter's placement; inputs and outputs are prepared by the torch style mixed with.
    """

    placements: dict[str, object]

    def _apply(self, module, device_mesh):
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [self.placements[pname]]),
                                                           requires_grad=param.requires_grad))

        return distribute_module(
            module, device_mesh, partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class _Conv1DColwise(_Conv1DStyle, ColwiseParallel):
    """Column-parallel Conv1D: weight split on dim 1 (its output), bias on dim 0."""

    placements = {"weight": Shard(1), "bias": Shard(0)}


class _Conv1DRowwise(_Conv1DStyle, RowwiseParallel):
    """Row-parallel Conv1D: weight split on dim 0 (its input), bias replicated."""

    placements = {"weight": Shard(0), "bias": Replicate()}
    desired_input_layouts = (Shard(-1),)


class _DTensorParams(ParallelStyle):
    """Any other module: parameters become DTensors with the layout's placements.

    Inputs are taken as replicated and outputs gathered back to ordinary tensors, so the
    module computes correctly (DTensor propagates the sharding) at the cost of communication.
    """

    def __init__(self, placements: dict[str, list]):
        self.placements = placements

    def _apply(self, module, device_mesh):
        def partition(name, mod, mesh):
            if mod is not module:
                return
            for pname, param in list(mod.named_parameters(recurse=False)):
                placement = self.placements.get(pname, [Replicate()])
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, placement),
                                                           requires_grad=param.requires_grad))

        def inputs_fn(mod, inputs, mesh):
            return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor)
                         and not isinstance(t, DTensor) else t for t in inputs)

        def outputs_fn(mod, outputs, mesh):
            if isinstance(outputs, DTensor):
                return outputs.redistribute(mesh, [Replicate()]).to_local()
            return outputs

        return distribute_module(module, device_mesh, partition, inputs_fn, outputs_fn)


@dataclass(frozen=True)
class _Split:
    module: str
    kind: str  # "colwise" | "rowwise" | "vocab" | "embed-colwise" | "dtensor"


def _direct_params(module: nn.Module, prefix: str, layouts: dict[str, ParamLayout]) -> dict[str, ParamLayout]:
    return {p: layouts[f"{prefix}{p}"] for p, _ in module.named_parameters(recurse=False) if f"{prefix}{p}" in layouts}


def _classify(name: str, module: nn.Module, params: dict[str, ParamLayout], axis: str) -> _Split | None:
    """Which TP mechanism a module's layouts on ``axis`` ask for (or a PlanError)."""
    using = {p: lay for p, lay in params.items() if lay.axis_dim(axis) is not None}
    if not using:
        return None
    weight = params.get("weight")
    bias = params.get("bias")
    linear_like = isinstance(module, nn.Linear) or _is_conv1d(module)
    if linear_like and weight is not None:
        out_dim = 1 if _is_conv1d(module) else 0
        wdim = weight.axis_dim(axis)
        if wdim is None:
            raise PlanError(f"parameter {name}.bias is split over {axis!r} but {name}.weight is not; split the weight "
                            f"too (('{axis}', None) for column-parallel) or replicate the bias")
        kind = "colwise" if wdim == out_dim else "rowwise"
        bdim = None if bias is None else bias.axis_dim(axis)
        if bias is not None and kind == "colwise" and bdim != 0:
            raise PlanError(f"parameter {name}.bias has layout {bias.layout!r} but {name}.weight is column-parallel over "
                            f"{axis!r}; a column-parallel layer's bias is split with its output: use ('{axis}',)")
        if bias is not None and kind == "rowwise" and bdim is not None:
            raise PlanError(f"parameter {name}.bias has layout {bias.layout!r} but {name}.weight is row-parallel over "
                            f"{axis!r}; a row-parallel layer's bias is added after the all-reduce: use None")
        return _Split(name, kind)
    if isinstance(module, nn.Embedding) and weight is not None:
        return _Split(name, "vocab" if weight.axis_dim(axis) == 0 else "embed-colwise")
    return _Split(name, "dtensor")


def _placements(params: dict[str, ParamLayout], axis: str) -> dict[str, list]:
    out = {}
    for pname, lay in params.items():
        dim = lay.axis_dim(axis)
        out[pname] = [Replicate()] if dim is None else [Shard(dim)]
    return out


def tensor_parallel_plan(model: nn.Module, layouts: dict[str, ParamLayout], axis: str,
                         sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (module name -> style) for one model axis."""
    splits: dict[str, _Split] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        split = _classify(name, module, _direct_params(module, f"{name}." if name else "", layouts), axis)
        if split is not None:
            splits[name] = split
    kinds_by_parent: dict[str, set[str]] = {}
    for name, split in splits.items():
        kinds_by_parent.setdefault(name.rpartition(".")[0], set()).add(split.kind)
    seq = Shard(SEQUENCE_DIM)
    styles: dict[str, ParallelStyle] = {}
    for name, split in splits.items():
        module, siblings = modules[name], kinds_by_parent[name.rpartition(".")[0]]
        if split.kind == "colwise":
            paired = "rowwise" in siblings
            kwargs = {"output_layouts": Shard(-1) if paired else Replicate()}
            if sequence_parallel:
                kwargs["input_layouts"] = seq
            styles[name] = (_Conv1DColwise if _is_conv1d(module) else ColwiseParallel)(**kwargs)
        elif split.kind == "rowwise":
            kwargs = {"input_layouts": Shard(-1) if "colwise" in siblings else Replicate()}
            if sequence_parallel:
                kwargs.update(output_layouts=seq, use_local_output=False)
            styles[name] = (_Conv1DRowwise if _is_conv1d(module) else RowwiseParallel)(**kwargs)
        elif split.kind in ("vocab", "embed-colwise"):
            style = RowwiseParallel if split.kind == "vocab" else ColwiseParallel
            styles[name] = style(input_layouts=Replicate(), output_layouts=seq if sequence_parallel else Replicate(),
                                 use_local_output=not sequence_parallel)
        else:
            if sequence_parallel:
                raise PlanError(f"module {name!r} ({type(module).__name__}) has parameters split over {axis!r} that no "
                                f"tensor-parallel style covers; with sequence_parallel=True only Linear, Embedding, "
                                f"Conv1D and norms are supported")
            styles[name] = _DTensorParams(_placements(_direct_params(module, f"{name}." if name else "", layouts), axis))
    if sequence_parallel:
        has_head = any(split.kind == "colwise" and "rowwise" not in kinds_by_parent[name.rpartition(".")[0]]
                       for name, split in splits.items())
        styles.update(_sequence_parallel_extras(model, splits, has_head))
    return styles


def _sequence_parallel_extras(model: nn.Module, splits: dict[str, _Split], has_head: bool
                              ) -> dict[str, ParallelStyle]:
    """Norms run on sequence shards; replicated embeddings hand out sequence shards."""
    extras: dict[str, ParallelStyle] = {}
    if not has_head:
        raise PlanError("sequence_parallel=True needs a column-parallel output projection (for example lm_head with "
                        "layout ('tp', None)) to gather the sequence at the end; none was found in the rules")
    for name, module in model.named_modules():
        if name in splits:
            continue
        if _is_norm(module):
            # DTensor output: its .shape stays global, which attention code reshaping with
            # hidden_states.shape[:-1] (HF Llama) relies on; TP layers accept it as input.
            extras[name] = SequenceParallel(use_local_output=False)
        elif isinstance(module, nn.Embedding):
            extras[name] = _SequenceShardOutput()
    return extras


class _SequenceShardOutput(ParallelStyle):
    """A replicated module hands out a DTensor split on the sequence (dim -2 of ``[..., T, D]``).

    torch's ``PrepareModuleOutput`` takes one fixed dim; an embedding of positions returns
    ``[T, D]`` while one of tokens returns ``[B, T, D]``, so the dim is read per output. The
    slice goes through DTensor so that its backward all-gathers the gradient (the replicated
    weights then receive the full-sequence gradient on every rank).
    """

    def _apply(self, module, device_mesh):
        def hook(mod, inputs, output):
            dt = DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)
            return dt.redistribute(device_mesh, [Shard(output.dim() - 2)])

        module.register_forward_hook(hook)
        return module


def model_axes(mesh_names: tuple[str, ...]) -> list[str]:
    """Mesh axes that split parameters by layout (everything but dp, fsdp, pp, sp)."""
    return [a for a in mesh_names if a not in ("dp", "fsdp", "pp", "sp")]


def apply_tensor_parallel(model: nn.Module, layouts: dict[str, ParamLayout], mesh: DeviceMesh, axis: str,
                          sequence_parallel: bool = False) -> nn.Module:
    """Apply the styles for ``axis`` with torch's ``parallelize_module`` on ``mesh[axis]``."""
    styles = tensor_parallel_plan(model, layouts, axis, sequence_parallel)
    if styles:
        parallelize_module(model, mesh[axis], styles)
    return model
