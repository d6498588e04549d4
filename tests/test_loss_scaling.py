"""float16 loss scaling (Plan(loss_scale=...)): the rules as data, the refusal of float16 without a scale,
scaled sharded training in a user's own loop (``model.step`` + its optimizer) against one process where unscaled
float16 gradients underflow, an overflow on one rank skipped on every rank, ``sk.verify`` scaled as training is,
the scale kept through a checkpoint, and the training loop's host reads.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from model_zoo import build_gpt4, tokens

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, gpt_loss
from shardkit.plan import FSDPOptions, Mesh, Pipeline, Plan, PlanError
from shardkit.plan.loss_scale import (
    ScaleRule,
    ScaleState,
    check_loss_scale,
    resolved_loss_scale,
    scale_rule,
)
from shardkit.runtime.loss_scaling import LossScaler
from shardkit.runtime.precision import Precision, mixed_precision_backward
from shardkit.training.run import prepare

FP16 = FSDPOptions(param_dtype="float16")
HALF = Precision.of(FP16)  # FSDP2's policy in one process
#: The loss is multiplied by this: every float16 gradient of the tiny GPT underflows to zero without a scale.
TINY = 1e-6
LR = 0.05 / TINY  # SGD steps of a useful size on the tiny gradients
STEPS = 3


def tiny_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return gpt_loss(logits.float(), targets) * TINY


# -- the rules, as data ------------------------------------------------------------------------------------
def test_dynamic_rule_backs_off_on_overflow_and_grows_after_good_steps():
    rule = ScaleRule(init_scale=1024.0, growth_interval=3)
    state, seen = rule.start(), []
    for overflow in (True, False, False, False, False, True):
        state = rule.next(state, overflow)
        seen.append((state.scale, state.good_steps))
    assert seen == [(512.0, 0), (512.0, 1), (512.0, 2), (1024.0, 0), (1024.0, 1), (512.0, 0)]
    assert scale_rule("dynamic") == ScaleRule(2.0**16, 2.0, 0.5, 2000)  # torch's GradScaler defaults
    fixed = scale_rule(128)
    assert [fixed.next(ScaleState(128.0, 1999), o).scale for o in (True, False)] == [128.0, 128.0]


def test_plan_field_resolves_checks_and_round_trips():
    assert Plan(Mesh(fsdp=2), fsdp=FP16).loss_scaling == "dynamic"
    assert Plan(Mesh(fsdp=2), fsdp=FSDPOptions(reduce_dtype="float16")).loss_scaling == "dynamic"
    assert Plan(Mesh(fsdp=2), fsdp=FSDPOptions(param_dtype="bfloat16")).loss_scaling is None
    assert Plan(Mesh(fsdp=2), fsdp=FP16, loss_scale=512).loss_scaling == 512.0
    assert resolved_loss_scale("dynamic", None, None) == "dynamic"  # asked for: scaled even in float32
    written = Plan(Mesh(fsdp=2), fsdp=FP16, loss_scale=1024)
    assert Plan.from_json(written.to_json()) == written and Plan.from_yaml(written.to_yaml()) == written
    assert "loss_scale" not in Plan(Mesh(fsdp=2)).to_dict()  # unwritten stays unwritten in files
    for bad in (True, 0, -1.0, math.inf, "static", "1024"):
        with pytest.raises(PlanError, match=r"Plan\(loss_scale=...\) must be null/None, 'dynamic', 'off'"):
            Plan(Mesh(fsdp=2), loss_scale=bad)
    with pytest.raises(PlanError, match="plan field 'loss_scale' must be"):
        Plan.from_dict({"mesh": {"fsdp": 2}, "loss_scale": "yes"})
    assert check_loss_scale(2, "x") == 2.0


def test_float16_without_a_scale_is_refused_by_name_recommending_bfloat16(tmp_path, capsys, no_processes):
    plan = Plan(Mesh(fsdp=2), fsdp=FSDPOptions(param_dtype="float16", reduce_dtype="float16"), loss_scale="off")
    (problem,) = plan.problems()
    assert problem.startswith("loss_scale='off' with param_dtype='float16' and reduce_dtype='float16': float16 "
                              "gradients below 6e-8 become zero")
    assert "param_dtype='bfloat16' and reduce_dtype='bfloat16'" in problem and "loss_scale='dynamic'" in problem
    assert Plan(Mesh(fsdp=2), fsdp=FSDPOptions(param_dtype="bfloat16"), loss_scale="off").problems() == []
    # sk.train / shardkit train: refused before any process starts, from the flag or the job file
    config = sk.TrainConfig(model="gpt-tiny", plan=Plan(Mesh(fsdp=2)), param_dtype="float16", loss_scale="off",
                            steps=1, batch_size=2, seq_len=8, data_mb=0.01)
    with pytest.raises(PlanError, match="^loss_scale=off: loss_scale='off' with param_dtype='float16'"):
        prepare(config)
    job = tmp_path / "job.yaml"
    job.write_text("model: gpt-tiny\nplan: {mesh: {fsdp: 2}, loss_scale: 64}\nprecision: {loss_scale: dynamic}\n")
    with pytest.raises(PlanError, match="precision.loss_scale is 'dynamic' but the plan's loss_scale is 64.0"):
        prepare(sk.TrainConfig.from_file(job))
    from shardkit.cli import main

    (tmp_path / "fp16.yaml").write_text("model: gpt-tiny\nprecision: {param_dtype: float16}\n")
    for argv, message in ((["--loss-scale", "off"], "shardkit: invalid plan: --loss-scale off: loss_scale='off' with "
                                                   "param_dtype='float16'"),
                          (["--loss-scale", "big"], "--loss-scale: must be dynamic or off or a positive number")):
        try:
            code = main(["train", "--config", str(tmp_path / "fp16.yaml"), "--mesh", "fsdp=2", *argv])
        except SystemExit as exc:  # a flag's own error exits while parsing
            code = exc.code
        assert code == 2 and message in capsys.readouterr().err


# -- one process: plain gradients ---------------------------------------------------------------------------
def test_plain_gradients_unscaled_and_an_overflow_skipped():
    torch.manual_seed(0)
    model, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    model(x).pow(2).mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    scaler = LossScaler("dynamic", torch.device("cpu"))
    scaler.scaled(lambda out, _: out.pow(2).mean())(model(x), None).backward()
    assert model.weight.grad.abs().max() > 1000 * expected[0].abs().max()  # scaled by 2**16
    assert scaler.unscale_(model).item() == 0.0
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
    with pytest.raises(sk.UsageError, match="unscale_ was called twice"):
        scaler.unscale_(model)
    before = model.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.5)
    assert scaler.update(model) is True and scaler.last_skipped is False
    optimizer.step()
    assert not torch.equal(model.weight, before)
    model.weight.grad[0, 0] = math.nan  # an overflow: every gradient None, so the optimizer's step changes nothing
    scaler.unscale_(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    assert scaler.update(model) is False and scaler.last_skipped is True
    assert all(p.grad is None for p in model.parameters())
    optimizer.step()  # no weight decay, no moment moved either
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(optimizer.state.values(), moments))
    assert (scaler.state_dict(), scaler.skipped) == ({"scale": 32768.0, "good_steps": 0}, 1)


# -- sharded: FSDP2 and tensor-parallel DTensor gradients ------------------------------------------------------
CASES = {
    "fsdp=2, 2 micro-batches, clipped": Plan(Mesh(fsdp=2), fsdp=FP16),
    "tp=2, clipped": Plan(Mesh(tp=2), rules=GPT_RULES, fsdp=FP16),
    "pp=2, 2 micro-batches of the schedule, clipped": Plan(Mesh(pp=2), fsdp=FP16, pipeline=Pipeline(
        split_points=["layers.2"], schedule="1f1b", microbatches=2)),
}


def _reference(scale: float | None, max_norm: float | None = None, precision: Precision = HALF
               ) -> tuple[dict, float]:
    """One process under ``precision`` (default float16 compute and gradients, as FSDP2's policy) with the loss
    times ``scale`` (None: no scaling), clipped to ``max_norm``, SGD: the weights after :data:`STEPS` steps, and
    the first step's gradient norm."""
    model = build_gpt4()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    first_norm = None
    factor = 1.0 if scale is None else scale
    for _ in range(STEPS):
        optimizer.zero_grad()
        mixed_precision_backward(model, *tokens(8), lambda out, y: tiny_loss(out, y) * factor, precision)
        for p in model.parameters():
            p.grad /= factor
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf)
        first_norm = norm.item() if first_norm is None else first_norm
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, first_norm


