"""The planner's entry points never answer a number they cannot stand behind: an unresolved (-1)
axis, a size that is not a whole number >= 1, or an axis the estimate does not price is refused
naming it and what is valid; what is priced is the plan given (its rules, FSDP2's padding, a tied
head's copy); the planner asks nothing of axes it does not search (`shardkit plan --axes dp,fsdp`
on a mixture of experts); `shardkit plan --rules`."""

from __future__ import annotations

import textwrap

import pytest

import shardkit as sk
from shardkit.cli import main
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt
from shardkit.planner.estimate import estimate, kv_cache_bytes
from shardkit.planner.explain import estimate_memory

A100 = "a100-80g"
LM_HEAD_ONLY = sk.LayoutMap([(r"lm_head\.weight", ("tp", None)), (r".*", None)])


def _est(plan, model="gpt-small", batch=8, seq=128, **kw):
    return estimate(model, plan, batch_size=batch, seq_len=seq, hardware=A100, **kw)


# -- an unresolved axis -------------------------------------------------------------------------

def test_an_inferred_axis_is_resolved_from_the_world_size_or_refused_by_name():
    with pytest.raises(sk.PlanError, match=r"estimate\(\): mesh axis 'fsdp' is -1.*pass world_size=N"):
        _est(sk.Plan(sk.Mesh(fsdp=-1)))
    with pytest.raises(sk.PlanError, match=r"mesh axis 'fsdp' is -1.*a multiple of 2"):
        _est(sk.Plan(sk.Mesh(fsdp=-1, tp=2), GPT_RULES))
    with pytest.raises(sk.PlanError, match=r"estimate_memory\(\): mesh axis 'dp' is -1"):
        estimate_memory(sk.Plan(sk.Mesh(dp=-1)), build_tiny_gpt())
    resolved = _est(sk.Plan(sk.Mesh(fsdp=-1)), world_size=4)
    assert resolved.memory == _est(sk.Plan(sk.Mesh(fsdp=4))).memory
    assert all(value >= 0 for value in resolved.memory.values()) and 0 < resolved.mfu <= 1


@pytest.mark.parametrize("world_size", [0, -4, 4.0, True, "4"])
def test_a_world_size_is_a_whole_number_of_devices(world_size):
    with pytest.raises(sk.UsageError, match=r"estimate\(world_size=.*\): the number of devices, a whole number >= 1"):
        _est(sk.Plan(sk.Mesh(fsdp=-1)), world_size=world_size)


@pytest.mark.parametrize("world_size", [0, -2, 2.0, True])
def test_explain_names_a_world_size_that_is_no_number_of_devices(world_size):
    with pytest.raises(sk.PlanError, match=rf"world size {world_size!r}: the number of devices, a whole number >= 1"):
        sk.explain_plan(sk.Plan(sk.Mesh(fsdp=-1)), build_tiny_gpt(), world_size=world_size)


# -- sizes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [-1, 0, 2.5, True, "8"])
def test_a_batch_that_is_not_a_positive_whole_number_says_what_is_valid(batch):
    with pytest.raises(sk.PlanError) as err:
        _est(sk.Plan(sk.Mesh(dp=2)), batch=batch)
    assert f"a batch of {batch!r} samples: give a whole number of samples, a positive multiple of 2" in str(err.value)


def test_a_pipelines_batch_is_a_multiple_of_its_micro_batches():
    plan = sk.Plan(sk.Mesh(pp=2, dp=2), pipeline=sk.Pipeline(microbatches=4))
    with pytest.raises(sk.PlanError, match=r"a positive multiple of 8 \(dp=2 x fsdp=1 x 4 micro-batches\), e\.g\. 8"):
        _est(plan, batch=-8)


@pytest.mark.parametrize("seq", [0, -3, 128.0, True])
def test_a_sequence_length_is_a_positive_whole_number(seq):
    with pytest.raises(sk.PlanError, match="sequence length .* must be a positive integer"):
        _est(sk.Plan(sk.Mesh(dp=2)), seq=seq)


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_accumulation_steps_are_a_whole_number(steps):
    with pytest.raises(sk.UsageError, match=r"grad_accum=.*: give a whole number of steps >= 1"):
        _est(sk.Plan(sk.Mesh(dp=2)), grad_accum=steps)


@pytest.mark.parametrize("kwargs", [{"tp": 0}, {"tp": -1}, {"tp": 1.0}, {"pp": 0}, {"batch_size": -1},
                                    {"batch_size": 0}, {"batch_size": 1.5}, {"seq_len": -3}, {"seq_len": True}])
def test_kv_cache_sizes_are_whole_numbers(kwargs):
    given = {"tp": 1, "pp": 1, "batch_size": 1, "seq_len": 8, **kwargs}
    name, value = next(iter(kwargs.items()))
    with pytest.raises(sk.UsageError, match=rf"kv_cache_bytes\({name}={value!r}\): give whole numbers >= 1"):
        kv_cache_bytes("gpt-small", **given)


def test_an_axis_the_estimate_does_not_price_is_refused_by_name():
    rules = sk.LayoutMap([(r"lm_head\.weight", ("expert", None)), (r".*", None)])
    with pytest.raises(sk.PlanError, match=r"mesh axes \{'expert': 2\} split parameters by their own rules, which the "
                                           r"estimate does not price; it prices pp, dp, fsdp, ep, sp, tp"):
        _est(sk.Plan(sk.Mesh(dp=2, expert=2), rules))
    assert _est(sk.Plan(sk.Mesh(dp=2, expert=1), rules)).memory == _est(sk.Plan(sk.Mesh(dp=2))).memory


