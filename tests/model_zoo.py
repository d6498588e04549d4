"""Models nobody in shardkit wrote, built from small configs (transformers) or by hand, for the
validate and verify tests. Top-level builders, so they pickle into worker processes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ATTN = "sdpa"


def _seeded(build):
    torch.manual_seed(0)
    return build()


def build_gpt4():
    """shardkit's reference GPT with 4 layers (pipelines of up to 4 stages), dim 32, 16 positions."""
    from shardkit.models.gpt import GPT, GPTConfig

    return _seeded(lambda: GPT(GPTConfig(layers=4, dim=32, heads=2, seq_len=16)))


def build_llama_tied():
    """Llama whose lm_head is the embedding (tie_word_embeddings=True)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _seeded(lambda: LlamaForCausalLM(LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, tie_word_embeddings=True, attn_implementation=ATTN)))


def build_llama_tied4():
    """The tied Llama with four layers (pipelines of up to four stages)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _seeded(lambda: LlamaForCausalLM(LlamaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, tie_word_embeddings=True, attn_implementation=ATTN)))


def build_llama_untied():
    """Llama with its own lm_head and four layers (pipelines of up to four stages)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _seeded(lambda: LlamaForCausalLM(LlamaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation=ATTN)))


def build_phi3():
    """Phi-3: packed qkv_proj (sliced with global offsets) and gate_up_proj (chunked in two)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return _seeded(lambda: Phi3ForCausalLM(Phi3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, pad_token_id=0, attn_implementation=ATTN)))


def build_qwen2():
    """Qwen2: biases on q/k/v."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _seeded(lambda: Qwen2ForCausalLM(Qwen2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, attn_implementation=ATTN)))


def build_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return _seeded(lambda: MistralForCausalLM(MistralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, attn_implementation=ATTN)))


def build_mixtral():
    """Mixtral: a mixture of experts (3-D expert weights, data-dependent routing) after each attention."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return _seeded(lambda: MixtralForCausalLM(MixtralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=256, max_position_embeddings=64,
        attn_implementation=ATTN)))


#: Mixtral's attention split over tp, its experts replicated (what infer_tp_rules' refusal advises).
MIXTRAL_ATTENTION_RULES = [(r".*self_attn\.(q_proj|k_proj|v_proj)\.weight", ("tp", None)),
                           (r".*self_attn\.o_proj\.weight", (None, "tp")), (".*", None)]


def build_mistral_window():
    """Mistral with a sliding window of 4 positions (its forward masks every layer with it)."""
    from transformers import MistralConfig, MistralForCausalLM

    return _seeded(lambda: MistralForCausalLM(MistralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, sliding_window=4, attn_implementation=ATTN)))


def build_qwen2_window():
    """Qwen2 with layer 0 full and layer 1 on a sliding window of 4 (``config.layer_types``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _seeded(lambda: Qwen2ForCausalLM(Qwen2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        attn_implementation=ATTN)))


def build_qwen3():
    """Qwen 3: per-head q_norm/k_norm inside the attention (replicated weights on each rank's heads)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _seeded(lambda: Qwen3ForCausalLM(Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        head_dim=16, vocab_size=256, max_position_embeddings=64, initializer_range=0.3, attn_implementation=ATTN)))


def build_granite():
    """Granite: its forward scales the embeddings (embedding_multiplier) and divides the logits (logits_scaling)."""
    from transformers import GraniteConfig, GraniteForCausalLM

    return _seeded(lambda: GraniteForCausalLM(GraniteConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, embedding_multiplier=3.0, logits_scaling=2.0,
        residual_multiplier=0.5, attention_multiplier=0.3, initializer_range=0.3, attn_implementation=ATTN)))


def build_gemma2():
    """Gemma 2, untied: sliding-window layers and a final logit softcap in its forward."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _seeded(lambda: Gemma2ForCausalLM(Gemma2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        head_dim=16, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False, sliding_window=4,
        final_logit_softcapping=5.0, attn_logit_softcapping=10.0, initializer_range=0.3,
        attn_implementation="eager")))


def build_cohere():
    """Cohere, untied: its forward multiplies the logits by logit_scale."""
    from transformers import CohereConfig, CohereForCausalLM

    return _seeded(lambda: CohereForCausalLM(CohereConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, logit_scale=0.5, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, initializer_range=0.3, attn_implementation=ATTN)))


def build_gemma_untied():
    """Gemma with its own lm_head: its embedding module scales by sqrt(hidden)."""
    from transformers import GemmaConfig, GemmaForCausalLM

    return _seeded(lambda: GemmaForCausalLM(GemmaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        head_dim=16, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.3,
        attn_implementation=ATTN)))


def build_gemma3_text():
    """Gemma 3 text, untied: a model type whose pipeline stages shardkit has not checked."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _seeded(lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        head_dim=16, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False,
        attn_implementation="eager")))


