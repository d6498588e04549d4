"""Apply a Plan to a model with torch.distributed (``sk.shard``).

The order follows torchtitan's parallelize procedures, top to bottom:

1. validate: ``sk.validate(plan, model)``, the same checks as before launch, so a plan passed
   straight to ``sk.launch`` + ``sk.shard`` fails with the same :class:`PlanError` before any
   weight moves; it also plans every model axis (:mod:`shardkit.planner.tensor_parallel`);
2. pipelines cut this rank's stage(s) first (:mod:`shardkit.runtime.pipeline`), which then
   parallelize the stage;
3. tensor, context and data parallelism (:mod:`shardkit.runtime.parallelize`);
4. the module's class gains ``step()`` and ``plan``, and the plan's loss scale (float16:
   :mod:`shardkit.runtime.loss_scaling`, applied by ``step()``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..plan import Plan, PlanWarning, UsageError, param_shapes
from ..planner.initialisation import uninitialised
from ..planner.validate import ValidationReport, validate
from .accumulation import gradient_sync_deferred, micro_batches
from .batch_stats import refuse_micro_batches
from .context import Context, current_context
from .loss_scaling import LossScaler
from .materialize import WeightSource, open_weights
from .parallelize import parallelize, with_mixin
from .pieces import full_parameter
from .router_balance import micro_batches as router_micro_batches


class ShardedModule:
    """Mixed into a sharded model's class: one ``step`` (and ``evaluate``) for every plan.

    >>> loss = model.step(inputs, targets, loss_fn)   # doctest: +SKIP
    """

    _sk_plan: Plan
    _sk_loss_scaler: LossScaler | None

    @property
    def plan(self) -> Plan:
        return self._sk_plan

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The plan's loss scale (float16), which :meth:`step` applies; ``None`` when the plan scales nothing."""
        return self._sk_loss_scaler

    def step(self, inputs: Any, targets: Any, loss_fn, accumulate: int = 1) -> torch.Tensor:
        """Forward and backward on this rank's batch; returns the loss averaged over all ranks.

        ``accumulate=k``: the batch runs as ``k`` equal micro-batches along dim 0, one after
        another, each loss scaled by ``1/k``; data-parallel gradients are reduced only in the
        last backward (:mod:`shardkit.runtime.accumulation`). Gradients and loss equal one step
        on the whole batch (for a ``loss_fn`` that averages over the batch).

        Under a loss scale (float16) the loss is scaled and the gradients unscaled here; after an
        overflow on any rank every rank's gradients are ``None``, so the ``optimizer.step()`` that
        follows changes nothing (:mod:`shardkit.runtime.loss_scaling`; ``model.loss_scaler.last_skipped``).
        """
        scaler = self._sk_loss_scaler
        if scaler is None:
            return self._step(inputs, targets, loss_fn, accumulate)
        return scaler.step_model(self, loss_fn, lambda scaled: self._step(inputs, targets, scaled, accumulate))

    def _step(self, inputs: Any, targets: Any, loss_fn, accumulate: int) -> torch.Tensor:
        refuse_micro_batches(self, accumulate)
        *first, last = micro_batches(inputs, targets, accumulate)
        losses = []
        with router_micro_batches(self, accumulate):  # a router loss over a micro-batch is refused
            if first:
                with gradient_sync_deferred(self):
                    losses += [self._micro_step(x, y, loss_fn, accumulate) for x, y in first]
            losses.append(self._micro_step(*last, loss_fn, accumulate))
        return mean_over_world(torch.stack(losses).sum())

    def evaluate(self, inputs: Any, targets: Any, loss_fn) -> torch.Tensor:
        """The loss of this rank's batch without gradients, averaged over all ranks as :meth:`step`
        returns it (a pipelined model has the same method). The training mode is left as it is."""
        with torch.no_grad():
            return mean_over_world(loss_fn(self(inputs), targets))

    def _micro_step(self, inputs: Any, targets: Any, loss_fn, count: int) -> torch.Tensor:
        loss = loss_fn(self(inputs), targets) / count
        loss.backward()
        return loss.detach()


