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

from ..observe.step_cost import Collective
from ..plan import Plan, UsageError
from ..plan.text import format_bytes
from .measured_step import default_loss, measure_step, sharded_for_step

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
    the CPU ``seconds`` its dry run took (shard and step, and with a pipeline the earlier stages'
    ranks run for the shapes it receives), the pipeline ``stages`` it runs (``()`` without one),
    and ``estimate``: ``sk.estimate``'s memory of a device in its place (the first stage's, the
    last's; ``None`` where not estimated, or for a rank holding neither)."""

    rank: int
    memory: dict[str, int]
    collectives: list[Collective]
    seconds: float
    stages: tuple[int, ...] = ()
    estimate: dict[str, int] | None = None

    @property
    def name(self) -> str:
        """``rank 5``, with a pipeline ``rank 5 (stage 1)``."""
        return f"rank {self.rank}" + (f" (stage {','.join(map(str, self.stages))})" if self.stages else "")

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
    (``estimate``: its memory by component on the most loaded device, or ``None`` where not
    estimated; each rank also has the estimate of a device in its place)."""

    plan: Plan
    world_size: int
    batch: int
    seq_len: int
    ranks: list[RankCost]
    estimate: dict[str, int] | None
    device_memory: int | None = None

    def ratios(self, rank: int | None = None) -> dict[str, float]:
        """Estimate / dry run per compared component (:data:`COMPARED`) of ``rank`` (default: the
        first), against the estimate of a device in its place, where the dry run measured bytes."""
        cost = self.ranks[0] if rank is None else next(r for r in self.ranks if r.rank == rank)
        if cost.estimate is None:
            return {}
        return {part: sum(cost.estimate[k] for k in keys) / cost.memory[part]
                for part, keys in COMPARED.items() if cost.memory[part]}

    def overflows(self) -> list[str]:
        """Each rank's overflow (:meth:`RankCost.overflow`) against ``device_memory``."""
        if self.device_memory is None:
            return []
        return [line for r in self.ranks if (line := r.overflow(self.device_memory)) is not None]

    def summary(self) -> str:
        """Memory by component per rank beside the estimate of a device in its place, the
        collectives, overflows; plain text."""
        parts = list(COMPARED) + ["other", "peak"]
        head = f"{'component':<12}"
        for r in self.ranks:
            head += f"{r.name:>22}" + (f"{'estimate':>12}{'est/dry':>9}" if r.estimate is not None else "")
        lines = [f"dry run: {self.plan.mesh} of {self.world_size} devices, batch {self.batch} x {self.seq_len}",
                 head]
        for part in parts:
            row = f"{part:<12}"
            for r in self.ranks:
                row += f"{format_bytes(r.memory[part], digits=2):>22}"
                if r.estimate is None:
                    continue
                # the peak beside the estimate's total less its allocator overhead
                keys = COMPARED.get(part, ("total",) if part == "peak" else ())
                est = sum(r.estimate[k] for k in keys) - (r.estimate["overhead"] if part == "peak" else 0)
                ratio = f"{est / r.memory[part]:.3f}" if keys and r.memory[part] else ""
                row += f"{format_bytes(est, digits=2) if keys else '':>12}{ratio:>9}"
            lines.append(row)
        for r in self.ranks:
            lines.append(f"{r.name} collectives ({r.seconds:.1f} s on CPU):")
            lines += [f"  {c.kind:<32} over {'x'.join(c.axes) or '-':<10} {c.calls:>5} calls "
                      f"{format_bytes(c.bytes, digits=2):>12}" for c in r.collectives]
        return "\n".join(lines + self.overflows())


