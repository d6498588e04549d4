"""A miniature of a transformers model: its own class built from its config, narrow and short.

``sk.validate`` proves a pipeline's stages on a miniature of the user's model
(:mod:`shardkit.planner.pipeline_proof`) rather than trusting a list of model types. The
miniature keeps the architecture (the class, its forward, every kind of decoder layer the
real model has) and shrinks what only sets sizes, so it builds and runs in milliseconds
whatever the real model's size:

- widths: 4 attention heads of 16 dims (1 or 2 key-value heads where the model groups them,
  4 where it does not), hidden size 64, feed-forward 128, a vocabulary of 256; at most 4
  experts with 2 per token; low-rank and expert widths likewise;
- a sliding window of 4 positions (shorter than the proof's sequence, so the windowed masks
  differ from the causal ones);
- layers: the shortest prefix of the real model's layers that holds every kind of layer it
  has (what the layer is made of, its attention kind, and its entries in the config's
  per-layer lists), at least two. A config whose per-layer pattern follows from a period
  (Jamba's attention every 8 layers) keeps it, so the prefix has the same kinds; the
  miniature's layers are checked against the real ones (:func:`layer_kinds`).

Weights are drawn from a fixed seed, ``N(0, 1/fan_in)`` for matrices (so logits are of
order one and scalings of them show), the model's own initialisation for the rest.

>>> from shardkit.models.hf import build_tiny_llama
>>> mini = build_miniature(build_tiny_llama())
>>> mini.model.config.num_hidden_layers, mini.model.config.hidden_size
(2, 64)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: Config fields set to at most these values (sizes only: the architecture stays).
WIDTHS = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 32, "ffn_hidden_size": 128, "head_dim": 16, "kv_lora_rank": 16,
          "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": 256,
          "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
          "num_experts_per_token": 2, "n_group": 1, "topk_group": 1, "num_attention_heads": 4}
#: Sizes of state-space and linear-attention layers, tried first (with :data:`WIDTHS`); a config
#: they do not fit (a product they break) is shrunk with :data:`WIDTHS` alone.
MIXER_WIDTHS = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 16, "mamba_num_heads": 4,
                "mamba_head_dim": 16, "ssm_state_size": 16, "mamba_chunk_size": 16, "chunk_size": 16,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16, "linear_num_heads": 4, "linear_head_dim": 16,
                "moe_shared_expert_intermediate_size": 32,
                "shared_intermediate_size": 32, "intermediate_size_mlp": 128, "moe_num_experts": 4, "n_groups": 1,
                "mamba_n_groups": 1, "mamba_ngroups": 1}
#: The shrinkings tried in order: the first whose miniature builds and runs is used. The last keeps
#: every width but the vocabulary's, for a config whose sizes depend on each other in ways the
#: others break; it is built only when it holds at most :data:`MAX_PARAMETERS`.
CANDIDATES = ({**WIDTHS, **MIXER_WIDTHS}, WIDTHS, {"vocab_size": 256})
#: The most parameters a miniature may hold (counted on the meta device before it is built).
MAX_PARAMETERS = 20_000_000
#: The sliding window of the miniature (its proof runs longer sequences).
WINDOW = 4


@dataclass(frozen=True)
class Miniature:
    """A miniature (``model``), what it was made from (``source``: the real model's class and
    model type) and how many of the real layers it copies (``layers``)."""

    model: nn.Module
    source: str
    layers: int

    def describe(self) -> str:
        config = self.model.config
        return (f"a {self.layers}-layer miniature of its config (hidden size {config.hidden_size}, "
                f"vocabulary {config.vocab_size})")


def model_name(model: nn.Module) -> str:
    """``Class (model_type 'x')``, as messages name a transformers model."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__}" + (f" (model_type {kind!r})" if kind else "")


def layer_kinds(model: nn.Module) -> list[tuple]:
    """One hashable description per decoder layer of a transformers causal LM: what the layer is
    made of (its modules' names and classes), its attention kind and its entries in the
    config's per-layer lists. Two layers of one kind run the same code."""
    from ..families.hf import _attention_kind

    inner, config = model.model, model.config
    count = len(inner.layers)
    lists = {k: v for k, v in config.to_dict().items() if _per_layer(k, v, count)}
    kinds = []
    for i, layer in enumerate(inner.layers):
        made_of = tuple((n, type(m).__name__) for n, m in layer.named_modules())
        kinds.append((made_of, _attention_kind(inner, i), tuple((k, repr(v[i])) for k, v in sorted(lists.items()))))
    return kinds


