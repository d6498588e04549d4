"""``sk.verify``: prove a plan computes what a single device computes.

The same model (``build_model()``), data and optimizer run once in this process on one
device and once sharded in a world; after every step the loss, every gradient and every
updated weight are compared. This is how silent engine bugs (for example FSDP2 summing
gradients on gloo where it should average) are caught.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..plan import Plan, PlanError
from .world import Context, LocalWorld, launch

#: Default fp32 tolerances. Sharded reductions run in a different order, so results differ
#: in the last bits. ``loss``: ``|diff| <= loss + loss_rel * |reference loss|``. ``grad``: per
#: parameter, ``|diff| <= grad + grad_rel * max|reference grad|``. ``weight``: max absolute
#: difference after step k (from 0) <= ``weight * lr * (k + 1)``: AdamW normalises each
#: gradient by its running RMS, so a parameter whose true gradient is ~0 (an attention key
#: bias, for instance) turns rounding noise into steps of up to ~lr; a tenth of lr per step
#: bounds that noise while a wrong gradient (caught by ``grad``) or update rule is far larger.
TOLERANCES = {"loss": 1e-5, "loss_rel": 0.0, "grad": 1e-5, "grad_rel": 1e-4, "weight": 0.1}
#: With bf16/fp16 mixed precision (``FSDPOptions.param_dtype``/``reduce_dtype``) the sharded
#: run computes in 8 significant bits against an fp32 reference: about 1% on the loss and 5%
#: on gradients; AdamW then flips the sign of near-zero gradients' steps, so weights may
#: differ by up to two steps of lr per step.
MIXED_PRECISION_TOLERANCES = {"loss": 1e-3, "loss_rel": 2e-2, "grad": 1e-3, "grad_rel": 5e-2, "weight": 2.0}


@dataclass(frozen=True)
class StepDiff:
    """Max |sharded - single| at one step, with the parameter where each max occurred."""

    step: int
    loss: float
    grad: float
    weight: float
    worst_grad: str
    worst_weight: str


@dataclass(frozen=True)
class VerifyResult:
    """Per-step differences and whether every one is within ``tolerances``."""

    ok: bool
    steps: list[StepDiff]
    tolerances: dict[str, float]
    losses: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"verify {'OK' if self.ok else 'FAILED'} (tolerances: {self.tolerances})"
        rows = [f"  step {s.step}: loss {s.loss:.2e}  grad {s.grad:.2e} ({s.worst_grad})  "
                f"weight {s.weight:.2e} ({s.worst_weight})" for s in self.steps]
        return "\n".join([head, *rows, *[f"  ! {p}" for p in self.problems]])


def _make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise PlanError(f"verify(optimizer={name!r}); valid: 'adamw', 'sgd'")


def _check_picklable(**objects: Any) -> None:
    for name, obj in objects.items():
        try:
            pickle.dumps(obj)
        except Exception as exc:
            raise PlanError(f"{name} cannot be pickled ({exc}); it is sent to every process, so define it as a "
                            f"top-level function in an importable module (not a lambda or a local function)") from None


def _reference(build_model, batch, loss_fn, steps, optimizer, lr) -> list[dict]:
    model = build_model()
    opt = _make_optimizer(optimizer, model.parameters(), lr)
    inputs, targets = batch
    records = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                 for n, p in model.named_parameters()}
        opt.step()
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        records.append({"loss": loss.item(), "grads": grads, "weights": weights})
    return records


def _sharded_job(ctx: Context, build_model, batch, loss_fn, steps, optimizer, lr) -> list[dict]:
    from .apply import full_grads, full_state_dict, shard

    model = shard(build_model(), ctx.plan, ctx)
    opt = _make_optimizer(optimizer, model.parameters(), lr)
    inputs, targets = ctx.shard_batch(*batch)
    records = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model.step(inputs, targets, loss_fn)
        grads = full_grads(model)
        opt.step()
        records.append({"loss": loss.item(), "grads": grads, "weights": full_state_dict(model)})
    return records


def _max_diff(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], rel: float = 0.0,
              atol: float = 1.0) -> tuple[float, str, bool]:
    """(max |diff|, where, all within atol + rel * max|ref|) over the parameters in ``got``."""
    worst, where, within = 0.0, "-", True
    for name, value in got.items():
        if not value.numel():
            continue
        expected = ref[name].float()
        diff = (value.float() - expected).abs().max().item()
        if not diff <= atol + rel * expected.abs().max().item():  # NaN fails too
            within = False
        if diff > worst or diff != diff:
            worst, where = diff, name
    return worst, where, within


def verify(build_model: Callable[[], nn.Module], plan: Plan, batch: tuple[Any, Any], *, loss_fn: Callable,
           steps: int = 3, optimizer: str = "adamw", lr: float = 1e-3, world: LocalWorld | None = None,
           tolerances: dict[str, float] | None = None) -> VerifyResult:
    """Run ``steps`` optimizer steps single-process and sharded; compare loss, grads, weights.

    ``build_model()`` must return a fresh module with deterministic weights; ``batch`` is the
    global ``(inputs, targets)``, split over data ranks as training would; ``loss_fn(output,
    targets)`` returns a mean scalar. Tolerances (fp32, see :data:`TOLERANCES`): loss 1e-5;
    gradients 1e-5 + 1e-4 x max|grad| per parameter; weights 0.1 x lr per step taken.
    Mixed precision: :data:`MIXED_PRECISION_TOLERANCES`.

    >>> result = verify(build_tiny_gpt, Plan(mesh=Mesh(fsdp=2)), (x, y), loss_fn=gpt_loss)  # doctest: +SKIP
    >>> result.ok
    True
    """
    _check_picklable(build_model=build_model, loss_fn=loss_fn)
    _make_optimizer(optimizer, [torch.zeros(1, requires_grad=True)], lr)
    world_size = world.size if world is not None else None
    if world_size is None:
        if not plan.mesh.is_resolved:
            raise PlanError("verify needs world= (or a mesh without -1) to know the world size")
        world_size = plan.mesh.size
    from ..planner.meta import meta_model
    from ..planner.validate import validate

    validate(plan, meta_model(build_model), world_size=world_size)
    inputs = batch[0]
    if isinstance(inputs, torch.Tensor):
        seq_len = int(inputs.shape[1]) if inputs.dim() >= 2 else None
        problems = plan.resolved(world_size).batch_problems(len(inputs), seq_len)
        if problems:
            raise PlanError(problems)
    mixed = {plan.fsdp.param_dtype, plan.fsdp.reduce_dtype} - {None, "float32"}
    tol = {**(MIXED_PRECISION_TOLERANCES if mixed else TOLERANCES), **(tolerances or {})}
    reference = _reference(build_model, batch, loss_fn, steps, optimizer, lr)
    per_rank = launch(_sharded_job, plan, build_model, batch, loss_fn, steps, optimizer, lr,
                      world=world, world_size=world_size)
    diffs, problems = [], []
    for step, ref in enumerate(reference):
        grads: dict[str, torch.Tensor] = {}
        weights: dict[str, torch.Tensor] = {}
        for records in per_rank:
            grads.update(records[step]["grads"])
            weights.update(records[step]["weights"])
        missing = sorted(set(ref["grads"]) - set(grads))
        if missing and step == 0:
            problems.append(f"parameters held by no rank: {missing}")
        loss = max(abs(r[step]["loss"] - ref["loss"]) for r in per_rank)
        loss_ok = loss <= tol["loss"] + tol["loss_rel"] * abs(ref["loss"])
        g, gw, g_ok = _max_diff(ref["grads"], grads, tol["grad_rel"], tol["grad"])
        w, ww, w_ok = _max_diff(ref["weights"], weights, 0.0, tol["weight"] * lr * (step + 1))
        diffs.append(StepDiff(step, loss, g, w, gw, ww))
        if not (loss_ok and g_ok and w_ok):
            problems.append(f"step {step}: " + ", ".join(
                what for what, good in (("loss", loss_ok), (f"gradient of {gw}", g_ok),
                                        (f"weight {ww}", w_ok)) if not good) + " out of tolerance")
    ok = not problems
    return VerifyResult(ok, diffs, tol, [r["loss"] for r in reference], problems)
