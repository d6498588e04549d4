"""Router losses and balancing over the whole batch, across every data rank (``dp``, ``fsdp``, ``ep``, ``sp``).

:func:`balance_routers` gives a sharded model one :class:`~shardkit.models.routing.BatchTotal`: an
all-reduce (sum) over the data mesh FSDP2 / DDP reduce gradients over, and the number of its ranks.

- **Auxiliary loss.** Every known router loss the validator finds (:mod:`shardkit.planner.routing`:
  transformers' ``load_balancing_loss_func`` in Mixtral's, Qwen2-MoE's ... modeling module, the
  reference GPT's) becomes :func:`shardkit.models.routing.load_balancing_loss_func`, which is
  transformers' formula value for value in one process (the validator checked it); while the
  sharded model's forward runs, the batch total is current, so the per-expert counts, probability
  sums and rows are all-reduced (detached: one all-reduce of ``2E + 1`` numbers per training
  forward; in eval mode each rank computes its own, with no collective) and
  every rank returns the whole batch's value, with a gradient that averages over the data ranks
  to one process's. Each rank's loss ``CE_rank + coef * aux`` therefore averages to one process's
  (what ``model.step`` reports), and so do the gradients. A step of several micro-batches is
  refused by name (:func:`micro_batches`).
- **Bias balancing.** Every bias-balanced router's ``load_total`` sums its load over the data ranks,
  so :func:`~shardkit.models.routing.update_expert_biases` (``sk.optimizer`` registers it after
  each step) moves the same bias on every rank, as one process would over the whole batch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..models import routing
from ..models.routing import ONE_PROCESS, BatchTotal, batch_total, bias_balanced
from ..planner.routing import router_losses


def _summed(groups: list[Any], tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over every rank of ``groups`` (one mesh dim each); no gradient."""
    out = tensor.detach().clone()
    for group in groups:
        dist.all_reduce(out, group=group)
    return out


def _install_known_losses(module: nn.Module) -> bool:
    """Put shardkit's load-balancing loss in place of each known one the model calls; whether there is any."""
    known = [loss for loss in router_losses(module, run=False) if loss.known]
    for loss in known:
        python_module = sys.modules[loss.module]
        if getattr(python_module, loss.name) is not routing.load_balancing_loss_func:
            setattr(python_module, loss.name, routing.load_balancing_loss_func)  # equal in one process (checked)
    return bool(known)


def balance_routers(module: nn.Module, data_mesh: Any) -> None:
    """Make ``module``'s router losses and bias balancing sum over ``data_mesh`` (a DeviceMesh whose
    every dim splits the batch; ``None`` or one rank: nothing to reduce, but micro-batches are still
    refused)."""
    total = ONE_PROCESS
    if data_mesh is not None and data_mesh.size() > 1:
        groups = [data_mesh.get_group(dim) for dim in range(data_mesh.ndim) if data_mesh.size(dim) > 1]
        total = BatchTotal(partial(_summed, groups), ranks=data_mesh.size())
    for _, router in bias_balanced(module):
        router.load_total = total
    if _install_known_losses(module):
        module._sk_batch_total = total
        module._sk_totals = []
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave, always_call=True)


def _enter(module: nn.Module, args: Any) -> None:
    """The batch total in force for this forward: in training mode only (evaluation and generation
    compute each rank's own, with no collective, so ranks need not run their forwards in lockstep)."""
    stack = ExitStack()
    stack.enter_context(batch_total(module._sk_batch_total if module.training else ONE_PROCESS))
    module._sk_totals.append(stack)


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    module._sk_totals.pop().close()


@contextmanager
def micro_batches(module: nn.Module, parts: int) -> Iterator[None]:
    """While open, ``module``'s forwards are ``parts`` micro-batches of one step (a router
    auxiliary loss over one of several refuses: it would not be the whole batch's)."""
    total = getattr(module, "_sk_batch_total", None)
    if total is None or parts == 1:
        yield
        return
    module._sk_batch_total = BatchTotal(total.reduce, total.ranks, parts)
    try:
        yield
    finally:
        module._sk_batch_total = total


__all__ = ["balance_routers", "micro_batches"]
