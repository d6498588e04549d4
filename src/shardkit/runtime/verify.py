"""``sk.verify``: prove a plan computes what a single device computes.

The model (``build_model()``) takes ``steps`` optimizer steps sharded in a world, and every
step is recomputed in this process on one device, from the weights the sharded run started
that step with and in the plan's precision; the loss, every gradient and every updated
weight are compared. Starting each step from the sharded run's own weights keeps the
comparison sharp: rounding differences do not compound over the steps (AdamW turns a
different sign of a near-zero gradient into a full step of ``lr``), so an error shows at the
step where it happens, in bf16 as clearly as in fp32. This is how silent engine bugs (for
example FSDP2 summing gradients on gloo where it should average) are caught.

Buffers are compared too, per rank (a running statistic or a step counter the forward updates
must equal one process's on every rank), each step recomputed from the sharded run's buffers
as from its weights. Dropout is off on both sides (:class:`~shardkit.runtime.dropout_off.DropoutOff`):
a sharded run cannot draw one process's random masks, so with dropout the two would differ by
the randomness, not by the sharding; the result says so in ``notes``.

Under a loss scale (float16, ``Plan(loss_scale=...)``) the sharded run steps as training does
(``model.step`` scales the loss, unscales the gradients, skips an overflowing step on every rank);
the single process runs the same :class:`~shardkit.runtime.loss_scaling.LossScaler` on its own
gradients, so each step's scale and skip decision are compared as well as its unscaled gradients;
a skipped step must leave the weights as they were.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..families import family_of
from ..plan import Plan, PlanError, UsageError
from ..plan.dtypes import torch_dtype
from .context import Context
from .dropout_off import DropoutOff
from .loss_scaling import LossScaler
from .precision import Precision
from .results import finished
from .verify_inputs import (
    batch_pair,
    check_lr,
    check_optimizer,
    check_picklable,
    check_steps,
    check_token_ids,
    checked_loss,
    checked_tolerances,
    world_size_of,
)
from .verify_reference import OPTIMIZERS, SingleProcess, make_optimizer
from .world import LocalWorld, launch

#: fp32 tolerances. Sharded reductions run in another order, so results differ in the last
#: bits. ``loss``: ``|diff| <= loss + loss_rel * |reference loss|``. ``grad``: per parameter,
#: ``|diff| <= grad + grad_rel * max|reference grad|``. ``weight``: per step, the weights the
#: sharded optimizer produced differ from those one process computes from the same weights and
#: gradients by at most ``weight * lr`` (measured: not at all; 1% of a step leaves room for
#: optimizer kernels that round differently, and catches any update rule that differs).
TOLERANCES = {"loss": 1e-5, "loss_rel": 0.0, "grad": 1e-5, "grad_rel": 1e-4, "weight": 1e-2}


def mixed_precision_tolerances(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances for a mixed-precision plan whose least precise dtype is ``dtype``.

    Both sides compute in ``dtype`` but over different parts of the batch, so its sums round
    differently: a bf16/fp16 cross-entropy mean differs by up to 1.9 machine epsilons
    (``loss_rel``: 4 eps), LayerNorm weight and bias gradients, sums over every token, by up
    to 7 eps of their largest element (``grad_rel``: 10 eps); measured on the tiny GPT, GPT-2
    and Llama, dp/fsdp/HSDP, 128 and 256 tokens. The optimizer runs in fp32 on both sides.

    >>> mixed_precision_tolerances(torch.bfloat16)["grad_rel"]  # 10 x 2**-7
    0.078125
    """
    eps = torch.finfo(dtype).eps
    return {**TOLERANCES, "loss": 0.0, "loss_rel": 4 * eps, "grad_rel": 10 * eps}


#: :func:`mixed_precision_tolerances` of bf16: loss 3.1%, gradients 1e-5 + 7.8% of max|grad|.
MIXED_PRECISION_TOLERANCES = mixed_precision_tolerances(torch.bfloat16)


@dataclass(frozen=True)
class StepDiff:
    """Max |sharded - single| at one step, with the parameter where each max occurred."""

    step: int
    loss: float
    grad: float
    weight: float
    worst_grad: str
    worst_weight: str
    buffer: float = 0.0
    worst_buffer: str = "-"


