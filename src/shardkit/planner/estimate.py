"""``sk.estimate``: memory per device and step time of a plan, before any device is used.

shardkit plans **language models**: causal LMs over token ids, a token embedding, repeated
blocks (the children of an ``nn.ModuleList``) and a head, as transformers' ``*ForCausalLM``
models and shardkit's reference GPT are. Their costs are *measured* on fake tensors by
:func:`shardkit.planner.analysis.analyse` (parameters, forward FLOPs and bytes saved for
backward per token, by component, as one tensor-parallel rank of the plan's rules computes
them); :mod:`shardkit.planner.memory` turns them into bytes per device (shardkit's one model of
memory) and :mod:`shardkit.planner.step_time` into seconds per step. Any other model (an
encoder, a vision model, a module taking other inputs) is refused by name
(:class:`~shardkit.plan.UsageError`): its plans can still be validated, explained and run, only
not priced. Every argument is checked first: a size that is not a whole number >= 1, a mesh
axis left at ``-1`` without ``world_size``, or an axis the estimate does not price is an error
naming it and what is valid, never a number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..plan import Plan, PlanError, UsageError
from ..plan.text import format_bytes, format_seconds
from .analysis import analyse, probe_model
from .costs import MESH_ORDER, OPTIMIZER_STATES, Costs, Setting
from .experts import expert_problems
from .hardware import Hardware
from .hardware import hardware as as_hardware
from .memory import MEMORY_KEYS, blocks_per_device, memory_of, stored_experts, tokens_per_microbatch
from .step_time import layer_exchanges, time_of


@dataclass(frozen=True)
class Estimate:
    """What a plan costs per device and per step.

    ``memory``: bytes on the most loaded device by component (:data:`~shardkit.planner.memory.MEMORY_KEYS`)
    and ``total``.
    ``step_time``: seconds per optimizer step; ``step_time_parts``: its parts (``compute``,
    ``bubble`` and the communication not hidden behind compute, by axis). ``mfu``: the model's
    training FLOPs (no recompute) per second over the devices' peak in the compute dtype.
    """

    plan: Plan
    batch_size: int
    seq_len: int
    hardware: Hardware
    memory: Mapping[str, int]
    step_time: float
    step_time_parts: Mapping[str, float]
    tokens_per_s: float
    mfu: float
    notes: tuple[str, ...] = ()
    grad_accum: int = 1
    experts: ExpertsEstimate | None = None

    @property
    def fits(self) -> bool:
        """Whether the most loaded device's total fits the hardware's memory."""
        return self.memory["total"] <= self.hardware.memory

    def summary(self) -> str:
        """Memory by component, step time by part, tokens/s and MFU, as plain text lines."""
        memory = ", ".join(f"{k} {format_bytes(self.memory[k], digits=2)}" for k in MEMORY_KEYS if self.memory[k])
        parts = ", ".join(f"{k} {format_seconds(v)}" for k, v in self.step_time_parts.items() if v > 0)
        accumulation = f", {self.grad_accum} accumulation steps" if self.grad_accum > 1 else ""
        lines = [f"memory per device{accumulation}: {format_bytes(self.memory['total'], digits=2)} of "
                 f"{format_bytes(self.hardware.memory, digits=2)} on {self.hardware.name} ({memory})",
                 f"step time: {format_seconds(self.step_time)} ({parts}); {self.tokens_per_s:,.0f} tokens/s; "
                 f"MFU {100 * self.mfu:.1f}%"]
        if self.experts is not None:
            lines.append(self.experts.summary())
        return "\n".join(lines + list(self.notes))


@dataclass(frozen=True)
class ExpertsEstimate:
    """A mixture of experts under a plan: ``layers`` MoE layers (experts modules) of ``num_experts``
    experts, ``top_k`` per token; ``local`` experts of each a device holds (``E / ep``) and their
    parameter ``bytes`` per device (after FSDP); ``total_params`` and ``active_params`` (those one
    token uses) of the whole model; ``all_to_all_bytes``: what a device sends to the other ``ep``
    ranks per step at balanced routing, and ``all_to_all_time`` (the step time's ``ep`` part)."""

    layers: int
    num_experts: int
    top_k: int
    local: int
    bytes: int
    total_params: int
    active_params: int
    all_to_all_bytes: int
    all_to_all_time: float

    def summary(self) -> str:
        share = 100 * self.active_params / self.total_params
        exchange = f"; all-to-all {format_bytes(self.all_to_all_bytes, digits=2)} per step per device " \
            f"({format_seconds(self.all_to_all_time)}, balanced routing)" if self.local < self.num_experts else ""
        return (f"experts: {self.local} of {self.num_experts} per device in each of {self.layers} MoE layers, "
                f"{format_bytes(self.bytes, digits=2)} of expert parameters per device; top {self.top_k}: "
                f"{self.active_params:,} of {self.total_params:,} parameters active per token ({share:.0f}%)"
                f"{exchange}")


def estimate(model: Any, plan: Plan, *, batch_size: int, seq_len: int, hardware: str | Hardware = "h100-80g",
             optimizer: str = "adamw", world_size: int | None = None, grad_accum: int = 1) -> Estimate:
    """Memory per device and step time of training the language model ``model`` under ``plan``,
    without running it.

    ``model``: a causal LM over token ids, as an ``nn.Module`` (the meta device is fine), a
    transformers config or a catalogue name (``shardkit.planner.catalogue``); other models are
    refused (module docstring). ``batch_size``: the global batch in sequences; ``world_size``:
    the number of devices, which a mesh axis of ``-1`` is inferred from; ``hardware``: a preset
    name, a hardware file or a :class:`Hardware`; ``grad_accum``: gradient accumulation steps (the
    batch is split into that many micro-steps; a pipeline accumulates over its own micro-batches).
    Tensor parallel is priced with the plan's own rules.

    >>> import shardkit as sk
    >>> e = sk.estimate("gpt-small", sk.Plan(sk.Mesh(fsdp=4)), batch_size=8, seq_len=128, hardware="a100-80g")
    >>> e.memory["optimizer"] == 2 * e.memory["parameters"], e.fits
    (True, True)
    >>> sk.estimate("gpt-small", sk.Plan(sk.Mesh(fsdp=-1)), batch_size=8, seq_len=128)
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.PlanError: estimate(): mesh axis 'fsdp' is -1, to be inferred from the number of devices; pass world_size=N (the number of devices), or give the axis its size
    """
    if optimizer not in OPTIMIZER_STATES:
        raise UsageError(f"estimate(optimizer={optimizer!r}) is unknown; valid: {sorted(OPTIMIZER_STATES)}")
    if type(grad_accum) is not int or grad_accum < 1:
        raise UsageError(f"estimate(grad_accum={grad_accum!r}): give a whole number of steps >= 1")
    hw = as_hardware(hardware)
    plan = priced_plan(plan, world_size, "estimate")
    if grad_accum > 1 and plan.pipeline is not None:
        raise UsageError(f"estimate(grad_accum={grad_accum}): a pipeline accumulates over its micro-batches; "
                         f"raise Pipeline(microbatches=...) instead")
    setting = replace(Setting.of(plan), accumulation=grad_accum)
    problems = plan.problems() + plan.batch_problems(batch_size, seq_len)
    if not problems and grad_accum > 1 and batch_size % (plan.mesh.data_size * grad_accum):
        problems.append(f"batch of {batch_size} samples does not split into {grad_accum} accumulation steps over "
                        f"{plan.mesh.data_size} data-parallel replicas; use a multiple of "
                        f"{plan.mesh.data_size * grad_accum}")
    if not problems and plan.mesh.size_of("ep") > 1:  # experts to split, E divisible, what ep composes with
        problems += expert_problems(plan, probe_model(model))[1]
    if problems:
        raise PlanError(problems)
    costs = Costs.of(model, seq_len, setting.tp, None, rules=plan.rules)
    memory, parts = evaluate(costs, setting, batch_size, hw, optimizer)
    return estimate_of(costs, plan, setting, batch_size, hw, memory, parts)


def priced_plan(plan: Any, world_size: Any, caller: str) -> Plan:
    """``plan`` resolved on ``world_size`` devices, checked for what the estimate can price: a
    :class:`Plan`, no ``-1`` axis left, no axis but those of :data:`~shardkit.planner.costs.MESH_ORDER`
    above size 1."""
    if not isinstance(plan, Plan):
        raise UsageError(f"{caller}(plan=...) must be a shardkit Plan, got {type(plan).__name__}")
    if world_size is not None and (type(world_size) is not int or world_size < 1):
        raise UsageError(f"{caller}(world_size={world_size!r}): the number of devices, a whole number >= 1")
    if world_size is not None:
        plan = plan.resolved(world_size)
    unresolved = [axis for axis, size in plan.mesh.items() if size == -1]
    if unresolved:
        known = math.prod(size for size in plan.mesh.values() if size != -1)
        multiple = f", a multiple of {known}" if known > 1 else ""
        raise PlanError(f"{caller}(): mesh axis {unresolved[0]!r} is -1, to be inferred from the number of devices; "
                        f"pass world_size=N (the number of devices{multiple}), or give the axis its size")
    unpriced = {axis: size for axis, size in plan.mesh.items() if axis not in MESH_ORDER and size > 1}
    if unpriced:
        raise PlanError(f"{caller}(): mesh axes {unpriced} split parameters by their own rules, which the estimate "
                        f"does not price; it prices {', '.join(MESH_ORDER)} (any other axis of size 1): estimate the "
                        f"plan with those splits on 'tp'")
    return plan


def evaluate(costs: Costs, s: Setting, batch_size: int, hw: Hardware,
             optimizer: str = "adamw") -> tuple[dict[str, int], dict[str, float]]:
    """``(memory by component with total, step time by part)`` of one setting: plain arithmetic on
    measured costs, fast enough for autoshard to call for every candidate."""
    return memory_of(costs, s, batch_size, hw, optimizer), time_of(costs, s, batch_size, hw, optimizer)


def estimate_of(costs: Costs, plan: Plan, setting: Setting, batch_size: int, hw: Hardware,
                memory: dict[str, int], parts: dict[str, float]) -> Estimate:
    """The :class:`Estimate` of ``plan`` from its setting's memory and step time parts."""
    step = sum(parts.values())
    tokens = batch_size * costs.seq_len
    whole = costs.whole
    model_flops = 3 * tokens * (whole.embedding.flops + whole.layers * whole.block.flops + whole.head.flops)
    peak = hw.peak_flops(setting.compute_dtype or whole.dtype) * setting.devices
    notes = []
    if memory["total"] > hw.memory:
        notes.append(f"does not fit: needs {format_bytes(memory['total'], digits=2)} of "
                     f"{format_bytes(hw.memory, digits=2)} per device")
    return Estimate(plan, batch_size, costs.seq_len, hw, memory, step, parts, tokens / step,
                    model_flops / (step * peak), tuple(notes), setting.accumulation,
                    _experts(costs, setting, batch_size, parts))


def _experts(costs: Costs, s: Setting, batch_size: int, parts: Mapping[str, float]) -> ExpertsEstimate | None:
    n = costs.numbers
    if not n.moe_modules:
        return None
    blocks = blocks_per_device(n, s)
    dtype = s.compute_dtype if s.compute_dtype is not None else costs.local.dtype
    tokens = tokens_per_microbatch(s, batch_size, costs.seq_len)
    sent = sum(runs * e.bytes for e, runs in layer_exchanges(n, s, tokens, dtype.itemsize)) if s.ep > 1 else 0
    return ExpertsEstimate(n.layers * n.moe_modules, n.num_experts, n.top_k, n.num_experts // s.ep,
                           blocks * stored_experts(n, s) * n.itemsize, costs.whole.total_params,
                           costs.whole.active_params, s.microbatches * s.accumulation * blocks * n.moe_modules * sent,
                           parts.get("ep", 0.0))


def kv_cache_bytes(model: Any, *, tp: int = 1, pp: int = 1, batch_size: int, seq_len: int,
                   dtype: torch.dtype | None = None) -> int:
    """Bytes of the KV cache one rank holds for ``batch_size`` sequences of ``seq_len`` positions in
    ``sk.generate``: keys and values of its layers (with ``pp`` stages split evenly, the stage with
    the most: ``ceil(layers / pp)``), for its KV heads (``kv_heads / tp``), ``head_dim`` wide, in
    ``dtype`` (default: the parameters'). Every size must be a whole number >= 1.

    >>> kv_cache_bytes("llama3-8b", tp=8, batch_size=1, seq_len=8192, dtype=torch.bfloat16) / 2**20
    128.0
    >>> kv_cache_bytes("llama3-8b", tp=8, pp=4, batch_size=1, seq_len=8192, dtype=torch.bfloat16) / 2**20
    32.0
    """
    wrong = [f"{name}={value!r}" for name, value in (("tp", tp), ("pp", pp), ("batch_size", batch_size),
                                                      ("seq_len", seq_len)) if type(value) is not int or value < 1]
    if wrong:
        raise UsageError(f"kv_cache_bytes({', '.join(wrong)}): give whole numbers >= 1")
    a = analyse(model, seq_len=seq_len, tp=1, dtype=dtype)
    if a.kv_heads % tp:
        raise PlanError(f"kv_cache_bytes(tp={tp}): the model's {a.kv_heads} KV heads do not split over tp={tp}")
    if not 1 <= pp <= a.layers:
        raise PlanError(f"kv_cache_bytes(pp={pp}): the model has {a.layers} layers; valid: 1 to {a.layers} stages")
    if not a.heads:
        raise PlanError(f"kv_cache_bytes: no attention with heads was found in {a.name}, so it keeps no KV cache "
                        f"shardkit can size")
    head_dim = a.head_dim or a.hidden // a.heads
    layers = -(-a.layers // pp)
    return 2 * layers * batch_size * seq_len * (a.kv_heads // tp) * head_dim * (dtype or a.dtype).itemsize


__all__ = ["Estimate", "ExpertsEstimate", "estimate", "estimate_of", "evaluate", "kv_cache_bytes", "priced_plan"]
