"""sk.verify: arguments checked before any process starts, verdicts that are earned, and mixed
precision compared with a single process in the same precision."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardkit as sk
from shardkit.models.gpt import build_tiny_gpt, gpt_loss
from shardkit.models.hf import build_tiny_gpt2, build_tiny_llama, hf_loss
from shardkit.runtime import verify as verify_module
from shardkit.runtime.precision import Precision, mixed_precision_backward
from shardkit.runtime.verify import TOLERANCES, mixed_precision_tolerances

DP2 = sk.Plan(mesh=sk.Mesh(dp=2))
FLOAT32 = Precision()
BF16 = sk.FSDPOptions(param_dtype="bfloat16")


def tokens(batch: int = 4, seq: int = 16, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


class NoProcesses:
    """A world of 2 in which starting a job fails the test: verify must reject its arguments first."""

    size = 2

    def run(self, *args, **kwargs):
        raise AssertionError("verify started processes before rejecting its arguments")


# -- bad arguments: a UsageError naming the argument, before any process starts -----------------
def per_token_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")


def float_loss(logits, targets):
    return 1.0


def constant_loss(logits, targets):
    return torch.tensor(1.0)


X, Y = tokens()
BAD_ARGUMENTS = [
    ({"steps": 0}, r"verify\(steps=0\).*int >= 1"),
    ({"steps": 2.0}, r"verify\(steps=2.0\)"),
    ({"steps": True}, r"verify\(steps=True\)"),
    ({"optimizer": "adam"}, r"verify\(optimizer='adam'\).*valid: 'adamw', 'sgd'"),
    ({"lr": 0}, r"verify\(lr=0\).*> 0"),
    ({"lr": math.nan}, r"verify\(lr=nan\)"),
    ({"lr": "1e-3"}, r"verify\(lr='1e-3'\)"),
    ({"tolerances": {"gard": 1e-3}}, r"unknown keys \['gard'\]; valid: \['grad', 'grad_rel', 'loss'"),
    ({"tolerances": {"grad": -1.0}}, r"'grad' is -1.0; a tolerance is a finite number >= 0"),
    ({"tolerances": {"loss": math.inf}}, r"'loss' is inf"),
    ({"tolerances": {"weight": "0.1"}}, r"'weight' is '0.1'"),
    ({"tolerances": [("grad", 1e-3)]}, r"tolerances must be a dict"),
    ({"plan": "dp=2"}, r"plan must be a shardkit Plan, got str"),
    ({"batch": X}, r"batch must be a pair \(inputs, targets\), got Tensor"),
    ({"batch": (X, Y, Y)}, r"got tuple of 3"),
    ({"batch": (X.tolist(), Y)}, r"inputs must be a tensor whose dim 0 is the batch, got list"),
    ({"batch": (X, Y[:2])}, r"inputs hold 4 samples \(shape \[4, 16\]\) but targets 2"),
    ({"batch": (X.float(), Y)}, r"dtype torch.float32, but GPT \(family 'gpt'\) takes token ids"),
    ({"batch": (X + 256, Y)}, r"token ids range from \d+ to \d+, but GPT \(family 'gpt'\) has a vocabulary of 256; valid ids: 0 to 255"),
    ({"batch": tokens(seq=40)}, r"sequences of 40 tokens, but GPT \(family 'gpt'\) has 32 positions"),
    ({"build_model": build_tiny_llama, "batch": tokens(seq=129)}, r"LlamaForCausalLM \(family 'hf-causal-lm'\) has 128 positions"),
    ({"loss_fn": per_token_loss}, r"loss_fn=per_token_loss\): loss_fn returned a torch.float32 tensor of shape \[64\]"),
    ({"loss_fn": float_loss}, r"loss_fn returned float; it must return a floating-point scalar tensor"),
    ({"loss_fn": constant_loss}, r"the loss does not depend on the model's parameters"),
    ({"loss_fn": lambda logits, targets: gpt_loss(logits, targets)}, r"verify\(loss_fn=...\): loss_fn cannot be pickled"),
    ({"world": "x"}, r"verify\(world=...\): give a sk.LocalWorld \(or None: a world is started for the run\), got str"),
]


@pytest.mark.parametrize("changes, message", BAD_ARGUMENTS, ids=[f"{next(iter(c))}{i}" for i, (c, _) in enumerate(BAD_ARGUMENTS)])
def test_bad_arguments_are_rejected_before_any_process_starts(changes, message):
    arguments = {"build_model": build_tiny_gpt, "plan": DP2, "batch": (X, Y), "loss_fn": gpt_loss,
                 "world": NoProcesses(), **changes}
    with pytest.raises(sk.UsageError, match=message):
        sk.verify(arguments.pop("build_model"), arguments.pop("plan"), arguments.pop("batch"), **arguments)


# -- verdicts are earned: the world replaced by records computed here, then tampered with -------
def one_rank(build_model, batch, loss_fn, steps, lr, precision=FLOAT32) -> list[dict]:
    """The records a correct rank returns (loss, full gradients and weights per step), computed in this process."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    records = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = mixed_precision_backward(model, *batch, loss_fn, precision)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        records.append({"loss": loss.item(), "grads": grads,
                        "weights": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return records


