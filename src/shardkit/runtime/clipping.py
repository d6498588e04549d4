"""Gradient-norm clipping over every shard of a sharded model (``sk.clip_grad_norm_``).

torch's ``clip_grad_norm_`` computes the norm of the gradients one process can see: DTensor
gradients (tensor parallel, FSDP2, FSDP2's replicate) on one mesh are reduced by DTensor itself,
counting a replicated shard once, but it cannot stack norms of DTensors on different meshes
(FSDP's ``fsdp`` mesh and its ``fsdp x tp`` mesh, say, or DTensors with plain tensors), and it
knows nothing of pipeline stages, whose parameters live on other ranks. So the norm is
computed in three steps, each with torch's own functions:

1. per mesh: ``torch.nn.utils.get_total_norm`` of the gradients on that mesh (plain tensors:
   one group of their own), made whole with ``DTensor.full_tensor()`` (DTensor's norm partial:
   a sum of p-th powers, or a max, over the mesh dims the gradient is sharded on; replicated
   dims are not summed);
2. the groups' norms combined into the norm of this pipeline stage's parameters, the same on
   every rank that holds the stage;
3. with a pipeline, the stages' norms combined over the ``pp`` group (an all-reduce of the
   p-th powers, or of the max for ``inf``): each stage's parameters are on exactly one pp rank
   (shardkit refuses ties across stages), so each is counted once.

Gradients are then scaled in place by torch's ``clip_grads_with_norm_``, one call per mesh.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..plan import UsageError
from .apply import ShardedModule
from .pipeline import PipelinedModule


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a model returned by ``sk.shard`` to a global norm of at most ``max_norm``.

    The norm is over every shard of every parameter of the whole model, on every rank: tensor,
    data (FSDP, HSDP, DDP), context and pipeline parallel and their mixes, a replicated
    parameter counted once, a tied parameter once; the result equals
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model in one process. Every rank of the
    job must call it (it is a collective). Returns the total norm (a float32 scalar on the
    rank's device, the same on every rank) before clipping; gradients are multiplied in place by
    ``min(1, max_norm / (norm + 1e-6))``, as torch does. ``norm_type``: any p > 0, or
    ``math.inf``.

    >>> clip_grad_norm_(nn.Linear(2, 2), 1.0)
    Traceback (most recent call last):
    ...
    shardkit.plan.errors.UsageError: sk.clip_grad_norm_(model, ...): model must be returned by sk.shard, got a Linear; for a model that is not sharded use torch.nn.utils.clip_grad_norm_
    >>> def train(ctx):                                            # doctest: +SKIP
    ...     model = sk.shard(build_model(), ctx.plan)
    ...     model.step(inputs, targets, loss_fn)
    ...     norm = sk.clip_grad_norm_(model, max_norm=1.0)
    """
    _check(model, max_norm, norm_type)
    total = grad_norm(model, norm_type)
    for group in _by_mesh(model).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm :func:`clip_grad_norm_` clips to, without clipping (for logging);
    a collective, like it.

    >>> grad_norm(nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    shardkit.plan.errors.UsageError: sk.clip_grad_norm_(model, ...): model must be returned by sk.shard, got a Linear; for a model that is not sharded use torch.nn.utils.clip_grad_norm_
    """
    _check(model, 1.0, norm_type)
    # a parameter tied across pipeline devices: counted on its first name's device only
    copies = {id(model.get_parameter(name)) for name in getattr(model, "tied_copies", {})}
    norms = [_group_norm(group, norm_type) for group in _by_mesh(model, skip=copies).values()]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros((), device=device)
    if isinstance(model, PipelinedModule):
        total = _over_stages(total, norm_type, model._sk_runtime.pp_group)
    return total


def _check(model: nn.Module, max_norm: float, norm_type: float) -> None:
    if not isinstance(model, (ShardedModule, PipelinedModule)):
        raise UsageError(f"sk.clip_grad_norm_(model, ...): model must be returned by sk.shard, got a "
                         f"{type(model).__name__}; for a model that is not sharded use torch.nn.utils.clip_grad_norm_")
    if model.plan.replicas is not None:
        raise UsageError("sk.clip_grad_norm_ does not support plans with replica groups (Plan(replicas=...)) yet: "
                         "each group holds its own copy of a grouped variable, and which copies one norm covers is "
                         "not defined; clip within each group by hand, or use a plan without replicas")
    problems = []
    if not _is_real(max_norm) or not 0 < max_norm < math.inf:
        problems.append(f"max_norm must be a positive finite number, got {max_norm!r}")
    if not _is_real(norm_type) or not norm_type > 0:
        problems.append(f"norm_type must be a number p > 0 (2.0: the Euclidean norm) or math.inf, got {norm_type!r}")
    if problems:
        raise UsageError(f"sk.clip_grad_norm_: {'; '.join(problems)}")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _by_mesh(model: nn.Module, skip: set[int] = frozenset()) -> dict[object, list[nn.Parameter]]:
    """This rank's parameters with a gradient (but those whose id is in ``skip``), grouped by DTensor
    mesh (``None``: plain tensors), in model order, so every rank of a mesh meets the same groups in the
    same order (each group's norm is a collective). ``parameters()`` yields a tied parameter once."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.grad is not None and id(p) not in skip:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return groups


def _group_norm(params: list[nn.Parameter], norm_type: float) -> torch.Tensor:
    """The norm of the whole gradients of ``params`` (all on one mesh, or all plain tensors), in float32."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm.float()


def _over_stages(stage_norm: torch.Tensor, norm_type: float, pp_group: dist.ProcessGroup) -> torch.Tensor:
    """The norm over every pipeline stage from each pp rank's norm of its own stage(s)."""
    if math.isinf(norm_type):
        total = stage_norm.clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        return total
    total = stage_norm.pow(norm_type)
    dist.all_reduce(total, group=pp_group)
    return total.pow(1.0 / norm_type)


__all__ = ["clip_grad_norm_", "grad_norm"]