def dry_run(build: Callable[..., nn.Module] | Any, plan: Plan, *, world_size: int, batch: int, seq_len: int,
            ranks: Sequence[int] | None = None, loss_fn: Callable | None = None, optimizer: str = "adamw",
            device_memory: int | None = None, hardware: Any = "h100-80g", estimate: bool = True,
            grad_accum: int = 1) -> DryRun:
    """One training step of ranks ``ranks`` of a ``world_size``-process world under ``plan``, on fake
    tensors and torch's fake process group: exact bytes per component and collectives per rank,
    beside ``sk.estimate``'s memory for the same plan (``estimate=False`` skips it).

    ``build``: the model's builder (called on the meta device) or a transformers config; ``batch``:
    the global batch in sequences of ``seq_len`` tokens; ``ranks``: any ranks of the world, on any
    pipeline stage (default: :func:`default_ranks`, rank 0 and with a pipeline the last stage's
    too); ``device_memory``: bytes per device, to say which component overflows (default:
    ``hardware``'s memory); ``optimizer``: ``adamw``, ``adam``, ``sgd`` (no state) or
    ``sgd-momentum`` (one state per parameter); ``grad_accum``: gradient accumulation steps, each
    micro-step a ``1/grad_accum`` part of every rank's batch (``sk.estimate``'s; refused with a
    pipeline, which accumulates over its own micro-batches, as ``sk.estimate`` refuses it).

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
    from ..planner.space import OPTIMIZER_STATES
    from ..planner.validate import validate
    from ..runtime.fake_world import StageMetas

    builder = _builder(build)
    plan = _checked(plan, world_size, batch, seq_len, ranks, grad_accum)
    if optimizer not in OPTIMIZER_STATES:
        raise UsageError(f"dry_run(optimizer={optimizer!r}) is unknown; valid: {sorted(OPTIMIZER_STATES)}")
    ranks = default_ranks(plan) if ranks is None else tuple(ranks)
    hw = as_hardware(hardware)
    # every check before any rank runs, and outside fake tensors, once: each rank shards a fresh meta
    # model with this report (a pipeline's stages are proven here, on a real miniature of the model)
    whole = meta_model(builder)  # checked and priced
    report = validate(plan, whole, world_size)
    run = _Ranks(builder, plan, report, world_size, batch, seq_len, loss_fn or default_loss(), optimizer, grad_accum)
    costs = []
    for rank in ranks:
        start = time.process_time()
        stages = run.receive(rank) if plan.pipeline is not None else StageMetas()
        memory, collectives = run.measure(rank, stages)
        costs.append(RankCost(rank, memory, collectives, time.process_time() - start, run.stages(rank)))
    predicted = None
    if estimate:
        predicted = dict(sk_estimate(whole, plan, batch_size=batch, seq_len=seq_len, hardware=hw,
                                     optimizer=optimizer, world_size=world_size, grad_accum=grad_accum).memory)
        costs = [replace(cost, estimate=_estimate_in_place(whole, plan, cost.stages, batch, seq_len, hw, optimizer,
                                                           grad_accum))
                 for cost in costs]
    return DryRun(plan, world_size, batch, seq_len, costs, predicted,
                  hw.memory if device_memory is None else device_memory)


def default_ranks(plan: Plan) -> tuple[int, ...]:
    """The ranks a dry run runs unless told: rank 0 and, with a pipeline, the first rank of the
    pipeline device holding the last stage (the head, the logits and their gradients), each at
    coordinate 0 on every other axis, where FSDP2's uneven shards are largest. The first stage
    holds the embedding and the most micro-batches in flight; a middle stage holds fewer and
    neither, so these two bound every component unless the stages' layers differ."""
    if plan.pipeline is None:
        return (0,)
    from ..planner.stages import stage_ranks

    owners = stage_ranks(plan.pipeline.num_stages(plan.mesh), plan.mesh.size_of("pp"), plan.pipeline.schedule)
    zero = dict.fromkeys(plan.mesh.names, 0)
    return tuple(sorted({_rank_at(plan.mesh, {**zero, "pp": owners[0]}),
                         _rank_at(plan.mesh, {**zero, "pp": owners[-1]})}))


def _rank_at(mesh: Any, coordinates: dict[str, int]) -> int:
    """The rank at ``coordinates`` (row-major, last axis fastest: :meth:`Mesh.coordinates` inverted)."""
    rank = 0
    for name in mesh.names:
        rank = rank * mesh.size_of(name) + coordinates[name]
    return rank


class _Ranks:
    """The ranks of one dry run, each in a fake world of its own: one measured
    (:meth:`measure`), or, with a pipeline, the earlier stages' ranks run up to the moment they
    send their outputs' shapes (:meth:`receive`), which a later stage's rank receives."""

    def __init__(self, builder: Callable[[], nn.Module], plan: Plan, report: Any, world_size: int, batch: int,
                 seq_len: int, loss_fn: Callable, optimizer: str, grad_accum: int) -> None:
        self.builder, self.plan, self.report, self.world_size = builder, plan, report, world_size
        self.batch, self.seq_len, self.loss_fn, self.optimizer = batch, seq_len, loss_fn, optimizer
        self.grad_accum = grad_accum
        #: per coordinates on the axes other than ``pp``: what each stage sends forward
        self.sent: dict[tuple[int, ...], Any] = {}

    def stages(self, rank: int) -> tuple[int, ...]:
        """The pipeline stages ``rank`` runs (``()`` without a pipeline)."""
        if self.plan.pipeline is None:
            return ()
        pp = self.plan.mesh.coordinates(rank)["pp"]
        return tuple(s for s, owner in enumerate(self._owners()) if owner == pp)

    def _owners(self) -> tuple[int, ...]:
        from ..planner.stages import stage_ranks

        pipeline, mesh = self.plan.pipeline, self.plan.mesh
        assert pipeline is not None
        return stage_ranks(pipeline.num_stages(mesh), mesh.size_of("pp"), pipeline.schedule)

    def measure(self, rank: int, stages: Any) -> tuple[dict[str, int], list[Collective]]:
        from ..planner.meta import meta_model
        from ..runtime.fake_world import fake_world

        model = meta_model(self.builder)  # built outside fake tensors
        with fake_world(rank, self.world_size, self.plan, stages) as ctx:
            return measure_step(ctx, model, self.plan, self.batch, self.seq_len, self.loss_fn, self.optimizer,
                                report=self.report, accumulate=self.grad_accum)

    def receive(self, rank: int) -> Any:
        """What ``rank``'s stages receive from the stages before them on other ranks (torch's
        ``_StageForwardMeta``: each output's shape, stride, dtype): each such stage's rank (the
        same coordinates on the other axes) is run in a fake world of its own, sharded as a real
        run shards it, through its first step's shape inference up to that stage's send (one
        micro-batch's forward through its stages); earlier stages first, each once per dry run."""
        from ..runtime.fake_world import StageMetas

        coordinates = self.plan.mesh.coordinates(rank)
        key = tuple(v for axis, v in coordinates.items() if axis != "pp")
        metas = self.sent.setdefault(key, StageMetas())
        owners = self._owners()

        def ensure(stage: int) -> None:  # stage's outputs recorded in metas
            if stage in metas.sent:
                return
            owner = owners[stage]
            for s in range(1, stage + 1):  # what the owner's stages up to this one receive from other ranks
                if owners[s] == owner and owners[s - 1] != owner:
                    ensure(s - 1)
            self._run_until_sent(_rank_at(self.plan.mesh, {**coordinates, "pp": owner}), stage, metas)

        for s in self.stages(rank):
            if s > 0 and owners[s - 1] != coordinates["pp"]:
                ensure(s - 1)
        return metas

    def _run_until_sent(self, rank: int, stage: int, metas: Any) -> None:
        from ..planner.meta import meta_model
        from ..runtime.fake_world import StageSent, fake_world

        model = meta_model(self.builder)  # built outside fake tensors
        metas.stop_after = stage
        try:
            with fake_world(rank, self.world_size, self.plan, metas) as ctx:
                model, _, inputs, targets = sharded_for_step(ctx, model, self.plan, self.batch, self.seq_len, self.optimizer,
                                                     self.report)
                try:
                    model.step(inputs, targets, self.loss_fn)
                except StageSent:
                    return
        finally:
            metas.stop_after = None
        raise AssertionError(f"rank {rank} ran a step without sending stage {stage}'s outputs' shapes")