def _error(weights: dict, reference: dict, start: dict, name: str) -> float:
    """How far the update of parameter ``name`` is from the reference's, relative to it."""
    update, expected = weights[name] - start[name], reference[name] - start[name]
    return ((update - expected).norm() / expected.norm()).item()


def _sharded(ctx, cases: list, max_norm: float) -> list:
    """Each case in a user's own loop, nothing but ``sk.shard``, ``model.step``, ``sk.clip_grad_norm_`` and a torch
    optimizer: STEPS steps (the plan's float16 scale applied by ``model.step``); then a step whose gradients rank 1
    poisons with an inf before they are unscaled, followed by the optimizer's step as usual; then a step left
    without ``zero_grad`` and another after it (refused). Returns the weights after the STEPS steps, whether the
    poisoned step was skipped, the gradients it left, the weights after it, the scale before and after it, and
    the refusal."""
    from shardkit.runtime.apply import full_state_dict

    out = []
    for name in cases:
        plan = CASES[name]
        ctx = replace(ctx, plan=plan)
        inputs, targets = ctx.shard_batch(*tokens(8))
        model = sk.shard(build_gpt4(), plan, ctx)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        micro = 2 if "micro-batches," in name else 1
        for _ in range(STEPS):
            model.step(inputs, targets, tiny_loss, accumulate=micro)
            sk.clip_grad_norm_(model, max_norm)
            optimizer.step()
            optimizer.zero_grad()
        trained = full_state_dict(model)
        scaler = model.loss_scaler
        before = scaler.state.scale
        if ctx.rank == 1:
            unscale = scaler.unscale_

            def poisoned(module, unscale=unscale):
                _local(next(module.parameters()).grad).view(-1)[0] = math.inf
                return unscale(module)

            scaler.unscale_ = poisoned
        model.step(inputs, targets, tiny_loss)
        scaler.__dict__.pop("unscale_", None)
        skipped, left = scaler.last_skipped, [n for n, p in model.named_parameters() if p.grad is not None]
        optimizer.step()  # the loop steps as usual: nothing moves
        after, scale = full_state_dict(model), scaler.state.scale
        model.step(inputs, targets, tiny_loss)
        optimizer.step()  # no zero_grad: the next step would add scaled gradients to unscaled ones
        try:
            model.step(inputs, targets, tiny_loss)
            refused = None
        except sk.UsageError as error:
            refused = str(error)
        out.append((trained, skipped, left, after, before, scale, refused))
    return out


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


