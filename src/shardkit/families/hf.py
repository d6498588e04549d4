"""HuggingFace ``transformers`` models: any model (attention, heads, positions, ring attention)
and GPT-2's fused projections. Decoder-only causal LMs, which pipelines can cut, are
:mod:`shardkit.families.hf_pipeline`'s.

transformers is imported only when a model is run, never to recognise one: a model is a
transformers model when its ``config`` has ``_attn_implementation``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..plan import PlanError
from .base import Attention, AttentionFn, AttributeChange, Family, WeightNames

#: The name ring attention is registered under in transformers' ``AttentionInterface``.
HF_ATTENTION = "shardkit_ring"
_ATTENTION_ATTR = "_shardkit_attention"  # the attention callable a module's forward should use
#: Module attributes holding a head count that a forward may use to reshape (OPT's ``view(bsz,
#: -1, self.num_heads, head_dim)``): a tensor-parallel shard must see the local count.
HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads",
                         "num_kv_heads")
#: Module attributes holding heads x head_dim (BERT's ``all_head_size``), local likewise.
WIDTH_ATTRIBUTES = ("all_head_size",)
#: Config fields giving the number of positions, in order of preference.
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "_attn_implementation")


def _config_value(model: nn.Module, *fields: str) -> Any:
    """The first of ``fields`` the model's config sets (positive integers for sizes; any other value as is)."""
    config = getattr(model, "config", None)
    for name in fields:
        value = getattr(config, name, None)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value <= 0):
            return value
    return None


def _stacks_experts(converter: Any) -> bool:
    """Whether a transformers ``WeightConverter`` stacks one tensor per expert: one target, sources
    with ``*`` for the expert, ``MergeModulelist(dim=0)`` then (several sources) ``Concatenate(dim=1)``."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    sources = list(converter.source_patterns)
    expected = [("MergeModulelist", 0)] + ([("Concatenate", 1)] if len(sources) > 1 else [])
    return (ops == expected and len(converter.target_patterns) == 1
            and all(p.count("*") == 1 and "(" not in p for p in sources))



#: Names transformers gives an attention's output projection (its input is the heads' width).
_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "proj", "dense", "c_proj", "wo")


def _output_width(module: nn.Module) -> int | None:
    """The heads' total width of an attention module without a config of its own (GOT-OCR2's vision
    tower): its output projection's input features."""
    for child_name in _OUTPUT_PROJECTIONS:
        child = getattr(module, child_name, None)
        if isinstance(child, nn.Linear):
            return child.in_features
    return None

