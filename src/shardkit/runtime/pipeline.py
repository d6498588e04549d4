"""Pipeline stages on torch.distributed.pipelining: split, parallelize, schedule, step.

:func:`build_pipeline` (called by ``sk.shard`` for plans with a pipeline) works torchtitan's way:

1. assign units to stages (:func:`shardkit.planner.stages.assign_stages`, checked);
2. prune this rank's model to the units of its stage(s): the other units are removed from
   their parents, so every remaining parameter keeps its ORIGINAL dotted name (layout rules,
   ``full_state_dict`` and ``sk.verify`` work by name);
3. give the model a per-stage forward (``model(x, stage=s)``) from its family
   (:mod:`shardkit.families`): the reference GPT, a HuggingFace causal LM (position embeddings
   and the causal mask are recomputed on every stage; only hidden states cross stage
   boundaries) or a chain model;
4. apply tp/fsdp/dp with :func:`shardkit.runtime.parallelize.parallelize`, as ``sk.validate`` planned
   them for the whole model (parameter names are unchanged by pruning);
5. wrap each local stage in a ``PipelineStage`` on ``mesh["pp"]``'s group and build the
   torch schedule. ``sequential`` is torch's GPipe with one micro-batch: the whole batch goes
   through stage 0, then stage 1, ..., and back (torch has no separate plain-sharding schedule,
   and GPipe with m=1 is exactly that).

The returned module is the pruned model with ``step(inputs, targets, loss_fn) -> loss``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.tensor import DTensor

from ..plan import DATA_AXES, Plan, PlanError, UsageError
from ..plan.layout import ParamLayout
from ..plan.pipeline import SCHEDULES, SINGLE_STAGE_SCHEDULES
from ..planner.model_checks import ModelFacts
from ..planner.stages import StageAssignment, assign_stages
from . import spans as timeline
from .accumulation import micro_batches
from .context import Context
from .materialize import WeightSource
from .meshes import process_group
from .parallelize import parallelize, with_mixin
from .pieces import local_tensor


# -- the pipelined model -------------------------------------------------------------------------
class PipelinedModule:
    """Mixed into a pruned stage model's class: ``forward(x, stage=s)`` runs stage ``s``; one ``step``.

    >>> loss = model.step(tokens, targets, gpt_loss)   # doctest: +SKIP
    """

    _sk_runtime: _Runtime

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
        """
        return self._sk_runtime.step(inputs, targets, loss_fn, accumulate)


class _StageModule(nn.Module):
    """What a ``PipelineStage`` runs: stage ``index`` of the pruned model, through its ``__call__``.

    It registers the stage's unit modules, so ``parameters()`` are exactly the stage's (the
    zero-bubble weight pass differentiates them); the model itself is held unregistered.
    """

    def __init__(self, model: nn.Module, index: int, unit_modules: list[nn.Module]):
        super().__init__()
        object.__setattr__(self, "model", model)
        self.index = index
        self.units = nn.ModuleList(unit_modules)

    def forward(self, *args: Any) -> Any:
        return self.model(*args, stage=self.index)


def _prune(model: nn.Module, keep: set[str], assignment: StageAssignment) -> None:
    """Remove every unit module not in ``keep`` from its parent; names of the rest are unchanged."""
    for unit in assignment.layout.units:
        for path in unit.modules:
            if path in keep:
                continue
            parent_path, _, leaf = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            if isinstance(parent, (nn.ModuleList, nn.Sequential)):
                del parent._modules[leaf]  # iteration then yields the kept blocks only
            else:
                parent._modules[leaf] = None


def _schedule_class(name: str) -> type:
    return getattr(torch_schedules, SCHEDULES[name][0])


