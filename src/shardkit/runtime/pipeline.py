"""Pipeline stages on torch.distributed.pipelining: the pipelined model and how it is built.

:func:`build_pipeline` (called by ``sk.shard`` for plans with a pipeline) works torchtitan's way:

1. assign units to stages (:func:`shardkit.planner.stages.assign_stages`, checked, the family's
   stage forward proven on a miniature of the model);
2. prune this rank's model to the units of its stage(s) (:func:`~shardkit.runtime.pipeline_stage.prune`):
   every remaining parameter keeps its ORIGINAL dotted name (layout rules, ``full_state_dict``
   and ``sk.verify`` work by name);
3. give the model a per-stage forward (``model(x, stage=s)``, :class:`PipelinedModule`) from its
   family (:mod:`shardkit.families`): the reference GPT, a HuggingFace causal LM (position
   embeddings and masks are recomputed on every stage; only hidden states cross stage
   boundaries) or a chain model;
4. apply tp/fsdp/dp with :func:`shardkit.runtime.parallelize.parallelize`, as ``sk.validate`` planned
   them for the whole model (parameter names are unchanged by pruning);
5. wrap each local stage in a ``PipelineStage`` on the plan's ``pp`` group (:mod:`~shardkit.runtime.meshes`) and build the
   torch schedule (:class:`~shardkit.runtime.pipeline_runtime.PipelineRuntime`). ``sequential``
   is torch's GPipe with one micro-batch: the whole batch goes through stage 0, then stage 1,
   ..., and back (torch has no separate plain-sharding schedule, and GPipe with m=1 is exactly that);
6. connect the copies of parameters tied across stages (:mod:`~shardkit.runtime.pipeline_ties`).

The returned module is the pruned model with ``step(inputs, targets, loss_fn) -> loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..plan import Plan, PlanError, UsageError
from ..plan.layout import ParamLayout
from ..planner.model_checks import ModelFacts
from ..planner.pipeline_proof import decode_problems
from ..planner.stages import StageAssignment, assign_stages
from .batch_stats import refuse_micro_batches
from .context import Context
from .loss_scaling import LossScaler
from .materialize import WeightSource
from .parallelize import parallelize, with_mixin
from .pipeline_runtime import PipelineRuntime
from .pipeline_stage import prune


# -- the pipelined model -------------------------------------------------------------------------
class PipelinedModule:
    """Mixed into a pruned stage model's class: ``forward(x, stage=s)`` runs stage ``s``; one ``step``.

    >>> loss = model.step(tokens, targets, gpt_loss)   # doctest: +SKIP
    """

    _sk_runtime: PipelineRuntime
    _sk_loss_scaler: LossScaler | None

    @property
    def plan(self) -> Plan:
        return self._sk_runtime.plan

    @property
    def stage_assignment(self) -> StageAssignment:
        return self._sk_runtime.assignment

    @property
    def tied_copies(self) -> dict[str, str]:
        """``{name here: first name}`` of this rank's copies of parameters tied across pipeline
        devices, where the first name's copy is on another device. The runtime keeps each copy
        equal to the first; checkpoints, exports, manifests and gradient norms count it once,
        under the first name."""
        return {t.name: t.first for t in self._sk_runtime.ties if not t.primary}

    @property
    def local_stages(self) -> list[int]:
        """The pipeline stages this rank runs."""
        return list(self._sk_runtime.local)

    def forward(self, *args: Any, stage: int | None = None, cache: Any = None, past: int = 0) -> Any:
        """Run stage ``stage`` (default: this rank's only stage); with ``cache``, decode after ``past``
        cached positions (:meth:`Family.stage_decode`)."""
        runtime = self._sk_runtime
        if stage is None:
            if len(runtime.local) != 1:
                raise UsageError(f"this rank runs stages {runtime.local}; call model(x, stage=s) with one of them")
            stage = runtime.local[0]
        if stage not in runtime.local:
            raise UsageError(f"stage {stage} does not run on this rank (it runs stages {runtime.local})")
        family = runtime.assignment.layout.family
        if cache is not None:
            return family.stage_decode(self, runtime.units[stage], *args, cache, past)
        return family.stage_forward(self, runtime.units[stage], *args)

    def through_stages(self, x: torch.Tensor, *, cache: Any = None, past: int = 0) -> torch.Tensor | None:
        """The whole model's forward on ``x`` (token ids), forward only: every stage in turn on the
        whole batch, hidden states sent point-to-point to the next stage's rank. Returns the last
        stage's output on the ranks running it, ``None`` on the others; every rank of the pipeline
        calls it. With ``cache`` (the model's KV cache) and ``past`` (the positions already in it)
        each stage decodes (:meth:`Family.stage_decode`).

        torch's schedules are not used here: their stages fix the shapes they send at their first
        step, where decoding sends a prompt and then one token at a time, and they have no place
        for a KV cache.
        """
        return self._sk_runtime.through_stages(self, (x,), cache, past)

    def evaluate(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """The loss of a batch without gradients, averaged over micro-batches and data ranks and
        equal on every rank, as :meth:`step` returns it: each of the pipeline's micro-batches
        goes through every stage in turn (:meth:`through_stages`). The model's training mode
        is left as it is.

        Not torch's ``schedule.eval``: it fails on the zero-bubble schedules ("can't
        steal_bwd_input if this stage doesn't have backward", torch 2.13); this runs under any.
        """
        return self._sk_runtime.evaluate(self, inputs, targets, loss_fn)

    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
             accumulate: int = 1) -> torch.Tensor:
        """Forward and backward over the micro-batches of this data rank's batch.

        Returns the loss averaged over micro-batches and data ranks (detached, equal on every
        rank: broadcast from the last stage). Gradients accumulate into ``.grad`` as one
        backward of the mean loss would. ``accumulate=k``: the batch runs through the schedule
        as ``k`` equal parts, one after another (each split into the pipeline's microbatches),
        with data-parallel gradients reduced once, in the last backward: the same gradients.

        Under a loss scale (float16) each micro-batch's loss is scaled on the last stage and the
        gradients unscaled here, an overflow on any rank skipped on every rank, as for any sharded
        model (:mod:`shardkit.runtime.loss_scaling`).
        """
        refuse_micro_batches(self, self._sk_runtime.microbatches * accumulate)
        scaler = self._sk_loss_scaler
        if scaler is None:
            return self._sk_runtime.step(inputs, targets, loss_fn, accumulate)
        return scaler.step_model(self, loss_fn, lambda scaled: self._sk_runtime.step(inputs, targets, scaled, accumulate))

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The plan's loss scale (float16), which :meth:`step` applies; ``None`` when the plan scales nothing."""
        return self._sk_loss_scaler


def build_pipeline(model: nn.Module, plan: Plan, ctx: Context, layouts: dict[str, ParamLayout],
                   facts: ModelFacts, seed: int = 0, source: WeightSource | None = None,
                   example_inputs: tuple | None = None) -> nn.Module:
    """Split ``model`` into this rank's pipeline stage(s), parallelize them, and schedule them
    (``layouts`` and ``facts``: what ``sk.validate`` planned for the whole model, with
    ``example_inputs`` when given, which also order a chain model's stages here).

    Returns the pruned model (original parameter names) with ``step(inputs, targets, loss_fn)``,
    ``plan``, ``local_stages`` and ``forward(x, stage=s)``.
    """

    plan = plan.resolved(ctx.world_size)
    pipeline = plan.pipeline
    if pipeline is None:
        raise UsageError("build_pipeline needs a plan with a pipeline")
    problems = pipeline.check_mesh(plan.mesh)
    if problems:
        raise PlanError(problems)
    if isinstance(model, PipelinedModule):
        raise UsageError("this model is already split into pipeline stages; build a fresh model for sk.shard")
    assignment = assign_stages(model, pipeline, plan.mesh, example_inputs)
    runtime = PipelineRuntime(model, plan, ctx, assignment)
    runtime.decode_problems = tuple(decode_problems(model, assignment.layout))  # of the whole model, before pruning
    keep = {m for s in runtime.local for m in assignment.modules(s)} | set(assignment.layout.shared)
    prune(model, keep, assignment)
    model = with_mixin(model, PipelinedModule, "Pipelined")
    model._sk_runtime = runtime
    model._sk_loss_scaler = LossScaler.of(plan, ctx.device)
    held = {n for n, _ in model.named_parameters()}
    layouts = dict(layouts)
    for tie in assignment.ties:  # a tied parameter's copy in a later stage is laid out as its first name
        layouts.update({name: replace(layouts[tie.names[0]], name=name) for name in tie.names[1:]})
    # each stage splits over ep the experts it holds (the others' layers were pruned with their stages)
    facts = replace(facts, experts=tuple(e for e in facts.experts if any(n.startswith(f"{e.name}.") for n in held)))
    model = parallelize(model, plan, ctx, {n: lay for n, lay in layouts.items() if n in held}, facts, seed, source)
    runtime.build(model)
    runtime.connect_ties(model)
    return model


__all__ = ["PipelinedModule", "build_pipeline"]
