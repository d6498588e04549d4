"""Apply a Plan to a model with torch.distributed (``sk.shard``).

The order follows torchtitan's parallelize procedures, top to bottom:

1. validate: ``sk.validate(plan, model)``, the same checks as before launch, so a plan passed
   straight to ``sk.launch`` + ``sk.shard`` fails with the same :class:`PlanError` before any
   weight moves; it also plans every model axis (:mod:`shardkit.planner.tensor_parallel`);
2. pipelines cut this rank's stage(s) first (:mod:`shardkit.runtime.pipeline`), which then
   parallelize the stage;
3. tensor, context and data parallelism (:mod:`shardkit.runtime.parallelize`);
4. the module's class gains ``step()`` and ``plan``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..plan import Plan, PlanWarning, UsageError
from ..planner.validate import validate
from .context import Context, current_context
from .parallelize import parallelize, with_mixin


class ShardedModule:
    """Mixed into a sharded model's class: one ``step`` for every plan.

    >>> loss = model.step(inputs, targets, loss_fn)   # doctest: +SKIP
    """

    _sk_plan: Plan

    @property
    def plan(self) -> Plan:
        return self._sk_plan

    def step(self, inputs: Any, targets: Any, loss_fn) -> torch.Tensor:
        """Forward and backward on this rank's batch; returns the loss averaged over all ranks."""
        loss = loss_fn(self(inputs), targets)
        loss.backward()
        return mean_over_world(loss.detach())


def mean_over_world(value: torch.Tensor) -> torch.Tensor:
    """Average a scalar over every rank (model-axis ranks hold equal values, so this is the data mean)."""
    value = value.clone().float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


def shard(model: nn.Module, plan: Plan, ctx: Context | None = None, *, example_inputs: tuple | None = None,
          seed: int = 0) -> nn.Module:
    """Split ``model`` as ``plan`` says, in this process of a launched world; returns the same module.

    Runs ``sk.validate`` first (the same :class:`PlanError` as before launch). The model takes
    and returns ordinary tensors; it gains ``model.step(inputs, targets, loss_fn)`` and
    ``model.plan``. Call it inside a function run by ``sk.launch``. ``example_inputs``: one
    micro-batch, for models whose family shardkit does not know (see ``sk.validate``).

    A model built on the meta device (``sk.meta_model(build)``) is split there and then
    materialised: each rank allocates only its shards, initialised by the model's own
    initialisation under ``seed`` (:func:`shardkit.runtime.materialize.materialize`), so the
    full weights are the same whatever the plan.

    >>> def work(ctx):                                    # doctest: +SKIP
    ...     model = sk.shard(build_model(), plan)
    ...     loss = model.step(x, y, loss_fn)
    """
    ctx = ctx or current_context()
    if not isinstance(model, nn.Module):
        raise UsageError(f"sk.shard(model, plan): model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, ShardedModule) or getattr(model, "_sk_facts", None) is not None:
        raise UsageError("sk.shard got a model that is already sharded; build a fresh model for each plan")
    plan = plan.resolved(ctx.world_size)
    with warnings.catch_warnings():
        if ctx.rank != 0:  # unused rules are said once, not once per process
            warnings.simplefilter("ignore", PlanWarning)
        report = validate(plan, model, ctx.world_size, example_inputs=example_inputs)
    assert report.facts is not None
    if plan.pipeline is not None:
        from .pipeline import build_pipeline

        return build_pipeline(model, plan, ctx, report.layouts.params, report.facts, seed)
    model = with_mixin(parallelize(model, plan, ctx, report.layouts.params, report.facts, seed), ShardedModule, "Sharded")
    model._sk_plan = plan
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _unpermute(module: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    perm = getattr(module, "_sk_permutations", {}).get(name)
    if perm is None:
        return t
    dim, index = perm
    return t.index_select(dim, torch.argsort(index.to(t.device)))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{dotted name: full tensor}`` of the parameters this rank holds (a collective on sharded ones).

    Every rank of a sharding group must call it. Adapter permutations are undone, so the
    names and values match the unsharded model.
    """
    return {n: _unpermute(model, n, _full(p)).cpu() for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{dotted name: full gradient}`` like :func:`full_state_dict` (zeros where a grad is None)."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = torch.zeros(p.shape) if g is None else _unpermute(model, n, _full(g)).cpu()
    return out


__all__ = ["ShardedModule", "full_grads", "full_state_dict", "mean_over_world", "shard"]