class HFFamily(Family):
    """Any transformers model: attention modules are the ``*Attention`` classes holding a config."""

    name = "hf"

    def matches(self, model: nn.Module) -> bool:
        return is_hf_model(model)

    def max_positions(self, model: nn.Module) -> int | None:
        return _config_value(model, *POSITION_FIELDS) or super().max_positions(model)

    def vocab_size(self, model: nn.Module) -> int | None:
        return _config_value(model, "vocab_size") or super().vocab_size(model)

    def takes_token_ids(self, model: nn.Module) -> bool:
        return _config_value(model, "vocab_size") is not None or super().takes_token_ids(model)

    def weight_names(self, model: nn.Module) -> WeightNames:
        """transformers' own renamings between checkpoints and models (v5's conversion mapping:
        GPT-NeoX files hold ``embed_out`` for ``lm_head``), applied as ``from_pretrained`` and
        ``save_pretrained`` apply them. Its converters that stack one tensor per expert
        (``MergeModulelist(dim=0)``, then ``Concatenate(dim=1)`` for several sources: Mixtral's
        ``experts.*.w1``/``w3`` into ``gate_up_proj``) are ``stacked``; any other converter (tensors
        merged on loading in another way) is named in ``merged``."""
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (
                WeightConverter,
                WeightRenaming,
                rename_source_key,
            )
        except ImportError:  # a transformers without conversion mappings names tensors as the model does
            return WeightNames()
        transforms = get_model_conversion_mapping(model, add_legacy=True)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        saving = [t.reverse_transform() for t in get_model_conversion_mapping(model, add_legacy=False)[::-1]]
        back = [t for t in saving if isinstance(t, WeightRenaming) and type(t).__name__ != "PrefixChange"]
        if not renamings and not converters:
            return WeightNames()
        stacks = [c for c in converters if _stacks_experts(c)]
        merged = tuple(str(p) for c in converters if c not in stacks for p in c.source_patterns)
        stacked = tuple((str(c.target_patterns[0]), tuple(map(str, c.source_patterns))) for c in stacks)
        return WeightNames(to_model=lambda key: rename_source_key(key, renamings, [])[0],
                           to_checkpoint=lambda name: rename_source_key(name, back, [], reverse=True)[0],
                           merged=merged, stacked=stacked)

    def example_inputs(self, model: nn.Module, seq_len: int | None = None) -> tuple | None:
        if not self.takes_token_ids(model):
            return None
        seq_len = seq_len or min(128, self.max_positions(model) or 128)
        return (torch.zeros(1, seq_len, dtype=torch.long),)

    # -- attention ----------------------------------------------------------------------------------
    def _attention_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Modules of classes named ``*Attention`` holding a config or a head count."""
        return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Attention") and (
            hasattr(m, "config") or any(isinstance(getattr(m, a, None), int) for a in HEAD_COUNT_ATTRIBUTES))]

    def attentions(self, model: nn.Module) -> list[Attention]:
        found = []
        for name, module in self._attention_modules(model):
            config = getattr(module, "config", None) or getattr(model, "config", None)
            heads = next((getattr(module, a) for a in ("num_heads", "num_attention_heads")
                          if isinstance(getattr(module, a, None), int)), getattr(config, "num_attention_heads", None))
            if not isinstance(heads, int):
                continue
            kv_heads = getattr(module, "num_key_value_heads", None) or getattr(config, "num_key_value_heads", None) \
                or heads
            width = getattr(config, "hidden_size", None) or _output_width(module)
            head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None) \
                or (width // heads if isinstance(width, int) else None)
            if head_dim is None:  # no config of its own and no output projection to read its width from
                continue
            found.append(Attention(name, heads, kv_heads, head_dim))
        return found

    def tensor_parallel_changes(self, model: nn.Module, split: set[str], size: int) -> list[AttributeChange]:
        """Head counts (and heads x head_dim widths) of attention modules whose projections are split."""
        changes = []
        for name, module in self._attention_modules(model):
            prefix = f"{name}." if name else ""
            if not any(s.startswith(prefix) for s in split):
                continue
            for attribute in (*HEAD_COUNT_ATTRIBUTES, *WIDTH_ATTRIBUTES):
                value = getattr(module, attribute, None)
                if isinstance(value, int) and not isinstance(value, bool) and value % size == 0:
                    changes.append(AttributeChange(name, attribute, value // size))
        return changes

    # -- context parallel ---------------------------------------------------------------------------
    def context_parallel_problems(self, model: nn.Module) -> list[str]:
        problems = []
        if not self._attention_modules(model):
            problems.append(f"{type(model).__name__} has no attention modules (transformers classes named "
                            f"*Attention) to run as ring attention; remove the 'sp' axis")
        dropout = _config_value(model, "attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
        if dropout:
            problems.append(f"{type(model).__name__} has attention dropout {dropout} (config), which context "
                            f"parallel (ring attention) does not support; set it to 0.0 in the config")
        if "position_ids" not in inspect.signature(model.forward).parameters:
            problems.append(f"{type(model).__name__}.forward takes no 'position_ids', so it cannot be given the "
                            f"global positions of its sequence chunk under context parallel")
        softcap = _config_value(model, "attn_logit_softcapping")
        if softcap is not None:
            problems.append(f"{type(model).__name__} caps its attention scores (attn_logit_softcapping={softcap}), "
                            f"which context parallel's ring attention does not do; remove the 'sp' axis for this "
                            f"model")
        layers = _config_value(model, "num_hidden_layers") or 0
        windowed = [i for i in range(layers) if _attention_kind(model, i) == "sliding_attention"]
        window, positions = _config_value(model, "sliding_window"), self.max_positions(model)
        if windowed and window is not None and (positions is None or positions > window):
            problems.append(f"{type(model).__name__} layers {windowed} attend over a sliding window of {window} "
                            f"positions, but context parallel's ring attention attends over the whole causal past "
                            f"(up to {positions} positions here); remove the 'sp' axis for this model")
        return problems

    def position_argument(self, model: nn.Module) -> str:
        return "position_ids"

    def install_attention(self, model: nn.Module, attention: AttentionFn) -> None:
        from transformers import AttentionInterface

        AttentionInterface.register(HF_ATTENTION, _interface_attention)
        _own_configs(model)
        model.set_attn_implementation(HF_ATTENTION)
        for _, module in self._attention_modules(model):
            setattr(module, _ATTENTION_ATTR, attention)

    def check_context_parallel_inputs(self, model: nn.Module, kwargs: dict) -> None:
        super().check_context_parallel_inputs(model, kwargs)
        if kwargs.get("labels") is not None:
            raise PlanError("under context parallel pass targets to your loss instead of labels= to the model: "
                            "HuggingFace shifts labels by one token inside each rank's sequence chunk, which is "
                            "wrong when the sequence is split; shard pre-shifted targets with shard_sequence")
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2 or not bool(mask.all()):
                raise PlanError("context parallel (ring attention) supports causal attention without padding: "
                                "attention_mask must be None or all ones; pack sequences without padding instead")
            kwargs["attention_mask"] = None


def _interface_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` entry: the attention installed on ``module``.

    Returns ``[batch, seq, heads, head_dim]`` like transformers' own attention functions.
    """
    attention = getattr(module, _ATTENTION_ATTR, None)
    if attention is None:
        raise PlanError(f"{type(module).__name__} uses attn_implementation={HF_ATTENTION!r} but no attention was "
                        f"installed on it (enable_context_parallel(model, mesh['sp']) does)")
    if attention_mask is not None:
        raise PlanError("context parallel computes the causal mask itself and takes no attention_mask; "
                        "custom or padding masks are not supported")
    if dropout:
        raise PlanError(f"context parallel does not support attention dropout (got {dropout}); "
                        f"set config.attention_dropout=0.0")
    changed = {k: v for k, v in kwargs.items() if k in ("softcap", "s_aux") and v is not None}
    if changed:
        raise PlanError(f"{type(module).__name__} asks its attention for {changed}, which context parallel's ring "
                        f"attention does not do; remove the 'sp' axis for this model")
    return attention(query, key, value, scale=scaling).transpose(1, 2).contiguous(), None