@dataclass(frozen=True)
class VerifyResult:
    """Per-step differences and whether every one is within ``tolerances``.

    ``losses`` are the single process's; ``float32_gap`` (mixed precision only) is the largest
    difference of the sharded run's first gradients from float32 ones: what the policy costs,
    and the proof that it was applied. ``notes``: how the comparison was made where it differs
    from training (dropout switched off on both sides). ``loss_scales`` (a loss scale, float16):
    the scale each step ran at, the same on both sides; ``skipped``: the steps both skipped
    (their gradients overflowed at that scale).
    """

    ok: bool
    steps: list[StepDiff]
    tolerances: dict[str, float]
    losses: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    float32_gap: float | None = None
    notes: list[str] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"verify {'OK' if self.ok else 'FAILED'} (tolerances: {self.tolerances})"
        rows = [f"  step {s.step}: loss {s.loss:.2e}  grad {s.grad:.2e} ({s.worst_grad})  "
                f"weight {s.weight:.2e} ({s.worst_weight})"
                + (f"  buffer {s.buffer:.2e} ({s.worst_buffer})" if s.worst_buffer != "-" else "") for s in self.steps]
        if self.loss_scales:
            rows.append(f"  loss scale per step: {', '.join(f'{s:g}' for s in self.loss_scales)}; skipped "
                        f"(overflow): {self.skipped or 'none'}")
        if self.float32_gap is not None:
            rows.append(f"  mixed precision: first gradients differ from float32 by up to {self.float32_gap:.2e}")
        return "\n".join([head, *rows, *[f"  note: {n}" for n in self.notes], *[f"  ! {p}" for p in self.problems]])


def _tolerances(plan: Plan, overrides: Any) -> dict[str, float]:
    """The tolerance table for ``plan`` (mixed precision or not), with the caller's ``overrides`` checked."""
    return {**_plan_tolerances(plan), **checked_tolerances(overrides, TOLERANCES)}


def _plan_tolerances(plan: Plan) -> dict[str, float]:
    """fp32 :data:`TOLERANCES`, or with mixed precision in force those of its least precise dtype."""
    if not plan.fsdp.mixed_precision:
        return dict(TOLERANCES)
    dtypes = {torch_dtype(d) for d in (plan.fsdp.param_dtype, plan.fsdp.reduce_dtype) if d is not None}
    return mixed_precision_tolerances(max(dtypes, key=lambda d: torch.finfo(d).eps))


# -- the sharded side -----------------------------------------------------------------------------------
def _sharded_job(ctx: Context, build_model, batch, loss_fn, steps, optimizer, lr,
                 example_inputs: tuple | None = None) -> list[dict]:
    from .apply import full_grads, full_state_dict, shard

    model = shard(build_model(), ctx.plan, ctx, example_inputs=example_inputs)
    opt = make_optimizer(optimizer, model, lr)
    inputs, targets = ctx.shard_batch(*batch)
    scaler = model.loss_scaler  # float16: model.step scales, unscales and skips an overflow on every rank
    records = []
    for _ in range(steps):
        opt.zero_grad()
        scale = None if scaler is None else scaler.state.scale
        with DropoutOff():
            loss = model.step(inputs, targets, loss_fn)
        grads = full_grads(model)
        opt.step()
        buffers = {n: finished(b).clone() for n, b in model.named_buffers()}
        records.append({"loss": loss.item(), "grads": grads, "weights": full_state_dict(model), "buffers": buffers,
                        "scale": scale, "skipped": scaler is not None and scaler.last_skipped})
    return records


