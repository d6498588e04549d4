"""sk.clip_grad_norm_ and model.step(..., accumulate=k) equal one process, under every strategy and mix.

Each sharded job takes one step (optionally in k micro-batches), reads the full gradients,
clips with a max_norm far below the norm and reads them again; the test process computes
the same with torch.nn.utils.clip_grad_norm_ on the unsharded model and the whole batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from model_zoo import build_gpt4, build_llama_tied, tokens

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, gpt_loss
from shardkit.models.hf import GPT2_RULES, LLAMA_RULES, build_tiny_gpt2, hf_loss
from shardkit.plan import Mesh, Pipeline, Plan

pytestmark = pytest.mark.world

MAX_NORM = 0.05  # far below the tiny models' gradient norms (2-norm about 1-5, inf-norm 0.16): clipping happens


def _reference(build, loss_fn, norm_type: float = 2.0, max_norm: float = MAX_NORM) -> tuple[float, float, dict, dict]:
    """(loss, norm, gradients, clipped gradients) of one process on the whole batch, by torch alone."""
    model = build()
    loss = loss_fn(model(tokens(8)[0]), tokens(8)[1])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return loss.item(), norm.item(), grads, {n: p.grad.clone() for n, p in model.named_parameters()}


def _sharded(ctx, build, loss_fn, accumulate: int, norm_type: float,
             max_norm: float = MAX_NORM) -> tuple[float, float, dict, dict]:
    from shardkit.runtime.apply import full_grads

    model = sk.shard(build(), ctx.plan, ctx)
    loss = model.step(*ctx.shard_batch(*tokens(8)), loss_fn, accumulate=accumulate)
    copies = getattr(model, "tied_copies", {})  # a later stage's copy of a parameter tied across stages

    def grads() -> dict[str, torch.Tensor]:
        return {copies.get(n, n): g for n, g in full_grads(model).items()}

    before = grads()
    norm = sk.clip_grad_norm_(model, max_norm, norm_type)
    return loss.item(), norm.item(), before, grads()


def _merged(results: list, index: int) -> dict[str, torch.Tensor]:
    """Gradients over every rank (pipeline ranks hold different stages; the copies of a parameter
    tied across stages must be equal)."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        for name, grad in result[index].items():
            assert name not in merged or torch.equal(merged[name], grad), f"the copies of {name} differ"
            merged[name] = grad
    return merged


def _assert_close(got: dict, expected: dict, what: str) -> None:
    assert set(got) == set(expected), f"{what}: parameters differ: {set(got) ^ set(expected)}"
    for name, value in got.items():
        scale = expected[name].abs().max().item()
        diff = (value - expected[name]).abs().max().item()
        assert diff <= 1e-6 + 1e-4 * scale, f"{what} of {name}: off by {diff:.2e} (max |value| {scale:.2e})"


def _check(world, plan: Plan, build=build_gpt4, loss_fn=gpt_loss, accumulate: int = 1, norm_type: float = 2.0,
           max_norm: float = MAX_NORM):
    ref_loss, ref_norm, ref_grads, ref_clipped = _reference(build, loss_fn, norm_type, max_norm)
    assert ref_norm > 3 * max_norm  # clipping really scales the gradients
    results = world(plan.mesh.size).run(_sharded, build, loss_fn, accumulate, norm_type, max_norm, plan=plan)
    for loss, norm, _, _ in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5)  # every rank: the whole model's norm
    _assert_close(_merged(results, 2), ref_grads, "gradient")
    _assert_close(_merged(results, 3), ref_clipped, "clipped gradient")


TWO = [
    ("fsdp=2", Plan(mesh=Mesh(fsdp=2))),
    ("tp=2", Plan(mesh=Mesh(tp=2), rules=GPT_RULES)),
    ("dp=2", Plan(mesh=Mesh(dp=2))),
    ("sp=2", Plan(mesh=Mesh(sp=2))),
    ("pp=2", Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="1f1b", microbatches=2))),
]
FOUR = [
    ("fsdp=2,tp=2", Plan(mesh=Mesh(fsdp=2, tp=2), rules=GPT_RULES)),
    ("dp=2,fsdp=2", Plan(mesh=Mesh(dp=2, fsdp=2))),  # HSDP
    ("pp=2,fsdp=2", Plan(mesh=Mesh(pp=2, fsdp=2), pipeline=Pipeline(schedule="gpipe", microbatches=2))),
    ("pp=2,dp=2", Plan(mesh=Mesh(pp=2, dp=2), pipeline=Pipeline(schedule="1f1b", microbatches=2))),
    ("pp=2,tp=2", Plan(mesh=Mesh(pp=2, tp=2), rules=GPT_RULES,
                       pipeline=Pipeline(split_points=["layers.2"], schedule="1f1b", microbatches=2))),
]


@pytest.mark.parametrize("plan", [p for _, p in TWO + FOUR], ids=[i for i, _ in TWO + FOUR])
def test_clipped_norm_and_gradients_equal_one_process(world, plan):
    _check(world, plan)


# -- gradient accumulation -------------------------------------------------------------------------
ACCUMULATE = [
    ("fsdp=2,tp=2", Plan(mesh=Mesh(fsdp=2, tp=2), rules=GPT_RULES)),
    ("dp=2", Plan(mesh=Mesh(dp=2))),  # DDP's composable replicate: its no_sync switch
    ("pp=2,fsdp=2", Plan(mesh=Mesh(pp=2, fsdp=2), pipeline=Pipeline(schedule="gpipe", microbatches=2))),
    ("pp=2", Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="1f1b", microbatches=2))),
    ("sp=2", Plan(mesh=Mesh(sp=2))),  # context parallel: sp joins the data-parallel reduction
]