def _estimate_in_place(whole: nn.Module, plan: Plan, stages: tuple[int, ...], batch: int, seq_len: int, hw: Any,
                       optimizer: str, grad_accum: int) -> dict[str, int] | None:
    """``sk.estimate``'s memory of a device holding ``stages`` (all of the model without a pipeline):
    the first stage's device, the last's, or both; ``None`` for a device holding neither (the
    estimate prices the first and the last)."""
    from ..planner.costs import Costs, Setting
    from ..planner.memory import memory_of

    setting = replace(Setting.of(plan), accumulation=grad_accum)
    if plan.pipeline is None:
        position = (True, True)
    else:
        position = (0 in stages, plan.pipeline.num_stages(plan.mesh) - 1 in stages)
        if not any(position):
            return None
    costs = Costs.of(whole, seq_len, setting.tp, None, rules=plan.rules)
    return memory_of(costs, setting, batch, hw, optimizer, position=position)


def _builder(build: Any) -> Callable[[], nn.Module]:
    if callable(build) and not hasattr(build, "model_type"):
        return build
    if hasattr(build, "model_type"):  # a transformers config
        from .model import _build_causal_lm

        return lambda: _build_causal_lm(build)
    raise UsageError(f"dry_run(build=...): give the model's builder (a callable) or a transformers config, got "
                     f"{type(build).__name__}")


def _checked(plan: Any, world_size: Any, batch: Any, seq_len: Any, ranks: Sequence[int] | None,
             grad_accum: Any) -> Plan:
    if not isinstance(plan, Plan):
        raise UsageError(f"dry_run(plan=...) must be a shardkit Plan, got {type(plan).__name__}")
    wrong = [f"{name}={value!r}" for name, value in (("world_size", world_size), ("batch", batch),
                                                      ("seq_len", seq_len), ("grad_accum", grad_accum))
             if type(value) is not int or value < 1]
    if wrong:
        raise UsageError(f"dry_run({', '.join(wrong)}): give whole numbers >= 1")
    outside = [] if ranks is None else [r for r in ranks if type(r) is not int or not 0 <= r < world_size]
    if ranks is not None and (not ranks or outside):
        raise UsageError(f"dry_run(ranks={list(ranks)!r}): give one or more ranks from 0 to {world_size - 1}")
    plan = plan.resolved(world_size)
    if grad_accum > 1 and plan.pipeline is not None:
        raise UsageError(f"dry_run(grad_accum={grad_accum}): a pipeline accumulates over its micro-batches; raise "
                         f"Pipeline(microbatches=...) instead")
    problems = plan.problems() + plan.batch_problems(batch, seq_len)
    if not problems and batch % (plan.mesh.data_size * grad_accum):
        problems.append(f"dry_run(batch={batch}) does not split into grad_accum={grad_accum} micro-steps over "
                        f"{plan.mesh.data_size} data ranks; valid: a multiple of {plan.mesh.data_size * grad_accum}")
    if problems:
        from ..plan import PlanError

        raise PlanError(problems)
    return plan


__all__ = ["COMPARED", "DryRun", "FILL_ORDER", "RankCost", "default_ranks", "dry_run"]
