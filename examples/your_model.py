"""Builders used by docs/your-model.md: your own model under shardkit.

Two kinds of model:

- transformers models built from a small config (nothing is downloaded): Qwen2, which has a
  tensor-parallel plan in transformers, and Phi-3 and GPT-2 as contrasts (packed projections;
  no plan at all);
- :class:`TinyLM`, a plain ``nn.Module`` causal LM written by hand, with the layout rules
  :data:`TINY_LM_RULES` that split it over a ``tp`` axis.

Every builder is a top-level function with no arguments that seeds ``torch.manual_seed(0)``,
so every process builds the same weights, and ``shardkit train --model
examples.your_model:build_qwen2`` can import it (run from the root of the checkout).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardkit as sk

VOCAB = 256  # shardkit train feeds bytes: token ids 0..255


# -- transformers models from a config ----------------------------------------------------------

def qwen2_config(**overrides: Any):
    """A tiny Qwen2: hidden 64, 2 layers, 4 query heads, 2 key/value heads, vocab 256, 128 positions."""
    from transformers import Qwen2Config

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128,
                 attn_implementation="sdpa")
    return Qwen2Config(**{**sizes, **overrides})


def build_qwen2() -> nn.Module:
    """``Qwen2ForCausalLM`` from :func:`qwen2_config`, seeded with 0."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(qwen2_config())


def build_qwen2_tied() -> nn.Module:
    """The same Qwen2 with ``lm_head`` tied to the input embedding (as the small Qwen2 checkpoints are)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(qwen2_config(tie_word_embeddings=True))


def build_phi3() -> nn.Module:
    """A tiny Phi-3: packed ``qkv_proj`` and ``gate_up_proj``; sizes as :func:`qwen2_config`."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa"))


def build_gpt2() -> nn.Module:
    """A tiny GPT-2 (n_embd 64, 2 layers, 4 heads): no tensor-parallel plan in transformers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"))


# -- a plain nn.Module ----------------------------------------------------------------------------

class Attention(nn.Module):
    """Causal self-attention. Heads are reshaped with ``-1``, so a rank holding some of the
    projections' output features runs its own heads with no change to this code."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """``down(gelu(up(x)))``."""

    def __init__(self, dim: int):
        super().__init__()
        self.up_proj = nn.Linear(dim, 4 * dim)
        self.down_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A causal LM over token ids: ``model(ids [batch, seq]) -> logits [batch, seq, vocab]``.

    It has no position embedding (causal attention alone orders the tokens), so nothing in it
    says how long a sequence may be: ``shardkit train`` then needs ``--seq-len``.
    """

    def __init__(self, vocab: int = VOCAB, dim: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_tiny_lm() -> TinyLM:
    """A fresh :class:`TinyLM` (dim 64, 4 heads, 2 blocks), seeded with 0."""
    torch.manual_seed(0)
    return TinyLM()


#: The layout rules of :class:`TinyLM` over ``tp`` (docs/your-model.md writes them step by step).
TINY_LM_RULES = sk.LayoutMap([
    (r"blocks\.\d+\.attn\.[qkv]_proj\.weight", ("tp", None)),
    (r"blocks\.\d+\.attn\.[qkv]_proj\.bias", ("tp",)),
    (r"blocks\.\d+\.attn\.o_proj\.weight", (None, "tp")),
    (r"blocks\.\d+\.mlp\.up_proj\.weight", ("tp", None)),
    (r"blocks\.\d+\.mlp\.up_proj\.bias", ("tp",)),
    (r"blocks\.\d+\.mlp\.down_proj\.weight", (None, "tp")),
    (r"head\.weight", ("tp", None)),
    (r".*", None),
])


# -- loss and data --------------------------------------------------------------------------------

def lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits (``output``, or ``output.logits`` for transformers models)
    against ``targets``, the next token of every position (already shifted)."""
    logits = output if isinstance(output, torch.Tensor) else output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def sample_batch(batch_size: int = 4, seq_len: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte ids ``(inputs, targets)``, each ``[batch_size, seq_len]``; targets are inputs shifted by one."""
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]
