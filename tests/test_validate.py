"""sk.validate is complete: what it accepts runs (tests/test_validated_models.py runs it), what
cannot run is refused on the meta device, naming the parameter or module and what would be valid.
Models here were written by others (transformers, built from small configs) or by hand."""

from __future__ import annotations

import pytest
from model_zoo import (
    build_bloom,
    build_gemma2,
    build_global_heads,
    build_gpt2,
    build_llama_dropout,
    build_llama_tied,
    build_mistral,
    build_mistral_window,
    build_opt,
    build_phi3,
    build_qwen2_window,
    build_qwen3,
    build_shared_blocks,
    build_with_unused,
    fused_rules,
)
from torch import nn

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt
from shardkit.models.hf import GPT2_RULES, LLAMA_RULES, build_tiny_llama
from shardkit.plan.hf_plan import hf_tp_plan
from shardkit.planner.meta import meta_model
from shardkit.runtime.parallelize import fsdp_units

LINEAR_RULES = [(r".*\.(q_proj|k_proj|v_proj|fc1)\.weight", ("tp", None)), (r".*\.(q_proj|k_proj|v_proj|fc1)\.bias", ("tp",)),
                (r".*\.(out_proj|fc2)\.weight", (None, "tp")), (".*", None)]


def _facts(build, plan):
    return sk.validate(plan, meta_model(build)).facts


def _problems(build, plan) -> list[str]:
    with pytest.raises(sk.PlanError) as err:
        sk.validate(plan, build if isinstance(build, nn.Module) else meta_model(build))
    return err.value.problems


# -- tensor parallel: heads, reshapes ------------------------------------------------------------------

def test_heads_and_kv_heads_are_checked_by_validate():
    (problem,) = _problems(build_tiny_llama, sk.Plan(sk.Mesh(tp=4), LLAMA_RULES))
    assert "4 query heads and 2 key/value heads" in problem and "valid tp sizes: [1, 2]" in problem


def test_an_attention_reshaping_with_a_global_head_count_is_adapted_when_its_family_knows_it():
    tp = _facts(build_opt, sk.Plan(sk.Mesh(tp=2), sk.LayoutMap(LINEAR_RULES))).tensor_parallel["tp"]
    assert {(c.module, c.attribute, c.local) for c in tp.changes} == {
        (f"model.decoder.layers.{i}.self_attn", "num_heads", 2) for i in range(2)}


def test_an_attention_reshaping_with_a_global_size_no_family_knows_is_refused_before_launch():
    rules = sk.LayoutMap([(r"attn\.[qkv]\.weight", ("tp", None)), (r"attn\.[qkv]\.bias", ("tp",)),
                          (r"attn\.o\.weight", (None, "tp")), (".*", None)])
    (problem,) = _problems(build_global_heads, sk.Plan(sk.Mesh(tp=2), rules))
    assert "fails on one tensor-parallel shard (tp=2) in module 'attn'" in problem
    assert "global size" in problem and "layout None" in problem


def test_a_model_whose_heads_are_sized_outside_the_attention_is_refused_before_launch():
    rules = sk.LayoutMap(fused_rules("query_key_value", "self_attention.dense", "dense_h_to_4h", "dense_4h_to_h"))
    (problem,) = _problems(build_bloom, sk.Plan(sk.Mesh(tp=2), rules))  # ALiBi slopes for all heads of the model
    assert "fails on one tensor-parallel shard (tp=2) in module 'transformer.h.0.self_attention'" in problem


# -- biases, norms, two axes ------------------------------------------------------------------------------

@pytest.mark.parametrize("rules, rule", [
    ([(r"layers\.\d+\.atn\.q\.weight", ("tp", None)), (".*", None)], r"#0 'layers"),  # a typo
    ([(".*", None), (r"lm_head\.weight", ("tp", None))], r"#1 'lm_head"),  # shadowed by the catch-all
], ids=["typo", "shadowed"])
def test_a_model_axis_whose_rules_match_no_parameter_is_refused(rules, rule):
    """The rules name tp but no parameter ends up split over it: every tp rank would compute the same."""
    with pytest.raises(sk.PlanError, match=r"mesh axis 'tp' \(size 2\) splits no parameter: the rules naming it "
                                           r"\(" + rule) as info:
        sk.validate(sk.Plan(sk.Mesh(fsdp=2, tp=2), sk.LayoutMap(rules)), meta_model(build_tiny_gpt))
    assert "fix the rules or remove the axis" in str(info.value)


