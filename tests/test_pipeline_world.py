"""Every pipeline schedule, and pp composed with dp / fsdp / tp, proven equal to one process by sk.verify."""

from __future__ import annotations

import pytest
import torch
from model_zoo import (
    build_cohere,
    build_gemma,
    build_gemma2,
    build_gemma3_text,
    build_gemma_untied,
    build_gpt4,
    build_granite,
    build_llama_tied,
    build_llama_tied4,
    build_mistral_window,
    build_qwen2_window,
    tokens,
)
from scoped_net import build_scoped

import shardkit as sk
from shardkit.models.gpt import GPT, GPT_RULES, GPTConfig, gpt_loss
from shardkit.models.hf import LLAMA_RULES, build_tiny_llama, hf_loss
from shardkit.plan import Mesh, Pipeline, Plan

pytestmark = pytest.mark.world


def build_gpt8() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(layers=8, dim=32, heads=2, seq_len=16))


def check(build, plan: Plan, world, loss_fn=gpt_loss, batch=None) -> None:
    result = sk.verify(build, plan, batch or tokens(8), loss_fn=loss_fn, steps=2, world=world)
    assert result.ok, str(result)
    assert not result.problems


SCHEDULES = [("sequential", 1, 1), ("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved-1f1b", 4, 2),
             ("zero-bubble", 4, 1), ("zbv", 4, 2)]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize(("schedule", "microbatches", "virtual"), SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_every_schedule_matches_a_single_process(world, pp, schedule, microbatches, virtual):
    build = build_gpt8 if pp * virtual > 4 else build_gpt4
    plan = Plan(mesh=Mesh(pp=pp), pipeline=Pipeline(schedule=schedule, microbatches=microbatches,
                                                    virtual_stages=virtual))
    check(build, plan, world(pp))


@pytest.mark.parametrize("plan", [
    Plan(mesh=Mesh(pp=2, dp=2), pipeline=Pipeline(schedule="1f1b", microbatches=2, split="auto")),
    Plan(mesh=Mesh(pp=2, fsdp=2), pipeline=Pipeline(schedule="gpipe", microbatches=2)),
    Plan(mesh=Mesh(pp=2, tp=2), rules=GPT_RULES, pipeline=Pipeline(split_points=["layers.2"], schedule="1f1b",
                                                                   microbatches=2)),
], ids=["pp2xdp2-auto", "pp2xfsdp2", "pp2xtp2"])
def test_pipeline_composes_with_data_and_tensor_parallel(world, plan):
    check(build_gpt4, plan, world(4))


def test_hf_llama_pipeline_carries_hidden_states_and_recomputes_positions(world):
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="1f1b", microbatches=2))
    check(build_tiny_llama, plan, world(2), loss_fn=hf_loss)


def test_hf_llama_pipeline_with_tensor_parallel(world):
    plan = Plan(mesh=Mesh(pp=2, tp=2), rules=LLAMA_RULES, pipeline=Pipeline(schedule="gpipe", microbatches=2))
    check(build_tiny_llama, plan, world(4), loss_fn=hf_loss)


def _stage_params(ctx, plan):
    model = sk.shard(build_scoped(), plan, ctx)
    return model.local_stages, sorted(n for n, _ in model.named_parameters())


def test_scoped_model_runs_its_stages_on_their_devices(world):
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(split="scopes", schedule="gpipe", microbatches=2))
    check(build_scoped, plan, world(2))
    (stages0, names0), (stages1, names1) = world(2).run(_stage_params, plan, plan=plan)
    assert (stages0, stages1) == ([0], [1])
    assert {n.split(".")[0] for n in names0} == {"embed", "block1"}
    assert {n.split(".")[0] for n in names1} == {"block2", "head"}


