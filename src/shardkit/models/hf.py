"""HuggingFace ``transformers`` model families built from a config (nothing is downloaded).

transformers is optional: it is imported only when a builder runs, so the rule sets below
can be used (and plans validated against shapes) without it.

Rule sets, for the ``tp`` axis:

- :data:`LLAMA_RULES`: q/k/v/gate/up column-parallel, o/down row-parallel, ``lm_head``
  column-parallel over the vocabulary, ``embed_tokens`` vocab-parallel (rows split over
  ``tp``; torch's ``RowwiseParallel`` on an ``nn.Embedding``: each rank looks up the ids in
  its slice of the vocabulary and the partial embeddings are summed). At 70B scale the
  embedding is 1B parameters, so replicating it would cost every rank 4 GiB in fp32.
- :data:`GPT2_RULES`: GPT-2's ``Conv1D`` stores its weight as ``[in, out]`` (transposed
  against ``nn.Linear``), so column-parallel is ``(None, "tp")`` and row-parallel
  ``("tp", None)``. The fused ``c_attn`` is permuted so each rank holds whole heads (see :mod:`shardkit.families.hf`).
  ``lm_head`` is tied to ``wte`` (one parameter, listed once as ``transformer.wte.weight``)
  and stays replicated.

>>> model = build_tiny_llama()
>>> sum(p.numel() for p in model.parameters())
106816
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..plan import LayoutMap

#: Attention kernel of the tiny models: torch SDPA, deterministic on CPU and no
#: attention-probability tensor materialised.
ATTN_IMPLEMENTATION = "sdpa"

LLAMA_RULES = LayoutMap([  # exactly LayoutMap.from_hf(a Llama model): transformers' own plan, sorted
    (r"lm_head\.weight", ("tp", None)),
    (r"model\.embed_tokens\.weight", ("tp", None)),
    (r"model\.layers\.\d+\.mlp\.down_proj\.weight", (None, "tp")),
    (r"model\.layers\.\d+\.mlp\.gate_proj\.weight", ("tp", None)),
    (r"model\.layers\.\d+\.mlp\.up_proj\.weight", ("tp", None)),
    (r"model\.layers\.\d+\.self_attn\.k_proj\.weight", ("tp", None)),
    (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", (None, "tp")),
    (r"model\.layers\.\d+\.self_attn\.q_proj\.weight", ("tp", None)),
    (r"model\.layers\.\d+\.self_attn\.v_proj\.weight", ("tp", None)),
    (r".*", None),
])

GPT2_RULES = LayoutMap([
    (r"transformer\.h\.\d+\.(attn\.c_attn|mlp\.c_fc)\.weight", (None, "tp")),
    (r"transformer\.h\.\d+\.(attn\.c_attn|mlp\.c_fc)\.bias", ("tp",)),
    (r"transformer\.h\.\d+\.(attn|mlp)\.c_proj\.weight", ("tp", None)),
    (r".*", None),
])


def tiny_llama_config(**overrides: Any):
    """Llama with grouped-query attention: hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 256."""
    from transformers import LlamaConfig

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256, max_position_embeddings=128,
                 attn_implementation=ATTN_IMPLEMENTATION)
    return LlamaConfig(**{**sizes, **overrides})


def llama_70b_config():
    """The shapes of Llama-3 70B: hidden 8192, 80 layers, 64 heads, 8 kv heads, vocab 128256."""
    return tiny_llama_config(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                             num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                             max_position_embeddings=8192)


def tiny_gpt2_config(**overrides: Any):
    """GPT-2: n_embd 64, 2 layers, 4 heads, vocab 256, 128 positions, no dropout, tied lm_head."""
    from transformers import GPT2Config

    sizes = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0,
                 eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                 attn_implementation=ATTN_IMPLEMENTATION)
    return GPT2Config(**{**sizes, **overrides})


def tiny_mixtral_config(**overrides: Any):
    """Mixtral: hidden 64, 2 layers, 4 heads, 2 kv heads, 4 experts of width 128 (top 2), vocab 256."""
    from transformers import MixtralConfig

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                 max_position_embeddings=128, attn_implementation=ATTN_IMPLEMENTATION)
    return MixtralConfig(**{**sizes, **overrides})


def tiny_qwen2_moe_config(**overrides: Any):
    """Qwen2-MoE: hidden 64, 2 layers, 4 heads, 2 kv heads, 4 experts of width 64 (top 2, not
    renormalised) and a gated shared expert of width 128 in every layer, vocab 256."""
    from transformers import Qwen2MoeConfig

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                 num_experts=4, num_experts_per_tok=2, vocab_size=256, max_position_embeddings=128,
                 attn_implementation=ATTN_IMPLEMENTATION)
    return Qwen2MoeConfig(**{**sizes, **overrides})


def build_tiny_mixtral() -> nn.Module:
    """A fresh tiny Mixtral (seed 0); top-level so it pickles into worker processes."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(tiny_mixtral_config())


def build_tiny_qwen2_moe() -> nn.Module:
    """A fresh tiny Qwen2-MoE (seed 0); top-level so it pickles into worker processes."""
    from transformers import Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(tiny_qwen2_moe_config())


def build_llama(config) -> nn.Module:
    """``LlamaForCausalLM(config)`` seeded with 0."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def build_tiny_llama() -> nn.Module:
    """A fresh tiny Llama (seed 0); top-level so it pickles into worker processes."""
    return build_llama(tiny_llama_config())


def build_tiny_gpt2() -> nn.Module:
    """A fresh tiny GPT-2 (seed 0); top-level so it pickles into worker processes."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(tiny_gpt2_config())


def build_llama_70b() -> nn.Module:
    """Llama 70B on the meta device: shapes only, no memory (for explain / validate)."""
    with torch.device("meta"):
        return build_llama(llama_70b_config())


def hf_loss(output: Any, targets: torch.Tensor, aux_loss_coef: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of ``output.logits`` (or of ``output`` if it is a tensor) against ``targets``,
    plus ``aux_loss_coef * output.aux_loss`` when given (a MoE model's router loss, as transformers adds
    ``router_aux_loss_coef * aux_loss`` with labels: ``functools.partial(hf_loss, aux_loss_coef=...)``).

    ``targets`` are already the next tokens (no shift here), as for :func:`shardkit.models.gpt.gpt_loss`.
    """
    logits = output if isinstance(output, torch.Tensor) else output.logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss + aux_loss_coef * output.aux_loss if aux_loss_coef else loss