def test_a_replicated_bias_under_a_column_parallel_weight_is_refused():
    rules = sk.LayoutMap([(r"layers\.\d+\.attn\.q_proj\.weight", ("tp", None)),
                          (r"layers\.\d+\.attn\.q_proj\.bias", None), *GPT_RULES.items()])
    problems = _problems(build_tiny_gpt, sk.Plan(sk.Mesh(tp=2), rules))
    assert any("layers.0.attn.q_proj.bias has layout None" in p and "column-parallel layer's bias is split with its "
               "output: use ('tp',)" in p for p in problems)


def test_a_row_parallel_bias_split_is_refused():
    rules = sk.LayoutMap([(r"layers\.\d+\.attn\.o_proj\.bias", ("tp",)), *GPT_RULES.items()])
    problems = _problems(build_tiny_gpt, sk.Plan(sk.Mesh(tp=2), rules))
    assert any("o_proj.bias" in p and "added after the all-reduce: use None" in p for p in problems)


def test_a_split_bias_under_a_replicated_weight_is_refused():
    rules = sk.LayoutMap([(r"layers\.[0-9]+\.mlp\.up_proj\.weight", None), *GPT_RULES.items()])
    problems = _problems(build_tiny_gpt, sk.Plan(sk.Mesh(tp=2), rules))
    assert any("up_proj.bias is split over 'tp' but layers.0.mlp.up_proj.weight is not" in p for p in problems)


def test_a_norm_split_over_tp_is_refused():
    rules = sk.LayoutMap([(r"layers\.\d+\.norm1\.(weight|bias)", ("tp",)), *GPT_RULES.items()])
    problems = _problems(build_tiny_gpt, sk.Plan(sk.Mesh(tp=2), rules))
    assert any("norm 'layers.0.norm1' (LayerNorm)" in p and "replicate its parameters" in p for p in problems)


def test_one_dim_or_one_module_over_two_model_axes_is_refused():
    two_on_a_dim = sk.LayoutMap([(r"lm_head[.]weight", (("tp", "mp"), None)), *GPT_RULES.items()])
    problems = _problems(build_tiny_gpt, sk.Plan(sk.Mesh(tp=2, mp=2), two_on_a_dim))
    assert any("'lm_head.weight' is split over model axes ['tp', 'mp']" in p for p in problems)
    two_on_a_module = sk.LayoutMap([(r"layers[.][0-9]+[.]attn[.]q_proj[.]bias", ("mp",)), *GPT_RULES.items()])
    problems = _problems(build_tiny_gpt, sk.Plan(sk.Mesh(tp=2, mp=2), two_on_a_module))
    assert any("module 'layers.0.attn.q_proj' has parameters split over different model axes" in p for p in problems)


# -- ties, packed projections ------------------------------------------------------------------------------

def test_a_tied_embedding_and_head_keep_one_layout_and_stay_tied():
    tp = _facts(build_llama_tied, sk.Plan(sk.Mesh(tp=2), LLAMA_RULES)).tensor_parallel["tp"]
    assert tp.ties == (("model.embed_tokens.weight", "lm_head.weight"),)
    assert tp.splits["model.embed_tokens"].kind == "vocab" and tp.splits["lm_head"].kind == "colwise"
    gpt2 = sk.LayoutMap([(r"transformer\.wte\.weight", ("tp", None)), *GPT2_RULES.items()])
    tp = _facts(build_gpt2, sk.Plan(sk.Mesh(tp=2), gpt2)).tensor_parallel["tp"]
    assert tp.ties == (("transformer.wte.weight", "lm_head.weight"),) and tp.splits["lm_head"].gather_output


