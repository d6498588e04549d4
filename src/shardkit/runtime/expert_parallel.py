"""Expert parallelism: every MoE layer's experts split over the ``ep`` axis, tokens sent to them.

:func:`apply_expert_parallel` turns each experts module the validator found
(:mod:`shardkit.planner.experts`) into an expert-parallel one: its stacked parameters become
DTensors sharded on dim 0 (the expert dim) over ``ep``, so rank ``j`` holds experts
``j * E/ep .. (j + 1) * E/ep - 1`` whole, and its forward becomes :func:`expert_parallel_forward`:

1. every (token, slot) of the rank's routing is sorted by expert (stable) and the per-expert
   counts are exchanged with one ``all_to_all_single`` (each rank learns how many rows it
   receives for each of its experts from each rank);
2. the rows travel to their experts' ranks with a second ``all_to_all_single`` with those split
   sizes (dropless: every row arrives, however skewed the routing; a rank may send or receive
   none), regrouped by local expert, and computed with grouped GEMM
   (:func:`shardkit.models.experts.expert_mlp`);
3. the results travel back by the reverse exchange and are combined at their source rank with
   the router's weights in a fixed order (:func:`shardkit.models.experts.combine`).

The exchanges are one autograd function (:class:`Exchange`), whose gradient is the reverse
exchange. The router stays replicated: it is reduced over every data rank, ``ep``
included, like any other parameter.

Gradient scale: each rank's loss is the mean over its own tokens and data parallelism averages
non-expert gradients over all ``N`` data ranks. An expert's gradient on its rank sums the
contributions of the tokens every rank of its ``ep`` group sent it; FSDP2 / replicate average it
over the ``N / ep`` data ranks that hold the same expert (:meth:`Meshes.expert_data
<shardkit.runtime.meshes.Meshes.expert_data>`), so the local weights' gradient is scaled by
``1 / ep`` on the way (:class:`ScaleGrad`): ``(1 / (N / ep)) * (1 / ep) * sum over N ranks``, the
one-process gradient of the mean loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..models.experts import combine, expert_mlp, sort_by_expert
from ..planner.expert_costs import expert_shard_dim
from ..planner.experts import ExpertsLayer
from .meshes import DataMesh
from .split_params import SumGradient


class Exchange(torch.autograd.Function):
    """``rows`` split ``in_splits`` to the ranks of ``group``, ``out_splits`` rows received from
    each (``dist.all_to_all_single``); its backward is the reverse exchange.

    Ours rather than torch's ``all_to_all_single_autograd``: torchtitan #1467 found that one
    keeping recomputed exchanges' buffers alive under activation checkpointing (torch 2.6), and
    its reporter's fix is this plain autograd function, which holds only the split sizes (on
    torch 2.13, CPU, we measured neither keeping a buffer; the tests check ours)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],  # type: ignore[override]
                group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out


def exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """``rows`` split ``in_splits`` to the ranks of ``group``, ``out_splits`` rows received from
    each, differentiably (:class:`Exchange`)."""
    return Exchange.apply(rows, out_splits, in_splits, group)


class ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale`` (the ``1 / ep`` of a local expert)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


@dataclass(frozen=True)
class RowCounts:
    """The (token, slot) rows one rank sent to / received from each ``ep`` rank in its experts
    module's last forward, and their ``dtype`` (kept on the module as ``_sk_rows``: how balanced
    the routing was, and that the exchange carried the compute dtype)."""

    sent: tuple[int, ...]
    received: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ExpertGroup:
    """The ``ep`` group of one rank: its process group, its size, and ``E``; ``compute_dtype``: the
    dtype its local experts compute in when no FSDP2 unit casts them (a mixed-precision policy's
    ``param_dtype`` with ``ep`` the only data axis); ``summed_over``: the process groups the local
    experts' gradient is summed over (the ``tp`` group under Megatron sequence parallel, whose ranks
    each route their own part of the sequence to the same experts)."""

    group: Any
    size: int
    num_experts: int
    compute_dtype: torch.dtype | None = None
    summed_over: tuple[Any, ...] = ()

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size