class _Runtime:
    """Per-process pipeline state: stages, schedule, groups; runs one step."""

    def __init__(self, model: nn.Module, plan: Plan, ctx: Context, assignment: StageAssignment):
        pipeline = plan.pipeline
        assert pipeline is not None
        self.plan, self.ctx, self.assignment = plan, ctx, assignment
        self.microbatches = pipeline.microbatches
        pp_mesh = ctx.mesh["pp"]
        self.pp_group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        self.local = assignment.local_stages(self.pp_rank)
        self.units = {s: [assignment.layout.units[i] for i in assignment.stages[s]] for s in self.local}
        self.last_pp_rank = assignment.ranks[-1]
        self.model = model
        self.stages: list[PipelineStage] = []
        self.loss_fn: Callable | None = None
        self.schedule_name = pipeline.schedule
        self.data_parallel: FSDPModule | None = None
        self.backwards_left = 0
        self.accumulate = 1
        self.first_part: tuple[tuple[int, ...], int] | None = None
        #: how many input tensors the first stage takes (None: any number)
        self.stage_inputs = _positional_inputs(assignment.layout.family.stage_forward)
        #: this rank's copies of parameters tied across pipeline devices (:meth:`connect_ties`)
        self.ties: list[_TiedCopy] = []

    def build(self, model: nn.Module) -> None:
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
            stage = PipelineStage(_StageModule(model, s, modules), s, self.assignment.num_stages, self.ctx.device,
                                  group=self.pp_group)
            _instrument(stage, self)
            self.stages.append(stage)
        cls = _schedule_class(self.schedule_name)

        def scaled_loss(output: Any, target: Any) -> torch.Tensor:
            assert self.loss_fn is not None
            return self.loss_fn(output, target) / (self.microbatches * self.accumulate)

        if self.schedule_name in SINGLE_STAGE_SCHEDULES:
            self.schedule = cls(self.stages[0], self.microbatches, loss_fn=scaled_loss, scale_grads=False)
        else:
            self.schedule = cls(self.stages, self.microbatches, loss_fn=scaled_loss, scale_grads=False)

    def connect_ties(self, model: nn.Module) -> None:
        """Keep the copies of each parameter tied across pipeline devices equal (Megatron's
        embedding group: an embedding tied to the LM head lives on the first and the last stage).

        torch's pipelining has no notion of a parameter shared by two stages, and torchtitan
        unties them; shardkit keeps the tie: one process group per tie's pipeline devices and
        per coordinate of the other axes (every rank creates every group, in one order), the
        first name's values broadcast to the other copies now, and after each :meth:`step` the
        gradient each copy gained summed over the copies (:meth:`_sum_tied_grads`). Copies on
        one device are one parameter already (``zbv`` puts the first and last stage on one)."""
        mesh, groups = self.ctx.mesh, {}
        # the groups (made once per process, runtime/meshes.py): one per coordinate of the other axes
        pp_dim = mesh.mesh_dim_names.index("pp")
        lines = mesh.mesh.movedim(pp_dim, -1).reshape(-1, mesh.mesh.shape[pp_dim]).tolist()
        for tie in self.assignment.ties:
            devices = tuple(sorted({self.assignment.ranks[s] for s in tie.stages}))
            if len(devices) < 2:
                continue
            if devices not in groups:  # every rank asks for every line's group, in one order
                for line in lines:
                    ranks = tuple(line[d] for d in devices)
                    group = process_group(ranks)
                    if dist.get_rank() in ranks:
                        groups[devices] = group
            if self.pp_rank not in devices:
                continue
            name = next(n for n, s in zip(tie.names, tie.stages) if s in self.local)
            first = self.assignment.ranks[tie.stages[0]]
            copy = _TiedCopy(name, tie.names[0], model.get_parameter(name), groups[devices], devices.index(first),
                             primary=first == self.pp_rank)
            with torch.no_grad():
                dist.broadcast(local_tensor(copy.param), group=copy.group, group_src=copy.source)
            self.ties.append(copy)

    def _tied_grads(self) -> list[torch.Tensor | None]:
        """Each tied copy's gradient before a step (``None``: none yet)."""
        return [None if t.param.grad is None else _local_grad(t.param).clone() for t in self.ties]

    def _sum_tied_grads(self, before: list[torch.Tensor | None]) -> None:
        """Add to each tied copy's gradient what the other copies gained in this step: the sum
        of the step's gains, so a gradient accumulated over steps is never summed twice.

        Every copy takes part in every step, frozen or not (so no device waits for another),
        and says whether it requires grad: a tie frozen under one name and not another (one
        parameter in one process) would let the copies drift, so it stops every device."""
        with torch.no_grad():
            for tie, old in zip(self.ties, before):
                param = tie.param
                if param.grad is None and param.requires_grad:
                    param.grad = torch.zeros_like(param)
                grad = _local_grad(param) if param.grad is not None else torch.zeros_like(local_tensor(param))
                gained = torch.empty(grad.numel() + 1, dtype=grad.dtype, device=grad.device)
                gained[:-1] = (grad - old if old is not None else grad).flatten()
                gained[-1] = float(param.requires_grad)
                dist.all_reduce(gained, group=tie.group)
                learning, copies = int(gained[-1].item()), dist.get_world_size(tie.group)
                if learning not in (0, copies):
                    raise UsageError(f"parameter {tie.name!r} is tied to {tie.first!r} (one parameter in one process), "
                                     f"but only {learning} of the {copies} pipeline devices holding a copy have it "
                                     f"requires_grad=True: freeze or unfreeze it under every name it has on every "
                                     f"stage (model.tied_copies lists a stage's other names)")
                if param.requires_grad:
                    gained = gained[:-1].view_as(grad)
                    grad.copy_(gained if old is None else old + gained)

    @property
    def has_first(self) -> bool:
        return 0 in self.local

    @property
    def has_last(self) -> bool:
        return self.assignment.num_stages - 1 in self.local

    def step(self, inputs: Any, targets: Any, loss_fn: Callable, accumulate: int = 1) -> torch.Tensor:
        inputs = self._check_inputs(inputs)
        problems = self.plan.pipeline.check_batch(int(inputs[0].shape[0])) if self.plan.pipeline else []
        if problems:
            raise PlanError(problems)
        parts = micro_batches(inputs, targets, accumulate, multiple_of=self.microbatches)
        self._check_part_shape(tuple(parts[0][0][0].shape), accumulate)
        self.loss_fn, self.accumulate = loss_fn, accumulate
        device = self.ctx.device
        losses: list[torch.Tensor] = []
        before = self._tied_grads()
        with timeline.span("step"), _recording_waits():
            # data-parallel gradients are reduced once, in this rank's last backward of the last part (_instrument)
            self.backwards_left = self.microbatches * len(self.local) * accumulate
            if self.data_parallel is not None:
                self.data_parallel.set_requires_gradient_sync(False)
            try:
                for part_inputs, part_targets in parts:
                    args = tuple(x.to(device) for x in part_inputs) if self.has_first else ()
                    target = part_targets.to(device) if self.has_last else None
                    part_losses: list[torch.Tensor] = []  # torch's schedule clears the list it is given
                    self.schedule.step(*args, target=target, losses=part_losses)
                    losses += part_losses
            finally:
                if self.data_parallel is not None:
                    self.data_parallel.set_requires_gradient_sync(True)
            with timeline.span("sync"):
                self._sum_tied_grads(before)
                return self._mean_loss(losses)

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable) -> torch.Tensor:
        inputs = self._check_inputs(inputs)
        problems = self.plan.pipeline.check_batch(int(inputs[0].shape[0])) if self.plan.pipeline else []
        if problems:
            raise PlanError(problems)
        losses = []
        with torch.no_grad():
            for part_inputs, part_targets in micro_batches(inputs, targets, self.microbatches):
                output = self.through_stages(model, tuple(part_inputs), None, 0)
                if output is not None:
                    losses.append(loss_fn(output, part_targets.to(output.device)) / self.microbatches)
        return self._mean_loss(losses)

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
                dist.all_reduce(loss, group=self.ctx.mesh[axis].get_group())
        return loss / self.plan.mesh.data_size


    def through_stages(self, model: nn.Module, inputs: tuple, cache: Any, past: int) -> torch.Tensor | None:
        ranks, device = self.assignment.ranks, self.ctx.device
        args = tuple(x.to(device) for x in inputs)
        for s in range(self.assignment.num_stages):
            if s not in self.local:
                continue
            if s > 0 and ranks[s - 1] != self.pp_rank:
                args = (_receive(self.pp_group, ranks[s - 1], device),)
            x = model(*args, stage=s, cache=cache, past=past)  # through __call__: FSDP2's hooks run
            args = (x,)
            if s + 1 < self.assignment.num_stages and ranks[s + 1] != self.pp_rank:
                _send(x, self.pp_group, ranks[s + 1])
        return x if self.has_last else None

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


