"""The per-process state of a pipeline and its steps: torch's stages and schedule, the loss.

:class:`PipelineRuntime` wraps this rank's stages in :class:`~shardkit.runtime.pipeline_stage.RecordedStage`
on the ``pp`` group of the plan's meshes (:func:`~shardkit.runtime.meshes.meshes_for`), builds torch's schedule, and runs

- :meth:`~PipelineRuntime.step`: forward and backward of the micro-batches through torch's
  schedule, data-parallel gradients reduced once (in this rank's last backward), tied copies
  summed, the loss averaged over micro-batches and data ranks and equal on every rank;
- :meth:`~PipelineRuntime.through_stages`: the whole model forward only, on any shape, each
  stage's output sent point-to-point (:mod:`shardkit.runtime.p2p`) to the next stage's rank;
- :meth:`~PipelineRuntime.evaluate`: a loss without gradients, micro-batch by micro-batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import schedules as torch_schedules

from ..plan import DATA_AXES, Plan, PlanError, UsageError
from ..plan.pipeline import SCHEDULES, SINGLE_STAGE_SCHEDULES
from ..planner.stages import StageAssignment
from . import p2p
from . import spans as timeline
from .accumulation import micro_batches
from .context import Context
from .meshes import meshes_for
from .pipeline_stage import RecordedStage, StageModule
from .pipeline_ties import TiedCopy, connect_ties, sum_tied_grads, tied_grads
from .pipeline_waits import recording_waits


class PipelineRuntime:
    """Per-process pipeline state: stages, schedule, groups, tied copies; runs one step."""

    def __init__(self, model: nn.Module, plan: Plan, ctx: Context, assignment: StageAssignment):
        pipeline = plan.pipeline
        assert pipeline is not None
        self.plan, self.ctx, self.assignment = plan, ctx, assignment
        self.microbatches = pipeline.microbatches
        # the meshes of the plan being applied, not the job's (whose plan may have no pipeline)
        self.meshes = meshes_for(plan, ctx.device.type)
        pp_mesh = self.meshes.device_mesh["pp"]
        self.pp_group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        self.local = assignment.local_stages(self.pp_rank)
        self.units = {s: [assignment.layout.units[i] for i in assignment.stages[s]] for s in self.local}
        self.last_pp_rank = assignment.ranks[-1]
        self.model = model
        self.stages: list[RecordedStage] = []
        self.loss_fn: Callable | None = None
        self.schedule_name = pipeline.schedule
        self.data_parallel: FSDPModule | None = None
        self.backwards_left = 0
        self.accumulate = 1
        self.first_part: tuple[tuple[int, ...], int] | None = None
        #: how many input tensors the first stage takes (None: any number)
        self.stage_inputs = _positional_inputs(assignment.layout.family.stage_forward)
        #: this rank's copies of parameters tied across pipeline devices (:meth:`connect_ties`)
        self.ties: list[TiedCopy] = []
        #: why decoding with a KV cache through these stages would differ from the model's (sk.generate refuses)
        self.decode_problems: tuple[str, ...] = ()
        #: per stage fed by another rank: the inputs' shapes of the last forward-only call and the
        #: (shape, dtype) its hidden states had then, on the sending side and on the receiving side
        #: (since :meth:`forget_layouts`)
        self.sent: dict[int, tuple[tuple, p2p.Layout]] = {}
        self.received: dict[int, tuple[tuple, p2p.Layout]] = {}

    def build(self, model: nn.Module) -> None:
        """Wrap this rank's stages of the parallelized ``model`` and build torch's schedule."""
        self.model = model
        self.data_parallel = model if isinstance(model, FSDPModule) else None
        data = [f"{a}={self.plan.mesh.size_of(a)}" for a in DATA_AXES if self.plan.mesh.size_of(a) > 1]
        if data and self.data_parallel is None:
            raise PlanError(f"pipeline stages with {', '.join(data)} need an FSDP2 data-parallel wrapper (fully_shard "
                            f"or FSDP2's replicate) to accumulate gradients over micro-batches and reduce them once, "
                            f"but the model is no FSDPModule after parallelize(): DDP's replicate, whose reducer "
                            f"expects one forward per backward, gives wrong gradients over micro-batches. "
                            f"runtime/parallelize.py must use FSDP2's replicate for plans with a pipeline")
        for s in self.local:
            modules = [model.get_submodule(m) for u in self.units[s] for m in u.modules]
            self.stages.append(RecordedStage(StageModule(model, s, modules), s, self.assignment.num_stages,
                                             self.ctx.device, self.pp_group, self._before_backward))
        cls = getattr(torch_schedules, SCHEDULES[self.schedule_name][0])

        def scaled_loss(output: Any, target: Any) -> torch.Tensor:
            assert self.loss_fn is not None
            return self.loss_fn(output, target) / (self.microbatches * self.accumulate)

        stages = self.stages[0] if self.schedule_name in SINGLE_STAGE_SCHEDULES else self.stages
        self.schedule = cls(stages, self.microbatches, loss_fn=scaled_loss, scale_grads=False)

    def connect_ties(self, model: nn.Module) -> None:
        """Keep the copies of each parameter tied across pipeline devices equal (:mod:`~shardkit.runtime.pipeline_ties`)."""
        self.ties = connect_ties(model, self.assignment, self.meshes.device_mesh, self.pp_rank, self.local)

    def _before_backward(self) -> None:
        """FSDP2 (``dp``/``fsdp``) reduces gradients once, in this rank's last backward of the step:
        left alone, it would reduce after every micro-batch (correct, but m times the communication).
        Gradients accumulate unsynced; the last backward syncs, and FSDP2's root callback reduces
        every group once."""
        self.backwards_left -= 1
        if self.backwards_left == 0 and self.data_parallel is not None:
            self.data_parallel.set_requires_gradient_sync(True)

    @property
    def has_first(self) -> bool:
        return 0 in self.local

    @property
    def has_last(self) -> bool:
        return self.assignment.num_stages - 1 in self.local

    def step(self, inputs: Any, targets: Any, loss_fn: Callable, accumulate: int = 1) -> torch.Tensor:
        inputs = self._check_inputs(inputs)
        self._check_batch(inputs)
        parts = micro_batches(inputs, targets, accumulate, multiple_of=self.microbatches)
        self._check_part_shape(tuple(parts[0][0][0].shape), accumulate)
        self.loss_fn, self.accumulate = loss_fn, accumulate
        device = self.ctx.device
        losses: list[torch.Tensor] = []
        before = tied_grads(self.ties)
        with timeline.span("step"), recording_waits():
            self.backwards_left = self.microbatches * len(self.local) * accumulate
            if self.data_parallel is not None:
                self.data_parallel.set_requires_gradient_sync(False)
            try:
                for part_inputs, part_targets in parts:
                    args = tuple(x.to(device) for x in part_inputs) if self.has_first else ()
                    target = part_targets.to(device) if self.has_last else None
                    part_losses: list[torch.Tensor] = []  # torch's schedule clears the list it is given
                    # return_outputs=False: else the last stage keeps every micro-batch's output (the logits)
                    # until the step ends, which nothing here reads
                    self.schedule.step(*args, target=target, losses=part_losses, return_outputs=False)
                    losses += part_losses
            finally:
                if self.data_parallel is not None:
                    self.data_parallel.set_requires_gradient_sync(True)
            with timeline.span("sync"):
                sum_tied_grads(self.ties, before)
                return self._mean_loss(losses)

    def forget_layouts(self) -> None:
        """Send the next forward-only call's hidden states with their headers (every rank of the pipeline
        calls it at the same point: a new evaluation, a new decoding), so a model changed between calls
        (another dtype) is never received in the layout it had before."""
        self.sent.clear()
        self.received.clear()

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable) -> torch.Tensor:
        inputs = self._check_inputs(inputs)
        self._check_batch(inputs)
        self.forget_layouts()
        losses = []
        with torch.no_grad():
            for part_inputs, part_targets in micro_batches(inputs, targets, self.microbatches):
                output = self.through_stages(model, tuple(part_inputs), None, 0)
                if output is not None:
                    losses.append(loss_fn(output, part_targets.to(output.device)) / self.microbatches)
        return self._mean_loss(losses)

    def through_stages(self, model: nn.Module, inputs: tuple, cache: Any, past: int) -> torch.Tensor | None:
        """Every local stage in turn, forward only. A stage's hidden states go to the next stage's rank
        with their header (shape and dtype) only when the inputs' shapes differ from the last call's since
        :meth:`forget_layouts` (the prefill, then the first decode step): both sides know the inputs, and
        the receiving side remembers the header, so a decode step reads nothing to the host to receive."""
        ranks, device = self.assignment.ranks, self.ctx.device
        args = tuple(x.to(device) for x in inputs)
        key = (tuple(tuple(x.shape) for x in inputs), cache is None)
        for s in range(self.assignment.num_stages):
            if s not in self.local:
                continue
            if s > 0 and ranks[s - 1] != self.pp_rank:
                known = self.received.get(s)
                received = p2p.receive(self.pp_group, ranks[s - 1], device,
                                       known[1] if known is not None and known[0] == key else None)
                self.received[s] = (key, (tuple(received.shape), received.dtype))
                args = (received,)
            x = model(*args, stage=s, cache=cache, past=past)  # through __call__: FSDP2's hooks run
            args = (x,)
            if s + 1 < self.assignment.num_stages and ranks[s + 1] != self.pp_rank:
                self._send(x, s + 1, key)
        return x if self.has_last else None

    def _send(self, x: torch.Tensor, stage: int, key: tuple) -> None:
        """Send stage ``stage``'s input ``x`` to its rank, its header only when the inputs' shapes are new."""
        known, layout = self.sent.get(stage), (tuple(x.shape), x.dtype)
        same = known is not None and known[0] == key
        if same and known[1] != layout:  # the receiver expects the last layout: it cannot take another
            raise UsageError(f"pipeline stage {stage - 1}'s output is {list(x.shape)} {x.dtype} where the same inputs "
                             f"{list(key[0])} gave {list(known[1][0])} {known[1][1]} before: a stage's output must "
                             f"depend only on its inputs' shapes")
        p2p.send(x, self.pp_group, self.assignment.ranks[stage], header=not same)
        self.sent[stage] = (key, layout)

    def _check_batch(self, inputs: tuple) -> None:
        problems = self.plan.pipeline.check_batch(int(inputs[0].shape[0])) if self.plan.pipeline else []
        if problems:
            raise PlanError(problems)

    def _check_inputs(self, inputs: Any) -> tuple:
        """``inputs`` as a tuple of tensors the first stage takes (the same check on every rank, so no
        rank waits for a stage that failed); :class:`UsageError` otherwise."""
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        family, takes = self.assignment.layout.family, self.stage_inputs
        if not all(isinstance(x, torch.Tensor) for x in inputs) or (takes is not None and len(inputs) != takes):
            given = ", ".join(f"{list(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                              for x in inputs)
            raise UsageError(f"a pipeline of the {family.name!r} family takes {takes} input tensor(s) (the token ids), "
                             f"but got {len(inputs)}: {given}; later stages receive only the hidden states, so an "
                             f"attention mask or other extra input cannot reach them: pass the token ids alone "
                             f"(pack sequences rather than pad them)")
        return inputs

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the last stage's (scaled) micro-batch losses, equal on every rank and averaged over data ranks."""
        loss = torch.stack([t.detach() for t in losses]).sum().float() if self.has_last \
            else torch.zeros((), device=self.ctx.device)
        dist.broadcast(loss, group=self.pp_group, group_src=self.last_pp_rank)
        for axis in DATA_AXES:
            if self.plan.mesh.size_of(axis) > 1:
                dist.all_reduce(loss, group=self.meshes.device_mesh[axis].get_group())
        return loss / self.plan.mesh.data_size

    def _check_part_shape(self, shape: tuple[int, ...], accumulate: int) -> None:
        """torch's stages fix their buffers' shapes on the first step: refuse a step whose parts differ."""
        if self.first_part is None:
            self.first_part = (shape, accumulate)
        elif self.first_part[0] != shape:
            (first, k) = self.first_part
            raise UsageError(f"this step's inputs go through the pipeline in parts of shape {list(shape)} "
                             f"(accumulate={accumulate}), but torch's pipeline stages were built for parts of shape "
                             f"{list(first)} by the first step (accumulate={k}); keep the batch shape and accumulate "
                             f"the same on every step")


def _positional_inputs(stage_forward: Callable) -> int | None:
    """How many inputs a family's ``stage_forward(model, units, ...)`` takes (``None``: any number)."""
    parameters = list(inspect.signature(stage_forward).parameters.values())[2:]
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


__all__ = ["PipelineRuntime"]
