"""``sk.autoshard``: every plan the model allows on the devices, estimated, ranked, in seconds.

The space: the degrees of ``dp``, ``fsdp``, ``tp``, ``pp``, ``sp`` (context parallel) and ``ep``
(expert parallel, for a mixture of experts) whose product is the device count, and per degree
choice the options that trade memory for time: ``reshard_after_forward``, pipeline schedule and
micro-batches, and recompute. A choice is refused, with its reason, when a divisibility rule
breaks (heads, KV heads, layers, vocabulary, sequence, batch, experts), when ``tp`` would leave
a node, when ``sk.validate`` would refuse it (``ep`` on a model without experts, ``ep`` with what
it does not compose with: :func:`~shardkit.planner.experts.composition_problems`), or when even
its leanest option needs more memory than a device has.

Why it is fast: the model is measured once per tensor-parallel degree on the meta device
(:func:`shardkit.planner.analysis.analyse`, cached), and a candidate's estimate is then plain
arithmetic (:func:`shardkit.planner.estimate.evaluate`). Within one degree choice the options
are tried from fastest to leanest and the first that fits ends the search (recompute only adds
time; GPipe only adds memory to 1F1B, so it is tried only where 1F1B cannot run).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..plan import FSDPOptions, LayoutMap, Mesh, Plan, PlanError, UsageError
from ..plan.dtypes import FLOATING, torch_dtype
from ..plan.pipeline import Pipeline
from ..plan.sequence import sequence_problems
from ..plan.text import format_bytes
from .analysis import ModelAnalysis
from .costs import MESH_ORDER, OPTIMIZER_STATES, Costs, Setting, mesh_of
from .estimate import Estimate, estimate_of, evaluate
from .expert_search import ep_refusal
from .hardware import Hardware
from .hardware import hardware as as_hardware
from .memory import memory_of
from .search_checks import ModelChecks
from .space import AXES
from .step_time import time_of

_RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    """A ranked plan: ``plan`` (``sk.shard`` runs it as is), its ``estimate``, why it ranks where it does,
    and ``grad_accum``: the gradient accumulation steps it is estimated with (the plan does not hold them)."""

    plan: Plan
    estimate: Estimate
    reason: str

    @property
    def grad_accum(self) -> int:
        """Gradient accumulation steps the plan needs to fit (1: none; a pipeline's are its micro-batches)."""
        return self.estimate.grad_accum


@dataclass(frozen=True)
class Rejected:
    """A family of plans refused, and why (``"tp=16"``: ``"tp=16 > 8 devices per node"``)."""

    family: str
    reason: str


class Candidates(list):
    """The ranked candidates (best first), and ``rejected``: the families refused, with reasons."""

    def __init__(self, ranked: Sequence[Candidate], rejected: Sequence[Rejected], considered: int):
        super().__init__(ranked)
        self.rejected = list(rejected)
        self.considered = considered


def autoshard(model: Any, *, devices: int, hardware: str | Hardware = "h100-80g", global_batch: int,
              seq_len: int, axes: Sequence[str] | None = None, top: int = 10, optimizer: str = "adamw",
              param_dtype: str | None = "auto", rules: LayoutMap | None = None) -> Candidates:
    """Rank every plan of the language model ``model`` on ``devices`` by estimated step time, best first.

    ``model``: a causal LM over token ids, as ``sk.estimate`` takes (other models are refused by
    name). ``axes`` restricts the space (e.g. ``("dp", "tp", "pp")``); only the axes searched
    need anything of the model (the ``tp`` rules only when ``tp`` is searched). ``rules``: the
    layout rules that split the model over ``tp`` (default: the model's own, as ``sk.analyse``
    finds them). ``param_dtype``: the compute dtype of every candidate (``"auto"``: bfloat16 where
    the hardware computes it 4x faster than float32, else the parameters' own). Raises
    :class:`PlanError` when nothing fits, saying what the leanest plan needs and why.

    >>> import shardkit as sk
    >>> best = sk.autoshard("gpt-small", devices=4, hardware="a100-80g", global_batch=8, seq_len=128)[0]
    >>> best.estimate.fits, best.plan.mesh.size
    (True, 4)
    """
    hw = as_hardware(hardware)
    axes = _axes(axes)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise UsageError(f"autoshard(devices={devices!r}): give a positive number of devices")
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len), ("top", top)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"autoshard({name}={value!r}): give a positive integer")
    if optimizer not in OPTIMIZER_STATES:
        raise UsageError(f"autoshard(optimizer={optimizer!r}) is unknown; valid: {sorted(OPTIMIZER_STATES)}")
    if rules is not None and (not isinstance(rules, LayoutMap) or "tp" not in rules.axes()):
        used = sorted(rules.axes()) if isinstance(rules, LayoutMap) else type(rules).__name__
        raise UsageError(f"autoshard(rules=...): give a LayoutMap that splits the model over 'tp' (got {used})")
    search = _Search(model, devices, hw, global_batch, seq_len, axes, optimizer, param_dtype, rules)
    best = search.run()
    if not best:
        raise PlanError(search.nothing_fits())
    ranked = sorted(best, key=lambda c: (c[2], c[1]["total"]))[:top]
    candidates = [search.candidate(setting, memory, parts, ranked[0][2]) for setting, memory, _, parts in ranked]
    return Candidates(candidates, search.rejected_list(), search.considered)