@pytest.mark.world
def test_scaled_float16_user_loop_matches_one_process_and_overflow_skips_every_rank(world):
    reference, norm = _reference(scale=2.0**16)
    max_norm = norm / 2  # clipping happens, on the unscaled gradients (a scaled norm is 65536 times larger)
    reference, _ = _reference(scale=2.0**16, max_norm=max_norm)
    exact, _ = _reference(scale=None, max_norm=max_norm, precision=Precision())  # float32
    start = {n: p.detach().clone() for n, p in build_gpt4().named_parameters()}
    unscaled, _ = _reference(scale=None)
    assert all(torch.equal(unscaled[n], start[n]) for n in start)  # float16 alone: every gradient underflowed
    # float16's own rounding: ~0.1% on most updates, ~10% on the attention projections' (subnormal gradients)
    tolerance = {n: max(0.02, 2 * _error(reference, exact, start, n)) for n in start}
    found = world(2).run(_sharded, list(CASES), max_norm)
    for i, name in enumerate(CASES):
        for rank, (trained, skipped, left, after, before, scale, refused) in enumerate(r[i] for r in found):
            for n in trained:
                error = _error(trained, reference, start, n)
                assert error <= tolerance[n], f"{name}, rank {rank}: {n}'s update is {error:.1%} off one process's"
            assert skipped is True and left == [], f"{name}: rank {rank} kept gradients although rank 1's overflowed"
            assert all(torch.equal(after[n], trained[n]) for n in trained), f"{name}: rank {rank}'s weights moved"
            assert (before, scale) == (2.0**16, 2.0**15), f"{name}: rank {rank}'s scale {before} -> {scale}"
            assert refused is not None and "still holds the gradient of the previous step" in refused \
                and "optimizer.zero_grad()" in refused and "accumulate=k" in refused, f"{name}: {refused}"


def _overflowing_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return gpt_loss(logits.float(), targets)


@pytest.mark.world
def test_verify_scales_float16_as_training_does(world):
    """sk.verify runs float16 under the plan's scale on both sides: the gradients no longer underflow (they are
    float16's rounding away from float32's), and a step that overflows is skipped by both sides alike."""
    shared = world(2)
    result = sk.verify(build_gpt4, Plan(Mesh(fsdp=2), fsdp=FP16), tokens(8), loss_fn=tiny_loss, steps=2,
                       optimizer="sgd", lr=LR, world=shared)
    assert result.ok, str(result)
    assert (result.loss_scales, result.skipped) == ([2.0**16, 2.0**16], [])
    float32 = build_gpt4()
    mixed_precision_backward(float32, *tokens(8), tiny_loss, Precision())
    largest = max(p.grad.abs().max().item() for p in float32.parameters())
    assert result.float32_gap < 0.1 * largest, "float16 gradients underflowed: the loss was not scaled"
    assert "loss scale per step: 65536, 65536" in str(result)
    # a fixed scale of 1e9 overflows float16 at every step: both sides skip, and verify says nothing was compared
    skipping = sk.verify(build_gpt4, Plan(Mesh(fsdp=2), fsdp=FP16, loss_scale=1e9), tokens(8),
                         loss_fn=_overflowing_loss, steps=2, world=shared)
    assert skipping.skipped == [0, 1] and skipping.loss_scales == [1e9, 1e9], str(skipping)
    assert skipping.problems == ["every step overflowed at its loss scale (1e+09, 1e+09), so no gradient was "
                                 "compared: take more steps (a dynamic scale halves after each overflow) or write "
                                 "a smaller fixed Plan(loss_scale=...)"], str(skipping)