@pytest.mark.parametrize("plan", [p for _, p in ACCUMULATE], ids=[i for i, _ in ACCUMULATE])
def test_accumulated_micro_batches_equal_one_step_on_the_whole_batch(world, plan):
    _check(world, plan, accumulate=2)  # each data rank's 4 (pp: 4 = 2 x 2 microbatches) samples in 2 parts


def _reductions(ctx, accumulate: int) -> dict[str, tuple[int, int]]:
    from shardkit.observe.comm import CommCounter

    model = sk.shard(build_gpt4(), ctx.plan, ctx)
    batch = ctx.shard_batch(*tokens(8))
    model.step(*batch, gpt_loss, accumulate=accumulate)  # lazy initialisation out of the count
    with CommCounter() as comm:
        model.step(*batch, gpt_loss, accumulate=accumulate)
    return comm.summary()


@pytest.mark.parametrize("plan, reduction, per_micro_batch", [
    (Plan(mesh=Mesh(fsdp=2, tp=2), rules=GPT_RULES), "reduce_scatter_tensor", "all_gather_into_tensor"),
    (Plan(mesh=Mesh(pp=2, dp=2), pipeline=Pipeline(schedule="1f1b", microbatches=2)), "all_reduce", "send"),
], ids=["fsdp2xtp2", "pp2xdp2"])
def test_accumulation_reduces_gradients_once(world, plan, reduction, per_micro_batch):
    once, twice = world(4).run(_reductions, 1, plan=plan)[0], world(4).run(_reductions, 2, plan=plan)[0]
    assert twice[per_micro_batch][0] == 2 * once[per_micro_batch][0]  # two forwards (or sends) ...
    assert twice[reduction] == once[reduction]  # ... one gradient reduction, of the same bytes


def test_clipping_counts_a_tied_parameter_once(world):
    """GPT-2 ties lm_head to wte: one parameter, one norm term (tensor parallel keeps the tie)."""
    _check(world, Plan(mesh=Mesh(tp=2), rules=GPT2_RULES), build=build_tiny_gpt2, loss_fn=hf_loss)


@pytest.mark.parametrize("plan, accumulate, norm_type", [
    (Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="1f1b", microbatches=2)), 1, 2.0),
    (Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="gpipe", microbatches=2)), 2, math.inf),
    (Plan(mesh=Mesh(pp=2, tp=2), rules=LLAMA_RULES, pipeline=Pipeline(microbatches=2)), 2, 2.0),
], ids=["pp2", "pp2-accumulate-inf", "pp2xtp2-accumulate"])
def test_a_parameter_tied_across_stages_is_counted_once_and_clipped_alike(world, plan, accumulate, norm_type):
    """The tied Llama's embedding (first stage) and LM head (last stage): one norm term, both copies
    holding the whole gradient, also accumulated over micro-steps."""
    _check(world, plan, build=build_llama_tied, loss_fn=hf_loss, accumulate=accumulate, norm_type=norm_type,
           max_norm=0.005)  # its 2-norm is about 0.06, its inf-norm about 0.02


def test_infinity_norm_over_pipeline_stages(world):
    _check(world, Plan(mesh=Mesh(pp=2, tp=2), rules=GPT_RULES,
                       pipeline=Pipeline(split_points=["layers.2"], schedule="1f1b", microbatches=2)),
           norm_type=math.inf)


def _refusals(ctx) -> list[str]:
    model = sk.shard(build_gpt4(), ctx.plan, ctx)
    inputs, targets = ctx.shard_batch(*tokens(8))
    messages = []
    for accumulate in (3, 0, 2):  # 3 and 0 refused before anything runs; 2 (parts of 2 samples) runs
        try:
            model.step(inputs, targets, gpt_loss, accumulate=accumulate)
        except sk.UsageError as error:
            messages.append(str(error))
    try:
        model.step(inputs, targets, gpt_loss)  # parts of 4 samples: torch's stages were built for 2
    except sk.UsageError as error:
        messages.append(str(error))
    return messages


def test_accumulate_refusals_name_the_values_that_work(world):
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="1f1b", microbatches=2))
    for messages in world(2).run(_refusals, plan=plan):
        assert len(messages) == 3
        assert "accumulate=3 does not split this rank's batch of 8 samples" in messages[0]
        assert "of a multiple of the pipeline's 2 microbatches; values that do: 1, 2, 4" in messages[0]
        assert "accumulate must be a positive integer" in messages[1] and "got 0" in messages[1]
        assert "parts of shape [8, 16] (accumulate=1)" in messages[2] and "[4, 16] by the first step" in messages[2]


def test_clip_arguments_are_checked():
    from shardkit.runtime.apply import ShardedModule
    from shardkit.runtime.parallelize import with_mixin

    with pytest.raises(sk.UsageError, match="model must be returned by sk.shard, got a Linear"):
        sk.clip_grad_norm_(torch.nn.Linear(2, 2), 1.0)
    model = with_mixin(torch.nn.Linear(2, 2), ShardedModule, "Sharded")
    model._sk_plan = Plan(mesh=Mesh(dp=4), replicas=sk.ReplicaGrouping(4, group_size=2))
    with pytest.raises(sk.UsageError, match=r"does not support plans with replica groups \(Plan\(replicas=...\)\)"):
        sk.clip_grad_norm_(model, 1.0)
    model._sk_plan = Plan(mesh=Mesh(dp=2))
    for max_norm, norm_type, message in [(0, 2.0, "max_norm must be a positive finite number, got 0"),
                                         (math.inf, 2.0, "got inf"), ("1", 2.0, "got '1'"),
                                         (1.0, -1, "norm_type must be a number p > 0"), (1.0, True, "got True")]:
        with pytest.raises(sk.UsageError, match=message):
            sk.clip_grad_norm_(model, max_norm, norm_type)