def fake_world(monkeypatch, tamper=lambda per_rank: per_rank, precision=FLOAT32) -> None:
    """Replace the world: two ranks that each report a correct single-process run, passed through ``tamper``."""
    def launch(job, plan, build_model, batch, loss_fn, steps, optimizer, lr, example, world=None, world_size=None):
        records = one_rank(build_model, batch, loss_fn, steps, lr, precision)
        return tamper([records, copy.deepcopy(records)])
    monkeypatch.setattr(verify_module, "launch", launch)


def run_verify(build_model=build_tiny_gpt, plan=DP2, loss_fn=gpt_loss, **kwargs) -> sk.VerifyResult:
    return sk.verify(build_model, plan, tokens(), loss_fn=loss_fn, steps=2, world=NoProcesses(), **kwargs)


def rename(records: list[dict], old: str, new: str, keep_old: bool = False) -> list[dict]:
    for record in records:
        for key in ("grads", "weights"):
            record[key][new] = record[key][old] if keep_old else record[key].pop(old)
    return records


def test_a_correct_run_is_ok(monkeypatch):
    fake_world(monkeypatch)
    result = run_verify()
    assert result.ok, result
    assert len(result.steps) == 2 and result.float32_gap is None


def test_a_rank_that_returns_nothing_fails(monkeypatch):
    fake_world(monkeypatch, lambda per_rank: [per_rank[0], []])
    result = run_verify()
    assert not result.ok and "rank 1 returned 0 of 2 steps" in result.problems


def test_comparing_no_parameter_fails(monkeypatch):
    def empty(per_rank):
        for record in per_rank[0] + per_rank[1]:
            record["grads"], record["weights"] = {}, {}
        return per_rank
    fake_world(monkeypatch, empty)
    result = run_verify()
    assert not result.ok
    assert "step 0: no parameter was compared" in str(result) and "parameters held by no rank" in str(result)


def test_parameters_on_one_side_only_are_named(monkeypatch):
    fake_world(monkeypatch, lambda per_rank: [rename(records, "lm_head.weight", "head.weight") for records in per_rank])
    result = run_verify()
    assert not result.ok
    assert "parameter 'head.weight' (rank 0) is not a parameter of build_model()'s model" in result.problems
    assert "parameters held by no rank: ['lm_head.weight']" in result.problems


def test_tied_parameters_match_under_any_of_their_names(monkeypatch):
    # GPT-2's lm_head.weight is transformer.wte.weight: the reference lists it once, as the latter.
    fake_world(monkeypatch, lambda per_rank: [rename(r, "transformer.wte.weight", "lm_head.weight") for r in per_rank])
    result = run_verify(build_tiny_gpt2, loss_fn=hf_loss)
    assert result.ok, result


def test_a_tie_split_by_sharding_is_reported(monkeypatch):
    fake_world(monkeypatch, lambda per_rank: [rename(r, "transformer.wte.weight", "lm_head.weight", keep_old=True)
                                              for r in per_rank])
    result = run_verify(build_tiny_gpt2, loss_fn=hf_loss)
    assert not result.ok
    assert ("parameters ['lm_head.weight', 'transformer.wte.weight'] are one tied parameter in build_model()'s model "
            "but separate ones after sharding: the plan splits a tie") in result.problems


def test_copies_of_a_tie_on_different_ranks_are_each_compared(monkeypatch):
    """A pipeline's first stage holds wte, its last stage the lm_head copy: no split-tie problem, and a
    copy the runtime let drift fails on its own name."""
    def stages(per_rank, drift=0.0):
        first, last = per_rank
        rename(last, "transformer.wte.weight", "lm_head.weight")
        for record in last:
            record["weights"]["lm_head.weight"] = record["weights"]["lm_head.weight"] + drift
        return [first, last]

    fake_world(monkeypatch, stages)
    assert run_verify(build_tiny_gpt2, loss_fn=hf_loss).ok
    fake_world(monkeypatch, lambda per_rank: stages(per_rank, drift=0.1))
    result = run_verify(build_tiny_gpt2, loss_fn=hf_loss)
    assert not result.ok and result.problems == [f"step {i}: weight lm_head.weight out of tolerance" for i in (0, 1)]


def test_a_weight_half_a_step_off_fails_under_bf16(monkeypatch):
    # The old bf16 bound, 2 x lr per step taken against an fp32 run, let this pass.
    def nudge(per_rank):
        for records in per_rank:
            records[1]["weights"]["layers.0.mlp.up_proj.weight"][0, 0] += 0.5e-3
        return per_rank
    fake_world(monkeypatch, nudge, Precision(torch.bfloat16))
    result = run_verify(plan=sk.Plan(mesh=sk.Mesh(dp=2), fsdp=BF16))
    assert not result.ok and result.problems == ["step 1: weight layers.0.mlp.up_proj.weight out of tolerance"]
    assert result.tolerances == mixed_precision_tolerances(torch.bfloat16)


