"""ZeRO stages (``Plan(zero=1 | 2 | 3)``): the strict field, its refusals, ``sk.optimizer``, each
stage equal to one process (``sk.verify``), the state bytes per device against ZeRO's formulas,
and the planner's estimate of them. One shared world of 2 processes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from model_zoo import build_with_unused
from torch import nn

import shardkit as sk
from shardkit.models.gpt import build_tiny_gpt, gpt_loss
from shardkit.planner.estimate import estimate

KEEP = sk.FSDPOptions(reshard_after_forward=False)
BF16 = {"param_dtype": "bfloat16"}
STAGES = {1: sk.Plan(sk.Mesh(dp=2), zero=1), 2: sk.Plan(sk.Mesh(fsdp=2), fsdp=KEEP, zero=2),
          3: sk.Plan(sk.Mesh(fsdp=2), zero=3)}


def _batch(batch=8, seq=32, vocab=256):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# -- the plan field ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["2", True, 4, 0, 2.0, [2]])
def test_zero_field_is_strict(value):
    with pytest.raises(sk.PlanError, match=r"plan field 'zero' must be null/None or one of \[1, 2, 3\]"):
        sk.Plan.from_dict({"mesh": {"fsdp": 2}, "zero": value})
    with pytest.raises(sk.PlanError, match=r"Plan\(zero=...\)"):
        sk.Plan(sk.Mesh(fsdp=2), zero=value)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_round_trips_and_default_is_none(stage):
    plan = STAGES[stage]
    assert sk.Plan.from_json(plan.to_json()) == plan == sk.Plan.from_yaml(plan.to_yaml())
    assert plan.to_dict()["zero"] == stage and plan.problems() == []
    assert sk.Plan.from_dict({"mesh": {"dp": 2}}).zero is None


CONTRADICTIONS = [
    (sk.Plan(sk.Mesh(fsdp=2), zero=1), "zero=1 shards only the optimizer state, over 'dp', but the mesh has fsdp=2"),
    (sk.Plan(sk.Mesh(dp=2, fsdp=2), zero=1), "use Mesh(dp=4) with zero=1, or zero=3"),
    (sk.Plan(sk.Mesh(tp=2), rules=[(".*", None)], zero=1), "zero=1 shards the optimizer state over the 'dp' axis"),
    (sk.Plan(sk.Mesh(dp=2, tp=2), rules=[(".*", None)], zero=1), "zero=1 with {'tp': 2}"),
    (sk.Plan(sk.Mesh(dp=2), fsdp=sk.FSDPOptions(**BF16), zero=1), "zero=1 with mixed precision"),
    (sk.Plan(sk.Mesh(dp=2), fsdp=KEEP, zero=2), "zero=2 shards parameters, gradients and optimizer state over the "
                                                "'fsdp' axis"),
    (sk.Plan(sk.Mesh(fsdp=2), fsdp=sk.FSDPOptions(reshard_after_forward=True), zero=2),
     "zero=2 keeps gathered parameters after the forward, but the plan has fsdp reshard_after_forward=True; set "
     "FSDPOptions(reshard_after_forward=False)"),
    (sk.Plan(sk.Mesh(fsdp=2), fsdp=KEEP, zero=3), "zero=3 frees gathered parameters after the forward, but the plan "
                                                  "has fsdp reshard_after_forward=False"),
]


@pytest.mark.parametrize("plan, message", CONTRADICTIONS, ids=range(len(CONTRADICTIONS)))
def test_contradictions_are_refused_before_launch(plan, message, no_processes):
    assert any(message in p for p in plan.problems()), plan.problems()
    with pytest.raises(sk.PlanError, match="zero="):
        sk.verify(build_tiny_gpt, plan, _batch(), loss_fn=gpt_loss)


def test_a_stage_alone_sets_what_the_user_left_out():
    """zero=2 alone is FSDP2 kept gathered (reshard_after_forward=False); a default nobody wrote is
    no contradiction, and stays unwritten through files and a change of stage."""
    plan = sk.Plan(sk.Mesh(fsdp=2), zero=2)
    assert plan.problems() == [] and plan.fsdp.reshard_after_forward is False and not plan.fsdp.written
    for text, read in ((plan.to_json(), sk.Plan.from_json), (plan.to_yaml(), sk.Plan.from_yaml)):
        assert "reshard_after_forward" not in text and read(text) == plan
    assert sk.Plan.from_dict({"mesh": {"fsdp": 2}, "zero": 2}) == plan
    assert sk.Plan.from_yaml("mesh: {fsdp: 2}\nzero: 2\nfsdp: {param_dtype: bfloat16}\n").problems() == []
    assert replace(plan, zero=3).fsdp.reshard_after_forward is True and replace(plan, zero=3).problems() == []
    assert replace(plan, zero=None).fsdp.reshard_after_forward is True
    kept = replace(plan, fsdp=replace(plan.fsdp, param_dtype="bfloat16"))  # another option changed: still unwritten
    assert kept.problems() == [] and not kept.fsdp.written and kept.fsdp.reshard_after_forward is False
    written = sk.Plan(sk.Mesh(fsdp=2), fsdp=sk.FSDPOptions(reshard_after_forward=False))
    assert written.fsdp.written and "reshard_after_forward: false" in written.to_yaml()
    assert sk.Plan.from_yaml(written.to_yaml()) == written and written != sk.Plan(sk.Mesh(fsdp=2))
    assert any("zero=3 frees gathered parameters" in p for p in replace(written, zero=3).problems())


@pytest.mark.parametrize("text, stage", [
    ('{"mesh": {"fsdp": 2}, "zero": 2, "fsdp": {"reshard_after_forward": true}}', 2),
    ("mesh: {fsdp: 2}\nzero: 2\nfsdp: {reshard_after_forward: true}\n", 2),
    ("mesh: {fsdp: 2}\nzero: 3\nfsdp: {reshard_after_forward: false}\n", 3),
])
def test_only_a_written_contradiction_is_refused(text, stage, tmp_path, capsys, no_processes):
    from shardkit.cli import main

    plan = sk.Plan.from_yaml(text)
    assert any(f"zero={stage} " in p and "reshard_after_forward" in p for p in plan.problems()), plan.problems()
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    assert main(["explain", "--model", "gpt-tiny", "--plan", str(path)]) == 2
    assert f"zero={stage} " in capsys.readouterr().err
    path.write_text(text.replace("true", "false") if stage == 2 else text.replace("false", "true"))
    assert main(["explain", "--model", "gpt-tiny", "--plan", str(path)]) == 0
    assert f"zero={stage}" in capsys.readouterr().out


def test_a_plan_file_with_a_stage_alone_is_explained(tmp_path, capsys, no_processes):
    from shardkit.cli import main

    path = tmp_path / "plan.yaml"
    path.write_text("mesh: {fsdp: 2}\nzero: 2\n")
    assert main(["explain", "--model", "gpt-tiny", "--plan", str(path)]) == 0
    assert "reshard_after_forward=False (zero=2's)" in capsys.readouterr().out


def test_optimizer_is_the_plain_one_without_a_plan():
    model = nn.Linear(4, 4)
    opt = sk.optimizer(model, torch.optim.AdamW, lr=0.5)
    assert type(opt) is torch.optim.AdamW and opt.defaults["lr"] == 0.5
    with pytest.raises(sk.UsageError, match="optimizer_class must be a torch.optim.Optimizer class"):
        sk.optimizer(model, "adamw", lr=0.5)
    with pytest.raises(sk.UsageError, match="model must be an nn.Module"):
        sk.optimizer(model.parameters(), torch.optim.AdamW)


# -- the planner's estimate -----------------------------------------------------------------------

def test_estimate_counts_each_stage():
    def states(plan):
        m = estimate("gpt-small", plan, batch_size=8, seq_len=128, hardware="a100-80g").memory
        return m["parameters"], m["gradients"], m["optimizer"], m["gathered"]

    plain = states(sk.Plan(sk.Mesh(dp=4)))
    zero1 = states(sk.Plan(sk.Mesh(dp=4), zero=1))
    zero2 = states(sk.Plan(sk.Mesh(fsdp=4), fsdp=KEEP, zero=2))
    zero3 = states(sk.Plan(sk.Mesh(fsdp=4), zero=3))
    params = plain[0]
    assert zero1[:2] == plain[:2] and zero1[2] == pytest.approx(plain[2] / 4, abs=8) and zero1[3] == 0
    assert zero2[:3] == zero3[:3] == pytest.approx((params / 4, params / 4, 2 * params / 4), abs=8)
    assert zero2[3] >= params and zero2[3] > zero3[3]  # stage 2 holds the whole model gathered from forward to backward
    assert states(sk.Plan(sk.Mesh(fsdp=4))) == zero3  # stage 3 is today's fsdp


# -- in a world: equal to one process, and the state bytes ------------------------------------------

VERIFIED = [STAGES[1], STAGES[2], STAGES[3],
            sk.Plan(sk.Mesh(fsdp=2), fsdp=sk.FSDPOptions(reshard_after_forward=False, **BF16), zero=2)]


@pytest.mark.parametrize("plan", VERIFIED, ids=["zero1", "zero2", "zero3", "zero2-bf16"])
def test_each_stage_matches_one_process(world, plan):
    result = sk.verify(build_tiny_gpt, plan, _batch(), loss_fn=gpt_loss, steps=3, world=world(2))
    assert result.ok, result
    assert len(result.steps) == 3 and result.losses[0] > result.losses[-1]


def test_zero1_with_a_parameter_the_forward_never_uses(world):
    """DDP's reducer fails on an unused parameter unless told: zero=1 (always DDP) tells it."""
    result = sk.verify(build_with_unused, STAGES[1], _batch(), loss_fn=gpt_loss, steps=2, world=world(2))
    assert result.ok, result