def test_estimate_wants_a_plan():
    with pytest.raises(sk.UsageError, match=r"estimate\(plan=...\) must be a shardkit Plan, got Mesh"):
        _est(sk.Mesh(dp=2))


# -- what is priced is the plan given --------------------------------------------------------------

def test_tensor_parallel_is_priced_with_the_plans_rules():
    megatron, head_only = _est(sk.Plan(sk.Mesh(tp=2), GPT_RULES)), _est(sk.Plan(sk.Mesh(tp=2), LM_HEAD_ONLY))
    whole = _est(sk.Plan(sk.Mesh(dp=1))).memory["parameters"]
    assert megatron.memory["parameters"] < head_only.memory["parameters"] < whole


@pytest.mark.parametrize("fsdp", [3, 5, 7])
def test_fsdp_pads_each_tensor_as_torch_does(fsdp):
    model = build_tiny_gpt()
    padded = sum(p.detach().chunk(fsdp, 0)[0].numel() * 4 for p in model.parameters())
    e = estimate(model, sk.Plan(sk.Mesh(fsdp=fsdp)), batch_size=fsdp, seq_len=32, hardware=A100)
    assert e.memory["parameters"] == padded


def _tied_llama(tied: bool = True):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=tied,
                       max_position_embeddings=128)


def test_a_tied_embedding_is_held_once_and_copied_to_a_pipelines_last_stage():
    a = sk.analyse(_tied_llama(), seq_len=64)
    one = estimate(_tied_llama(), sk.Plan(sk.Mesh(dp=1)), batch_size=1, seq_len=64, hardware=A100)
    assert one.memory["parameters"] == 4 * a.total_params  # the embedding and the LM head are one tensor
    plan = sk.Plan(sk.Mesh(pp=2), pipeline=sk.Pipeline(schedule="gpipe", microbatches=2))
    last = estimate(_tied_llama(), plan, batch_size=2, seq_len=64, hardware=A100)
    # the last stage (it holds the logits too): its two blocks, the final norm and its own copy of the embedding
    assert last.memory["parameters"] == 4 * (2 * a.block.params + a.head.params + 32000 * 256)


# -- the planner asks nothing of axes it does not search ------------------------------------------

QWEN3_MOE = '''
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig


    def config():
        return Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                              num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64)


    def build():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config())
'''


@pytest.fixture
def qwen3_moe(tmp_path, monkeypatch):
    (tmp_path / "planner_qwen3_moe.py").write_text(textwrap.dedent(QWEN3_MOE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import planner_qwen3_moe

    return planner_qwen3_moe


def test_plan_searches_data_axes_of_a_mixture_of_experts(qwen3_moe, capsys, no_processes):
    """Its experts' tensor-parallel style has no shardkit equivalent, which matters only to tp."""
    code = main(["plan", "--model", "planner_qwen3_moe:build", "--devices", "4", "--axes", "dp,fsdp",
                 "--global-batch", "8", "--seq", "32", "--hardware", A100])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "candidates (fastest first)" in out and "fsdp=4" in out


def test_the_experts_are_counted_in_the_analysis(qwen3_moe):
    """torch's FLOP counter has no formula for the experts' grouped product: each routed token
    costs its top-k experts' gate/up and down products, besides the router."""
    a = sk.analyse(qwen3_moe.config(), seq_len=16)
    hidden, inner, experts, top = 32, 16, 4, 2
    router = 2 * hidden * experts
    per_expert = 2 * hidden * 2 * inner + 2 * inner * hidden
    assert a.block.flops_per_token["mlp"] == router + top * per_expert
    # transformers' plans are read: its expert-parallel plan for a MoE (planner/model_rules.py), so the
    # stacked expert weights stay whole over tp, as the runtime holds them (ep splits them), while the
    # attention keeps its tensor-parallel layout
    assert a.tp_rules().lookup("model.layers.0.mlp.experts.down_proj")[1] is None
    assert a.tp_rules().lookup("model.layers.0.self_attn.q_proj.weight")[1] == ("tp", None)


# -- shardkit plan --rules -------------------------------------------------------------------------

def test_plan_takes_rules_from_a_file(tmp_path, capsys, no_processes):
    rules, out = tmp_path / "rules.yaml", tmp_path / "plan.yaml"
    rules.write_text("- ['lm_head\\.weight', [tp, null]]\n- ['.*', null]\n")
    argv = ["plan", "--model", "gpt-small", "--devices", "2", "--axes", "tp", "--global-batch", "4", "--seq", "64",
            "--hardware", A100, "--rules", str(rules)]
    assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    plan = sk.Plan.load(out)
    assert plan.mesh == sk.Mesh(tp=2) and plan.rules == LM_HEAD_ONLY
    capsys.readouterr()
    assert main([*argv[:6], "dp", *argv[7:]]) == 0
    assert f"--rules {rules}: not read, tp is not searched (--axes dp)" in capsys.readouterr().out
    rules.write_text("- ['.*', null]\n")
    assert main(argv) == 2
    assert "give a LayoutMap that splits the model over 'tp'" in capsys.readouterr().err


def test_autoshard_refuses_rules_without_tp():
    with pytest.raises(sk.UsageError, match=r"autoshard\(rules=...\): give a LayoutMap that splits the model over 'tp'"):
        sk.autoshard("gpt-small", devices=2, hardware=A100, global_batch=4, seq_len=64,
                     rules=sk.LayoutMap([(".*", None)]))
    best = sk.autoshard("gpt-small", devices=2, hardware=A100, global_batch=4, seq_len=64, axes=("tp",),
                        rules=LM_HEAD_ONLY)[0]
    assert best.plan.rules == LM_HEAD_ONLY and best.estimate.memory == _est(best.plan, batch=4, seq=64).memory

