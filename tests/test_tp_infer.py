"""sk.infer_tp_rules: tensor-parallel rules from a model's dataflow on meta. Where transformers has a
plan, the inferred rules give every parameter its layout; where it has none, they equal one process
(sk.verify, tp=2 and fsdp=2 x tp=2); a model with nothing to pair is refused with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_zoo import (
    MIXTRAL_ATTENTION_RULES,
    build_bert,
    build_gemma,
    build_gpt2,
    build_gptj,
    build_layer_norm_between,
    build_layer_norm_between_mlp,
    build_llama_tied,
    build_mistral,
    build_mixtral,
    build_neox,
    build_one_head_attention,
    build_one_head_attention_mlp,
    build_phi3,
    build_qwen2,
    build_rms_norm_between_mlp,
    build_softmax_between_mlp,
    build_two_head_attention_mlp,
    loss,
    tokens,
)
from torch import nn

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt
from shardkit.models.hf import build_tiny_llama
from shardkit.plan.layout import resolve_layouts
from shardkit.planner.meta import meta_model
from shardkit.planner.tensor_parallel import aliases
from shardkit.planner.tp_infer import pair_layers, trace_feeds


def _layouts(model: nn.Module, rules: sk.LayoutMap, axis: str = "tp") -> dict:
    """The resolved layout of every parameter name; a tied alias has its first name's (as validate has)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    params = resolve_layouts(shapes, rules, sk.Mesh(**{axis: 2})).params
    return {name: params[first].layout for name, first in aliases(model).items()}


# -- equal to transformers' own plans ----------------------------------------------------------------

WITH_PLANS = {"llama": build_tiny_llama, "llama tied": build_llama_tied, "qwen2 (q/k/v biases)": build_qwen2,
              "mistral": build_mistral, "gemma (tied)": build_gemma, "phi3 (packed)": build_phi3,
              "gpt-neox (packed head by head)": build_neox, "gpt-j": build_gptj}


@pytest.mark.parametrize("name", list(WITH_PLANS))
def test_inferred_rules_equal_transformers_plan_on_every_parameter(name):
    model = meta_model(WITH_PLANS[name])
    inferred, theirs = _layouts(model, sk.infer_tp_rules(model)), _layouts(model, sk.LayoutMap.from_hf(model))
    assert inferred == theirs
    assert sum(layout is not None for layout in theirs.values()) >= 9  # their plan splits the model


def test_another_axis_name_is_used_throughout():
    model = meta_model(build_tiny_llama)
    inferred = _layouts(model, sk.infer_tp_rules(model, axis="model"), "model")
    assert inferred == _layouts(model, sk.LayoutMap.from_hf(model, axis="model"), "model")
    assert inferred["lm_head.weight"] == ("model", None)


# -- models with no plan: what is split, and that it equals one process --------------------------------

class MLPStack(nn.Module):
    """A hand-written MLP stack: four Linears in a row, then a replicated head."""

    def __init__(self):
        super().__init__()
        self.fc = nn.ModuleList([nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 32), nn.Linear(32, 16)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.fc:
            x = F.gelu(layer(x))
        return self.head(x)


def build_mlp_stack() -> MLPStack:
    torch.manual_seed(0)
    return MLPStack()


def mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)


def _features() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)