def mean_over_world(value: torch.Tensor) -> torch.Tensor:
    """Average a scalar over every rank (model-axis ranks hold equal values, so this is the data mean)."""
    value = value.clone().float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


def shard(model: nn.Module, plan: Plan, ctx: Context | None = None, *, example_inputs: tuple | None = None,
          seed: int = 0, weights: str | Path | WeightSource | None = None) -> nn.Module:
    """Split ``model`` as ``plan`` says, in this process of a launched world; returns the same module.

    Runs ``sk.validate`` first (the same :class:`PlanError` as before launch). The model takes
    and returns ordinary tensors; it gains ``model.step(inputs, targets, loss_fn)`` and
    ``model.plan``. Call it inside a function run by ``sk.launch``. ``example_inputs``: one
    micro-batch, for models whose family shardkit does not know (see ``sk.validate``).

    A model built on the meta device (``sk.meta_model(build)``) is split there and then
    materialised: each rank allocates only its shards, initialised by the model's own
    initialisation under ``seed`` (:func:`shardkit.runtime.materialize.materialize`), so the
    full weights are the same whatever the plan.

    ``weights``: a HuggingFace safetensors folder (or file) to take the weights from instead:
    every name and shape is checked against the model first (all problems named, nothing read),
    then each rank reads only the boxes of each tensor it holds. Build the model on meta
    (``sk.meta_model(AutoModelForCausalLM.from_config, config)``) and no rank ever holds it whole.

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
    return shard_validated(model, plan, ctx, report, example_inputs=example_inputs, seed=seed, weights=weights)


def shard_validated(model: nn.Module, plan: Plan, ctx: Context, report: ValidationReport, *,
                    example_inputs: tuple | None = None, seed: int = 0,
                    weights: str | Path | WeightSource | None = None) -> nn.Module:
    """:func:`shard` once ``sk.validate`` has checked ``plan`` (resolved on ``ctx``'s world) on a model
    built as ``model`` was: ``report`` is its report, whose layouts and facts are applied by name.
    ``sk.dry_run`` validates once and shards a fresh copy of the model per rank with it.
    A report of another plan or of other parameters is refused."""
    shapes = {name: lay.shape for name, lay in report.layouts.params.items()}
    if report.mesh != plan.mesh or report.facts is None or shapes != param_shapes(model):
        raise UsageError(f"shard_validated: the report is sk.validate's of {report.mesh!r} on "
                         f"{len(shapes)} parameters, not of this plan ({plan.mesh!r}) on this model's "
                         f"{len(param_shapes(model))}: validate this plan on this model")
    source = None if weights is None else open_weights(weights, model)
    if source is None and any(p.device.type == "meta" for p in model.parameters()):
        missing = uninitialised(model)
        if missing:
            raise UsageError(f"the model is on the meta device, and its initialisation writes no values for "
                             f"{len(missing)} parameter(s): {', '.join(map(repr, missing[:5]))}"
                             f"{' ...' if len(missing) > 5 else ''}; give their modules a reset_parameters(), pass "
                             f"weights=..., or build the model in full")
    if plan.pipeline is not None:
        from .pipeline import build_pipeline

        return build_pipeline(model, plan, ctx, report.layouts.params, report.facts, seed, source, example_inputs)
    sharded = with_mixin(parallelize(model, plan, ctx, report.layouts.params, report.facts, seed, source),
                         ShardedModule, "Sharded")
    sharded._sk_plan = plan
    sharded._sk_loss_scaler = LossScaler.of(plan, ctx.device)
    return sharded


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{dotted name: full tensor}`` of the parameters this rank holds (a collective on sharded ones).

    Every rank of a sharding group must call it. Adapter permutations are undone, so the
    names and values match the unsharded model.
    """
    permutations = getattr(model, "_sk_permutations", {})
    return {n: full_parameter(p, permutations.get(n)).clone().cpu() for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{dotted name: full gradient}`` like :func:`full_state_dict` (zeros where a grad is None)."""
    permutations = getattr(model, "_sk_permutations", {})
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = torch.zeros(p.shape) if g is None else full_parameter(g, permutations.get(n)).clone().cpu()
    return out


__all__ = ["ShardedModule", "full_grads", "full_state_dict", "mean_over_world", "shard", "shard_validated"]