def _evaluate_between_steps(ctx, batch, held_out):
    """Held-out loss, step, held-out loss, step, held-out loss (SGD): as one process would compute them."""
    model = sk.shard(build_gpt4(), ctx.plan, ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        losses.append(model.evaluate(*held_out, gpt_loss).item())
        optimizer.zero_grad()
        losses.append(model.step(*batch, gpt_loss).item())
        optimizer.step()
    return losses + [model.evaluate(*held_out, gpt_loss).item()]


@pytest.mark.parametrize(("schedule", "virtual"), [("1f1b", 1), ("zero-bubble", 1), ("zbv", 2)])
def test_evaluate_between_steps_equals_one_process(world, schedule, virtual):
    """model.evaluate runs forward only under every schedule (torch's schedule.eval fails on zero-bubble ones)
    and leaves training as it was."""
    batch, held_out = tokens(4), tokens(8, 16)
    held_out = (held_out[0].roll(1, 0), held_out[1].roll(1, 0))
    model, expected = build_gpt4(), []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        with torch.no_grad():
            expected.append(gpt_loss(model(held_out[0]), held_out[1]).item())
        optimizer.zero_grad()
        loss = gpt_loss(model(batch[0]), batch[1])
        loss.backward()
        expected.append(loss.item())
        optimizer.step()
    with torch.no_grad():
        expected.append(gpt_loss(model(held_out[0]), held_out[1]).item())
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule=schedule, microbatches=2, virtual_stages=virtual))
    for losses in world(2).run(_evaluate_between_steps, batch, held_out, plan=plan, timeout=300):
        assert losses == pytest.approx(expected, rel=1e-5)


def _generate_on_stages(ctx, build, prompt):
    return sk.generate(sk.shard(build(), ctx.plan, ctx), prompt, max_new_tokens=8)


@pytest.mark.parametrize("build", [build_mistral_window, build_qwen2_window], ids=["mistral", "qwen2-hybrid"])
def test_sliding_window_layers_keep_their_window_on_a_pipeline(world, build):
    """Each stage masks a layer as the model's own forward does (a sliding window of 4 on 16 tokens; Qwen2
    with one full and one windowed layer): training and generation equal one process."""
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2))
    check(build, plan, world(2), loss_fn=hf_loss, batch=tokens(4))
    prompt = tokens(2, 7)[0]
    model = build()
    model.generation_config.eos_token_id = None
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)
    for tokens_out in world(2).run(_generate_on_stages, build, prompt, plan=plan, timeout=120):
        assert torch.equal(tokens_out, expected)


def _extra_inputs(ctx):
    """A pipelined Llama given (ids, attention_mask): step and evaluate refuse on every rank (none waits)."""
    model = sk.shard(build_tiny_llama(), ctx.plan, ctx)
    ids, targets = tokens(4)
    messages = []
    for call in (model.step, model.evaluate):
        try:
            call((ids, torch.ones_like(ids)), targets, hf_loss)
        except sk.UsageError as exc:
            messages.append(str(exc))
    messages.append(model.evaluate([ids], targets, hf_loss).item())  # a list of one tensor is an input tuple
    return messages


def test_inputs_a_pipeline_cannot_carry_are_refused_on_every_rank(world):
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2))
    for *refusals, loss in world(2).run(_extra_inputs, plan=plan, timeout=120):
        assert len(refusals) == 2 and loss > 0
        for message in refusals:
            assert "takes 1 input tensor(s) (the token ids), but got 2: [4, 16] torch.int64, [4, 16]" in message


@pytest.mark.parametrize("build", [build_granite, build_gemma2, build_cohere, build_gemma_untied],
                         ids=["granite", "gemma2", "cohere", "gemma"])
def test_embedding_and_logit_scalings_of_the_model_forward_run_on_the_stages(world, build):
    """Granite's embedding multiplier and logits scaling, Gemma 2's final softcap, Cohere's logit scale: the
    pipeline's stages apply them as the model's forward does (they were left out: wrong loss, no error)."""
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2))
    check(build, plan, world(2), loss_fn=hf_loss, batch=tokens(4))