@dataclass
class _TiedCopy:
    """This rank's copy (``name``) of a parameter tied across pipeline devices (``first``: the
    model's first name for it), the group of the devices holding a copy, the group rank of
    the first name's device (``source``), and whether this is that device (``primary``)."""

    name: str
    first: str
    param: nn.Parameter
    group: dist.ProcessGroup
    source: int
    primary: bool


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """``param``'s gradient as its local shard, laid out as ``param`` first: the backward of a
    vocabulary-split embedding leaves a replicated DTensor gradient beside its sharded weight,
    while the LM head tied to it gets a sharded one, and the copies' shards must match."""
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return local_tensor(grad)


def _positional_inputs(stage_forward: Callable) -> int | None:
    """How many inputs a family's ``stage_forward(model, units, ...)`` takes (``None``: any number)."""
    parameters = list(inspect.signature(stage_forward).parameters.values())[2:]
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


#: dtypes a hidden state may have between stages, by the code :func:`_send` sends ahead of it
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 6


def _send(tensor: torch.Tensor, group: dist.ProcessGroup, dst: int) -> None:
    """Send a tensor of any shape: a fixed-size header (dims, shape, dtype) first, then the data."""
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise UsageError(f"a pipeline stage's output of dtype {tensor.dtype} and shape {list(tensor.shape)} cannot be "
                         f"sent to the next stage: give {[str(d) for d in _DTYPES]} with at most {_MAX_DIMS} dims")
    header = [tensor.dim(), _DTYPES.index(tensor.dtype), *tensor.shape] + [0] * (_MAX_DIMS - tensor.dim())
    dist.send(torch.tensor(header, device=tensor.device), group=group, group_dst=dst)
    dist.send(tensor.contiguous(), group=group, group_dst=dst)