COL, ROW = ("tp", None), (None, "tp")
CONV_COL, CONV_ROW = ROW, COL  # GPT-2's Conv1D stores [in, out]
NO_PLAN = {  # model: (builder, batch, loss, {parameter: inferred layout} for what is split)
    "gpt2": (build_gpt2, tokens(), loss, {
        **{f"transformer.h.{i}.{m}.weight": CONV_COL for i in (0, 1) for m in ("attn.c_attn", "mlp.c_fc")},
        **{f"transformer.h.{i}.{m}.bias": ("tp",) for i in (0, 1) for m in ("attn.c_attn", "mlp.c_fc")},
        **{f"transformer.h.{i}.{m}.c_proj.weight": CONV_ROW for i in (0, 1) for m in ("attn", "mlp")},
        "transformer.wte.weight": COL, "lm_head.weight": COL}),  # lm_head is wte (tied)
    "bert": (build_bert, tokens(), loss, {
        **{f"bert.encoder.layer.{i}.{m}.weight": COL for i in (0, 1) for m in
           ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense")},
        **{f"bert.encoder.layer.{i}.{m}.bias": ("tp",) for i in (0, 1) for m in
           ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense")},
        **{f"bert.encoder.layer.{i}.{m}.weight": ROW for i in (0, 1) for m in ("attention.output.dense",
                                                                                 "output.dense")},
    }),  # the decoder's bias is cls.predictions.bias (another module's): it and the tied embedding stay whole
    "shardkit gpt": (build_tiny_gpt, tokens(), loss, {
        **{n: lay for n, lay in _layouts(build_tiny_gpt(), GPT_RULES).items() if lay is not None},
        "embed.weight": COL}),
    "mlp stack": (build_mlp_stack, _features(), mse, {
        "fc.0.weight": COL, "fc.0.bias": ("tp",), "fc.1.weight": ROW,
        "fc.2.weight": COL, "fc.2.bias": ("tp",), "fc.3.weight": ROW}),
}


@pytest.mark.parametrize("name", list(NO_PLAN))
def test_inferred_rules_split_what_megatron_splits(name):
    build, _, _, expected = NO_PLAN[name]
    model = meta_model(build)
    rules = sk.infer_tp_rules(model)
    assert list(rules.items())[-1] == (".*", None)
    assert {n: lay for n, lay in _layouts(model, rules).items() if lay is not None} == expected


VERIFIED = [(name, mesh) for name in NO_PLAN for mesh in ("tp=2", "fsdp=2,tp=2")]


@pytest.mark.parametrize("name, mesh", VERIFIED, ids=[f"{n}-{m}" for n, m in VERIFIED])
def test_inferred_rules_equal_one_process(world, name, mesh):
    build, batch, loss_fn, _ = NO_PLAN[name]
    plan = sk.Plan(sk.Mesh.parse(mesh), sk.infer_tp_rules(meta_model(build)))
    result = sk.verify(build, plan, batch, loss_fn=loss_fn, steps=2, world=world(plan.mesh.size))
    assert result.ok, result


def test_packed_projections_are_split_as_whole_parts_by_validate():
    model = meta_model(build_gpt2)
    report = sk.validate(sk.Plan(sk.Mesh(tp=2), sk.infer_tp_rules(model)), model)
    splits = report.facts.tensor_parallel["tp"].splits
    assert splits["transformer.h.0.attn.c_attn"].packed == 3  # [q | k | v], each rank its heads of each
    phi3 = meta_model(build_phi3)
    splits = sk.validate(sk.Plan(sk.Mesh(tp=2), sk.infer_tp_rules(phi3)), phi3).facts.tensor_parallel["tp"].splits
    assert splits["model.layers.0.mlp.gate_up_proj"].packed == 2  # chunked in two: [gate | up]
    assert splits["model.layers.0.self_attn.qkv_proj"].gather_output  # sliced at global offsets: gathered


# -- what does not pair ----------------------------------------------------------------------------

class Residual(nn.Module):
    """``x + down(relu(up(x)))`` twice, then a norm and a head: up/down pair inside each block;
    a down's output is a residual, which no Linear may take split."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(8, 32), "down": nn.Linear(32, 8)})
                                    for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["down"](torch.relu(block["up"](x)))
        return self.head(self.norm(x))


def test_residuals_norms_and_the_output_are_not_split():
    rules = sk.infer_tp_rules(Residual(), example_inputs=(torch.zeros(2, 5, 8),))
    assert list(rules.items()) == [(r"blocks\.\d+\.down\.weight", ROW), (r"blocks\.\d+\.up\.bias", ("tp",)),
                                   (r"blocks\.\d+\.up\.weight", COL), (".*", None)]


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


class Fork(nn.Module):
    """``a``'s output enters two Linears: splitting it for one would hand the other a shard."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) * self.c(h)


REFUSED = {
    "a single Linear": (nn.Linear(4, 4), "its output reaches the model's output"),
    "a conv net": (nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)),
                   "the forward runs no nn.Linear or Conv1D"),
    "a norm between two Linears": (Norms(), "'a': its output meets parameter 'norm.weight' in layer_norm"),
    "an output entering two Linears": (Fork(), "'a': its output enters 2 linear layers (['b', 'c'])"),
}
REFUSED_INPUTS = {"a conv net": (torch.zeros(1, 3, 8, 8),)}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_model_with_nothing_to_pair_is_refused_with_the_reason(name):
    model, reason = REFUSED[name]
    inputs = REFUSED_INPUTS.get(name, (torch.zeros(2, model.a.in_features if hasattr(model, "a") else 4),))
    with pytest.raises(sk.PlanError, match="no column/row pair found") as info:
        sk.infer_tp_rules(model, example_inputs=inputs)
    assert reason in str(info.value) and type(model).__name__ in str(info.value)


# -- ops that compute across the features a split would cut ------------------------------------------

def _why(model: nn.Module) -> dict[str, str]:
    """Why each layer of a ``BlocksLM`` (tests/model_zoo.py) is not split."""
    return pair_layers(model, trace_feeds(model, (torch.zeros(1, 7, dtype=torch.long),), vocab=256))[1]