def _per_layer(name: str, value: Any, count: int) -> bool:
    """Whether config field ``name`` holds one entry per layer (not a list of layer indices, such as
    LFM2's ``full_attn_idxs`` when every layer is listed)."""
    if not isinstance(value, (list, tuple)) or len(value) != count or name.endswith(("token_id", "token_ids")):
        return False
    return not (all(_is_size(v) or v == 0 for v in value) and list(value) == sorted(set(value)) and count > 1)


def miniature_config(model: nn.Module, layers: int, widths: dict[str, int] = WIDTHS) -> Any:
    """``model``'s config with the sizes of ``widths``, :data:`WINDOW` and ``layers`` layers."""
    config = model.config
    values = config.to_dict()
    count = config.num_hidden_layers
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    for name, limit in widths.items():
        if _is_size(values.get(name)):
            values[name] = min(values[name], limit)
    if _is_size(heads) and _is_size(kv_heads):  # grouped: 1 or 2 key-value heads; not grouped: as many as heads
        values["num_key_value_heads"] = 1 if kv_heads == 1 else values["num_attention_heads"] if kv_heads == heads \
            else 2
    if widths.get("mamba_n_heads") and _is_size(values.get("mamba_n_heads")) and _is_size(values.get("mamba_d_head")):
        # Mamba-2 heads split the mixer's width (mamba_d_ssm, else mamba_expand x hidden_size) between them
        width = values.get("mamba_d_ssm") or values.get("mamba_expand", 2) * values["hidden_size"]
        values["mamba_d_head"] = width // values["mamba_n_heads"]
    if _is_size(values.get("sliding_window")):
        values["sliding_window"] = min(values["sliding_window"], WINDOW)
    for name, value in list(values.items()):
        if isinstance(value, (list, tuple)) and len(value) == count and not name.endswith("token_id"):
            values[name] = list(value)[:layers]
        elif name.endswith("token_id") and _is_size(value) and value >= values["vocab_size"]:
            values[name] = values["vocab_size"] - 1  # inside the miniature's vocabulary (a pad is a padding_idx)
    values["num_hidden_layers"] = layers
    for name in ("dtype", "torch_dtype"):
        values.pop(name, None)
    mini = type(config).from_dict(values)
    mini._attn_implementation = config._attn_implementation if config._attn_implementation in ("eager", "sdpa") \
        else "sdpa"
    return mini


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def prefix_length(kinds: list[tuple]) -> int:
    """The shortest prefix of layers holding every kind in ``kinds`` (at least 2 when there are 2).

    >>> prefix_length(["a", "a", "b", "a", "c"]), prefix_length(["a"] * 8)
    (5, 2)
    """
    first = {}
    for i, kind in enumerate(kinds):
        first.setdefault(kind, i)
    return min(len(kinds), max(2, max(first.values(), default=0) + 1))


def build_miniature(model: nn.Module, widths: dict[str, int] = WIDTHS, seed: int = 0) -> Miniature:
    """A miniature of ``model`` (a transformers causal LM, on the meta device is fine), on the CPU in
    float32, in eval mode, with seeded weights; torch's global random state is left as it was.

    Raises ``ValueError`` naming what differs when the miniature's layers are not of the kinds
    of the real model's first layers (a pattern that a shorter model does not keep).
    """
    kinds = layer_kinds(model)
    layers = prefix_length(kinds)
    config = miniature_config(model, layers, widths)
    with torch.device("meta"):
        count = sum(p.numel() for p in type(model)(config).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"a {layers}-layer model of its config with sizes {widths} holds {count:,} parameters, "
                         f"more than the {MAX_PARAMETERS:,} a miniature may")
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            mini = type(model)(config)
        finally:
            torch.set_default_dtype(default)
        mini.float().eval()
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in mini.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]), generator=generator)
    built = layer_kinds(mini)
    wanted = kinds[:layers]
    if [k[:2] for k in built] != [k[:2] for k in wanted]:
        layer = next(i for i, (a, b) in enumerate(zip(built, wanted)) if a[:2] != b[:2])
        raise ValueError(f"its layer {layer} is a {wanted[layer][1]} layer made of "
                         f"{sorted({c for _, c in wanted[layer][0]})}, but a {layers}-layer model of its config "
                         f"makes it a {built[layer][1]} layer made of {sorted({c for _, c in built[layer][0]})}")
    return Miniature(mini, model_name(model), layers)


__all__ = ["CANDIDATES", "MAX_PARAMETERS", "MIXER_WIDTHS", "WIDTHS", "WINDOW", "Miniature", "build_miniature", "layer_kinds", "miniature_config", "model_name",
           "prefix_length"]
