"""What sk.validate accepts runs and equals one process (sk.verify, 2 steps, 2 processes), for models
nobody in shardkit wrote: transformers architectures from small configs, and hand-written ones with
shared blocks or unused parameters. The cases are the classes the last red team found broken."""

from __future__ import annotations

import pytest
from model_zoo import (
    MIXTRAL_ATTENTION_RULES,
    build_bert,
    build_falcon,
    build_gemma,
    build_gpt2,
    build_gptj,
    build_llama_tied,
    build_mistral,
    build_mixtral,
    build_neox,
    build_opt,
    build_phi3,
    build_qwen2,
    build_qwen3,
    build_shared_blocks,
    build_with_unused,
    fused_rules,
    loss,
    tokens,
)

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt
from shardkit.models.hf import GPT2_RULES, LLAMA_RULES
from shardkit.planner.meta import meta_model

OPT_RULES = sk.LayoutMap([(r".*\.(q_proj|k_proj|v_proj|fc1)\.weight", ("tp", None)),
                          (r".*\.(q_proj|k_proj|v_proj|fc1)\.bias", ("tp",)),
                          (r".*\.(out_proj|fc2)\.weight", (None, "tp")), (".*", None)])
TP2 = sk.Mesh(tp=2)
BF16 = sk.FSDPOptions(param_dtype="bfloat16", reduce_dtype="float32")


def _from_hf(build):
    return sk.LayoutMap.from_hf(meta_model(build))


def build_llama_first_layer_frozen():
    """A fine-tuning setup: the first block and the tied embedding frozen (AdamW must not decay them)."""
    model = build_llama_tied()
    for param in [*model.model.layers[0].parameters(), model.model.embed_tokens.weight]:
        param.requires_grad_(False)
    return model


