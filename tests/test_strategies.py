"""Every strategy and combination equals a single process (loss, gradients, weights; 3 AdamW steps)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt, gpt_loss
from shardkit.models.hf import GPT2_RULES, LLAMA_RULES, build_tiny_gpt2, build_tiny_llama, hf_loss
from shardkit.planner.validate import validate


def _batch(batch=8, seq=32, vocab=256):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


GPT_CASES = [
    ("dp=2", None), ("fsdp=2", None), ("tp=2", GPT_RULES),
    ("fsdp=4", None), ("tp=4", GPT_RULES), ("dp=2,tp=2", GPT_RULES), ("fsdp=2,tp=2", GPT_RULES),
    ("dp=2,fsdp=2", None), ("dp=2,fsdp=2,sp=2", None),  # HSDP with context parallel in the shard dim
]


@pytest.mark.parametrize("mesh, rules", GPT_CASES, ids=[c[0] for c in GPT_CASES])
def test_reference_gpt_matches_single_process(world, mesh, rules):
    plan = sk.Plan(mesh=sk.Mesh.parse(mesh), rules=rules)
    result = sk.verify(build_tiny_gpt, plan, _batch(), loss_fn=gpt_loss, steps=3, world=world(plan.mesh.size))
    assert result.ok, result
    assert len(result.steps) == 3 and result.losses[0] > result.losses[-1]


HF_CASES = [
    ("llama", build_tiny_llama, LLAMA_RULES, "fsdp=2"), ("llama", build_tiny_llama, LLAMA_RULES, "tp=2"),
    ("llama", build_tiny_llama, LLAMA_RULES, "fsdp=2,tp=2"),
    ("gpt2", build_tiny_gpt2, GPT2_RULES, "fsdp=2"), ("gpt2", build_tiny_gpt2, GPT2_RULES, "tp=2"),
    ("gpt2", build_tiny_gpt2, GPT2_RULES, "fsdp=2,tp=2"),
]


@pytest.mark.parametrize("family, build, rules, mesh", HF_CASES, ids=[f"{c[0]}-{c[3]}" for c in HF_CASES])
def test_huggingface_models_match_single_process(world, family, build, rules, mesh):
    mesh = sk.Mesh.parse(mesh)
    plan = sk.Plan(mesh=mesh, rules=rules if "tp" in mesh else None)
    result = sk.verify(build, plan, _batch(), loss_fn=hf_loss, steps=3, world=world(mesh.size))
    assert result.ok, result


def rank_dependent_loss(logits, targets):
    """A deliberately wrong loss under sharding: rank 1 scales its loss (and so its gradients)."""
    scale = 1.0 + (dist.is_initialized() and dist.get_rank() == 1)
    return gpt_loss(logits, targets) * scale


def test_verify_catches_a_wrong_gradient(world):
    result = sk.verify(build_tiny_gpt, sk.Plan(mesh=sk.Mesh(dp=2)), _batch(), loss_fn=rank_dependent_loss,
                       steps=1, world=world(2))
    assert not result.ok
    assert result.steps[0].grad > 1e-4 and "out of tolerance" in str(result)


def _shard_and_report(ctx):
    from shardkit.runtime.apply import full_state_dict

    model = sk.shard(build_tiny_gpt(), ctx.plan)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    loss = model.step(*ctx.shard_batch(*_batch()), gpt_loss)
    full = full_state_dict(model)
    return local, loss.item(), type(model).__name__, {k: tuple(v.shape) for k, v in full.items()}


def test_shard_keeps_names_splits_parameters_and_steps(world):
    plan = sk.Plan(mesh=sk.Mesh(fsdp=2, tp=2), rules=GPT_RULES)
    out = world(4).run(_shard_and_report, plan=plan)
    shapes = {n: tuple(p.shape) for n, p in build_tiny_gpt().named_parameters()}
    expected = 0  # tp splits by layout, then FSDP splits dim 0 of the tp-local shard in 2 (padding odd sizes)
    for p in validate(plan, shapes).layouts.params.values():
        local = p.local_shape(plan.mesh)
        expected += -(-local[0] // 2) * math.prod(local[1:])
    assert expected < sum(math.prod(s) for s in shapes.values()) / 2
    for local, _loss, cls, full in out:
        assert local == expected
        assert full == shapes and cls.startswith("Sharded")
    assert len({round(o[1], 6) for o in out}) == 1  # the same global loss on every rank


def test_fsdp_mixed_precision_options_take_effect(world):
    plan = sk.Plan(mesh=sk.Mesh(fsdp=2), fsdp=sk.FSDPOptions(reshard_after_forward=False, param_dtype="bfloat16",
                                                               reduce_dtype="float32"))
    result = sk.verify(build_tiny_gpt, plan, _batch(), loss_fn=gpt_loss, steps=2, world=world(2))
    assert result.ok, result  # against a single process computing in bf16 too
    assert result.float32_gap > 1e-4  # and visibly not fp32 arithmetic: the sharded run really computed in bf16
