"""Architectures nobody in shardkit wrote, from transformers' own default configs (cut to 2 layers),
found failing by a survey of every causal LM config of transformers 5.25 validated on meta: each
now builds and validates (or is refused by name), never crashes."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardkit as sk
from shardkit.families import family_of


@pytest.fixture
def two_layers(monkeypatch):
    """``benchmarks/hf_moe_survey.py``'s cut of a default config to 2 layers, as the survey built them."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from hf_moe_survey import two_layer_config

    return two_layer_config


def test_a_vision_attention_without_a_config_of_its_own_is_read_by_its_output_projection(two_layers):
    """GOT-OCR2's vision attention holds a head count but no config, and the model's config no
    ``hidden_size``: its heads' width is read from its output projection (it crashed sk.validate)."""
    from transformers import AutoModelForCausalLM, GotOcr2Config

    model = sk.meta_model(AutoModelForCausalLM.from_config, two_layers(GotOcr2Config))
    attentions = {a.name: a for a in family_of(model).attentions(model)}
    vision = attentions["model.vision_tower.layers.0.attn"]
    assert (vision.heads, vision.head_dim) == (12, 64)
    sk.validate(sk.Plan(sk.Mesh(tp=2), sk.LayoutMap.from_hf(model)), model)


@pytest.mark.parametrize("name", ["DeepseekV3Config", "ErgoConfig"])
def test_stacked_experts_larger_than_the_machine_are_built_on_meta(name, two_layers):
    """transformers 5.25 builds these experts as one tensor per layer (DeepSeek-V3's 30 GB in float32):
    ``meta_model`` could not allocate it even untouched on a 24 GiB machine."""
    import transformers
    from transformers import AutoModelForCausalLM

    model = sk.meta_model(AutoModelForCausalLM.from_config, two_layers(getattr(transformers, name)))
    assert all(p.device.type == "meta" for p in model.parameters())
    sk.validate(sk.Plan(sk.Mesh(fsdp=2)), model)
