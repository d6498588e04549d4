"""``sk.dry_run``: one real training step of one rank (or a few) of an N-process world, in this
process, on torch's fake process group and fake tensors (:mod:`shardkit.runtime.fake_world`):
the real ``sk.shard``, forward, backward and optimizer step, with no memory allocated and no
collective moving data. Each rank's exact bytes by component and the collectives it issues
(:mod:`shardkit.observe.step_cost`) are set beside ``sk.estimate``'s prediction for the same
plan; with a device memory, a plan that would not fit says which component overflows.

See ``docs/dry-run.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ..observe.step_cost import Collective, StepCost
from ..plan import Plan, UsageError
from ..plan.text import format_bytes
from ..runtime.context import Context

#: The dry run's components beside the estimate's (``sk.estimate``'s memory keys they are compared with).
COMPARED: dict[str, tuple[str, ...]] = {
    "parameters": ("parameters",),
    "gradients": ("gradients",),
    "optimizer": ("optimizer",),
    "gathered": ("gathered",),
    "activations": ("activations",),
    "temporaries": ("temporaries",),
}
#: The order a device's memory fills in: the state first, then what a step adds.
FILL_ORDER = ("parameters", "gradients", "optimizer", "other", "gathered", "activations", "temporaries")


@dataclass(frozen=True)
class RankCost:
    """What one step costs rank ``rank``: ``memory`` by component (and ``peak``), ``collectives``,
    and the CPU ``seconds`` its dry run took (shard and step)."""

    rank: int
    memory: dict[str, int]
    collectives: list[Collective]
    seconds: float

    def overflow(self, device_memory: int) -> str | None:
        """``None`` if the peak fits ``device_memory``; else which component overflows it: the one
        during which memory, filled in :data:`FILL_ORDER`, passes the device's."""
        if self.memory["peak"] <= device_memory:
            return None
        total = 0
        for part in FILL_ORDER:
            total += self.memory[part]
            if total > device_memory:
                break
        return (f"rank {self.rank} needs {format_bytes(self.memory['peak'], digits=2)} at its peak, over the device's "
                f"{format_bytes(device_memory, digits=2)}: {part} overflows it ({format_bytes(total, digits=2)} with "
                f"everything before it in {', '.join(FILL_ORDER[:FILL_ORDER.index(part) + 1])})")


@dataclass(frozen=True)
class DryRun:
    """A dry run's ranks (:class:`RankCost`) and ``sk.estimate``'s prediction for the same plan
    (``estimate``: its memory by component, or ``None`` where the estimate cannot price the model)."""

    plan: Plan
    world_size: int
    batch: int
    seq_len: int
    ranks: list[RankCost]
    estimate: dict[str, int] | None
    device_memory: int | None = None

    def ratios(self, rank: int | None = None) -> dict[str, float]:
        """Estimate / dry run per compared component (:data:`COMPARED`) of ``rank`` (default: the
        first), where the dry run measured bytes."""
        if self.estimate is None:
            return {}
        cost = self.ranks[0] if rank is None else next(r for r in self.ranks if r.rank == rank)
        return {part: sum(self.estimate[k] for k in keys) / cost.memory[part]
                for part, keys in COMPARED.items() if cost.memory[part]}

    def overflows(self) -> list[str]:
        """Each rank's overflow (:meth:`RankCost.overflow`) against ``device_memory``."""
        if self.device_memory is None:
            return []
        return [line for r in self.ranks if (line := r.overflow(self.device_memory)) is not None]

    def summary(self) -> str:
        """Memory by component per rank beside the estimate, the collectives, overflows; plain text."""
        parts = list(COMPARED) + ["other", "peak"]
        head = f"{'component':<12}" + "".join(f"{'rank ' + str(r.rank):>14}" for r in self.ranks)
        head += f"{'estimate':>14}{'est/dry':>9}" if self.estimate is not None else ""
        lines = [f"dry run: {self.plan.mesh} of {self.world_size} devices, batch {self.batch} x {self.seq_len}",
                 head]
        ratios = self.ratios()
        for part in parts:
            row = f"{part:<12}" + "".join(f"{format_bytes(r.memory[part], digits=2):>14}" for r in self.ranks)
            if self.estimate is not None:  # the peak beside the estimate's total less its allocator overhead
                keys = COMPARED.get(part, ("total",) if part == "peak" else ())
                est = sum(self.estimate[k] for k in keys) - (self.estimate["overhead"] if part == "peak" else 0)
                if part == "peak" and self.ranks[0].memory["peak"]:
                    ratios[part] = est / self.ranks[0].memory["peak"]
                ratio = f"{ratios[part]:.3f}" if part in ratios else ""
                row += f"{format_bytes(est, digits=2) if keys else '':>14}{ratio:>9}"
            lines.append(row)
        for r in self.ranks:
            lines.append(f"rank {r.rank} collectives ({r.seconds:.1f} s on CPU):")
            lines += [f"  {c.kind:<32} over {'x'.join(c.axes) or '-':<10} {c.calls:>5} calls "
                      f"{format_bytes(c.bytes, digits=2):>12}" for c in r.collectives]
        return "\n".join(lines + self.overflows())