RED_TEAM = {  # each rank would normalise, or attend with scores summed, over its part of the features only
    "weightless F.layer_norm between up_proj and down_proj": (
        build_layer_norm_between, "'blocks.0.up_proj': its output passes through layer_norm, which normalises over "
                                  "its split features"),
    "attention over one head of the whole width": (
        build_one_head_attention, "'blocks.0.q_proj': its output enters scaled_dot_product_attention split inside "
                                  "a head"),
}


@pytest.mark.parametrize("name", list(RED_TEAM))
def test_a_pair_only_joined_through_an_op_over_its_features_is_refused_naming_the_op(name):
    build, reason = RED_TEAM[name]
    with pytest.raises(sk.PlanError, match="no column/row pair found in BlocksLM") as info:
        sk.infer_tp_rules(build())
    assert reason in str(info.value)


SPLIT_MLP = {"blocks.0.fc1.weight": COL, "blocks.0.fc1.bias": ("tp",), "blocks.0.fc2.weight": ROW,
             "embed.weight": COL, "head.weight": COL, "head.bias": ("tp",)}
MIXED = {  # model: (builder, the layer that stays whole, why): each block also has an MLP that is split
    "weightless F.layer_norm": (build_layer_norm_between_mlp, "up_proj",
                                "passes through layer_norm, which normalises over its split features"),
    "rms norm written out (mean of squares)": (build_rms_norm_between_mlp, "up_proj",
                                               "passes through mean over its split features"),
    "softmax over the hidden dim": (build_softmax_between_mlp, "up_proj",
                                    "passes through softmax over its split features"),
    "attention over one head": (build_one_head_attention_mlp, "q_proj",
                                "enters scaled_dot_product_attention split inside a head"),
}


def _split_in_block0(model: nn.Module, rules: sk.LayoutMap) -> dict:
    return {n: lay for n, lay in _layouts(model, rules).items() if lay is not None and not n.startswith("blocks.1.")}


@pytest.mark.parametrize("name", list(MIXED))
def test_layers_joined_through_an_op_over_their_features_stay_whole(world, name):
    build, layer, reason = MIXED[name]
    model = build()
    rules = sk.infer_tp_rules(model)
    assert _split_in_block0(model, rules) == SPLIT_MLP
    assert reason in _why(model)[f"blocks.0.{layer}"]
    plan = sk.Plan(sk.Mesh(tp=2), rules)
    result = sk.verify(build, plan, tokens(), loss_fn=loss, steps=2, world=world(2))
    assert result.ok, result


def test_attention_is_split_between_whole_heads_only(world):
    one_head, two_heads = build_one_head_attention_mlp(), build_two_head_attention_mlp()
    assert _split_in_block0(one_head, sk.infer_tp_rules(one_head)) == SPLIT_MLP
    rules = sk.infer_tp_rules(two_heads)  # [B, T, 2, 32]: SDPA contracts over each head's 32 features
    attention = {f"blocks.0.{p}_proj.{kind}": lay for p in "qkv" for kind, lay in (("weight", COL), ("bias", ("tp",)))}
    assert _split_in_block0(two_heads, rules) == {**SPLIT_MLP, **attention, "blocks.0.o_proj.weight": ROW}
    result = sk.verify(build_two_head_attention_mlp, sk.Plan(sk.Mesh(tp=2), rules), tokens(), loss_fn=loss,
                       steps=2, world=world(2))
    assert result.ok, result


HAND_WRITTEN = {  # rules splitting the same pairs by hand: validate follows their outputs as inference does
    "up/down around a weightless layer_norm": (build_layer_norm_between, [
        (r".*up_proj\.weight", COL), (r".*up_proj\.bias", ("tp",)), (r".*down_proj\.weight", ROW)],
        "'blocks.0.up_proj': its output, split over the tensor-parallel axis, passes through layer_norm"),
    "q/k/v/o of one-head attention": (build_one_head_attention, [
        (r".*[qkv]_proj\.weight", COL), (r".*[qkv]_proj\.bias", ("tp",)), (r".*o_proj\.weight", ROW)],
        "'blocks.0.q_proj': its output, split over the tensor-parallel axis, enters scaled_dot_product_attention"),
}


@pytest.mark.parametrize("name", list(HAND_WRITTEN))
def test_validate_refuses_hand_written_rules_splitting_through_an_op_over_the_features(name):
    build, rules, reason = HAND_WRITTEN[name]
    with pytest.raises(sk.PlanError, match="column-parallel layer") as info:
        sk.validate(sk.Plan(sk.Mesh(tp=2), sk.LayoutMap([*rules, (".*", None)])), build())
    assert reason in str(info.value) and "wrong numbers" in str(info.value)
    two_heads = sk.LayoutMap([*HAND_WRITTEN["q/k/v/o of one-head attention"][1], (".*", None)])
    sk.validate(sk.Plan(sk.Mesh(tp=2), two_heads), build_two_head_attention_mlp())  # between whole heads: valid