def test_packed_projections_are_permuted_or_gathered():
    tp = _facts(build_phi3, sk.Plan(sk.Mesh(tp=2), sk.LayoutMap.from_hf(meta_model(build_phi3)))).tensor_parallel["tp"]
    qkv, o = tp.splits["model.layers.0.self_attn.qkv_proj"], tp.splits["model.layers.0.self_attn.o_proj"]
    gate_up, down = tp.splits["model.layers.0.mlp.gate_up_proj"], tp.splits["model.layers.0.mlp.down_proj"]
    assert qkv.gather_output and o.replicated_input  # sliced with global offsets: computed on the whole output
    assert gate_up.packed == 2 and not gate_up.gather_output and not down.replicated_input  # chunk(2): permuted
    assert tp.changes == ()  # nothing made local where the output is gathered (Phi-3 slices with num_key_value_heads)


def test_gpt2_fused_qkv_is_permuted_only_when_it_is_split():
    mlp_only = sk.LayoutMap([(r".*mlp\.c_fc\.weight", (None, "tp")), (r".*mlp\.c_fc\.bias", ("tp",)),
                             (r".*mlp\.c_proj\.weight", ("tp", None)), (".*", None)])
    tp = _facts(build_gpt2, sk.Plan(sk.Mesh(tp=2), mlp_only)).tensor_parallel["tp"]
    assert tp.changes == () and "transformer.h.0.attn.c_attn" not in tp.splits
    tp = _facts(build_gpt2, sk.Plan(sk.Mesh(tp=2), GPT2_RULES)).tensor_parallel["tp"]
    assert tp.splits["transformer.h.0.attn.c_attn"].packed == 3
    assert {c.attribute for c in tp.changes} == {"split_size"}


# -- sequence and context parallel ----------------------------------------------------------------------

def test_sequence_parallel_gathers_the_sequence_before_a_replicated_head():
    rules = sk.LayoutMap([(p, lay) for p, lay in GPT_RULES.items() if not p.startswith("lm_head")])
    tp = _facts(build_tiny_gpt, sk.Plan(sk.Mesh(tp=2), rules, sequence_parallel=True)).tensor_parallel["tp"]
    assert tp.gathers == ("lm_head",) and "layers.0.norm1" in tp.norms


def test_sequence_parallel_with_a_replicated_attention_is_refused():
    mlp_only = sk.LayoutMap([(r"layers\.\d+\.mlp\.up_proj\.weight", ("tp", None)),
                             (r"layers\.\d+\.mlp\.up_proj\.bias", ("tp",)),
                             (r"layers\.\d+\.mlp\.down_proj\.weight", (None, "tp")), (".*", None)])
    problems = _problems(build_tiny_gpt, sk.Plan(sk.Mesh(tp=2), mlp_only, sequence_parallel=True))
    assert any("'layers.0.attn.q_proj' (Linear) inside block 'layers.0' is replicated" in p for p in problems)


def test_context_parallel_needs_attention_it_knows_and_no_attention_dropout():
    net = nn.Sequential(nn.Embedding(256, 16), nn.Linear(16, 256))
    (problem,) = _problems(net, sk.Plan(sk.Mesh(sp=2)))
    assert "takes neither 'positions' nor 'position_ids'" in problem
    (problem,) = _problems(build_llama_dropout, sk.Plan(sk.Mesh(sp=2)))
    assert "attention dropout 0.1" in problem and "set it to 0.0" in problem


def test_context_parallel_refuses_sliding_window_layers_shorter_than_the_positions():
    (problem,) = _problems(build_qwen2_window, sk.Plan(sk.Mesh(sp=2)))
    assert "layers [1] attend over a sliding window of 4 positions" in problem and "(up to 64 positions" in problem
    (problem,) = _problems(build_mistral_window, sk.Plan(sk.Mesh(sp=2)))
    assert "layers [0, 1] attend over a sliding window of 4" in problem
    sk.validate(sk.Plan(sk.Mesh(sp=2)), meta_model(build_mistral))  # its window of 4096 covers all 64 positions


def test_context_parallel_refuses_capped_attention_scores():
    problems = _problems(build_gemma2, sk.Plan(sk.Mesh(sp=2)))
    assert any("caps its attention scores (attn_logit_softcapping=10.0)" in p for p in problems)


