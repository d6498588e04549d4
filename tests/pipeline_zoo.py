"""transformers causal LMs of model types shardkit's pipelines were never written for, built from
small configs with every kind of layer their architecture has (sliding and full attention, Mamba,
short convolutions, mixtures of experts), and models whose forward does something the stages
do not. Top-level builders, so they pickle into worker processes."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
#: model type -> the config fields beside SIZES; each has 4 layers (a pipeline of 2 stages holds 2 each).
CONFIGS = {
    "glm4": {},
    "nemotron": {},
    "starcoder2": {"sliding_window": 4},
    "gemma3_text": {"head_dim": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2},
    "olmo3": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2},
    "exaone4": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2},
    "smollm3": {"no_rope_layers": [1, 0, 1, 0]},
    "qwen3_moe": {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                  "mlp_only_layers": [0]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "jamba": {"num_experts": 4, "num_experts_per_tok": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
              "expert_layer_period": 2, "expert_layer_offset": 0},
    "lfm2": {"layer_types": ["conv", "full_attention"] * 2},
    "apertus": {},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "falcon_h1": {"mamba_n_heads": 4, "mamba_d_ssm": 64, "mamba_d_head": 16, "mamba_d_state": 16,
                  "mamba_chunk_size": 16, "lm_head_multiplier": 0.5, "embedding_multiplier": 2.0},
    "phi3": {},
}


def build(model_type: str) -> torch.nn.Module:
    """A 4-layer model of ``model_type`` (sdpa attention where it has one, seeded)."""
    config = AutoConfig.for_model(model_type, **SIZES, num_hidden_layers=4, **CONFIGS[model_type])
    config._attn_implementation = "eager" if model_type == "gpt_oss" else "sdpa"  # GPT-OSS has no sdpa
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def build_glm4():
    return build("glm4")


def build_starcoder2():
    return build("starcoder2")


def build_gemma3_text():
    return build("gemma3_text")


def build_jamba():
    return build("jamba")


def build_gpt_oss():
    return build("gpt_oss")


def build_qwen3_moe():
    return build("qwen3_moe")


def build_falcon_h1():
    return build("falcon_h1")


class DoubledLlama(LlamaForCausalLM):
    """A Llama (model_type 'llama') whose forward doubles the logits, which no stage does."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


class HalfGradientLlama(LlamaForCausalLM):
    """A Llama whose forward gives the same logits with half their gradient (a straight-through scaling)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits.detach() + (out.logits - out.logits.detach()) * 0.5
        return out


def _llama_config() -> LlamaConfig:
    return LlamaConfig(**SIZES, num_hidden_layers=4)


def build_doubled_llama():
    torch.manual_seed(0)
    return DoubledLlama(_llama_config())


def build_half_gradient_llama():
    torch.manual_seed(0)
    return HalfGradientLlama(_llama_config())
