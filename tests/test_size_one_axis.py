"""A size-1 axis needs no rules: ``tp=1`` reads no tensor-parallel plan and infers none, so a model
whose plan has styles shardkit cannot apply (Qwen3-MoE's experts) is explained, planned and
generated from; ``LayoutMap.from_hf`` reads such a plan (stacked expert weights split on their
own dims), and a parameter whose style has no equivalent is refused naming it and the axis."""

from __future__ import annotations

import json

import pytest
import torch
from model_zoo import with_expert_tp_entries
from pipeline_zoo import build_qwen3_moe

import shardkit as sk
from shardkit.cli import main


def _qwen3_moe_with_expert_entries():
    return with_expert_tp_entries(sk.meta_model(build_qwen3_moe))


def test_from_hf_reads_a_mixture_of_experts_plan():
    """It refused the whole plan for the experts' module style ``moe_tp_experts``; the stacked
    ``[experts, out, in]`` weights take their own entries (packed_colwise: out; rowwise: in)."""
    model = _qwen3_moe_with_expert_entries()
    rules = sk.LayoutMap.from_hf(model)
    assert rules.lookup("model.layers.1.mlp.experts.gate_up_proj")[1] == (None, "tp", None)
    assert rules.lookup("model.layers.1.mlp.experts.down_proj")[1] == (None, None, "tp")
    assert rules.lookup("model.layers.0.self_attn.q_proj.weight")[1] == ("tp", None)
    assert rules.lookup("model.layers.0.self_attn.q_norm.weight")[1] is None
    sk.validate(sk.Plan(sk.Mesh(tp=1), rules), model)  # a size-1 axis splits nothing: nothing refused


def test_the_experts_split_over_tp_larger_than_1_are_refused_before_launch_naming_them():
    """The same rules at tp=2: the stacked experts' grouped product has no DTensor strategy for
    that split, so validate refuses it, naming the expert weight and the axis (not the workers)."""
    model = _qwen3_moe_with_expert_entries()
    with pytest.raises(sk.PlanError) as info:
        sk.validate(sk.Plan(sk.Mesh(tp=2), sk.LayoutMap.from_hf(model)), model)
    assert "mlp.experts.gate_up_proj" in str(info.value) and "'tp'" in str(info.value)


class _Config:
    _attn_implementation = "sdpa"
    base_model_tp_plan = {"layers.*.proj": "colwise", "layers.*.kv_a": "mla_kv_a_proj"}


class _Tiny:
    """What from_hf reads of a transformers model, as plain data."""

    config, base_model_prefix = _Config(), ""

    def named_parameters(self):
        return [("layers.0.proj.weight", torch.empty(4, 2)), ("layers.0.kv_a.weight", torch.empty(4, 2))]


def test_a_parameter_whose_style_has_no_equivalent_is_refused_naming_it_and_the_axis():
    with pytest.raises(sk.PlanError) as info:
        sk.LayoutMap.from_hf(_Tiny(), axis="model")
    assert str(info.value) == ("parameter 'layers.0.kv_a.weight': transformers plan entry 'layers.*.kv_a' has style "
                               "'mla_kv_a_proj', which has no shardkit equivalent over axis 'model'; write a rule for "
                               "it yourself (or replicate it: layout None), or use a mesh with model=1, which needs "
                               "no rules")


def test_explain_at_tp_1_reads_no_plan(capsys, no_processes):
    code = main(["explain", "--model", "pipeline_zoo:build_qwen3_moe", "--mesh", "tp=1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "mlp.experts.gate_up_proj" in out


def test_explain_at_tp_1_infers_no_rules(capsys, no_processes):
    """A model with no rules and nothing to pair (embeddings straight into the head) at tp=1: the
    inference ran and its refusal stopped the command."""
    code = main(["explain", "--model", "cli_models:build_head_only_lm", "--mesh", "tp=1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "inferred" not in err


def test_generate_at_the_default_tp_1_matches_one_process(tmp_path, world, monkeypatch, capsys):
    """``generate`` (default tp=1) of Qwen3-MoE from a folder of its weights (as the model names
    them) makes the tokens a greedy loop over the model in this process makes."""
    model = build_qwen3_moe()
    folder = tmp_path / "qwen3_moe"
    folder.mkdir()
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))
    seen = []
    import shardkit.runtime.world as world_module  # generate imports launch from there when it runs

    launch = world_module.launch

    def borrowed(fn, plan, *args, world_size, timeout):
        seen.append(launch(fn, plan, *args, world=world(world_size), timeout=timeout))
        return seen[-1]

    monkeypatch.setattr(world_module, "launch", borrowed)
    prompt = torch.tensor([[5, 17, 42]])
    code = main(["generate", "--model", "pipeline_zoo:build_qwen3_moe", "--hf", str(folder),
                 "--prompt-ids", "5,17,42", "--max-new-tokens", "4", "--no-eos"])
    assert code == 0, capsys.readouterr().err
    ids = prompt
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert seen[0] == [ids[0, 3:].tolist()]