# -- data parallel: what the runtime must know ---------------------------------------------------------

def test_unused_parameters_are_found_on_meta():
    assert _facts(build_with_unused, sk.Plan(sk.Mesh(dp=2))).unused_parameters == ("spare.weight", "spare.bias")
    assert _facts(build_tiny_gpt, sk.Plan(sk.Mesh(dp=2))).unused_parameters == ()


def test_blocks_sharing_a_module_are_not_fsdp_units_of_their_own():
    assert fsdp_units(build_shared_blocks()) == []
    assert len(fsdp_units(build_tiny_gpt())) == 2


# -- shard runs the same checks ------------------------------------------------------------------------

def _shard_tiny_gpt(ctx):
    sk.shard(build_tiny_gpt(), ctx.plan)


def test_shard_without_validate_gets_the_same_plan_error(world):
    plan = sk.Plan(sk.Mesh(fsdp=2, dp=2))  # dp after fsdp: HSDP's replicate dim must come first
    with pytest.raises(sk.PlanError) as before:
        sk.validate(plan, meta_model(build_tiny_gpt))
    with pytest.raises(sk.WorldError) as inside:
        world(4).run(_shard_tiny_gpt, plan=plan)
    assert "PlanError" in inside.value.details and str(before.value) in inside.value.details


def test_a_tie_given_two_layouts_is_refused_and_a_rule_for_its_second_name_is_not_unused():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", sk.PlanWarning)  # LLAMA_RULES' lm_head rule is the tie's, not unused
        _facts(build_llama_tied, sk.Plan(sk.Mesh(tp=2), LLAMA_RULES))
    rules = sk.LayoutMap([(r"lm_head[.]weight", None), *LLAMA_RULES.items()])
    (problem,) = _problems(build_llama_tied, sk.Plan(sk.Mesh(tp=2), rules))
    assert "'lm_head.weight' is tied to 'model.embed_tokens.weight'" in problem and "one layout" in problem


def test_a_split_parameter_held_by_a_module_without_a_style_is_refused():
    """BERT's MLM head holds its bias twice (``cls.predictions.bias`` is ``decoder.bias``): split, it passed
    validate and failed in the workers (torch distributed it twice). Refused before launch, naming both."""
    from transformers import BertConfig, BertForMaskedLM

    model = sk.meta_model(BertForMaskedLM, BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=4, intermediate_size=64,
                                                      max_position_embeddings=64))
    rules = sk.LayoutMap([(r"cls\.predictions\.bias", ("tp",)), (r"cls\.predictions\.decoder\.weight", ("tp", None)),
                          (r"bert\.embeddings\.word_embeddings\.weight", ("tp", None)), (r".*", None)])
    with pytest.raises(sk.PlanError, match="parameter 'cls.predictions.bias' is also 'cls.predictions.decoder.bias': "
                                           "split over 'tp' .* 'cls.predictions' is not split by a tensor-parallel "
                                           "style of its own; keep it replicated"):
        sk.validate(sk.Plan(sk.Mesh(tp=2), rules=rules), model)


def test_partial_gradients_are_found_by_dataflow_not_by_transformers_marks():
    """transformers marks Qwen 3's q_norm/k_norm replicated_with_grad_allreduce; shardkit no longer reads the
    mark (once a list of modules it refused beside split activations): it follows the split activations on
    meta. The per-head norms are summed; a module marked so that runs on whole activations needs nothing."""
    model = meta_model(build_qwen3)
    rules = sk.LayoutMap.from_hf(model)
    report = sk.validate(sk.Plan(sk.Mesh(tp=2), rules), model, 2)
    assert "model.layers.0.self_attn.q_norm.weight" in report.facts.tensor_parallel["tp"].summed
    model.tp_plan = {**hf_tp_plan(model), "model.layers.*.post_attention_layernorm": "replicated_with_grad_allreduce"}
    summed = sk.validate(sk.Plan(sk.Mesh(tp=2), rules), model, 2).facts.tensor_parallel["tp"].summed
    assert not any("post_attention_layernorm" in name for name in summed)
