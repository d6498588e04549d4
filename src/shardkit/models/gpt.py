"""A small decoder-only transformer (GPT) in plain PyTorch, and its tensor-parallel rules.

The reference model of demos, tests and benchmarks. Module names (what layout rules match):
``embed``, ``pos_embed``, ``layers.{i}.{norm1, attn.{q,k,v,o}_proj, norm2, mlp.{up,down}_proj}``,
``norm_f``, ``lm_head``. With ``GPTConfig(experts=E, top_k=k)`` every block's ``mlp`` is a
mixture of experts instead (:class:`MoE`: ``mlp.gate.weight`` and the stacked
``mlp.experts.{gate_up_proj, down_proj}``, in transformers' layout and interface, so expert
parallelism treats it and transformers' MoE models alike). Attention reshapes heads with ``-1``, so after column-parallel
q/k/v projections each tensor-parallel rank simply runs its own heads; it calls
``attn.attention_fn(q, k, v)`` (causal), an attribute context-parallel code can replace.
Decoding passes a :class:`KVCache` (``model(ids, cache=model.kv_cache())``); without one the
forward is unchanged. Under tensor parallel each rank's cache holds only its own heads.

>>> import torch
>>> model = build_tiny_gpt()
>>> model(torch.zeros(2, 8, dtype=torch.long)).shape
torch.Size([2, 8, 256])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..plan import LayoutMap
from .experts import local_experts_forward
from .routing import ONE_PROCESS, BatchTotal, WithAuxLoss, load_balancing_loss_func

INIT_STD = 0.02  # normal init of Linear and Embedding weights (GPT-2's choice)
BALANCES = ("none", "bias")  # GPTConfig.balance


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`GPT`; ``seq_len`` is the number of learned positions."""

    vocab: int = 256
    layers: int = 2
    dim: int = 64
    heads: int = 4
    seq_len: int = 32
    mlp_ratio: int = 4
    experts: int = 0  # 0: a dense MLP per block; E > 0: a mixture of E experts, top_k of them per token
    top_k: int = 2
    router_aux_loss_coef: float = 0.0  # > 0: Mixtral's load-balancing loss over every layer joins the backward
    balance: str = "none"  # "bias": DeepSeek-V3's auxiliary-loss-free balancing (a bias on the choice only)
    bias_update_rate: float = 1e-3  # the bias moves by this much per optimizer step (balance="bias")

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(f"GPTConfig: dim={self.dim} is not divisible by heads={self.heads}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"GPTConfig: top_k={self.top_k} must be between 1 and experts={self.experts}")
        if self.balance not in BALANCES:
            raise ValueError(f"GPTConfig: balance={self.balance!r} is not one of {list(BALANCES)}")
        if (self.router_aux_loss_coef or self.balance != "none") and not self.experts:
            raise ValueError("GPTConfig: router_aux_loss_coef and balance need experts > 0 (a router to balance)")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention over ``[batch, heads, seq, head_dim]`` tensors."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class LayerCache:
    """One attention layer's keys and values so far, ``[batch, heads, seq, head_dim]`` (empty at first)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """The number of positions held."""
        return 0 if self.keys is None else self.keys.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' ``k``/``v``; returns every position's keys and values."""
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values


class KVCache:
    """Keys and values of every layer for incremental decoding (one :class:`LayerCache` per layer).

    ``nbytes`` is what this process holds: after tensor parallel, its own heads only.

    >>> model = build_tiny_gpt()
    >>> cache = model.kv_cache()
    >>> _ = model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    >>> cache.length, cache.nbytes
    (5, 5120)
    """

    def __init__(self, layers: int):
        self.layers = [LayerCache() for _ in range(layers)]

    @property
    def length(self) -> int:
        """The number of positions held (the next token's position)."""
        return self.layers[0].length if self.layers else 0

    @property
    def nbytes(self) -> int:
        """Bytes of every cached key and value tensor."""
        return sum(t.nbytes for layer in self.layers for t in (layer.keys, layer.values) if t is not None)


def _after_past(past: int, seq: int, device: torch.device) -> torch.Tensor:
    """The causal mask of ``seq`` new queries over ``past + seq`` keys (query i sees keys ``<= past + i``)."""
    return torch.arange(past + seq, device=device)[None, :] <= (past + torch.arange(seq, device=device))[:, None]


class Attention(nn.Module):
    """Multi-head causal self-attention; heads are inferred from the projection width."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.dim // config.heads
        self.q_proj = nn.Linear(config.dim, config.dim)
        self.k_proj = nn.Linear(config.dim, config.dim)
        self.v_proj = nn.Linear(config.dim, config.dim)
        self.o_proj = nn.Linear(config.dim, config.dim)
        self.attention_fn = causal_attention

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        batch, seq = x.shape[:2]
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.update(k, v)
        if past:  # new queries after cached positions: SDPA's is_causal aligns top-left, so an explicit mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=_after_past(past, seq, x.device))
        else:
            out = self.attention_fn(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.dim, config.mlp_ratio * config.dim)
        self.down_proj = nn.Linear(config.mlp_ratio * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Router(nn.Module):
    """Mixtral's top-k router: softmax over ``weight [experts, dim]`` logits (in float32), the
    ``top_k`` largest kept and renormalised. ``forward(x [T, dim]) -> (logits, top_k_weights, top_k_index)``.

    With ``balance="bias"`` (DeepSeek-V3's auxiliary-loss-free balancing) the buffer ``expert_bias``
    is added to the probabilities for the choice only (the weights stay the chosen experts'
    probabilities), training forwards count the choices in ``expert_load``, and :meth:`update_bias`
    (after each optimizer step: :func:`~shardkit.models.routing.update_expert_biases`) moves the bias
    towards the experts chosen less than the mean."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.top_k = config.top_k
        self.weight = nn.Parameter(torch.empty(config.experts, config.dim))
        if config.balance == "bias":
            self.bias_update_rate = config.bias_update_rate
            self.register_buffer("expert_bias", torch.zeros(config.experts))
            self.register_buffer("expert_load", torch.zeros(config.experts), persistent=False)
            self.load_total: BatchTotal = ONE_PROCESS  # the whole batch's load: shardkit sums it over the data ranks

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = F.softmax(logits.float(), dim=-1)
        if hasattr(self, "expert_bias"):
            index = torch.topk(probs + self.expert_bias, self.top_k, dim=-1).indices
            weights = probs.gather(-1, index)
            if self.training and torch.is_grad_enabled():  # a training step's choices (not evaluation's)
                self.expert_load += torch.bincount(index.reshape(-1), minlength=self.expert_load.shape[0])
        else:
            weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(x.dtype), index

    @torch.no_grad()
    def update_bias(self) -> None:
        """``expert_bias += rate * sign(mean load - load)`` over the load since the last update (of the
        whole batch: ``load_total``), then the count starts again."""
        load = self.load_total(self.expert_load)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.expert_load.zero_()


class Experts(nn.Module):
    """``E`` SwiGLU experts stacked as transformers stacks them: ``gate_up_proj [E, 2 * ffn, dim]``
    (gate rows first), ``down_proj [E, dim, ffn]``; ``forward(hidden_states [T, dim], top_k_index
    [T, k], top_k_weights [T, k]) -> [T, dim]``, each token's experts' outputs weighted and summed.

    The one-process computation: tokens sorted by expert, one grouped product per projection
    (:func:`~shardkit.models.experts.local_experts_forward`, as transformers' ``grouped_mm``
    experts). Expert parallelism replaces this forward (:mod:`shardkit.runtime.expert_parallel`).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.num_experts = config.experts
        ffn = config.mlp_ratio * config.dim
        self.gate_up_proj = nn.Parameter(torch.empty(config.experts, 2 * ffn, config.dim))
        self.down_proj = nn.Parameter(torch.empty(config.experts, config.dim, ffn))
        self.act_fn = F.silu

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return local_experts_forward(self, hidden_states, top_k_index, top_k_weights)


class MoE(nn.Module):
    """A sparse MLP: ``gate`` (:class:`Router`) picks ``top_k`` of ``experts`` (:class:`Experts`) per token."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.keeps_logits = config.router_aux_loss_coef > 0
        self.router_logits: torch.Tensor | None = None  # a training forward's, for the auxiliary loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, index = self.gate(flat)
        if self.keeps_logits and self.training:
            self.router_logits = logits
        return self.experts(flat, index, weights).reshape(x.shape)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.dim)
        self.mlp = MoE(config) if config.experts else MLP(config)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cache)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only transformer: ``model(idx, positions=None, cache=None) -> logits [B, T, vocab]``.

    ``positions`` are the global positions of the ``T`` tokens (default ``arange(T)``, after the
    cached ones with a ``cache``); a sequence-parallel rank holding a slice of the sequence
    passes its own. ``cache`` (from :meth:`kv_cache`) keeps every layer's keys and values, so a
    decode step runs only the new tokens.

    With ``router_aux_loss_coef > 0`` a training forward computes Mixtral's load-balancing loss
    over every layer's router logits (:func:`~shardkit.models.routing.load_balancing_loss_func`),
    keeps its value as ``aux_loss`` (detached: no graph outlives the step) and adds ``coef * aux_loss``
    to the backward of whatever loss the logits feed (:class:`~shardkit.models.routing.WithAuxLoss`):
    the returned logits, and so the loss's value, are unchanged.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.pos_embed = nn.Embedding(config.seq_len, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm_f = nn.LayerNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab, bias=False)
        self.aux_loss: torch.Tensor | None = None  # the last training forward's load-balancing loss
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """Initialise one module's own weights (transformers' convention: ``model._init_weights(module)``)."""
        _init_weights(module)

    def kv_cache(self) -> KVCache:
        """An empty cache for ``forward(..., cache=)``."""
        return KVCache(self.config.layers)  # every layer's slot, also on a pipeline stage holding some of them

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        if positions is None:
            past = 0 if cache is None else cache.length
            positions = torch.arange(past, past + idx.shape[1], device=idx.device)
        x = self.embed(idx) + self.pos_embed(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x) if cache is None else layer(x, cache.layers[i])
        logits = self.lm_head(self.norm_f(x))
        if self.config.router_aux_loss_coef and self.training:
            aux_loss = load_balancing_loss_func(self._take_router_logits(), self.config.experts, self.config.top_k)
            logits = WithAuxLoss.apply(logits, self.config.router_aux_loss_coef * aux_loss)
            # the value only: kept with its graph, the model would hold the graph and the graph the model (through
            # FSDP2's hooks on it), a cycle through C++ the garbage collector never frees, meshes included
            self.aux_loss = aux_loss.detach()
        return logits

    def _take_router_logits(self) -> tuple[torch.Tensor, ...]:
        """Every MoE layer's router logits of this forward (each layer's reference dropped)."""
        found = []
        for layer in self.layers:
            found.append(layer.mlp.router_logits)
            layer.mlp.router_logits = None
        return tuple(found)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, Router):
        nn.init.normal_(module.weight, std=INIT_STD)
        for name in ("expert_bias", "expert_load"):
            if hasattr(module, name):
                nn.init.zeros_(getattr(module, name))
    if isinstance(module, Experts):
        nn.init.normal_(module.gate_up_proj, std=INIT_STD)
        nn.init.normal_(module.down_proj, std=INIT_STD)