def test_bad_arguments_are_named():
    with pytest.raises(sk.UsageError, match="model must be an nn.Module, got dict"):
        sk.infer_tp_rules({})
    with pytest.raises(sk.UsageError, match="axis must be a mesh axis name"):
        sk.infer_tp_rules(nn.Linear(2, 2), axis="")
    with pytest.raises(sk.UsageError, match="example_inputs=...\\): must be a tuple"):
        sk.infer_tp_rules(nn.Linear(2, 2), example_inputs=torch.zeros(1, 2))
    with pytest.raises(sk.PlanError, match=r"fails on meta tensors with example inputs of shapes \[\[1, 3\]\]"):
        sk.infer_tp_rules(nn.Linear(2, 2), example_inputs=(torch.zeros(1, 3),))


def test_a_mixture_of_experts_has_its_attention_split_and_its_experts_replicated():
    """The trace failed in torch's meta kernel of grouped_mm ("Expected inputs of BF16 type") and was
    refused; now the experts run on meta (families/on_meta.py) and the rules are those the refusal
    advised writing by hand (MIXTRAL_ATTENTION_RULES, checked in test_validated_models), with the
    embedding and head split over the vocabulary."""
    rules = sk.infer_tp_rules(meta_model(build_mixtral))
    model = meta_model(build_mixtral)
    for name, _ in model.named_parameters():
        inferred = rules.lookup(name)[1]
        by_hand = sk.LayoutMap(MIXTRAL_ATTENTION_RULES).lookup(name)[1]
        assert inferred == by_hand or name in ("model.embed_tokens.weight", "lm_head.weight"), name
    assert rules.lookup("model.layers.0.mlp.experts.gate_up_proj")[1] is None
    assert rules.lookup("lm_head.weight")[1] == ("tp", None)


def test_a_module_whose_input_cannot_be_known_is_asked_for_it():
    """A guessed input ([1, in_features] of the first Linear it found) failed inside the model with
    its own error; shardkit now asks for example_inputs before running anything."""
    conv_first = nn.Sequential(nn.Conv1d(3, 8, 3), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(sk.UsageError, match=r"first layer with parameters is a Conv1d.*pass example_inputs="):
        sk.infer_tp_rules(conv_first)

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x, mask):
            return self.down(self.up(x) * mask)

    with pytest.raises(sk.UsageError, match=r"TwoInputs.forward takes 2 required arguments \(x, mask\).*"
                                            r"pass example_inputs="):
        sk.infer_tp_rules(TwoInputs())
    given = (torch.zeros(2, 5, 3), torch.zeros(2, 1, 16))
    with pytest.raises(sk.PlanError, match=r"example inputs of shapes \[\[2, 5, 3\], \[2, 1, 16\]\]"):
        sk.infer_tp_rules(TwoInputs(), example_inputs=given)  # the model's own error, with what was given
    rules = sk.infer_tp_rules(TwoInputs(), example_inputs=(torch.zeros(2, 8), torch.zeros(2, 1)))
    assert rules.lookup("down.weight")[1] == (None, "tp")


# -- the command line -------------------------------------------------------------------------------

def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from shardkit.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_explain_infers_rules_for_a_model_without_any_and_says_so(capsys, no_processes):
    code, out, err = _cli(["explain", "--model", "cli_models:build_tiny_lm", "--mesh", "tp=2"], capsys)
    assert code == 0
    lines = err.splitlines()
    assert lines[0] == "tensor-parallel rules inferred from the model's dataflow: 6 rules"
    assert lines[1:] == [r"  down_proj\.weight  (None, 'tp')", r"  embed\.weight  ('tp', None)",
                         r"  lm_head\.weight  ('tp', None)", r"  up_proj\.bias  ('tp',)",
                         r"  up_proj\.weight  ('tp', None)", "  .*  None"]
    assert "up_proj.weight" in out and "colwise" in out and "vocab-parallel" in out


@pytest.mark.parametrize("model", ["gpt-tiny", "cli_models:build_tiny_lm"])
def test_rules_are_inferred_only_with_a_tp_axis_and_no_rules(capsys, no_processes, model):
    for mesh in ("fsdp=2", "dp=2"):
        code, _, err = _cli(["explain", "--model", model, "--mesh", mesh], capsys)
        assert code == 0 and err == ""
    if model == "gpt-tiny":  # built-in rules
        code, _, err = _cli(["explain", "--model", model, "--mesh", "tp=2"], capsys)
        assert code == 0 and err == ""
