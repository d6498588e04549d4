"""transformers decoder-only causal LMs cut into pipeline stages.

A model is recognised by its layout, not its model type: ``model.layers`` (a ModuleList)
beside one ``nn.Embedding`` (``embed_tokens``, Nemotron-H's ``embeddings``), one more child
holding parameters (the final norm, whatever its name: ``norm``, ``final_layernorm``, LFM2's
``embedding_norm``) and children without parameters (rotary embeddings, recomputed on every
stage), and ``lm_head``.

A stage re-runs the piece of the model's forward it holds, as transformers 5 writes it:
the embedding (and an ``embedding_multiplier``), the decoder layers with the mask
transformers builds for each layer's kind (``config.layer_types``; none for a kind it has no
builder for) and the rotary embedding of each kind, the final norm, and the LM head with
the logit scalings of the model's forward. A model whose forward does something else is not
trusted on its type: ``sk.validate`` runs a miniature of it both ways
(:mod:`shardkit.planner.pipeline_proof`) and refuses where the numbers differ.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .base import ModelLayout, Unit
from .hf import HFFamily, _attention_kind, is_hf_model


class HFCausalLMFamily(HFFamily):
    """A decoder-only causal LM: ``model.{<embedding>, layers, <final norm>}`` and ``lm_head``."""

    name = "hf-causal-lm"

    def matches(self, model: nn.Module) -> bool:
        return is_hf_model(model) and isinstance(getattr(model, "lm_head", None), nn.Module) \
            and decoder_parts(model) is not None

    def pipeline_layout(self, model: nn.Module, example_inputs: tuple | None = None) -> ModelLayout:
        parts = decoder_parts(model)
        assert parts is not None
        units = [Unit(parts.embedding, (parts.embedding,), block=False)]
        units += [Unit(f"model.layers.{i}", (f"model.layers.{i}",)) for i in range(len(model.model.layers))]
        units += [Unit(parts.norm, (parts.norm,), block=False), Unit("lm_head", ("lm_head",), block=False)]
        return ModelLayout(self, tuple(units), parts.shared, example_inputs or self.example_inputs(model))

    def stage_forward(self, model: nn.Module, units: Sequence[Unit], x: torch.Tensor) -> torch.Tensor:
        """The forward restricted to ``units``; positions, rotary embeddings and masks recomputed here."""
        return self.stage_decode(model, units, x, None, 0)

    def stage_decode(self, model: nn.Module, units: Sequence[Unit], x: torch.Tensor, cache: Any,
                     past: int) -> torch.Tensor:
        hidden, rest = x, list(units)
        if isinstance(model.get_submodule(rest[0].name), nn.Embedding):  # the first stage takes token ids
            hidden = model.get_submodule(rest.pop(0).name)(x)
            multiplier = getattr(model.model, "embedding_multiplier", None)  # Granite's and Falcon-H1's forwards
            if multiplier is not None:
                hidden = hidden * multiplier
        blocks = [u for u in rest if u.block]
        if blocks:
            hidden = _run_layers(model, blocks, hidden, cache, past)
        for unit in rest:
            if unit.name == "lm_head":
                hidden = _scaled_logits(model, model.lm_head(hidden))
            elif not unit.block:  # the final norm
                hidden = model.get_submodule(unit.name)(hidden)
        return hidden


@dataclass(frozen=True)
class DecoderParts:
    """Dotted names of a decoder-only LM's embedding and final norm, and its parameterless
    modules (rotary embeddings), which every stage recomputes."""

    embedding: str
    norm: str
    shared: tuple[str, ...]


def decoder_parts(model: nn.Module) -> DecoderParts | None:
    """The parts of ``model.model`` beside its ``layers``: exactly one ``nn.Embedding`` child, one
    other child holding parameters (the final norm) and any holding none; else ``None``."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, nn.Module) or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return None
    others = [(n, c) for n, c in inner.named_children() if n != "layers"]
    embeddings = [n for n, c in others if isinstance(c, nn.Embedding)]
    held = [n for n, c in others if n not in embeddings and next(c.parameters(), None) is not None]
    if len(embeddings) != 1 or len(held) != 1:
        return None
    return DecoderParts(f"model.{embeddings[0]}", f"model.{held[0]}",
                        tuple(f"model.{n}" for n, c in others if n not in embeddings + held))