def build_gemma():
    """Gemma: tied embeddings by default, explicit head_dim."""
    from transformers import GemmaConfig, GemmaForCausalLM

    return _seeded(lambda: GemmaForCausalLM(GemmaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        head_dim=16, vocab_size=256, max_position_embeddings=64, attn_implementation=ATTN)))


def build_opt():
    """OPT: attention reshapes with ``self.num_heads`` (a global count) and a -1 sequence dim."""
    from transformers import OPTConfig, OPTForCausalLM

    return _seeded(lambda: OPTForCausalLM(OPTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, vocab_size=256,
        word_embed_proj_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        attn_implementation=ATTN)))


def build_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return _seeded(lambda: GPT2LMHeadModel(GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation=ATTN)))


def build_falcon():
    """Falcon: grouped fused query_key_value, and ``mlp_output += attention_output`` in place."""
    from transformers import FalconConfig, FalconForCausalLM

    return _seeded(lambda: FalconForCausalLM(FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
        vocab_size=256, attention_dropout=0.0, hidden_dropout=0.0)))


def build_falcon_one_norm():
    """Falcon with ``parallel_attn`` and one norm: its output is read by the attention's and the MLP's
    column-parallel layers, under two parents (each converts it: no scope spans them)."""
    from transformers import FalconConfig, FalconForCausalLM

    return _seeded(lambda: FalconForCausalLM(FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256, parallel_attn=True,
        new_decoder_architecture=False, multi_query=False, attention_dropout=0.0, hidden_dropout=0.0,
        attn_implementation=ATTN)))


def build_neox():
    """GPT-NeoX: fused query_key_value packed head by head ([q k v] per head): a plain split is right."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return _seeded(lambda: GPTNeoXForCausalLM(GPTNeoXConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
        max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, attn_implementation=ATTN)))


def build_gptj():
    """GPT-J: splits heads with ``self.num_attention_heads``."""
    from transformers import GPTJConfig, GPTJForCausalLM

    return _seeded(lambda: GPTJForCausalLM(GPTJConfig(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, rotary_dim=8, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")))


def build_bert():
    """BERT (masked LM): column- and row-parallel partners live in different parent modules."""
    from transformers import BertConfig, BertForMaskedLM

    return _seeded(lambda: BertForMaskedLM(BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))


def build_bloom():
    """Bloom: ALiBi biases built for every head of the whole model, outside the attention."""
    from transformers import BloomConfig, BloomForCausalLM

    return _seeded(lambda: BloomForCausalLM(BloomConfig(
        hidden_size=64, n_layer=2, n_head=4, vocab_size=256, hidden_dropout=0.0, attention_dropout=0.0)))


COL, ROW = ("tp", None), (None, "tp")


def fused_rules(qkv: str, out: str, up: str, down: str, qkv_bias: bool = True, up_bias: bool = True) -> list:
    """Megatron rules for models with a fused qkv projection (or separate q/k/v named in ``qkv``)."""
    rules = [(rf".*\.{qkv}\.weight", COL), (rf".*\.{out}\.weight", ROW), (rf".*\.{up}\.weight", COL),
             (rf".*\.{down}\.weight", ROW)]
    rules += [(rf".*\.{qkv}\.bias", ("tp",))] * qkv_bias + [(rf".*\.{up}\.bias", ("tp",))] * up_bias
    return [*rules, (".*", None)]


def build_llama_dropout():
    """Llama with attention dropout (context parallel cannot run it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _seeded(lambda: LlamaForCausalLM(LlamaConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, attention_dropout=0.1, attn_implementation=ATTN)))


