"""Pipelines of transformers models: proven on a miniature of the model, not trusted by model type.

``sk.validate`` builds a narrow, short miniature of the model's own class from its config, runs the
stages and the model's forward, and refuses only where they differ, saying what differs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pipeline_zoo import CONFIGS, build, build_doubled_llama, build_half_gradient_llama
from transformers import AutoConfig, AutoModelForCausalLM

import shardkit as sk
import shardkit.planner.pipeline_proof as proof
from shardkit.families import hf_pipeline, model_layout
from shardkit.plan import Mesh, Pipeline, Plan
from shardkit.planner.miniature import MAX_PARAMETERS, build_miniature, layer_kinds, prefix_length
from shardkit.runtime.generate import check_generation

PP2 = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2))


@pytest.mark.parametrize("model_type", sorted(set(CONFIGS) - {"mixtral", "phi3"}))  # those two were on the list
def test_model_types_outside_the_old_list_are_proven_and_validate(model_type):
    """glm4, nemotron, starcoder2, Gemma 3, Jamba, LFM2, GPT-OSS, Falcon-H1, ...: refused by a list of 14 model
    types before (Jamba, LFM2 and Falcon-H1, named final norms, were no causal LM at all)."""
    model = sk.meta_model(lambda: build(model_type))
    sk.validate(PP2, model, 2)
    assert model_layout(model).kind == "hf-causal-lm"


@pytest.mark.parametrize("build_model, what", [
    (build_doubled_llama, r"the logits of the stages \(every unit a stage of its own\) differ from the model's "
                          r"forward's by up to [0-9.]+ \(the largest value is [0-9.]+; the first difference at index "
                          r"\[0, 0, 0\] of shape \[2, 12, 256\]\)"),
    (build_half_gradient_llama, r"the gradient of 'model.embed_tokens.weight' through the stages \(every unit a stage "
                                r"of its own\) differs from the one through the model's forward by up to"),
], ids=["logits", "gradients"])
def test_a_forward_the_stages_do_not_compute_is_refused_saying_what_differs(build_model, what):
    """Both are model_type 'llama', which the list accepted: their pipelines trained something else, silently."""
    with pytest.raises(sk.PlanError, match=r"\(model_type 'llama'\) cannot be cut into pipeline stages: on a 2-layer "
                                           r"miniature of its config \(hidden size 64, vocabulary 256\), " + what
                                           + r".*use a plan without 'pp' for this model"):
        sk.validate(PP2, sk.meta_model(build_model), 2)


@pytest.mark.parametrize("model_type, field", [("gemma2", "final_logit_softcapping"), ("granite", "logits_scaling"),
                                               ("cohere", "logit_scale"), ("falcon_h1", "lm_head_multiplier")])
def test_the_proof_sees_a_logit_scaling_the_stages_would_leave_out(monkeypatch, model_type, field):
    """With the stages' logit scalings taken away, each of these models is refused (a cap at 30 included:
    the miniature's logits are of order one, not transformers' initial 0.02)."""
    extra = {"falcon_h1": {"mamba_n_heads": 4, "mamba_d_ssm": 64, "mamba_d_head": 16, "lm_head_multiplier": 0.5},
             "cohere": {"logit_scale": 0.5}, "granite": {"logits_scaling": 4.0}}.get(model_type, {})
    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                  **extra)
    assert getattr(config, field, None) not in (None, 1.0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert proof.stage_problems(model, model_layout(model)) == []
    monkeypatch.setattr(hf_pipeline, "_scaled_logits", lambda model, logits: logits)
    monkeypatch.setattr(proof, "_PROOFS", {})
    problems = proof.stage_problems(model, model_layout(model))
    assert len(problems) == 1 and f"(model_type {model_type!r})" in problems[0] and "the logits" in problems[0]


def test_a_model_that_trains_on_stages_but_decodes_otherwise_is_refused_for_generation_only():
    """MiniMax keeps a cache of its own kind: its stages train as its forward does, but sk.generate on a
    pipeline (transformers' DynamicCache through the stages) is refused before launch, saying why."""
    config = AutoConfig.for_model("minimax", vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  num_local_experts=4, num_experts_per_tok=2, head_dim=16, block_size=4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sk.validate(PP2, model, 2)
    check_generation(model, 4, 4)  # no pipeline: transformers' own loop is not ours to judge
    with pytest.raises(sk.PlanError, match=r"MiniMaxForCausalLM \(model_type 'minimax'\) cannot be cut into pipeline "
                                           r"stages for generation: .*with a KV cache failed \(ValueError: MiniMax "
                                           r"uses cache of its own"):
        check_generation(model, 4, 4, PP2)


def test_a_miniature_of_a_real_size_config_holds_every_kind_of_layer_and_is_small():
    """Gemma 3's 26 layers (5 windowed, then 1 full), Jamba's 32 (attention every 8th from the 4th, experts every
    2nd): the shortest prefix with every kind, at widths that build in milliseconds."""
    for model_type, layers in (("gemma3_text", 6), ("jamba", 5), ("llama", 2)):
        with torch.device("meta"):
            real = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
        mini = build_miniature(real)
        kinds = layer_kinds(real)
        assert mini.layers == layers and set(kinds[:layers]) == set(kinds)
        assert sum(p.numel() for p in mini.model.parameters()) < MAX_PARAMETERS // 20
        assert mini.model.config.num_hidden_layers == layers and mini.model.config.hidden_size <= 64


def test_the_proof_is_made_once_per_config(monkeypatch):
    built = []
    monkeypatch.setattr(proof, "_PROOFS", {})
    monkeypatch.setattr(proof, "build_miniature", lambda *a, **k: built.append(1) or build_miniature(*a, **k))
    model = sk.meta_model(lambda: build("glm4"))
    for _ in range(3):
        assert proof.stage_problems(model, model_layout(model)) == []
    assert len(built) == 1


def test_a_proof_leaves_the_global_random_state_and_threads_as_they_were(monkeypatch):
    monkeypatch.setattr(proof, "_PROOFS", {})
    model = sk.meta_model(lambda: build("nemotron"))
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    proof.stage_problems(model, model_layout(model))
    assert torch.equal(torch.rand(3), expected) and torch.get_num_threads() == threads


@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=30))
def test_the_prefix_holds_every_kind_and_is_the_shortest(kinds):
    n = prefix_length(kinds)
    assert set(kinds[:n]) == set(kinds)
    assert n == len(kinds) or n == 2 or set(kinds[:n - 1]) != set(kinds)
    assert n >= min(2, len(kinds))