def _attention_kind(inner: nn.Module, layer: int) -> str:
    """What a decoder layer attends to, as the model's own forward decides: ``config.layer_types``,
    else a sliding window wherever the config has one (Mistral), else the whole causal past."""
    config = inner.config
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return kinds[layer]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


class GPT2Family(HFFamily):
    """transformers GPT-2: ``Conv1D`` projections (weights ``[in, out]``) and a fused ``c_attn`` = ``[q | k | v]``
    split with ``split_size``, the width a shard must see as local."""

    name = "gpt2"

    def matches(self, model: nn.Module) -> bool:
        return is_hf_model(model) and any(_is_gpt2_attention(m) for m in model.modules())

    def fused_projections(self, model: nn.Module) -> dict[str, int]:
        out = {}
        for name, module in model.named_modules():
            if _is_gpt2_attention(module):
                prefix = f"{name}." if name else ""
                out[f"{prefix}c_attn"] = module.c_attn.weight.shape[1] // module.embed_dim  # 3, or 2 ([k | v])
        return out

    def tensor_parallel_changes(self, model: nn.Module, split: set[str], size: int) -> list[AttributeChange]:
        changes = []
        for name, module in model.named_modules():
            prefix = f"{name}." if name else ""
            if _is_gpt2_attention(module) and f"{prefix}c_attn" in split and module.split_size % size == 0:
                changes.append(AttributeChange(name, "split_size", module.split_size // size))
        return changes


def _is_gpt2_attention(module: nn.Module) -> bool:
    return hasattr(module, "c_attn") and hasattr(module, "split_size") and hasattr(module, "embed_dim")


def _own_configs(model: nn.Module) -> None:
    """Give ``model``'s modules copies of their configs, copied together (a sub-config shared by two
    modules stays shared): transformers' ``set_attn_implementation`` writes into the config, which the
    model shares with whoever built it (a builder that makes every model from one config object
    would find ring attention asked of its next model, which has none installed)."""
    import copy

    root = getattr(model, "config", None)
    if root is None:
        return
    copies: dict[int, Any] = {}
    copy.deepcopy(root, copies)  # the memo maps each copied object's id to its copy
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) in copies:
            module.config = copies[id(config)]


__all__ = ["GPT2Family", "HFFamily", "HF_ATTENTION", "is_hf_model"]
