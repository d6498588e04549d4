"""Pipelines of transformers models shardkit's stages were never written for, proven on a miniature by
sk.validate, then checked here against one process by sk.verify (training) and transformers' own
generate (decoding); and the pipeline runtime's own parts: torch's stage subclassed, not patched,
and hidden states sent in batches of point-to-point operations only."""

from __future__ import annotations

import pytest
import torch
from model_zoo import build_gpt4, tokens
from pipeline_zoo import (
    build_falcon_h1,
    build_gemma3_text,
    build_glm4,
    build_gpt_oss,
    build_jamba,
    build_qwen3_moe,
    build_starcoder2,
)

import shardkit as sk
from shardkit.models.gpt import gpt_loss
from shardkit.models.hf import hf_loss
from shardkit.plan import Mesh, Pipeline, Plan

pytestmark = pytest.mark.world

PP2 = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="1f1b", microbatches=2))


@pytest.mark.parametrize("build", [build_glm4, build_starcoder2, build_gemma3_text, build_jamba, build_gpt_oss,
                                   build_qwen3_moe, build_falcon_h1],
                         ids=["glm4", "starcoder2", "gemma3_text", "jamba", "gpt_oss", "qwen3_moe", "falcon_h1"])
def test_a_proven_model_trains_on_two_stages_as_one_process(world, build):
    result = sk.verify(build, PP2, tokens(4), loss_fn=hf_loss, steps=2, world=world(2))
    assert result.ok, str(result)
    assert not result.problems


def _generate(ctx, build, prompt):
    return sk.generate(sk.shard(build(), ctx.plan, ctx), prompt, max_new_tokens=6, eos_token_id=None)


@pytest.mark.parametrize("build", [build_gemma3_text, build_jamba], ids=["gemma3_text", "jamba"])
def test_a_proven_model_generates_on_two_stages_as_transformers_does(world, build):
    """Gemma 3 (windowed and full layers, a rotary embedding per kind) and Jamba (Mamba layers' own cache)."""
    prompt = tokens(2, 7)[0]
    model = build()
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    for out in world(2).run(_generate, build, prompt, plan=PP2, timeout=180):
        assert torch.equal(out, expected)


def _runtime_parts(ctx):
    """The stage objects' classes and patched attributes; a step; then an evaluation and a generation (the
    stages' outputs sent by shardkit) with torch's blocking send and recv taken away: every exchange must be
    posted with batch_isend_irecv. (torch's own stages vote on their shapes with blocking sends at their
    first step, torch 2.13, so the step runs before.)"""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    model = sk.shard(build_gpt4(), ctx.plan, ctx)
    stages = model._sk_runtime.stages
    found = [(isinstance(s, PipelineStage), sorted(k for k in vars(s) if k.endswith("_one_chunk"))) for s in stages]
    batch = tokens(4)
    loss = model.step(*batch, gpt_loss).item()

    def refuse(*args, **kwargs):
        raise AssertionError("a blocking dist.send/dist.recv: sends and receives must be posted in batches")

    send, recv = dist.send, dist.recv
    dist.send, dist.recv = refuse, refuse
    try:
        held_out = model.evaluate(*batch, gpt_loss).item()
        out = sk.generate(model, batch[0][:1, :4], max_new_tokens=3)
    finally:
        dist.send, dist.recv = send, recv
    return found, loss, held_out, out.shape


def test_the_stages_are_subclassed_and_every_exchange_is_batched(world):
    for found, loss, held_out, shape in world(2).run(_runtime_parts, plan=PP2, timeout=180):
        assert found == [(True, [])]  # torch's PipelineStage, no method replaced on the instance
        assert loss > 0 and held_out > 0 and tuple(shape) == (1, 7)
