"""Parameters outside the split layers that act on split activations, made right on each rank.

:mod:`shardkit.planner.split_params` found them on meta; here they get what it decided:

- ``summed`` (a learnable scalar on split features, a norm over each of this rank's heads):
  replicated as they are; their owner module's forward sees them through an identity whose
  backward sums the gradient over the axis (each rank's covers its part of the features);
- ``sliced`` (one value per head, GPT-OSS' ``sinks``): a DTensor ``Shard(dim)`` on the axis
  (saved, gathered and verified like any split parameter); the owner's forward sees this
  rank's slice (``to_local``, whose backward hands the gradient to the DTensor).

Why our own: torch's styles put replicated parameters on DTensors only for modules run entirely
on DTensors (``SequenceParallel``, transformers' ``replicated_with_grad_allreduce``), which fails
on any op DTensor has no rule for or that mixes DTensors with the plain tensors the other styles
hand out; an identity with an all-reduce in its backward (Megatron's "copy to tensor-parallel
region") works on any op. The owner's attribute is shadowed for the length of its forward
(its instance ``__dict__`` entry comes before ``_parameters``); FSDP2 has unsharded the
parameter by then (its pre-forward hooks run first) and reshards it after.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_tensor

from ..planner.tensor_parallel import AxisPlan


class SumGradient(torch.autograd.Function):
    """The identity; its backward sums the gradient over ``group`` (in place of a copy)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _shadow(module: nn.Module, pname: str, view: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """For the length of ``module``'s forward, ``module.<pname>`` is ``view(the parameter)``."""
    def enter(mod: nn.Module, _args: tuple) -> None:
        mod.__dict__[pname] = view(mod._parameters[pname])

    def leave(mod: nn.Module, _args: tuple, _out: object) -> None:
        mod.__dict__.pop(pname, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def apply_split_params(model: nn.Module, plan: AxisPlan, mesh: DeviceMesh) -> None:
    """Give the parameters ``plan`` found acting on split activations their sum or their slice."""
    group = mesh.get_group()
    for name in plan.summed:
        owner, _, pname = name.rpartition(".")
        _shadow(model.get_submodule(owner), pname, lambda p: SumGradient.apply(p, group))
    for name, dim in plan.sliced:
        owner, _, pname = name.rpartition(".")
        module = model.get_submodule(owner)
        param = module._parameters[pname]
        assert param is not None
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)]),
                                                      requires_grad=param.requires_grad))
        _shadow(module, pname, _local)


__all__ = ["SumGradient", "apply_split_params"]