def _receive(group: dist.ProcessGroup, src: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(2 + _MAX_DIMS, dtype=torch.long, device=device)
    dist.recv(header, group=group, group_src=src)
    dims, dtype, *shape = header.tolist()
    tensor = torch.empty(shape[:dims], dtype=_DTYPES[dtype], device=device)
    dist.recv(tensor, group=group, group_src=src)
    return tensor


def _count_saved(params: Callable[[], list[torch.Tensor]], record: Any) -> Any:
    """saved_tensors_hooks adding the bytes of non-parameter tensors saved for backward to ``record.bytes``."""

    def storage(t: torch.Tensor) -> int:
        local = getattr(t, "_local_tensor", t)
        try:
            return local.untyped_storage().data_ptr()
        except RuntimeError:  # a tensor subclass without storage: not a parameter's
            return -1

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta" and storage(t) not in {storage(p) for p in params()}:
            record.bytes += t.numel() * t.element_size()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _instrument(stage: PipelineStage, runtime: _Runtime) -> None:
    """Record F/B/I/W spans per micro-batch (with saved activation bytes) while a timeline records,
    and let FSDP2 (``dp``/``fsdp``) reduce gradients once, in this rank's last backward of the step.

    The stage's submodule is not the FSDP module (it calls the model through its ``__call__``),
    so torch's schedules do not switch FSDP's gradient sync; left alone, FSDP2 would reduce
    after every micro-batch (correct, but m times the communication). Gradients accumulate
    unsynced; the last backward syncs, and FSDP2's root callback reduces every group once.
    """
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
    index = stage.stage_index

    def forward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
        if not timeline.is_recording():
            return forward(chunk, *args, **kwargs)
        with timeline.span("F", index, chunk) as record, _count_saved(lambda: list(stage.submod.parameters()), record):
            return forward(chunk, *args, **kwargs)

    def backward_one_chunk(chunk: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False) -> Any:
        runtime.backwards_left -= 1
        if runtime.backwards_left == 0 and runtime.data_parallel is not None:
            runtime.data_parallel.set_requires_gradient_sync(True)
        with timeline.span("B" if full_backward else "I", index, chunk):
            return backward(chunk, loss=loss, full_backward=full_backward, last_backward=last_backward)

    def backward_weight_one_chunk(chunk: int, last_backward: bool = False) -> Any:
        with timeline.span("W", index, chunk):
            return weight(chunk, last_backward=last_backward)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


@contextmanager
def _recording_waits() -> Iterator[None]:
    """While recording, time torch's blocking P2P waits (``schedules._wait_batch_p2p``) as ``wait`` spans."""
    original = getattr(torch_schedules, "_wait_batch_p2p", None)
    if not timeline.is_recording() or original is None:
        yield
        return

    def waiting(work: list) -> None:
        if not work:
            return original(work)
        with timeline.span("wait"):
            return original(work)

    torch_schedules._wait_batch_p2p = waiting
    try:
        yield
    finally:
        torch_schedules._wait_batch_p2p = original


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
    runtime = _Runtime(model, plan, ctx, assignment)
    keep = {m for s in runtime.local for m in assignment.modules(s)} | set(assignment.layout.shared)
    _prune(model, keep, assignment)
    model = with_mixin(model, PipelinedModule, "Pipelined")
    model._sk_runtime = runtime
    held = {n for n, _ in model.named_parameters()}
    layouts = dict(layouts)
    for tie in assignment.ties:  # a tied parameter's copy in a later stage is laid out as its first name
        layouts.update({name: replace(layouts[tie.names[0]], name=name) for name in tie.names[1:]})
    model = parallelize(model, plan, ctx, {n: lay for n, lay in layouts.items() if n in held}, facts, seed, source)
    runtime.build(model)
    runtime.connect_ties(model)
    return model


__all__ = ["PipelinedModule", "build_pipeline"]
