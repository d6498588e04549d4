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
    validate(plan, meta_model(builder), world_size)
    costs = []
    for rank in ranks:
        start = time.process_time()
        memory, collectives = _one_rank(meta_model(builder), plan, rank, world_size, batch, seq_len,
                                        loss_fn, optimizer)
        costs.append(RankCost(rank, memory, collectives, time.process_time() - start))
    predicted = None
    if estimate:
        predicted = dict(sk_estimate(meta_model(builder), plan, batch_size=batch, seq_len=seq_len, hardware=hw,
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
                 loss_fn: Callable | None = None, optimizer: str = "adamw") -> tuple[dict[str, int], list[Collective]]:
    """Shard ``model`` (on meta) by ``plan`` in ``ctx``'s world, and run one training step of a global
    batch of ``batch`` random sequences of ``seq_len`` tokens under :class:`StepCost`: the rank's
    bytes by component and its collectives in a step that finds the optimizer state made, as every
    step but the first does (:func:`_steady_state`). The dry run calls it in its fake world; a real world's
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
    _steady_state(sharded, opt, plan, inputs, targets, loss_fn or hf_loss)
    with StepCost(sharded, opt, plan.mesh) as cost:
        sharded.step(inputs, targets, loss_fn or hf_loss)
        opt.step()
    return cost.memory(), cost.collectives()


def _steady_state(model: nn.Module, opt: Any, plan: Plan, inputs: Any, targets: Any, loss_fn: Callable) -> None:
    """What the first step leaves for the next: the optimizer's state (one optimizer step on zero
    gradients), and with a pipeline, torch's stages initialised (their first step infers shapes with
    ``autograd.grad``, which the memory tracker's module hooks refuse): one whole step there."""
    import torch

    if plan.pipeline is not None:
        model.step(inputs, targets, loss_fn)
    else:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


__all__ = ["COMPARED", "DryRun", "FILL_ORDER", "RankCost", "dry_run", "measure_step"]