def dry_run(build: Callable[..., nn.Module] | Any, plan: Plan, *, world_size: int, batch: int, seq_len: int,
            ranks: Sequence[int] = (0,), loss_fn: Callable | None = None, optimizer: str = "adamw",
            device_memory: int | None = None, hardware: Any = "h100-80g", estimate: bool = True) -> DryRun:
    """One training step of ranks ``ranks`` of a ``world_size``-process world under ``plan``, on fake
    tensors and torch's fake process group: exact bytes per component and collectives per rank,
    beside ``sk.estimate``'s memory for the same plan (``estimate=False`` skips it).

    ``build``: the model's builder (called on the meta device) or a transformers config; ``batch``:
    the global batch in sequences of ``seq_len`` tokens; ``device_memory``: bytes per device, to
    say which component overflows (default: ``hardware``'s memory).

    >>> import shardkit as sk
    >>> from shardkit.models.hf import build_tiny_llama
    >>> run = sk.dry_run(build_tiny_llama, sk.Plan(sk.Mesh(fsdp=64)), world_size=64, batch=64,
    ...                  seq_len=32)                                       # doctest: +SKIP
    >>> run.ranks[0].memory["parameters"] > 0, run.overflows()              # doctest: +SKIP
    (True, [])
    """
    import time

    from ..planner.estimate import estimate as sk_estimate
    from ..planner.hardware import hardware as as_hardware
    from ..planner.meta import meta_model
    from ..planner.validate import validate

    builder = _builder(build)
    plan = _checked(plan, world_size, batch, seq_len, ranks)
    hw = as_hardware(hardware)
    # every check before any rank runs, and outside fake tensors: a pipeline's stages are proven on a
    # real miniature of the model (the proof is kept, and sk.shard's own validation finds it)
    whole = meta_model(builder)  # checked and priced; each rank shards a fresh one
    validate(plan, whole, world_size)
    costs = []
    for rank in ranks:
        start = time.process_time()
        memory, collectives = _one_rank(meta_model(builder), plan, rank, world_size, batch, seq_len,
                                        loss_fn, optimizer)
        costs.append(RankCost(rank, memory, collectives, time.process_time() - start))
    predicted = None
    if estimate:
        predicted = dict(sk_estimate(whole, plan, batch_size=batch, seq_len=seq_len, hardware=hw,
                                     optimizer=optimizer, world_size=world_size).memory)
    return DryRun(plan, world_size, batch, seq_len, costs, predicted,
                  hw.memory if device_memory is None else device_memory)


def _builder(build: Any) -> Callable[[], nn.Module]:
    if callable(build) and not hasattr(build, "model_type"):
        return build
    if hasattr(build, "model_type"):  # a transformers config
        from .model import _build_causal_lm

        return lambda: _build_causal_lm(build)
    raise UsageError(f"dry_run(build=...): give the model's builder (a callable) or a transformers config, got "
                     f"{type(build).__name__}")


def _checked(plan: Any, world_size: Any, batch: Any, seq_len: Any, ranks: Sequence[int]) -> Plan:
    if not isinstance(plan, Plan):
        raise UsageError(f"dry_run(plan=...) must be a shardkit Plan, got {type(plan).__name__}")
    wrong = [f"{name}={value!r}" for name, value in (("world_size", world_size), ("batch", batch),
                                                      ("seq_len", seq_len)) if type(value) is not int or value < 1]
    if wrong:
        raise UsageError(f"dry_run({', '.join(wrong)}): give whole numbers >= 1")
    outside = [r for r in ranks if type(r) is not int or not 0 <= r < world_size]
    if not ranks or outside:
        raise UsageError(f"dry_run(ranks={list(ranks)!r}): give one or more ranks from 0 to {world_size - 1}")
    plan = plan.resolved(world_size)
    later = [r for r in ranks if plan.pipeline is not None and plan.mesh.coordinates(r).get("pp", 0)]
    if later:
        raise UsageError(f"dry_run(ranks={list(ranks)!r}): rank(s) {later} hold later pipeline stages, whose input "
                         f"shapes only the stage before knows; a dry run runs ranks of the first stage (pp "
                         f"coordinate 0), e.g. {[r for r in range(world_size) if not plan.mesh.coordinates(r)['pp']][:4]}")
    problems = plan.problems() + plan.batch_problems(batch, seq_len)
    if problems:
        from ..plan import PlanError

        raise PlanError(problems)
    return plan


def _one_rank(model: nn.Module, plan: Plan, rank: int, world_size: int, batch: int, seq_len: int,
              loss_fn: Callable | None, optimizer: str) -> tuple[dict[str, int], list[Collective]]:
    from ..runtime.fake_world import fake_world

    with fake_world(rank, world_size, plan) as ctx:
        return measure_step(ctx, model, plan, batch, seq_len, loss_fn, optimizer)


