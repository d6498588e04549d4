"""Apply a planned tensor-parallel axis with torch's own styles (``parallelize_module``).

:func:`shardkit.planner.tensor_parallel.plan_axis` decided, before launch, each module's
mechanism; this module turns it into torch's styles on the axis' 1-D mesh:

=====================  ==========================================  ==================================
mechanism              torch                                       communication
=====================  ==========================================  ==================================
``colwise``            ``ColwiseParallel`` (Conv1D: a subclass)    output kept split, or all-gathered
``rowwise``            ``RowwiseParallel`` (Conv1D: a subclass)    all-reduce of partial outputs
``vocab``              ``RowwiseParallel`` on an Embedding          masked lookup + all-reduce
``embed-colwise``      ``ColwiseParallel`` on an Embedding          all-gather of the embedding dim
``dtensor``            DTensor parameters via ``distribute_module``  inputs replicated, outputs gathered
=====================  ==========================================  ==================================

Before the styles: family attribute changes (local head counts, GPT-2's ``split_size``) and
packed projections permuted rank-major (``[a | b]`` -> ``[a_0 | b_0 | a_1 | b_1 ...]``, so a
contiguous shard holds its slice of every part; undone by ``full_state_dict``). After them:
tied parameters re-tied (torch's styles give each module its own new Parameter), and the
parameters outside the split layers that act on split activations summed or sliced
(:mod:`shardkit.runtime.split_params`).

With ``sequence_parallel`` (Megatron SP) the residual stream is split along the sequence (dim
1): column-parallel layers all-gather their input, row-parallel layers reduce-scatter their
output, norms run as torch's ``SequenceParallel``, embeddings hand out sequence shards and
replicated output heads get the whole sequence back first. The residual stream stays a
DTensor (sequence-sharded) so model code reading ``hidden_states.shape`` (HF Llama's rotary
positions and reshapes) sees global shapes; the model's output is an ordinary tensor.
"""

from __future__ import annotations

from functools import partial
from typing import Any

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
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..families.modules import is_conv1d, linear_dims
from ..plan import UsageError
from ..planner.tensor_parallel import (
    COLWISE,
    DTENSOR,
    ROWWISE,
    VOCAB,
    AxisPlan,
    ModuleSplit,
    input_scopes,
)
from .split_params import apply_split_params

SEQUENCE_DIM = 1
#: ``{parameter name: (dim, permutation)}``: ``permuted.index_select(dim, argsort(permutation))`` is the original.
Permutations = dict[str, tuple[int, torch.Tensor]]


class _SharedInput:
    """Mixin for ``ColwiseParallel``: the column-parallel modules reading one tensor in a call of their
    parent (q, k and v of one norm's output; gate and up) share one conversion of it, as Megatron's do
    (:func:`~shardkit.planner.tensor_parallel.shared_input_scopes`).

    torch converts per module: each makes its own DTensor of the input, so without SP the backward
    all-reduces the input's gradient once per module (three times for q, k, v) instead of once for
    their sum, and under SP each all-gathers the same sequence shards and keeps its own gathered copy
    for its backward (three whole-sequence inputs held where one is read). Here the first module's
    conversion is kept in its parent's :class:`~shardkit.planner.tensor_parallel.InputScope`
    (``_sk_input_scope``) and a later module given the same tensor takes it: one all-gather forward,
    one reduction of the summed gradient backward. A recompute in the backward runs the parent again
    and converts anew, as the forward did: torch's selective checkpointing hands its saved outputs
    back by each operator's count, so the recompute must run the forward's operators."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        scope = getattr(mod, "_sk_input_scope", None)
        kept = scope.get(inputs[0]) if scope is not None else None
        if kept is not None and kept.device_mesh is device_mesh:
            return kept
        converted = ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
        if scope is not None:
            scope.keep(inputs[0], converted)
        return converted


class _SharedInputColwise(_SharedInput, ColwiseParallel):
    """``ColwiseParallel`` whose layers share the conversion of an input they all read (:class:`_SharedInput`)."""


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


class _Conv1DColwise(_Conv1DStyle, _SharedInput, ColwiseParallel):
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

    def __init__(self, placements: dict[str, int | None]):
        self.placements = placements

    def _apply(self, module, device_mesh):
        def partition(name, mod, mesh):
            if mod is not module:
                return
            for pname, param in list(mod.named_parameters(recurse=False)):
                dim = self.placements.get(pname)
                placement = [Replicate()] if dim is None else [Shard(dim)]
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


def _style(split: ModuleSplit, module: nn.Module, sequence_parallel: bool) -> ParallelStyle:
    seq = Shard(SEQUENCE_DIM)
    if split.kind == COLWISE:
        kwargs: dict[str, Any] = {"output_layouts": Replicate() if split.gather_output else Shard(-1)}
        if sequence_parallel:
            kwargs["input_layouts"] = seq
        return (_Conv1DColwise if is_conv1d(module) else _SharedInputColwise)(**kwargs)
    if split.kind == ROWWISE:
        kwargs = {"input_layouts": Replicate() if split.replicated_input else Shard(-1)}
        if sequence_parallel:
            kwargs.update(output_layouts=seq, use_local_output=False)
        return (_Conv1DRowwise if is_conv1d(module) else RowwiseParallel)(**kwargs)
    if split.kind == DTENSOR:
        return _DTensorParams(split.placements)
    style = RowwiseParallel if split.kind == VOCAB else ColwiseParallel
    return style(input_layouts=Replicate(), output_layouts=seq if sequence_parallel else Replicate(),
                 use_local_output=not sequence_parallel)


def tensor_parallel_styles(model: nn.Module, plan: AxisPlan) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (module name -> style) for one planned axis."""
    modules = dict(model.named_modules())
    styles = {name: _style(split, modules[name], plan.sequence_parallel) for name, split in plan.splits.items()
              if name in modules}
    if plan.sequence_parallel:
        for name in plan.norms:
            if name in modules:
                # DTensor output: its .shape stays global, which attention code reshaping with
                # hidden_states.shape[:-1] (HF Llama) relies on; TP layers accept it as input.
                styles[name] = SequenceParallel(use_local_output=False)
        for name in plan.embeddings:
            if name in modules:
                styles[name] = _SequenceShardOutput()
        for name in plan.gathers:
            if name in modules:
                styles[name] = PrepareModuleInput(input_layouts=(Shard(SEQUENCE_DIM),),
                                                  desired_input_layouts=(Replicate(),), use_local_output=True)
        seq = (Shard(SEQUENCE_DIM),)
        for name in plan.routed:  # MoE blocks route the rank's own part of the sequence: experts act per token
            if name in modules:
                styles[name] = PrepareModuleInputOutput(input_layouts=seq, desired_input_layouts=seq,
                                                        use_local_input=True, output_layouts=seq,
                                                        desired_output_layouts=seq, use_local_output=False)
    return styles