class _Gain(torch.nn.Module):
    def __init__(self, shift: float):
        super().__init__()
        self.g = torch.nn.Parameter(torch.linspace(0.5, 2.0, 8))
        self.b = torch.nn.Parameter(torch.full((8,), shift))

    def forward(self, x):
        return torch.tanh(x * self.g + self.b)  # these do not commute: the order changes the numbers


class _Gains(torch.nn.Module):
    """Registered a, b, c, d; runs d, c, b, a. Nothing to guess an input from: only an example input orders it."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = _Gain(-1.0), _Gain(0.5), _Gain(1.0), _Gain(2.0)

    def forward(self, x):
        return self.a(self.b(self.c(self.d(x))))


def build_gains() -> _Gains:
    return _Gains()


def _mse(output, target):
    return torch.nn.functional.mse_loss(output, target)


def test_a_chain_ordered_by_its_example_input_is_staged_so_in_the_workers(world):
    """sk.verify runs a model of no known family on a sample of its batch, and sk.shard hands example_inputs
    to the stages (it validated with them, then ordered the stages by a guess)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="gpipe", microbatches=2))
    result = sk.verify(build_gains, plan, (x, x.flip(0)), loss_fn=_mse, steps=2, world=world(2))
    assert result.ok, str(result)


# -- a parameter tied across stages: a copy on each, kept equal --------------------------------------
TIED = [
    ("llama pp=2 1f1b", build_llama_tied, Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="1f1b", microbatches=2))),
    ("gemma pp=2", build_gemma, Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2))),
    ("llama pp=2 interleaved", build_llama_tied4, Plan(mesh=Mesh(pp=2), pipeline=Pipeline(
        schedule="interleaved-1f1b", microbatches=2, virtual_stages=2))),
    ("llama pp=2 zbv (both ends on one device)", build_llama_tied4, Plan(mesh=Mesh(pp=2), pipeline=Pipeline(
        schedule="zbv", microbatches=2, virtual_stages=2))),
    ("llama pp=4 (the middle stages hold no copy)", build_llama_tied4, Plan(mesh=Mesh(pp=4), pipeline=Pipeline(
        schedule="1f1b", microbatches=4))),
    ("llama pp=2 x fsdp=2", build_llama_tied, Plan(mesh=Mesh(pp=2, fsdp=2), pipeline=Pipeline(
        schedule="gpipe", microbatches=2))),
    ("llama pp=2 x tp=2", build_llama_tied, Plan(mesh=Mesh(pp=2, tp=2), rules=LLAMA_RULES, pipeline=Pipeline(
        microbatches=2))),
]


@pytest.mark.parametrize("build, plan", [(b, p) for _, b, p in TIED], ids=[i for i, _, _ in TIED])
def test_an_embedding_tied_to_the_lm_head_trains_as_one_process(world, build, plan):
    """sk.verify compares both copies (first and last stage) with the one parameter of one process."""
    check(build, plan, world(plan.mesh.size), loss_fn=hf_loss, batch=tokens(8))


def _two_steps_without_zero_grad(ctx):
    from shardkit.runtime.apply import full_grads

    model = sk.shard(build_llama_tied(), ctx.plan, ctx)
    for half in (tokens(8)[0][:4], tokens(8)[0][4:]):
        model.step(*ctx.shard_batch(half, half.roll(-1, dims=1)), hf_loss)
    copies = model.tied_copies
    return {copies.get(n, n): g for n, g in full_grads(model).items()}


def test_tied_gradients_accumulated_over_steps_are_summed_once(world):
    """Gradients left to accumulate over two step() calls: each step adds only its own gain over the copies."""
    model = build_llama_tied()
    for half in (tokens(8)[0][:4], tokens(8)[0][4:]):
        hf_loss(model(half), half.roll(-1, dims=1)).backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2))
    first, last = world(2).run(_two_steps_without_zero_grad, plan=plan)
    assert torch.allclose(first["model.embed_tokens.weight"], expected["model.embed_tokens.weight"], atol=1e-6)
    assert torch.equal(first["model.embed_tokens.weight"], last["model.embed_tokens.weight"])