def _axes(axes: Sequence[str] | None) -> tuple[str, ...]:
    if axes is None:
        return AXES
    if isinstance(axes, str) or not isinstance(axes, Sequence) or not axes:
        raise UsageError(f"autoshard(axes={axes!r}): give a list of axis names from {list(AXES)}, e.g. ('dp', 'tp')")
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise UsageError(f"autoshard(axes=...): unknown axes {unknown}; valid: {list(AXES)}")
    if len(set(axes)) != len(axes):
        raise UsageError(f"autoshard(axes={list(axes)}): an axis is given twice")
    return tuple(axes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _Search:
    """One autoshard run: the space walked, the best option per degree choice, what was refused."""

    def __init__(self, model: Any, devices: int, hw: Hardware, batch: int, seq_len: int, axes: tuple[str, ...],
                 optimizer: str, param_dtype: str | None, rules: LayoutMap | None = None):
        self.model, self.devices, self.hw, self.batch, self.seq_len = model, devices, hw, batch, seq_len
        self.axes, self.optimizer, self.rules = axes, optimizer, rules
        self.whole = Costs.of(model, seq_len, 1, None).whole
        self.compute_dtype = _compute_dtype(param_dtype, hw, self.whole)
        self.rejected: dict[str, str] = {}
        self.leanest: tuple[int, Setting, dict[str, int]] | None = None
        self.considered = 0
        self.costs: dict[int, Costs] = {}
        self.sequence_parallel: dict[int, bool] = {}
        self.checks = ModelChecks(model)
        self.allowed = self._allowed()

    # -- the walk -------------------------------------------------------------------------------
    def run(self) -> list[tuple[Setting, dict[str, int], float, dict[str, float]]]:
        best = []
        for tp in self._degrees("tp", self.devices):
            costs = self._costs(tp)
            if costs is None:
                continue
            for pp in self._degrees("pp", self.devices // tp):
                if pp > 1 and not self.allowed["pp"]:
                    continue
                if pp > self.whole.layers:
                    self._reject(f"pp={pp}", f"pp={pp} > {self.whole.layers} layers (a stage needs at least one)")
                    continue
                for sp in self._degrees("sp", self.devices // (tp * pp)):
                    data = self.devices // (tp * pp * sp)
                    if sp > 1 and not self.allowed["sp"]:
                        continue
                    if sp > 1 and pp > 1:
                        self._reject("pp > 1 with sp > 1", "context parallel inside a pipeline stage is not supported")
                        continue
                    if not self._sequence_fits(tp, sp):
                        continue
                    if self.batch % data:
                        self._reject(f"dp x fsdp={data}", f"global batch {self.batch} does not split over "
                                     f"{data} data-parallel replicas")
                        continue
                    found = None
                    for ep in self._expert_degrees(data, Setting(tp=tp, pp=pp, sp=sp)):
                        for dp in _divisors(data // ep):
                            fsdp = data // ep // dp
                            if (dp > 1 and "dp" not in self.axes) or (fsdp > 1 and "fsdp" not in self.axes):
                                continue
                            option = self._best_option(costs, Setting(dp=dp, fsdp=fsdp, tp=tp, pp=pp, sp=sp, ep=ep))
                            if option is not None:
                                best.append(option)
                                found = option
                    if found is None and self.leanest is not None:
                        family = f"tp={tp} pp={pp} sp={sp}"
                        if family not in self.rejected:
                            self._reject(family, self._memory_reason(tp, pp, sp))
        return best

    def _degrees(self, axis: str, limit: int) -> list[int]:
        return [d for d in _divisors(limit) if axis in self.axes or d == 1]

    def _costs(self, tp: int) -> Costs | None:
        if tp > self.hw.devices_per_node:
            self._reject(f"tp={tp}", f"tp={tp} > {self.hw.devices_per_node} devices per node (tensor parallel "
                         f"communicates every block: it stays within a node)")
            return None
        w = self.whole
        for what, count in (("attention heads", w.heads), ("KV heads", w.kv_heads), ("MLP width", w.intermediate)):
            if count % tp:
                self._reject(f"tp={tp}", f"tp={tp} does not divide the {count} {what}")
                return None
        try:
            costs = Costs.of(self.model, self.seq_len, tp, None, rules=self.rules if tp > 1 else None)
        except (PlanError, UsageError) as exc:
            self._reject(f"tp={tp}", str(exc).splitlines()[0])
            return None
        if tp > 1:
            rules = costs.local.tp_rules()
            refusal = self._refusal(Plan(Mesh(tp=tp), rules=rules))
            if refusal is not None:
                self._reject(f"tp={tp}", refusal)
                return None
            self.sequence_parallel[tp] = self._refusal(Plan(Mesh(tp=tp), rules=rules, sequence_parallel=True)) is None
        self.costs[tp] = costs
        return costs

    def _expert_degrees(self, data: int, base: Setting) -> list[int]:
        found, refused = self.checks.expert_degrees(self.axes, data, base)
        for family, reason in refused:
            self._reject(family, reason)
        return found

    def _refusal(self, plan: Plan) -> str | None:
        return self.checks.refusal(plan)

    def _allowed(self) -> dict[str, bool]:
        """Which kinds of plan the model allows (pipelines, context parallel, each recompute), each
        checked once by ``sk.validate`` on the model; the refused are listed with the reason."""
        probes = {"pp": Plan(Mesh(pp=2), pipeline=Pipeline(microbatches=2)), "sp": Plan(Mesh(sp=2)),
                  "full": Plan(Mesh(dp=1), recompute="full"), "selective": Plan(Mesh(dp=1), recompute="selective")}
        allowed = {}
        for kind, plan in probes.items():
            if kind in ("pp", "sp") and kind not in self.axes:
                allowed[kind] = False
                continue
            refusal = self._refusal(plan)
            allowed[kind] = refusal is None
            if refusal is not None:
                self._reject(f"{kind} > 1" if kind in ("pp", "sp") else f"recompute={kind}", refusal)
        return allowed

    def _sequence_fits(self, tp: int, sp: int) -> bool:
        probe = Plan(mesh_of(Setting(tp=tp, sp=sp)), sequence_parallel=tp > 1)
        problems = sequence_problems(probe, self.seq_len)
        for problem in problems:
            self._reject(f"sp={sp}" if sp > 1 else f"tp={tp}", problem)
        return not problems

    def _options(self, base: Setting) -> Iterator[Setting]:
        """Options of one degree choice, fastest first within each group ending in a fit."""
        local = self.batch // base.data
        reshards = (False, True) if base.fsdp * base.sp > 1 and base.fsdp > 1 else (True,)
        pipelines: list[tuple[str, int, int]] = [("1f1b", 1, 1)]
        if base.pp > 1:
            pipelines = []
            for m in _microbatches(local, base.pp):
                if m >= base.pp:
                    pipelines.append(("1f1b", m, 1))
                    if self.whole.layers >= 2 * base.pp and m % base.pp == 0:
                        pipelines.append(("interleaved-1f1b", m, 2))
                else:
                    pipelines.append(("gpipe", m, 1))
        # Megatron sequence parallel whenever tp splits the blocks (not inside a pipeline: refused there)
        compute = self.compute_dtype
        recomputes = [r for r in _RECOMPUTE if r == "none" or self.allowed[r]]
        if base.ep > 1:  # what ep does not compose with yet: in the parameters' dtype, without that recompute
            compute = self._expert_precision(base)
            recomputes = [r for r in recomputes if r == "none" or self._expert_option(base, f"recompute={r}",
                                                                                      recompute=r)]
        mixed = compute != self.whole.dtype  # then gradients are reduced in float32, as plan_of says
        common = dict(sequence_parallel=base.tp > 1 and base.pp == 1 and self.sequence_parallel[base.tp],
                      compute_dtype=compute, reduce_dtype=torch.float32 if mixed else None,
                      order=MESH_ORDER)
        for reshard in reshards:
            if base.pp > 1:  # within a pipeline setting: recompute from none to full
                for schedule, m, v in pipelines:
                    for recompute in recomputes:
                        yield replace(base, schedule=schedule, microbatches=m, virtual=v, recompute=recompute,
                                      reshard=reshard, **common)
            else:  # without a pipeline: per recompute, gradient accumulation from none up
                for recompute in recomputes:
                    for steps in _accumulation(local):
                        yield replace(base, accumulation=steps, recompute=recompute, reshard=reshard, **common)

    def _expert_option(self, base: Setting, what: str, **options: Any) -> bool:
        """Whether ``ep`` composes with ``options``; when not, ``ep with {what}`` is refused with why."""
        refusal = ep_refusal(base, **options)
        if refusal is not None:
            self._reject(f"ep with {what}", refusal)
        return refusal is None

    def _expert_precision(self, base: Setting) -> torch.dtype:
        """The compute dtype of ``ep`` options: the search's, or the parameters' own where ``ep`` does
        not compose with a mixed-precision policy."""
        if self.compute_dtype == self.whole.dtype:
            return self.compute_dtype
        name = str(self.compute_dtype).removeprefix("torch.")
        policy = FSDPOptions(param_dtype=name, reduce_dtype="float32")
        return self.compute_dtype if self._expert_option(base, f"param_dtype={name}", fsdp=policy) \
            else self.whole.dtype

    def _best_option(self, costs: Costs, base: Setting):
        best = None
        fitted_group: tuple | None = None
        for setting in self._options(base):
            # the first option that fits ends its group: more recompute (in a pipeline) or more
            # accumulation steps (without one) only add time
            group = (setting.reshard, setting.schedule, setting.microbatches, setting.virtual) if base.pp > 1 \
                else (setting.reshard, setting.recompute)
            if group == fitted_group:
                continue
            self.considered += 1
            memory = memory_of(costs, setting, self.batch, self.hw, self.optimizer)
            if self.leanest is None or memory["total"] < self.leanest[0]:
                self.leanest = (memory["total"], setting, memory)
            if memory["total"] > self.hw.memory:
                continue
            fitted_group = group
            parts = time_of(costs, setting, self.batch, self.hw, self.optimizer)
            step = sum(parts.values())
            if best is None or step < best[2]:
                best = (setting, memory, step, parts)
        return best

    # -- what comes out -------------------------------------------------------------------------
    def candidate(self, setting: Setting, memory: dict[str, int], parts: dict[str, float], fastest: float) -> Candidate:
        costs = self.costs[setting.tp]
        plan = self.plan_of(setting, costs.local)
        estimate = estimate_of(costs, plan, setting, self.batch, self.hw, memory, parts)
        return Candidate(plan, estimate, _reason(setting, estimate, fastest))

    def plan_of(self, s: Setting, analysis: ModelAnalysis) -> Plan:
        dtype = None if s.compute_dtype is None or s.compute_dtype == self.whole.dtype else str(
            s.compute_dtype).removeprefix("torch.")
        pipeline = (Pipeline(schedule=s.schedule, microbatches=s.microbatches, virtual_stages=s.virtual)
                    if s.pp > 1 else None)
        return Plan(mesh_of(s), rules=analysis.tp_rules() if s.tp > 1 else None,
                    fsdp=FSDPOptions(reshard_after_forward=s.reshard, param_dtype=dtype,
                                     reduce_dtype="float32" if dtype else None),
                    pipeline=pipeline, sequence_parallel=s.sequence_parallel, recompute=s.recompute)

    def rejected_list(self) -> list[Rejected]:
        return [Rejected(family, reason) for family, reason in self.rejected.items()]

    def _reject(self, family: str, reason: str) -> None:
        self.rejected.setdefault(family, reason)

    def _memory_reason(self, tp: int, pp: int, sp: int) -> str:
        leanest = min((self._family_leanest(tp, pp, sp)), key=lambda m: m["total"])
        return f"needs {_gib(leanest['total'])} of {_gib(self.hw.memory)} per device at best ({_parts(leanest)})"

    def _family_leanest(self, tp: int, pp: int, sp: int) -> list[dict[str, int]]:
        data = self.devices // (tp * pp * sp)
        fsdp = data if "fsdp" in self.axes else 1
        base = Setting(dp=data // fsdp, fsdp=fsdp, tp=tp, pp=pp, sp=sp)
        return [evaluate(self.costs[tp], s, self.batch, self.hw, self.optimizer)[0] for s in self._options(base)]

    def nothing_fits(self) -> str:
        if self.leanest is None:
            reasons = "; ".join(f"{family}: {reason}" for family, reason in self.rejected.items())
            return f"no plan of {self.devices} devices is possible for this model: {reasons}"
        total, setting, memory = self.leanest
        what = " ".join(f"{a}={setting.size(a)}" for a in MESH_ORDER if setting.size(a) > 1) or "one device"
        return (f"no plan fits: the smallest plan needs {_gib(total)} per device on {self.devices} devices "
                f"({what}, recompute={setting.recompute}), because {_parts(memory)}, and each "
                f"{self.hw.name} device has {_gib(self.hw.memory)}; add devices, shorten the sequence "
                f"({self.seq_len}) or the batch ({self.batch}), or use a device with more memory")


def _accumulation(local: int) -> list[int]:
    """Gradient accumulation steps tried without a pipeline: divisors of the local batch, doubling."""
    steps, out = 1, []
    while steps <= local:
        if local % steps == 0:
            out.append(steps)
        steps *= 2
    if out[-1] != local:
        out.append(local)
    return out


def _microbatches(local: int, pp: int) -> list[int]:
    """Micro-batch counts tried for a pipeline: divisors of the local batch near pp, 2pp, 4pp and below pp."""
    divisors = _divisors(local)
    chosen = {d for d in divisors if d in (pp, 2 * pp, 4 * pp)}
    below = [d for d in divisors if d < pp]
    if below:
        chosen.add(below[-1])
    above = [d for d in divisors if d > pp]
    if not chosen.intersection(above) and above:
        chosen.add(above[0])
    return sorted(chosen)


def _compute_dtype(param_dtype: str | None, hw: Hardware, whole: ModelAnalysis):
    if param_dtype == "auto":
        faster = hw.peak_flops("bfloat16") >= 4 * hw.peak_flops("float32")  # tensor cores, not a CPU's 2-3x
        return torch.bfloat16 if faster else whole.dtype
    if param_dtype is None:
        return whole.dtype
    if param_dtype not in FLOATING:
        raise UsageError(f"autoshard(param_dtype={param_dtype!r}) is unknown; valid: 'auto', None, {list(FLOATING)}")
    return torch_dtype(param_dtype)


def _gib(value: float) -> str:
    return format_bytes(value, digits=1)


def _parts(memory: dict[str, int]) -> str:
    keys = sorted((k for k in memory if k != "total" and memory[k]), key=lambda k: -memory[k])
    return ", ".join(f"{k} {_gib(memory[k])}" for k in keys[:4])


def _reason(s: Setting, e: Estimate, fastest: float) -> str:
    parts = e.step_time_parts
    step = e.step_time
    overheads = sorted(((k, v) for k, v in parts.items() if k != "compute" and v >= 0.005 * step),
                       key=lambda kv: -kv[1])
    costs = ", ".join(f"{k} {100 * v / step:.0f}%" for k, v in overheads[:2]) or "no exposed overhead"
    memory = f"{_gib(e.memory['total'])} of {_gib(e.hardware.memory)}"
    lead = "fastest" if step <= fastest else f"{step / fastest:.2f}x the fastest step"
    extra = f"; recompute {s.recompute} to fit" if s.recompute != "none" else ""
    extra += f"; {s.accumulation} accumulation steps" if s.accumulation > 1 else ""
    return f"{lead}: {memory} per device{extra}; step {100 * parts['compute'] / step:.0f}% compute, {costs}"


__all__ = ["AXES", "Candidate", "Candidates", "Rejected", "autoshard"]