class SharedBlocks(nn.Module):
    """Two blocks that use one and the same Linear (ALBERT-style weight sharing)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        common = nn.Linear(32, 32)
        self.layers = nn.ModuleList(nn.Sequential(common, nn.GELU(), nn.Linear(32, 32)) for _ in range(2))
        self.head = nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def build_shared_blocks() -> SharedBlocks:
    return _seeded(SharedBlocks)


class WithUnused(nn.Module):
    """A model with a parameter its forward never uses (DDP's reducer fails on it)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.spare = nn.Linear(32, 32)
        self.head = nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def build_with_unused() -> WithUnused:
    return _seeded(WithUnused)


class GlobalHeadsAttention(nn.Module):
    """Attention that reshapes with a head count held under a name no family knows."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.n_query_groups, self.width = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_query_groups, self.width).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class GlobalHeadsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.attn = GlobalHeadsAttention()
        self.head = nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.embed(x)))


def build_global_heads() -> GlobalHeadsNet:
    return _seeded(GlobalHeadsNet)


def loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (or ``output.logits``)."""
    logits = output if isinstance(output, torch.Tensor) else output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tokens(batch: int = 4, seq: int = 16, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


# -- ops that compute across the features a column layer would split (tests/test_tp_infer.py) ----------
def _mix(kind: str, h: torch.Tensor) -> torch.Tensor:
    """An op over the whole last dim of ``h``: each tensor-parallel rank would see only its part."""
    if kind == "layer_norm":
        return F.layer_norm(h, h.shape[-1:])  # no weight: no parameter to notice
    if kind == "rms_norm":
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return F.softmax(h, dim=-1)


class MixedBlock(nn.Module):
    """``x + down_proj(gelu(mix(up_proj(x))))``; with ``mlp``, then ``x + fc2(gelu(fc1(x)))``."""

    def __init__(self, kind: str, mlp: bool, d: int = 64):
        super().__init__()
        self.kind = kind
        self.up_proj, self.down_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.fc1, self.fc2 = (nn.Linear(d, 2 * d), nn.Linear(2 * d, d)) if mlp else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down_proj(F.gelu(_mix(self.kind, self.up_proj(x))))
        return x if self.fc1 is None else x + self.fc2(F.gelu(self.fc1(x)))


class HeadsBlock(nn.Module):
    """Pre-norm causal attention over ``heads`` heads (one: no head reshape, SDPA over the whole
    width); with ``mlp``, then a pre-norm MLP."""

    def __init__(self, heads: int, mlp: bool, d: int = 64):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.norm = nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.mlp_norm = nn.LayerNorm(d) if mlp else None
        self.fc1, self.fc2 = (nn.Linear(d, 2 * d), nn.Linear(2 * d, d)) if mlp else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = (p(h) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.heads > 1:  # the head count read from the width (-1): a shard has its heads
            q, k, v = (s.view(*x.shape[:2], -1, self.head_dim).transpose(1, 2) for s in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.heads > 1:
            out = out.transpose(1, 2).flatten(2)
        x = x + self.o_proj(out)
        return x if self.fc1 is None else x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


class BlocksLM(nn.Module):
    """Token and position embeddings (256 x 64, 32 x 64), two blocks, a vocabulary head."""

    def __init__(self, make_block):
        super().__init__()
        self.embed, self.pos_embed = nn.Embedding(256, 64), nn.Embedding(32, 64)
        self.blocks = nn.ModuleList([make_block(), make_block()])
        self.head = nn.Linear(64, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos_embed(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_layer_norm_between() -> BlocksLM:
    """The red team's model: a weightless ``F.layer_norm`` between up_proj and down_proj."""
    return _seeded(lambda: BlocksLM(lambda: MixedBlock("layer_norm", mlp=False)))


def build_one_head_attention() -> BlocksLM:
    """The red team's model: SDPA on [B, T, 64] q/k/v (one head over the whole width)."""
    return _seeded(lambda: BlocksLM(lambda: HeadsBlock(1, mlp=False)))


def build_layer_norm_between_mlp() -> BlocksLM:
    return _seeded(lambda: BlocksLM(lambda: MixedBlock("layer_norm", mlp=True)))


def build_rms_norm_between_mlp() -> BlocksLM:
    return _seeded(lambda: BlocksLM(lambda: MixedBlock("rms_norm", mlp=True)))


def build_softmax_between_mlp() -> BlocksLM:
    return _seeded(lambda: BlocksLM(lambda: MixedBlock("softmax", mlp=True)))


def build_one_head_attention_mlp() -> BlocksLM:
    return _seeded(lambda: BlocksLM(lambda: HeadsBlock(1, mlp=True)))


def build_two_head_attention_mlp() -> BlocksLM:
    return _seeded(lambda: BlocksLM(lambda: HeadsBlock(2, mlp=True)))


#: The experts' entries of the tensor-parallel plans of Mixtral, Qwen2-MoE and Qwen3-MoE in
#: transformers 5.24 (5.25 dropped them: its experts are split only by its expert-parallel plan;
#: Llama-4's plan still has such entries). Tests of how ``LayoutMap.from_hf`` reads them set them on
#: the model themselves, so that they test shardkit whatever transformers is installed.
EXPERT_TP_ENTRIES = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                     "model.layers.*.mlp.experts.down_proj": "rowwise",
                     "model.layers.*.mlp.experts": "moe_tp_experts"}


def with_expert_tp_entries(model):
    """``model`` (a transformers MoE) with :data:`EXPERT_TP_ENTRIES` in its ``tp_plan``."""
    model.tp_plan = {**model.tp_plan, **EXPERT_TP_ENTRIES}
    return model