CASES = {
    "frozen layer and tied embedding, fsdp=2": (build_llama_first_layer_frozen, lambda: sk.Plan(sk.Mesh(fsdp=2))),
    "frozen layer and tied embedding, pp=2": (build_llama_first_layer_frozen, lambda: sk.Plan(
        sk.Mesh(pp=2), pipeline=sk.Pipeline(microbatches=2))),
    "llama tied embedding, tp=2": (build_llama_tied, lambda: sk.Plan(TP2, LLAMA_RULES)),
    "gemma (tied) from_hf, tp=2": (build_gemma, lambda: sk.Plan(TP2, _from_hf(build_gemma))),
    "gpt2 wte split (tied lm_head), tp=2": (build_gpt2, lambda: sk.Plan(TP2, sk.LayoutMap(
        [(r"transformer\.wte\.weight", ("tp", None)), *GPT2_RULES.items()]))),
    "gpt2 mlp only, tp=2": (build_gpt2, lambda: sk.Plan(TP2, sk.LayoutMap(
        [(r".*mlp\.c_fc\.weight", (None, "tp")), (r".*mlp\.c_fc\.bias", ("tp",)),
         (r".*mlp\.c_proj\.weight", ("tp", None)), (".*", None)]))),
    "phi3 packed qkv/gate_up from_hf, tp=2": (build_phi3, lambda: sk.Plan(TP2, _from_hf(build_phi3))),
    "qwen2 (q/k/v biases) from_hf, tp=2": (build_qwen2, lambda: sk.Plan(TP2, _from_hf(build_qwen2))),
    "mistral from_hf, tp=2": (build_mistral, lambda: sk.Plan(TP2, _from_hf(build_mistral))),
    "qwen3 per-head q/k norms from_hf, tp=2": (build_qwen3, lambda: sk.Plan(TP2, _from_hf(build_qwen3))),
    "qwen3 per-head q/k norms, sequence parallel": (build_qwen3, lambda: sk.Plan(TP2, _from_hf(build_qwen3),
                                                                                  sequence_parallel=True)),
    "mixtral attention split, experts replicated, tp=2": (build_mixtral, lambda: sk.Plan(
        TP2, sk.LayoutMap(MIXTRAL_ATTENTION_RULES))),
    "mixtral pipeline, pp=2": (build_mixtral, lambda: sk.Plan(sk.Mesh(pp=2), pipeline=sk.Pipeline(microbatches=2))),
    "opt global head count, tp=2": (build_opt, lambda: sk.Plan(TP2, OPT_RULES)),
    "gpt sequence parallel, replicated head": (build_tiny_gpt, lambda: sk.Plan(TP2, sk.LayoutMap(
        [(p, lay) for p, lay in GPT_RULES.items() if not p.startswith("lm_head")]), sequence_parallel=True)),
    "blocks sharing a module, fsdp=2": (build_shared_blocks, lambda: sk.Plan(sk.Mesh(fsdp=2))),
    "unused parameter, dp=2": (build_with_unused, lambda: sk.Plan(sk.Mesh(dp=2))),
    "gpt bf16 mixed precision, tp only": (build_tiny_gpt, lambda: sk.Plan(TP2, GPT_RULES, fsdp=BF16)),
    "llama tied bf16, tp=2": (build_llama_tied, lambda: sk.Plan(TP2, LLAMA_RULES, fsdp=BF16)),
    "gpt bf16 mixed precision, pipeline only": (build_tiny_gpt, lambda: sk.Plan(
        sk.Mesh(pp=2), pipeline=sk.Pipeline(schedule="gpipe", microbatches=2), fsdp=BF16)),
    "gpt bf16 mixed precision, context parallel only": (build_tiny_gpt, lambda: sk.Plan(sk.Mesh(sp=2), fsdp=BF16)),
    "phi3 pipeline, pp=2": (build_phi3, lambda: sk.Plan(sk.Mesh(pp=2), pipeline=sk.Pipeline(microbatches=2))),
    "falcon (in-place residual on a row-parallel output), tp=2": (build_falcon, lambda: sk.Plan(TP2, sk.LayoutMap(
        fused_rules("query_key_value", "self_attention.dense", "dense_h_to_4h", "dense_4h_to_h", False, False)))),
    "gpt-neox (qkv packed head by head), tp=2": (build_neox, lambda: sk.Plan(TP2, sk.LayoutMap(
        fused_rules("query_key_value", "attention.dense", "dense_h_to_4h", "dense_4h_to_h")))),
    "gpt-j (num_attention_heads made local), tp=2": (build_gptj, lambda: sk.Plan(TP2, sk.LayoutMap(
        fused_rules("(q_proj|k_proj|v_proj)", "out_proj", "fc_in", "fc_out", qkv_bias=False)))),
    "bert (partners in different parents), tp=2": (build_bert, lambda: sk.Plan(TP2, sk.LayoutMap(
        fused_rules(r"self\.(query|key|value)", r"attention\.output\.dense", r"intermediate\.dense",
                    r"layer\.\d+\.output\.dense")))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_what_validate_accepts_equals_one_process(world, case):
    build, plan = CASES[case]
    result = sk.verify(build, plan(), tokens(), loss_fn=loss, steps=2, world=world(2))
    assert result.ok, result
    if plan().fsdp.mixed_precision:
        assert result.float32_gap is not None and result.float32_gap > 1e-4  # and bf16 really ran


def _rank_one_doubles(output, targets):
    """A wrong loss on purpose: rank 1 doubles its loss, so its gradients (its shards') are wrong."""
    import torch.distributed as dist

    return loss(output, targets) * (1.0 + (dist.is_initialized() and dist.get_rank() == 1))


def test_a_wrong_tensor_parallel_result_fails_under_mixed_precision_too(world):
    result = sk.verify(build_tiny_gpt, sk.Plan(TP2, GPT_RULES, fsdp=BF16), tokens(), loss_fn=_rank_one_doubles,
                       steps=1, world=world(2))
    assert not result.ok and "out of tolerance" in str(result)
