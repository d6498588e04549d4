"""Sequence parallelism: length validation, context parallel on models, and sk.verify of every form."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import build_falcon_one_norm

from shardkit.families import family_of
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt, gpt_loss
from shardkit.models.hf import LLAMA_RULES, build_tiny_llama, hf_loss
from shardkit.plan import Mesh, Plan, PlanError, UsageError
from shardkit.plan.sequence import check_sequence_length, required_multiple, sequence_problems
from shardkit.planner.model_rules import default_rules
from shardkit.runtime.context_parallel import enable_context_parallel
from shardkit.runtime.ring_attention import shard_sequence
from shardkit.runtime.verify import verify

TOL = 1e-5


# -- validation before launch (no processes) --------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(sp=st.sampled_from([1, 2, 4, 8]), tp=st.sampled_from([1, 2, 4]), megatron=st.booleans(),
       seq_len=st.integers(1, 512))
def test_sequence_problems_accept_exactly_the_splittable_lengths(sp, tp, megatron, seq_len):
    plan = Plan(mesh=Mesh(sp=sp, tp=tp), sequence_parallel=megatron)
    balanced = sp == 1 or seq_len % (2 * sp) == 0
    megatron_ok = not megatron or tp == 1 or (seq_len % sp == 0 and (seq_len // sp) % tp == 0)
    assert (sequence_problems(plan, seq_len) == []) == (balanced and megatron_ok)
    assert (seq_len % required_multiple(plan) == 0) == (balanced and megatron_ok)


@pytest.mark.parametrize("plan,seq_len,expected", [
    (Plan(mesh=Mesh(sp=2, fsdp=2)), 30, r"sequence length 30 .*'sp' \(size 2\).*multiple of 2 x sp = 4.*28, 32"),
    (Plan(mesh=Mesh(sp=4)), 20, r"multiple of 2 x sp = 8.*16, 24"),
    (Plan(mesh=Mesh(tp=4), sequence_parallel=True), 30, r"sequence_parallel=True over 'tp' \(size 4\).*tp = 4.*28, 32"),
    (Plan(mesh=Mesh(sp=2, tp=4), sequence_parallel=True), 36,
     r"sp x tp = 8 .*multiples of 8, nearest: 32, 40"),
])
def test_bad_sequence_lengths_are_rejected_with_the_valid_ones(plan, seq_len, expected):
    with pytest.raises(PlanError, match=expected):
        check_sequence_length(plan, seq_len)


def test_non_positive_sequence_length_is_a_problem():
    assert sequence_problems(Plan(mesh=Mesh(sp=2)), 0) == ["sequence length 0 must be a positive integer"]


# -- context parallel on models, by hand (shard, forward, backward, mean over sp) --------------
def _tokens(seq_len: int, batch: int = 2, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _single_process(build, loss_fn, inputs, targets):
    model = build()
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _context_parallel_by_hand(ctx, build, loss_fn, seq_len):
    inputs, targets = _tokens(seq_len)
    ref_loss, ref_grads = _single_process(build, loss_fn, inputs, targets)
    sp_mesh = ctx.mesh["sp"]
    sp_rank, sp = sp_mesh.get_local_rank(), sp_mesh.size()
    model = enable_context_parallel(build(), sp_mesh)
    loss = loss_fn(model(shard_sequence(inputs, sp_rank, sp)), shard_sequence(targets, sp_rank, sp))
    loss.backward()
    group = sp_mesh.get_group()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=group)
    worst = 0.0
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=group)
        worst = max(worst, (p.grad / sp - ref_grads[name]).abs().max().item())
    return abs(mean_loss.item() / sp - ref_loss), worst


@pytest.mark.parametrize("sp,build,loss_fn", [
    (2, build_tiny_gpt, gpt_loss),
    (4, build_tiny_llama, hf_loss),  # rotary on global positions, grouped-query attention
])
def test_context_parallel_model_equals_single_process(world, sp, build, loss_fn):
    results = world(sp).run(_context_parallel_by_hand, build, loss_fn, 32, plan=Plan(mesh=Mesh(sp=sp)))
    for rank, (loss_diff, grad_diff) in enumerate(results):
        assert loss_diff < TOL and grad_diff < TOL, f"rank {rank}: loss {loss_diff:.2e} grad {grad_diff:.2e}"


def _llama_rejects(ctx, kwargs_name):
    model = enable_context_parallel(build_tiny_llama(), ctx.mesh["sp"])
    inputs, targets = _tokens(16)
    local = shard_sequence(inputs, ctx.mesh["sp"].get_local_rank(), 2)
    extra = {"labels": local} if kwargs_name == "labels" else {"attention_mask": torch.ones_like(local).tril()}
    try:
        model(local, **extra)
    except PlanError as exc:
        return str(exc)
    return "accepted"


def _unsupported_model_error(ctx):
    try:
        enable_context_parallel(torch.nn.Linear(4, 4), ctx.mesh["sp"])
    except PlanError as exc:
        return str(exc)
    return "accepted"


def test_enable_context_parallel_rejects_models_it_cannot_position(world):
    with pytest.raises(UsageError, match="process group or a 1-D DeviceMesh"):  # a misused API, not a plan
        enable_context_parallel(torch.nn.Linear(4, 4), "sp")
    for text in world(2).run(_unsupported_model_error, plan=Plan(mesh=Mesh(sp=2))):
        assert "takes neither 'positions' nor 'position_ids'" in text


@pytest.mark.parametrize("kwargs_name,message", [("labels", "labels="), ("attention_mask", "without padding")])
def test_hf_context_parallel_rejects_labels_and_padding_masks(world, kwargs_name, message):
    assert all(message in text for text in world(2).run(_llama_rejects, kwargs_name, plan=Plan(mesh=Mesh(sp=2))))


def _plan_id(value) -> str:
    if not isinstance(value, Plan):
        return str(value)
    return ",".join(f"{a}={n}" for a, n in value.mesh.items()) + ("+megatron_sp" if value.sequence_parallel else "")


# -- sk.verify: every form and combination equals one process (loss, gradients, weights) ------
@pytest.mark.parametrize("plan", [
    Plan(mesh=Mesh(sp=2)),
    Plan(mesh=Mesh(sp=4)),
    Plan(mesh=Mesh(sp=2, fsdp=2)),
    Plan(mesh=Mesh(fsdp=2, sp=2)),
    Plan(mesh=Mesh(dp=2, sp=2)),
    Plan(mesh=Mesh(sp=2, tp=2), rules=GPT_RULES),
    Plan(mesh=Mesh(tp=2), rules=GPT_RULES, sequence_parallel=True),
    Plan(mesh=Mesh(fsdp=2, tp=2), rules=GPT_RULES, sequence_parallel=True),
], ids=_plan_id)
def test_verify_gpt_sequence_parallel(world, plan):
    result = verify(build_tiny_gpt, plan, _tokens(32, batch=4), loss_fn=gpt_loss, steps=2,
                    world=world(plan.mesh.size))
    assert result.ok, str(result)


@pytest.mark.parametrize("plan", [
    Plan(mesh=Mesh(sp=2, fsdp=2)),
    Plan(mesh=Mesh(sp=2, tp=2), rules=LLAMA_RULES),
    Plan(mesh=Mesh(tp=2), rules=LLAMA_RULES, sequence_parallel=True),
], ids=_plan_id)
def test_verify_llama_sequence_parallel(world, plan):
    result = verify(build_tiny_llama, plan, _tokens(32, batch=4), loss_fn=hf_loss, steps=2,
                    world=world(plan.mesh.size))
    assert result.ok, str(result)


@pytest.mark.parametrize("plan,seq_len", [
    (Plan(mesh=Mesh(sp=2, fsdp=2)), 30),
    (Plan(mesh=Mesh(sp=4)), 20),
    (Plan(mesh=Mesh(tp=2), rules=GPT_RULES, sequence_parallel=True), 31),
], ids=_plan_id)
def test_verify_rejects_bad_sequence_lengths_before_launch(plan, seq_len):
    with pytest.raises(PlanError, match=rf"sequence length {seq_len} "):
        verify(build_tiny_gpt, plan, _tokens(seq_len, batch=4), loss_fn=gpt_loss)


# -- Megatron SP without a data axis: the norms' Partial gradients reduced once, not by the optimizer --
def _partial_grads_job(ctx, batch):
    from torch.distributed.tensor import DTensor

    from shardkit.observe.comm import CommCounter
    from shardkit.runtime.apply import full_grads, shard
    from shardkit.runtime.clipping import grad_norm

    model = shard(build_tiny_gpt(), ctx.plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    found = {}
    for accumulate in (1, 2):
        opt.zero_grad()
        with CommCounter() as backward:
            model.step(*batch, gpt_loss, accumulate=accumulate)
        found[accumulate] = {
            "backward_all_reduces": backward.summary().get("all_reduce", (0, 0))[0],
            "partial": [n for n, p in model.named_parameters()
                        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)],
            "norm": grad_norm(model).item(), "grads": full_grads(model)}
    with CommCounter() as step:
        opt.step()
    found["optimizer_collectives"] = step.summary()
    return found


def test_sequence_parallel_without_data_axis_reduces_partial_grads_once(world):
    batch = _tokens(32, batch=4)
    reference = build_tiny_gpt()
    gpt_loss(reference(batch[0]), batch[1]).backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    plan = Plan(mesh=Mesh(tp=2), rules=GPT_RULES, sequence_parallel=True)
    for found in world(2).run(_partial_grads_job, batch, plan=plan):
        assert found["optimizer_collectives"] == {}
        for accumulate in (1, 2):
            got = found[accumulate]
            assert got["partial"] == [], f"accumulate={accumulate}: Partial gradients {got['partial']}"
            assert got["backward_all_reduces"] == 2, got  # the loss's mean and ONE for every norm gradient
            assert abs(got["norm"] - ref_norm) < 1e-4 * ref_norm
            for name, p in reference.named_parameters():
                assert torch.allclose(got["grads"][name], p.grad, atol=TOL), (accumulate, name)


# -- tensor parallel's column-parallel layers reading one tensor convert it once (Megatron's count) -----
def _collectives_job(ctx, batch):
    from shardkit.observe.comm import CommCounter
    from shardkit.runtime.apply import shard

    model = shard(build_tiny_llama(), ctx.plan)
    inputs, targets = ctx.shard_batch(*batch)
    with CommCounter() as forward:
        loss = hf_loss(model(inputs), targets)
    with CommCounter() as backward:
        loss.backward()
    return forward.summary(), backward.summary()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+megatron_sp"])
def test_the_layers_reading_one_tensor_share_its_gather_and_its_gradients_reduction(world, sequence_parallel):
    # q, k, v read one norm's output and gate, up another: 2 inputs a block (torch's styles converted per
    # layer: 5, so SP gathered and kept 5 whole-sequence inputs and the backward reduced 5 gradients)
    plan = Plan(mesh=Mesh(tp=2), rules=LLAMA_RULES, sequence_parallel=sequence_parallel)
    layers = build_tiny_llama().config.num_hidden_layers
    for forward, backward in world(2).run(_collectives_job, _tokens(32, batch=4), plan=plan):
        inputs = 2 * layers + 1  # and the head's
        if sequence_parallel:
            assert forward["all_gather_into_tensor"][0] == inputs + 1, forward  # and the logits'
            assert backward["reduce_scatter_tensor"][0] == inputs, backward
        else:
            assert backward["all_reduce"][0] == inputs, backward


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_falcon_whose_attention_and_mlp_read_one_norm_equals_one_process_under_megatron_sp(world, recompute):
    # the norm's output is read by column-parallel layers under two parents (the attention, the MLP)
    model = build_falcon_one_norm()
    plan = Plan(mesh=Mesh(tp=2), rules=default_rules(model, family_of(model)), sequence_parallel=True,
                recompute=recompute)
    result = verify(build_falcon_one_norm, plan, _tokens(32, batch=4), loss_fn=hf_loss, steps=2, world=world(2))
    assert result.ok, str(result)