# -- the training loop: host reads, and the scale through a checkpoint ------------------------------------------
#: What reads a tensor to the host (a sync with the device) when shardkit's code calls it.
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


class _Counted:
    """A job's data whose batches note, as each is taken, the host reads and gathers made so far."""

    def __init__(self, data, counts: dict):
        self.data, self.counts = data, counts

    def batches(self, *args, **kwargs):
        for batch in self.data.batches(*args, **kwargs):
            self.counts["at_batch"].append((self.counts["reads"], self.counts["gathers"]))
            yield batch


def _train_counting(ctx, job) -> tuple[list, list]:
    """``train_rank`` with every host read shardkit's code makes (and every ``all_gather_object``) counted:
    the rank's losses and the reads and gathers of each step but the last."""
    import sys

    import torch.distributed as dist

    from shardkit.training.loop import train_rank

    counts = {"reads": 0, "gathers": 0, "at_batch": []}

    def counting(fn, key):
        def wrapper(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("shardkit"):
                counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    saved = {name: getattr(torch.Tensor, name) for name in READS}
    gather = dist.all_gather_object
    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, counting(fn, "reads"))
        dist.all_gather_object = counting(gather, "gathers")
        stats, _ = train_rank(ctx, replace(job, data=_Counted(job.data, counts)))
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        dist.all_gather_object = gather
    marks = counts["at_batch"]
    return stats.losses, [(r1 - r0, g1 - g0) for (r0, g0), (r1, g1) in zip(marks, marks[1:])]


@pytest.mark.world
def test_training_loop_reads_the_host_only_when_asked_and_resumes_the_scale(world, tmp_path):
    import json

    base = sk.TrainConfig(model="gpt-tiny", plan=Plan(Mesh(fsdp=2)), param_dtype="float16", steps=5, batch_size=4,
                          seq_len=16, data_mb=0.05, log_dir=tmp_path / "logs", log_every=3, save=tmp_path / "ck",
                          save_every=3, optimizer="sgd", lr=0.5)
    job = prepare(base)
    assert job.plan.loss_scaling == "dynamic"  # float16 scales without being asked
    found = world(2).run(_train_counting, job, plan=job.plan)
    losses = found[0][0]
    for rank, (_, steps) in enumerate(found):
        # steps 1 and 2 neither log, evaluate nor save: one read each, the overflow flag; no gather
        assert steps[:2] == [(1, 0), (1, 0)], f"rank {rank}: (host reads, gathers) of steps 1-2: {steps[:2]}"
        reads, gathers = steps[2]  # step 3 logs and saves: the numbers asked for, in one read with the flag's
        assert reads <= 3 and gathers >= 1, f"rank {rank}: step 3 made {reads} host reads, {gathers} gathers"
    def scale(folder: str) -> dict:
        return json.loads((tmp_path / folder / "manifest.json").read_text())["extra"]["loss_scale"]

    assert scale("ck/step-00000003")["scale"] < 2.0**16, "float16's first step overflows at 2**16: the scale backs off"
    again = replace(base, resume=tmp_path / "ck" / "step-00000003", log_dir=None, log_every=1, save=tmp_path / "ck2",
                    save_every=None)
    resumed = world(2).run(_train_counting, prepare(again), plan=job.plan)
    assert resumed[0][0] == losses[3:], "a resumed run trains steps 4-5 as the whole run did"
    assert scale("ck2/step-00000005") == scale("ck/step-00000005"), "the scale and its good steps, resumed"


def test_dry_run_of_a_float16_plan_measures_a_scaled_step():
    """sk.dry_run's fake tensors hold no overflow flag to read: the scaled step it measures is one that steps."""
    from shardkit.models.hf import build_tiny_llama

    plan = Plan(Mesh(fsdp=2), fsdp=FSDPOptions(param_dtype="float16", reduce_dtype="float32"))
    dry = sk.dry_run(build_tiny_llama, plan, world_size=2, batch=2, seq_len=16, ranks=(0,), estimate=False)
    assert dry.ranks[0].memory["peak"] > 0