def measure_step(ctx: Context, model: nn.Module, plan: Plan, batch: int, seq_len: int,
                 loss_fn: Callable | None = None, optimizer: str = "adamw",
                 first_step: bool = False) -> tuple[dict[str, int], list[Collective]]:
    """Shard ``model`` (on meta) by ``plan`` in ``ctx``'s world, and run one training step of a global
    batch of ``batch`` random sequences of ``seq_len`` tokens under :class:`StepCost`: the rank's
    bytes by component and its collectives in a step that finds the optimizer state made, as every
    step but the first does. What the first step leaves is made without running it
    (:func:`_steady_state`), or with ``first_step=True`` by running it (forward, backward and
    optimizer step), as a real run does. The dry run calls it in its fake world; a real world's
    job can call it too, and gets the same numbers (``tests/test_dry_run.py``)."""
    import torch

    from ..families import token_sizes
    from ..models.hf import hf_loss
    from ..runtime.apply import shard
    from .step import make_optimizer

    vocab = token_sizes(model)[0] or 2
    ctx = replace(ctx, plan=plan)  # the batch splits over this plan's data ranks
    sharded = shard(model, plan, ctx)
    opt = make_optimizer(sharded, optimizer, 1e-4)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
    inputs, targets = ctx.shard_batch(tokens[:, :-1], tokens[:, 1:])
    if first_step:
        sharded.step(inputs, targets, loss_fn or hf_loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        _steady_state(sharded, opt, plan, inputs, targets, loss_fn or hf_loss)
    with StepCost(sharded, opt, plan.mesh) as cost:
        sharded.step(inputs, targets, loss_fn or hf_loss)
        opt.step()
    return cost.memory(), cost.collectives()


def _steady_state(model: nn.Module, opt: Any, plan: Plan, inputs: Any, targets: Any, loss_fn: Callable) -> None:
    """What the first step leaves for the next, without running it: with a pipeline, torch's stages
    initialised (:func:`_initialise_stages`), and the optimizer's state (:func:`_optimizer_state`)."""
    if plan.pipeline is not None:
        _initialise_stages(model, inputs, targets, loss_fn)
    _optimizer_state(opt)


class _StagesReady(Exception):
    """Raised by :func:`_initialise_stages` to leave a step once torch's stages are initialised."""


def _initialise_stages(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable) -> None:
    """torch's pipeline stages as their first step leaves them: on that step, before any
    micro-batch, the schedule infers the stages' shapes (with ``autograd.grad``, which the memory
    tracker's module hooks refuse) and makes their receive buffers. The step runs up to there
    and stops: the micro-batches, which would cost as much as the measured step, do not run
    (every rank of a real world stops at the same point, so the shape exchange stays paired)."""
    schedule = model._sk_runtime.schedule
    # torch 2.13: single-stage schedules initialise in _initialize_stage, the others in _initialize_stages
    name = "_initialize_stage" if hasattr(schedule, "_initialize_stage") else "_initialize_stages"
    initialise = getattr(schedule, name)

    def then_stop(*args: Any, **kwargs: Any) -> None:
        initialise(*args, **kwargs)
        raise _StagesReady

    setattr(schedule, name, then_stop)
    try:
        model.step(inputs, targets, loss_fn)
    except _StagesReady:
        pass
    finally:
        delattr(schedule, name)


def _optimizer_state(opt: Any) -> None:
    """The optimizer's state as its first step makes it, made by that step on plain tensors: each
    DTensor parameter's local shard stands in for it (with a zero gradient), and the state made
    for the shard is put back under the parameter as a DTensor laid out like it. The tensors
    (shapes, dtypes, strides, bytes) are those a step on the DTensors makes, which costs
    DTensor's dispatch on each of the optimizer's ops (a dozen per parameter with AdamW): most of
    a dry run's time. torch's optimizers keep their step counts (``"step"``) as plain tensors."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor

    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt  # it steps the rank's part
    held = [group["params"] for group in inner.param_groups]
    with torch.no_grad():
        stand_ins = {p: _stand_in(p) for params in held for p in params}
    for group, params in zip(inner.param_groups, held, strict=True):
        group["params"] = [stand_ins[p] for p in params]
    try:
        inner.step()
    finally:
        for group, params in zip(inner.param_groups, held, strict=True):
            group["params"] = params
    for p, local in stand_ins.items():
        if local not in inner.state:  # SGD without momentum keeps none
            continue
        state = inner.state.pop(local)
        if isinstance(p, DTensor):
            state = {key: DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                             run_check=False)
                     if key != "step" and isinstance(value, torch.Tensor) and value.shape == local.shape else value
                     for key, value in state.items()}
        inner.state[p] = state
    opt.zero_grad(set_to_none=True)


def _stand_in(p: Any) -> Any:
    """A leaf on ``p``'s local shard (``p`` itself when it is a plain tensor), with a zero gradient."""
    import torch
    from torch.distributed.tensor import DTensor

    local = p.to_local().detach().requires_grad_(p.requires_grad) if isinstance(p, DTensor) else p
    local.grad = torch.zeros_like(local)
    return local


__all__ = ["COMPARED", "DryRun", "FILL_ORDER", "RankCost", "dry_run", "measure_step"]