def _local_weights(experts: nn.Module, ep: ExpertGroup) -> dict[str, torch.Tensor]:
    """This rank's slices of the experts' parameters as plain tensors in ``ep.compute_dtype`` (when
    given), gradients scaled by ``1 / ep.size`` and summed over ``ep.summed_over``."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in experts.named_parameters(recurse=False):
        local = param.to_local() if isinstance(param, DTensor) else param
        for group in ep.summed_over:
            local = SumGradient.apply(local, group)
        local = local if ep.compute_dtype is None else local.to(ep.compute_dtype)
        out[name] = ScaleGrad.apply(local, 1.0 / ep.size)
    return out


def expert_parallel_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, ep: ExpertGroup) -> torch.Tensor:
    """The experts module's output for this rank's tokens, each computed on its expert's rank."""
    local = ep.local_experts
    routed = sort_by_expert(top_k_index, ep.num_experts)
    rows = hidden_states[routed.order // top_k_index.shape[-1]]
    received_counts = torch.empty_like(routed.counts)  # [ep * local]: from each rank, rows per local expert
    dist.all_to_all_single(received_counts, routed.counts, group=ep.group)
    send = routed.counts.view(ep.size, local).sum(dim=1).tolist()
    receive = received_counts.view(ep.size, local).sum(dim=1).tolist()
    experts._sk_rows = RowCounts(tuple(send), tuple(receive), rows.dtype)
    arrived = exchange(rows, receive, send, ep.group)  # by source rank, then local expert
    expert_of_row = torch.arange(local, device=rows.device).repeat(ep.size).repeat_interleave(
        received_counts, output_size=arrived.shape[0])
    by_expert = torch.argsort(expert_of_row, stable=True)  # by local expert, then source rank
    weights = _local_weights(experts, ep)
    computed = expert_mlp(experts, arrived[by_expert], received_counts.view(ep.size, local).sum(dim=0), weights)
    returned = exchange(torch.empty_like(computed).index_copy(0, by_expert, computed), send, receive, ep.group)
    return combine(returned, routed.order, top_k_weights).to(hidden_states.dtype)


class ExpertParallelExperts:
    """Mixed into an experts module's class: its forward becomes :func:`expert_parallel_forward`."""

    _sk_expert_group: ExpertGroup

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights, self._sk_expert_group)


_CLASSES: dict[type, type] = {}


def apply_expert_parallel(model: nn.Module, layers: Iterable[ExpertsLayer], ep_mesh: Any,
                          summed_over: tuple[Any, ...] = ()) -> None:
    """Split each experts module of ``layers`` over ``ep_mesh`` (a 1-D DeviceMesh) in place: its
    parameters become DTensors sharded on dim 0, its forward sends tokens to their experts.
    ``summed_over``: process groups whose ranks route different tokens to the same experts."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for layer in layers:
        experts = model.get_submodule(layer.name)
        for name, param in list(experts.named_parameters(recurse=False)):
            split = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        cls = type(experts)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls), {})
        experts.__class__ = _CLASSES[cls]
        experts._sk_expert_group = ExpertGroup(ep_mesh.get_group(), ep_mesh.size(), layer.num_experts,
                                               summed_over=summed_over)


def expert_parameters(model: nn.Module, layers: Iterable[ExpertsLayer]) -> set[nn.Parameter]:
    """The parameters ``ep`` splits (every experts module's own)."""
    return {p for layer in layers for p in model.get_submodule(layer.name).parameters(recurse=False)}


def wrap_experts(model: nn.Module, layers: Iterable[ExpertsLayer], data: DataMesh | None, mp_policy: Any,
                 reshard_after_forward: bool | None) -> set[nn.Parameter]:
    """Data parallelism of the experts, before the model's: each experts module on its own over
    ``data`` (:meth:`Meshes.expert_data <shardkit.runtime.meshes.Meshes.expert_data>`): FSDP2's
    ``fully_shard`` when it shards (each parameter on the dim
    :func:`~shardkit.planner.expert_costs.expert_shard_dim` picks: dim 1 where a rank's ``E / ep``
    experts are fewer than the shards, so none is padded to a whole expert), its ``replicate``
    when not. Returns the parameters the
    model-wide wrapping must leave alone: every expert's when ``data`` is ``None`` (``ep`` is the
    only data axis, so no other rank holds the same experts and nothing reduces them; a
    mixed-precision policy's ``param_dtype`` is then applied by the forward itself)."""
    if data is None:
        dtype = getattr(mp_policy, "param_dtype", None)
        for layer in layers:
            experts = model.get_submodule(layer.name)
            experts._sk_expert_group = replace(experts._sk_expert_group, compute_dtype=dtype)
        return expert_parameters(model, layers)
    for layer in layers:
        experts = model.get_submodule(layer.name)
        if data.shards:
            from torch.distributed.fsdp import fully_shard

            fully_shard(experts, mesh=data.mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                        shard_placement_fn=_expert_placement(data.mesh.size(data.mesh.ndim - 1)))
        else:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(experts, mesh=data.mesh, mp_policy=mp_policy)
    return set()


def _expert_placement(shards: int) -> Any:
    """FSDP2's ``shard_placement_fn`` for an experts module sharded ``shards`` ways: ``Shard`` of
    :func:`~shardkit.planner.expert_costs.expert_shard_dim` of the rank's local experts."""
    from torch.distributed.tensor import DTensor, Shard

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(expert_shard_dim(local.shape, shards))

    return placement


__all__ = ["ExpertGroup", "ExpertParallelExperts", "RowCounts", "ScaleGrad", "apply_expert_parallel",
           "Exchange", "exchange", "expert_parallel_forward", "expert_parameters", "wrap_experts"]