# -- costs of the automatic split on the meta device ------------------------------------------------------
@pytest.mark.parametrize("model_type", ["mixtral", "jamba", "qwen3_moe", "gpt_oss"])
def test_the_automatic_split_measures_mixtures_of_experts_on_meta(model_type):
    """torch's meta kernel of grouped_mm takes only bfloat16: a float32 MoE split automatically failed with
    "Expected inputs of BF16 type"; now measured, the experts' products counted (torch's counter skips them)."""
    from shardkit.planner.stages import assign_stages

    model = sk.meta_model(lambda: build(model_type))
    assignment = assign_stages(model, Pipeline(split="auto", microbatches=2), Mesh(pp=2))
    costs = {c.name: c for c in assignment.costs}
    config = model.config
    tokens = assignment.layout.example_inputs[0].numel()
    moe = next(i for i, layer in enumerate(model.model.layers) if any("Experts" in type(m).__name__
                                                                       for m in layer.modules()))
    experts = costs[f"model.layers.{moe}"]
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    assert experts.flops >= 2 * tokens * config.num_experts_per_tok * 2 * config.hidden_size * width
    assert all(c.act_bytes > 0 for c in costs.values() if "layers" in c.name)


class _GroupedExperts(torch.nn.Module):
    """Four experts of [8 -> 16], 4 tokens each, through torch's grouped matrix product."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8, 16))
        self.register_buffer("offs", torch.tensor([4, 8, 12, 16], dtype=torch.int32))

    def forward(self, x):
        return torch.nn.functional.grouped_mm(x.reshape(-1, 8), self.w, offs=self.offs).reshape(*x.shape[:-1], 16)


def test_a_float32_chain_with_grouped_products_is_ordered_and_measured_on_meta():
    """Without transformers: the chain's order and its costs come from meta runs, which failed in torch's
    grouped_mm meta kernel ("Expected inputs of BF16 type"); the product's FLOPs are 2 x 16 x 8 x 16."""
    from shardkit.planner.stages import assign_stages

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(32, 8), _GroupedExperts(), torch.nn.Linear(16, 32))
    assert [u.name for u in model_layout(model).units] == ["0", "1", "2"]
    assignment = assign_stages(model, Pipeline(split="auto", schedule="gpipe"), Mesh(pp=2),
                               example_inputs=(torch.zeros(2, 8, dtype=torch.long),))
    assert [c.flops for c in assignment.costs] == [0, 2 * 16 * 8 * 16, 2 * 16 * 16 * 32]