DIM, LAYERS = 16, 4
PSI, TENSORS = LAYERS * DIM * DIM, LAYERS  # parameters, and parameter tensors (one AdamW step counter each)


class Tower(nn.Module):
    """Four equal bias-free layers, each its own FSDP unit: every count below divides exactly by 2."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _state_job(ctx):
    from torch.distributed.tensor import DTensor

    from shardkit.observe.memory import state_bytes, tensors_nbytes

    model = sk.shard(Tower(), ctx.plan)
    opt = sk.optimizer(model, torch.optim.AdamW, lr=1e-3)
    x, y = ctx.shard_batch(torch.ones(4, DIM), torch.zeros(4, DIM))
    out = model(x)
    # between forward and backward: the parameters FSDP2 holds gathered (registered as plain tensors)
    gathered = tensors_nbytes(p for p in model.parameters() if not isinstance(p, DTensor)) if ctx.plan.zero > 1 else 0
    nn.functional.mse_loss(out.float(), y).backward()
    opt.step()
    held = state_bytes(model, opt)  # after the step, gradients still allocated, as shardkit train measures
    return type(opt).__name__, held.params, held.grads, held.optimizer, gathered


def test_zero2_alone_runs_fsdp2_kept_gathered(world):
    """The runtime gets the stage's reshard_after_forward=False when the plan leaves it out."""
    alone = world(2).run(_state_job, plan=sk.Plan(sk.Mesh(fsdp=2), zero=2))
    assert alone == world(2).run(_state_job, plan=STAGES[2]) and alone[0][-1] == 4 * PSI


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_state_bytes_per_device_follow_zero_formulas(world, precision):
    """Bytes per device, N = 2, Psi parameters, T tensors (each has AdamW's 4-byte step counter,
    which ZeRO's accounting leaves out). torch holds float32 parameters as the master copy and
    float32 gradients; under mixed precision only the gathered copy is bf16 (docs/zero.md)."""
    n, mixed = 2, precision == "bfloat16"
    compute = 2 if mixed else 4
    options = {"param_dtype": precision} if mixed else {}
    plans = {2: sk.Plan(sk.Mesh(fsdp=n), fsdp=sk.FSDPOptions(reshard_after_forward=False, **options), zero=2),
             3: sk.Plan(sk.Mesh(fsdp=n), fsdp=sk.FSDPOptions(**options), zero=3)}
    if not mixed:
        plans[1] = STAGES[1]
    expected = {  # (optimizer type, parameters, gradients, optimizer state, gathered between forward and backward)
        1: ("PartitionedOptimizer", 4 * PSI, 4 * PSI, 8 * PSI // n + 4 * TENSORS // n, 0),
        2: ("AdamW", 4 * PSI // n, 4 * PSI // n, 8 * PSI // n + 4 * TENSORS, compute * PSI),
        3: ("AdamW", 4 * PSI // n, 4 * PSI // n, 8 * PSI // n + 4 * TENSORS, 0),
    }
    zero_formula = {1: 8 * PSI + 8 * PSI / n, 2: 4 * PSI + 12 * PSI / n, 3: 16 * PSI / n} if not mixed else {
        2: 2 * PSI + 14 * PSI / n, 3: 16 * PSI / n}
    for stage, plan in plans.items():
        per_rank = world(n).run(_state_job, plan=plan)
        assert per_rank == [expected[stage]] * n, (stage, per_rank)
        _, params, grads, optimizer, gathered = per_rank[0]
        total = params + grads + optimizer - 4 * TENSORS * (1 if stage == 1 else n) // n + gathered
        # what torch holds beyond ZeRO's accounting: stage 2 keeps the float32 shard beside the gathered
        # copy (fp32: 4 Psi/N), and under mixed precision float32 gradients where ZeRO has 16-bit ones (2 Psi/N)
        extra = {1: 0, 2: 4 * PSI / n if not mixed else 2 * PSI / n, 3: 0}[stage]
        assert total == zero_formula[stage] + extra, (stage, total, zero_formula[stage])


def _steps(model, opt, ctx, steps):
    from shardkit.runtime.apply import full_state_dict

    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x, y = ctx.shard_batch(torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g))
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return full_state_dict(model)


def _save_job(ctx, folder):
    model = sk.shard(Tower(), ctx.plan)
    opt = sk.optimizer(model, torch.optim.AdamW, lr=1e-2)
    _steps(model, opt, ctx, 2)
    sk.save(folder, model, opt, step=2)
    return len(opt.state), _steps(model, opt, ctx, 1)


def _resume_job(ctx, folder):
    model = sk.shard(Tower(), ctx.plan)
    opt = sk.optimizer(model, torch.optim.AdamW, lr=1e-2)
    sk.load(folder, model, opt)
    return _steps(model, opt, ctx, 1)


def test_zero1_checkpoints_each_ranks_part_and_resumes_under_any_stage(world, tmp_path):
    """sk.save writes each rank's part of ZeRO-1's state; resuming under zero=1 or zero=3 continues
    exactly as the run that saved it (a lost or zeroed part would change AdamW's next step)."""
    saved = world(2).run(_save_job, str(tmp_path), plan=STAGES[1])
    assert [held for held, _ in saved] == [LAYERS // 2] * 2  # each rank holds half of the tensors' state
    after = saved[0][1]
    for plan in (STAGES[1], STAGES[3]):
        resumed = world(2).run(_resume_job, str(tmp_path), plan=plan)[0]
        for name, value in after.items():
            torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6, msg=f"{name} under zero={plan.zero}")


@pytest.mark.parametrize("stage, expected", [("2", "reshard_after_forward=False"), ("3", "zero=3")])
def test_zero_flag_builds_the_stage(stage, expected, capsys, no_processes):
    from shardkit.cli import main

    assert main(["explain", "--model", "gpt-tiny", "--mesh", "fsdp=2", "--zero", stage]) == 0
    out = capsys.readouterr().out
    assert expected in out and f"zero={stage}" in out


def test_zero_flag_is_refused_where_the_stage_cannot_run(tmp_path, capsys, no_processes):
    from shardkit.cli import main

    assert main(["explain", "--model", "gpt-tiny", "--mesh", "fsdp=2", "--zero", "1"]) == 2
    assert "zero=1 shards only the optimizer state, over 'dp'" in capsys.readouterr().err
    sk.Plan(sk.Mesh(dp=2)).save(tmp_path / "plan.yaml")
    assert main(["explain", "--model", "gpt-tiny", "--plan", str(tmp_path / "plan.yaml"), "--zero", "1"]) == 2
    assert "--plan is a whole plan, so --zero cannot be combined with it" in capsys.readouterr().err