def _freeze_tie(ctx, everywhere: bool):
    model = sk.shard(build_llama_tied(), ctx.plan, ctx)
    for name, param in model.named_parameters():
        if name == "model.embed_tokens.weight" or (everywhere and name in model.tied_copies):
            param.requires_grad_(False)
    try:
        model.step(*ctx.shard_batch(*tokens(4)), hf_loss)
    except sk.UsageError as exc:
        return str(exc)
    return {name: param.grad for name, param in model.named_parameters()}


def test_a_tie_frozen_under_one_name_only_stops_every_stage_and_frozen_everywhere_stays_frozen(world):
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2))
    for message in world(2).run(_freeze_tie, False, plan=plan, timeout=120):
        assert "parameter " in message and "only 1 of the 2 pipeline devices holding a copy" in message
    first, last = world(2).run(_freeze_tie, True, plan=plan, timeout=120)
    assert first["model.embed_tokens.weight"] is None and last["lm_head.weight"] is None
    assert last["model.norm.weight"] is not None


def _generate_from_folder(ctx, folder, prompt, out):
    model = sk.shard(sk.meta_model(build_llama_tied), ctx.plan, ctx, weights=folder)
    sk.export_hf(out, model)
    return sk.generate(model, prompt, max_new_tokens=8, eos_token_id=None)


def test_a_tied_model_loaded_from_a_hf_folder_generates_under_a_pipeline(world, tmp_path):
    """transformers saves a tied weight once: the last stage's LM head gets the embedding's values, and
    sk.export_hf writes it once again."""
    from safetensors import safe_open

    model = build_llama_tied()
    model.save_pretrained(tmp_path / "in")
    prompt = tokens(2, 7)[0]
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2))
    for tokens_out in world(2).run(_generate_from_folder, tmp_path / "in", prompt, tmp_path / "out", plan=plan,
                                   timeout=120):
        assert torch.equal(tokens_out, expected)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as exported:
        assert "lm_head.weight" not in exported.keys()
        assert torch.equal(exported.get_tensor("model.embed_tokens.weight"), model.model.embed_tokens.weight)


def test_a_model_type_whose_stages_were_never_checked_is_proven_and_trains_as_one_process(world):
    """gemma3_text was refused by a list of 14 checked model types; sk.validate now proves its stages on a
    miniature of it (tests/test_pipeline_proof.py refuses models whose forward the stages do not compute)."""
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2))
    sk.validate(plan, sk.meta_model(build_gemma3_text), 2)
    check(build_gemma3_text, plan, world(2), loss_fn=hf_loss, batch=tokens(4))


def _pipeline_under_another_job_plan(ctx, plan: Plan):
    from shardkit.runtime.apply import full_grads

    model = sk.shard(build_llama_tied(), plan, ctx)  # the job's own plan (ctx.plan) has no 'pp'
    batch = tokens(4)[0]
    loss = model.step(batch, batch.roll(-1, dims=1), hf_loss)
    copies = model.tied_copies
    return loss, {copies.get(n, n): g for n, g in full_grads(model).items()}


def test_a_pipeline_takes_its_mesh_from_the_plan_it_applies_not_the_jobs(world):
    """sk.shard(model, Plan(pp=2, ...)) in a job launched with a plan without 'pp' (here dp=2): its stages,
    tied copies and loss use the pp group of the plan applied, and the step equals one process's."""
    model = build_llama_tied()
    batch = tokens(4)[0]
    loss = hf_loss(model(batch), batch.roll(-1, dims=1))
    loss.backward()
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2))
    for got, grads in world(2).run(_pipeline_under_another_job_plan, plan, plan=Plan(mesh=Mesh(dp=2))):
        assert torch.allclose(got, loss.detach(), atol=1e-6)
        for name, param in model.named_parameters():
            assert name not in grads or torch.allclose(grads[name], param.grad, atol=1e-6), name
        assert "model.embed_tokens.weight" in grads