# -- comparison ------------------------------------------------------------------------------------
def _match_names(per_rank: list[list[dict]], aliases: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """``{sharded name: reference name}`` over every rank, and the problems: parameters on one side only,
    and ties split within a rank. Copies of a tied parameter on different ranks (pipeline stages) are
    both compared with the reference, which checks that the runtime keeps them equal."""
    rank_of: dict[str, int] = {}
    split: set[tuple[str, ...]] = set()
    for rank, records in enumerate(per_rank):
        by_reference: dict[str, list[str]] = {}
        for name in records[0]["grads"] if records else ():
            rank_of.setdefault(name, rank)
            if name in aliases:
                by_reference.setdefault(aliases[name], []).append(name)
        split |= {tuple(sorted(names)) for names in by_reference.values() if len(names) > 1}
    names = {name: aliases[name] for name in rank_of if name in aliases}
    problems = [f"parameter {name!r} (rank {rank}) is not a parameter of build_model()'s model"
                for name, rank in rank_of.items() if name not in aliases]
    missing = sorted(set(aliases.values()) - set(names.values()))
    if missing:
        problems.append(f"parameters held by no rank: {missing}")
    problems += [f"parameters {list(tie)} are one tied parameter in build_model()'s model but separate ones after "
                 f"sharding: the plan splits a tie" for tie in sorted(split)]
    return names, problems


def _gather(per_rank: list[list[dict]], step: int, key: str) -> dict[str, torch.Tensor]:
    """``{sharded name: tensor}`` of ``key`` ("grads", "weights", "buffers") at ``step``, merged over the ranks."""
    merged: dict[str, torch.Tensor] = {}
    for records in per_rank:
        if step < len(records):
            merged.update(records[step].get(key, {}))
    return merged


def _by_reference(values: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """``values`` under the reference's names (of a split tie, the first sharded parameter's)."""
    renamed: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        if name in names:
            renamed.setdefault(names[name], value)
    return renamed


def _max_diff(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], names: dict[str, str], atol: float,
              rel: float = 0.0) -> tuple[float, str, bool, int]:
    """(max |diff|, where, all within ``atol + rel * max|expected|``, parameters compared) over ``got``'s matched names."""
    worst, where, within, compared = 0.0, "-", True, 0
    for name, value in got.items():
        if name not in names or not value.numel():
            continue
        reference = expected[names[name]].float()
        diff = (value.float() - reference).abs().max().item()
        compared += 1
        if not diff <= atol + rel * reference.abs().max().item():  # NaN fails too
            within = False
        if diff > worst or diff != diff:
            worst, where = diff, name
    return worst, where, within, compared


def _compare_step(step: int, reference: SingleProcess, first: tuple[float, dict[str, torch.Tensor]],
                  per_rank: list[list[dict]], names: dict[str, str], tol: dict[str, float]) -> tuple[StepDiff, list[str]]:
    """One step: the sharded loss and gradients against ``first`` (the reference's at the same weights), then the
    sharded optimizer's weights against the reference's optimizer step with the sharded gradients."""
    ref_loss, ref_grads = first
    grads, weights = _gather(per_rank, step, "grads"), _gather(per_rank, step, "weights")
    expected = reference.update(_by_reference(grads, names))
    loss = max((abs(r[step]["loss"] - ref_loss) for r in per_rank if step < len(r)), default=math.nan)
    loss_ok = loss <= tol["loss"] + tol["loss_rel"] * abs(ref_loss)
    if reference.skipped:  # both skipped (else a scale problem below): no gradients, the weights unchanged
        g, worst_grad, grad_ok, compared = 0.0, "- (step skipped)", True, 1
    else:
        g, worst_grad, grad_ok, compared = _max_diff(ref_grads, grads, names, tol["grad"], tol["grad_rel"])
    w, worst_weight, weight_ok, _ = _max_diff(expected, weights, names, tol["weight"] * reference.lr)
    bad = [what for what, good in (("loss", loss_ok), (f"gradient of {worst_grad}", grad_ok),
                                   (f"weight {worst_weight}", weight_ok)) if not good]
    problems = [f"step {step}: {', '.join(bad)} out of tolerance"] if bad else []
    problems += _scale_problems(step, reference, per_rank)
    if not compared:
        problems.append(f"step {step}: no parameter was compared (the sharded run reported none that the model has)")
    b, worst_buffer, buffer_problems = _compare_buffers(step, reference.buffers(), per_rank, tol)
    return StepDiff(step, loss, g, w, worst_grad, worst_weight, b, worst_buffer), problems + buffer_problems


def _scale_problems(step: int, reference: SingleProcess, per_rank: list[list[dict]]) -> list[str]:
    """Each rank's loss scale and skip decision at ``step`` against one process's under the same scaler."""
    if reference.scaler is None:
        return []
    return [f"step {step}: rank {rank} ran at loss scale {r[step]['scale']} and "
            f"{'skipped' if r[step]['skipped'] else 'stepped'}, one process at {reference.scale:g} and "
            f"{'skipped' if reference.skipped else 'stepped'} (the gradients overflowed on one side only)"
            for rank, r in enumerate(per_rank)
            if step < len(r) and (r[step]["scale"] != reference.scale or r[step]["skipped"] != reference.skipped)]


def _compare_buffers(step: int, expected: dict[str, torch.Tensor], per_rank: list[list[dict]],
                     tol: dict[str, float]) -> tuple[float, str, list[str]]:
    """Every rank's buffers after ``step`` against one process's (``expected``), within the gradients' bounds
    (``grad + grad_rel * max|expected|``): (max |diff|, where, problems naming each buffer and rank)."""
    worst, where, problems = 0.0, "-", []
    for rank, records in enumerate(per_rank):
        for name, value in (records[step].get("buffers", {}) if step < len(records) else {}).items():
            if name not in expected:
                problems.append(f"step {step}: buffer {name!r} (rank {rank}) is not a buffer of build_model()'s model")
                continue
            reference = expected[name].float()
            if value.shape != reference.shape:
                problems.append(f"step {step}: buffer {name!r} (rank {rank}) has shape {list(value.shape)}, one "
                                f"process's {list(reference.shape)}")
                continue
            diff = (value.float() - reference).abs().max().item() if value.numel() else 0.0
            bound = tol["grad"] + tol["grad_rel"] * (reference.abs().max().item() if value.numel() else 0.0)
            if not diff <= bound:  # NaN fails too
                problems.append(f"step {step}: buffer {name!r} (rank {rank}) differs from one process's by "
                                f"{diff:.3g} (tolerance {bound:.3g})")
            if diff > worst or diff != diff or where == "-":
                worst, where = diff, f"{name}, rank {rank}"
    return worst, where, problems


def _compare(reference: SingleProcess, first: tuple[float, dict[str, torch.Tensor]], per_rank: list[list[dict]],
             steps: int, tol: dict[str, float]) -> VerifyResult:
    """Every step of the sharded run, replayed by ``reference`` from the sharded weights (``first``: step 0's loss
    and gradients, computed before the world ran)."""
    problems = [f"rank {rank} returned {len(records or [])} of {steps} steps"
                for rank, records in enumerate(per_rank) if len(records or []) != steps]
    names, name_problems = _match_names(per_rank, reference.aliases)
    problems += name_problems
    diffs, losses, scales, skipped = [], [], [], []
    for step in range(steps):
        if step:
            reference.load(_by_reference(_gather(per_rank, step - 1, "weights"), names))
            reference.load_buffers(_gather(per_rank, step - 1, "buffers"))
            first = reference.backward()
        diff, step_problems = _compare_step(step, reference, first, per_rank, names, tol)
        diffs.append(diff)
        losses.append(first[0])
        problems += step_problems
        if reference.scale is not None:
            scales.append(reference.scale)
            skipped += [step] if reference.skipped else []
    if skipped and len(skipped) == steps:
        problems.append(f"every step overflowed at its loss scale ({', '.join(f'{s:g}' for s in scales)}), so no "
                        f"gradient was compared: take more steps (a dynamic scale halves after each overflow) or "
                        f"write a smaller fixed Plan(loss_scale=...)")
    return VerifyResult(not problems, diffs, tol, losses, problems, loss_scales=scales, skipped=skipped)


def _check_precision_applied(result: VerifyResult, plan: Plan, float32_grads: dict[str, torch.Tensor],
                             per_rank: list[list[dict]], aliases: dict[str, str]) -> VerifyResult:
    """``result`` with ``float32_gap``, and a problem if the sharded first gradients (of the first step a loss scale
    did not skip) are float32 ones (within the fp32 relative tolerance): the plan's mixed precision was not applied."""
    names, _ = _match_names(per_rank, aliases)
    # the first step not skipped by the loss scale: the steps skipped before it left the weights as they started
    taken = next((s for s in range(len(result.steps)) if s not in result.skipped), None)
    if taken is None:
        return result
    # relative only: float16 gradients of a small loss (the ones a loss scale saves) sit far below any absolute bound
    gap, _, as_float32, _ = _max_diff(float32_grads, _gather(per_rank, taken, "grads"), names, 0.0,
                                      TOLERANCES["grad_rel"])
    problems = [f"the plan asks for mixed precision (param_dtype={plan.fsdp.param_dtype!r}, reduce_dtype="
                f"{plan.fsdp.reduce_dtype!r}) but the sharded run's gradients equal float32 ones: the policy was not "
                f"applied"] if as_float32 else []
    return replace(result, ok=result.ok and not problems, problems=result.problems + problems, float32_gap=gap)


def verify(build_model: Callable[[], nn.Module], plan: Plan, batch: tuple[Any, Any], *, loss_fn: Callable,
           steps: int = 3, optimizer: str = "adamw", lr: float = 1e-3, world: LocalWorld | None = None,
           tolerances: dict[str, float] | None = None) -> VerifyResult:
    """Take ``steps`` optimizer steps sharded, replay each in one process; compare loss, gradients, weights.

    ``build_model()`` must return a fresh module with deterministic weights; ``batch`` is the
    global ``(inputs, targets)``, split over data ranks as training would; ``loss_fn(output,
    targets)`` returns a mean scalar. Every argument is checked before any process starts
    (:class:`~shardkit.plan.UsageError`, :class:`~shardkit.plan.PlanError`). Each step is
    recomputed from the weights the sharded run started it with, in the plan's precision.
    Tolerances: fp32 :data:`TOLERANCES` (loss 1e-5; gradients 1e-5 + 1e-4 x max|grad| per
    parameter; weights 0.01 x lr); with mixed precision :func:`mixed_precision_tolerances`
    (bf16: loss 3.1%; gradients 1e-5 + 7.8% x max|grad|; weights 0.01 x lr), and a check that
    the policy was applied (float16: loss 0.4%; gradients 1e-5 + 1% x max|grad|). Under a loss scale
    (float16) both sides scale as ``model.step`` does, each step's scale and skip compared
    (``result.loss_scales``, ``result.skipped``). ``tolerances={"grad": ...}`` overrides any of them. Every rank's buffers
    are compared after each step within the gradients' bounds, each named where it differs.
    Dropout is off on both sides (a sharded run cannot draw one process's masks); ``result.notes``
    says so when the model has any.

    >>> result = verify(build_tiny_gpt, Plan(mesh=Mesh(fsdp=2)), (x, y), loss_fn=gpt_loss)  # doctest: +SKIP
    >>> result.ok  # doctest: +SKIP
    True
    """
    check_picklable(build_model=build_model, loss_fn=loss_fn)
    if not isinstance(plan, Plan):
        raise UsageError(f"verify(plan=...): plan must be a shardkit Plan, got {type(plan).__name__}")
    check_steps(steps)
    check_optimizer(optimizer, tuple(OPTIMIZERS))
    check_lr(lr)
    tol = _tolerances(plan, tolerances)
    inputs, targets = batch_pair(batch)
    world_size = world_size_of(plan, world)
    from ..planner.meta import meta_model
    from ..planner.validate import validate

    model = meta_model(build_model)
    # a model of no known family is run on two samples of the batch, not on a guessed input (its stages' order;
    # a batch norm in training needs more than one value per channel)
    example = (inputs[:2],) if family_of(model).name == "chain" else None
    validate(plan, model, world_size=world_size, example_inputs=example)
    check_token_ids(model, inputs)
    problems = plan.resolved(world_size).batch_problems(len(inputs), int(inputs.shape[1]) if inputs.dim() >= 2 else None)
    if problems:
        raise PlanError(problems)
    # The single process runs step 0 before any process starts, so a wrong loss_fn is reported here.
    scaling = plan.loss_scaling
    scaler = None if scaling is None else LossScaler(scaling, torch.device("cpu"), alone=True)
    reference = SingleProcess(build_model, (inputs, targets), checked_loss(loss_fn), optimizer, lr,
                              Precision.of(plan.fsdp), scaler)
    start = reference.buffers()
    float32_grads = reference.backward(Precision())[1] if plan.fsdp.mixed_precision else None
    reference.load_buffers(start)  # that forward updated running statistics: step 0 starts from the same ones
    first = reference.backward()
    per_rank = launch(_sharded_job, plan, build_model, (inputs, targets), loss_fn, steps, optimizer, lr, example,
                      world=world, world_size=world_size)
    result = _compare(reference, first, per_rank, steps, tol)
    if reference.dropouts:
        result.notes.append(f"dropout off on both sides ({reference.dropouts} dropout call(s) with p > 0 per step): a "
                            f"sharded run cannot draw one process's random masks, so the computation is compared "
                            f"without them")
    if float32_grads is not None:
        result = _check_precision_applied(result, plan, float32_grads, per_rank, reference.aliases)
    return result