def _run_layers(model: nn.Module, blocks: Sequence[Unit], hidden: torch.Tensor, cache: Any,
                past: int) -> torch.Tensor:
    """The decoder layers of ``blocks`` on ``hidden``, each given what the model's forward gives it."""
    inner = model.model
    position_ids = torch.arange(past, past + hidden.shape[1], device=hidden.device).unsqueeze(0)
    layers = [int(u.name.rpartition(".")[2]) for u in blocks]
    kinds = {layer: _attention_kind(inner, layer) for layer in layers}
    masks = _causal_masks(inner, hidden, position_ids, cache, layers)
    rotary = next((m for m in inner.children() if "Rotary" in type(m).__name__), None)  # rotary_emb, LFM2-MoE's pos_emb
    embeddings: dict[str, Any] = {}
    if rotary is not None:
        if "layer_type" in _parameter_names(type(rotary).forward):  # Gemma 3, OLMo 3: one rotary per kind
            embeddings = {kind: rotary(hidden, position_ids, kind) for kind in set(kinds.values())}
        else:
            embeddings = dict.fromkeys(kinds.values(), rotary(hidden, position_ids=position_ids))
    first = model.get_submodule(blocks[0].name)
    extra = {} if cache is None else {
        "cache" if "cache" in _parameter_names(type(first).forward) else "past_key_values": cache, "use_cache": True}
    for unit, layer in zip(blocks, layers):
        kind = kinds[layer]
        if rotary is not None:
            extra["position_embeddings"] = embeddings[kind]
        out = model.get_submodule(unit.name)(hidden, attention_mask=masks[kind], position_ids=position_ids, **extra)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def _scaled_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """What a causal LM's forward does to ``lm_head``'s output: Granite divides by ``logits_scaling``,
    Cohere multiplies by ``logit_scale``, Falcon-H1 by ``lm_head_multiplier``, Gemma 2 caps with
    ``final_logit_softcapping``."""
    config = model.config
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None:
        logits = logits / scaling
    for scale in (getattr(model, "logit_scale", None), getattr(model.model, "lm_head_multiplier", None)):
        if scale is not None:
            logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


@functools.cache
def _parameter_names(fn: Callable) -> frozenset[str]:
    """The parameter names of ``fn``, read once (stage forwards ask for them at every call)."""
    return frozenset(inspect.signature(fn).parameters)


def _mask_builder(kind: str) -> Callable | None:
    """transformers' mask builder for a kind of layer (``config.layer_types``): its own table
    (``LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING``), else the causal and sliding-window builders."""
    from transformers import masking_utils

    table = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", None) or {
        "full_attention": masking_utils.create_causal_mask,
        "sliding_attention": masking_utils.create_sliding_window_causal_mask}
    build = table.get(kind)
    return build if callable(build) else None


def _causal_masks(inner: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, cache: Any,
                  layers: list[int]) -> dict[str, Any]:
    """The mask of each kind of layer among ``layers`` (``{kind: mask}``), built by transformers; with a
    cache, the key length comes from the stage's first layer of that kind (the others' caches stay empty here)."""
    masks = {}
    for layer in layers:
        kind = _attention_kind(inner, layer)
        if kind in masks:
            continue
        build = _mask_builder(kind)
        if build is None:  # no mask, as Nemotron-H's forward gives its MLP and MoE blocks (the proof checks it)
            masks[kind] = None
            continue
        params = _parameter_names(build.func if isinstance(build, functools.partial) else build)
        kwargs = {"config": inner.config, "inputs_embeds": hidden, "attention_mask": None,
                  "position_ids": position_ids, "cache" if "cache" in params else "past_key_values": cache}
        if "cache_position" in params:
            kwargs["cache_position"] = position_ids[0]
        if cache is not None and "layer_idx" in params:
            kwargs["layer_idx"] = layer
        masks[kind] = build(**kwargs)
    return masks


__all__ = ["DecoderParts", "HFCausalLMFamily", "decoder_parts"]