#: Tensor-parallel rules (Megatron style): q/k/v and up_proj column-parallel, o/down_proj
#: row-parallel, lm_head column-parallel over the vocabulary; the rest replicated.
GPT_RULES = LayoutMap([
    (r"layers\.\d+\.attn\.[qkv]_proj\.weight", ("tp", None)),
    (r"layers\.\d+\.attn\.[qkv]_proj\.bias", ("tp",)),
    (r"layers\.\d+\.mlp\.up_proj\.weight", ("tp", None)),
    (r"layers\.\d+\.mlp\.up_proj\.bias", ("tp",)),
    (r"layers\.\d+\.(attn\.o_proj|mlp\.down_proj)\.weight", (None, "tp")),
    (r"lm_head\.weight", ("tp", None)),
    (r".*", None),
])


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: ``logits [B, T, V]``, ``targets [B, T]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tiny_config() -> GPTConfig:
    """2 layers, dim 64, 4 heads, 32 positions (about 135K parameters): tests."""
    return GPTConfig(vocab=256, layers=2, dim=64, heads=4, seq_len=32)


def small_config() -> GPTConfig:
    """4 layers, dim 128, 4 heads, 128 positions (about 875K parameters): the train demo."""
    return GPTConfig(vocab=256, layers=4, dim=128, heads=4, seq_len=128)


def tiny_moe_config() -> GPTConfig:
    """:func:`tiny_config` with a mixture of 4 experts (top 2) in every block: tests."""
    return GPTConfig(vocab=256, layers=2, dim=64, heads=4, seq_len=32, experts=4, top_k=2)


def build_tiny_gpt() -> GPT:
    """A fresh tiny GPT with seed 0 (top-level, so it pickles into worker processes)."""
    torch.manual_seed(0)
    return GPT(tiny_config())


def build_tiny_gpt_moe() -> GPT:
    """A fresh tiny mixture-of-experts GPT (:func:`tiny_moe_config`) with seed 0.

    >>> build_tiny_gpt_moe().layers[0].mlp.experts.gate_up_proj.shape
    torch.Size([4, 512, 64])
    """
    torch.manual_seed(0)
    return GPT(tiny_moe_config())


def build_small_gpt() -> GPT:
    """A fresh small GPT with seed 0."""
    torch.manual_seed(0)
    return GPT(small_config())