def permute_packed(model: nn.Module, plan: AxisPlan) -> Permutations:
    """Permute every packed column-parallel weight rank-major, in place (same Parameter objects)."""
    modules = dict(model.named_modules())
    permutations: Permutations = {}
    for name, split in plan.splits.items():
        if split.packed == 1 or name not in modules:
            continue
        module = modules[name]
        out_dim = linear_dims(module)[0]
        width = module.weight.shape[out_dim]
        part, local = width // split.packed, width // split.packed // plan.size
        perm = torch.cat([torch.arange(rank * local, (rank + 1) * local) + p * part
                          for rank in range(plan.size) for p in range(split.packed)])
        with torch.no_grad():
            for pname, dim in (("weight", out_dim), ("bias", 0)):
                param = getattr(module, pname, None)
                if param is not None:
                    param.copy_(param.index_select(dim, perm.to(param.device)))
                    permutations[f"{name}.{pname}" if name else pname] = (dim, perm)
    return permutations


def _own_output(module: nn.Module, inputs: Any, output: Any) -> Any:
    """The output as a tensor of its own, not a view (the forward changes it in place)."""
    return output.clone() if isinstance(output, torch.Tensor) and not isinstance(output, DTensor) else output


def _retie(model: nn.Module, ties: tuple[tuple[str, ...], ...]) -> None:
    """Point every name of a tied parameter at the first name's (now distributed) Parameter."""
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, pname = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._parameters[pname] = first


def prepare_shard(model: nn.Module, plan: AxisPlan) -> Permutations:
    """What comes before torch's styles, the same on every rank: the family's attribute changes
    (local head counts, GPT-2's ``split_size``) and packed weights permuted rank-major. Refuses
    a model prepared once already (its attributes are local, its weights permuted)."""
    marker = f"_sk_prepared_{plan.axis}"
    if getattr(model, marker, False):
        raise UsageError(f"this model was already adapted for tensor parallel over {plan.axis!r} (attributes made "
                        f"local, packed weights permuted); adapt a freshly built model once")
    modules = dict(model.named_modules())
    for change in plan.changes:
        if change.module in modules:
            setattr(modules[change.module], change.attribute, change.local)
    setattr(model, marker, True)
    return permute_packed(model, plan)


def apply_tensor_parallel(model: nn.Module, plan: AxisPlan, mesh: DeviceMesh) -> Permutations:
    """Apply ``plan`` on the axis' 1-D ``mesh`` in place; returns the permutations made."""
    permutations = prepare_shard(model, plan)
    styles = tensor_parallel_styles(model, plan)
    if styles:
        parallelize_module(model, mesh, styles)
    modules = dict(model.named_modules())
    for name, scope in input_scopes(modules, plan)[0].items():
        modules[name]._sk_input_scope = scope
    for name, split in plan.splits.items():
        if split.copy_output and name in modules:
            modules[name].register_forward_hook(_own_output)  # after the style's hook: a copy of its view
    _retie(model, tuple(t for t in plan.ties if all(_has_parameter(model, n) for n in t)))
    apply_split_params(model, plan, mesh)  # parameters acting on split activations: summed or sliced
    return permutations


def _has_parameter(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


__all__ = ["Permutations", "apply_tensor_parallel", "permute_packed", "prepare_shard", "tensor_parallel_styles"]