def test_mixed_precision_that_was_not_applied_fails(monkeypatch):
    fake_world(monkeypatch)  # the sharded run computes in float32
    result = run_verify(plan=sk.Plan(mesh=sk.Mesh(dp=2), fsdp=BF16))
    assert not result.ok and result.float32_gap < TOLERANCES["grad"]
    assert result.problems == ["the plan asks for mixed precision (param_dtype='bfloat16', reduce_dtype=None) but the "
                               "sharded run's gradients equal float32 ones: the policy was not applied"]


def test_mixed_precision_tolerances_apply_only_when_it_is_in_force():
    float32 = sk.FSDPOptions(param_dtype="float32", reduce_dtype="float32")
    assert verify_module._tolerances(sk.Plan(mesh=sk.Mesh(dp=2), fsdp=float32), None) == TOLERANCES
    fp16 = verify_module._tolerances(sk.Plan(mesh=sk.Mesh(dp=2), fsdp=sk.FSDPOptions(param_dtype="float16")), None)
    bf16 = verify_module._tolerances(sk.Plan(mesh=sk.Mesh(dp=2), fsdp=sk.FSDPOptions(param_dtype="float16",
                                                                                      reduce_dtype="bfloat16")), {})
    assert fp16["grad_rel"] == 10 * 2**-10 and bf16["grad_rel"] == 10 * 2**-7  # the least precise dtype decides


# -- mixed precision in real worlds ---------------------------------------------------------------
# GPT with fsdp=2 and bf16 compute, fp32 reduction: tests/test_strategies.py::test_fsdp_mixed_precision_options_take_effect.
BF16_CASES = [(build_tiny_llama, hf_loss, "fsdp=2"), (build_tiny_gpt, gpt_loss, "dp=2")]


@pytest.mark.parametrize("build, loss_fn, mesh", BF16_CASES, ids=[f"{b.__name__}-{m}" for b, _, m in BF16_CASES])
def test_a_correct_bf16_plan_matches_a_bf16_single_process(world, build, loss_fn, mesh):
    plan = sk.Plan(mesh=sk.Mesh.parse(mesh), fsdp=BF16)
    result = sk.verify(build, plan, tokens(8, 32), loss_fn=loss_fn, steps=2, world=world(plan.mesh.size))
    assert result.ok, result
    assert result.float32_gap > 10 * TOLERANCES["grad"]  # the sharded run really computed in bf16


def gradient_scaled_on_rank_one(logits, targets):
    """A deliberately wrong loss under sharding: the same value, but rank 1's gradient is 1.4 times too large."""
    loss = gpt_loss(logits, targets)
    scale = 1.4 if dist.is_initialized() and dist.get_rank() == 1 else 1.0
    return loss * scale - loss.detach() * (scale - 1)


def test_a_wrong_gradient_under_bf16_fails(world):
    plan = sk.Plan(mesh=sk.Mesh(dp=2), fsdp=BF16)
    result = sk.verify(build_tiny_gpt, plan, tokens(8, 32), loss_fn=gradient_scaled_on_rank_one, steps=1,
                       world=world(2))
    assert not result.ok and result.problems[0].startswith("step 0: gradient of ")  # the loss alone looks right


# -- buffers and dropout ---------------------------------------------------------------------------
class SampleCounter(torch.nn.Module):
    """Counts the samples its forward sees in a buffer: under dp=2 each rank sees half of them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.shape[0]
        return self.linear(x)


def build_dropout_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4))


def test_a_buffer_that_differs_from_one_process_fails_naming_it(world):
    # Before: parameters only; the counter, 64 short on every rank, passed.
    batch = (torch.randn(128, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(128, 2))
    result = sk.verify(SampleCounter, DP2, batch, loss_fn=F.mse_loss, steps=1, world=world(2))
    assert not result.ok
    assert result.problems == [f"step 0: buffer 'seen' (rank {rank}) differs from one process's by 64 (tolerance 0.0128)"
                               for rank in (0, 1)]


def test_a_model_with_dropout_is_verified_with_dropout_off_on_both_sides(world):
    # Before: "step 0: loss, gradient of 3.weight out of tolerance" (each rank drew its own masks).
    g = torch.Generator().manual_seed(2)
    plan = sk.Plan(mesh=sk.Mesh(fsdp=2))
    result = sk.verify(build_dropout_mlp, plan, (torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)),
                       loss_fn=F.mse_loss, steps=2, world=world(2))
    assert result.ok, result
    assert result.notes and result.notes[0].startswith("dropout off on both sides (1 dropout call(s) with p > 0")
    assert "note: dropout off on both sides" in str(result)
