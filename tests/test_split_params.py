"""Parameters outside the split layers that act on split activations (issue 15, 1st class; 4, 1st bullet).

Apertus' xIELU scalars on tensor-parallel-split MLP features (their gradients summed over tp),
Qwen 3's per-head norms (the same, no longer a special case), GPT-OSS' per-head ``sinks``
(sliced with their heads); on hand-written modules, the planner's decision per parameter; a
split layout on a module no tensor-parallel mechanism runs (Conv2d) refused before launch.
"""

from __future__ import annotations

import pytest
import torch
from model_zoo import _seeded, build_qwen3, loss, tokens
from torch import nn

import shardkit as sk
from shardkit.planner.meta import meta_model
from shardkit.planner.split_activations import follow_splits

TP2 = sk.Mesh(tp=2)


def build_apertus():
    """Apertus: xIELU's learnable scalars alpha_p/alpha_n applied to the split up_proj features."""
    from transformers import ApertusConfig, ApertusForCausalLM

    return _seeded(lambda: ApertusForCausalLM(ApertusConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, attn_implementation="sdpa")))


def build_gpt_oss():
    """GPT-OSS: one attention sink per head (``sinks``), concatenated with the scores of its head."""
    from transformers import GptOssConfig, GptOssForCausalLM

    return _seeded(lambda: GptOssForCausalLM(GptOssConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=256, max_position_embeddings=64,
        sliding_window=8, attn_implementation="eager")))


#: GPT-OSS' attention split over tp (transformers' own plan splits only its embedding).
GPT_OSS_ATTENTION = sk.LayoutMap([(r".*self_attn\.(q|k|v)_proj\.weight", ("tp", None)),
                                  (r".*self_attn\.(q|k|v)_proj\.bias", ("tp",)),
                                  (r".*self_attn\.o_proj\.weight", (None, "tp")), (".*", None)])
WATCHED = ("act_fn.alpha_p", "act_fn.alpha_n", "q_norm.weight", "sinks")


def _trained(ctx, build, steps: int) -> dict[str, torch.Tensor]:
    """The watched parameters after ``steps`` SGD steps: this rank's own copy (its local tensor)
    for a replicated one, the whole tensor for a split one."""
    model = sk.shard(build(), ctx.plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        optimizer.zero_grad()
        model.step(*ctx.shard_batch(*tokens()), loss)
        optimizer.step()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters() if n.endswith(WATCHED)}


def _one_process(build, steps: int) -> dict[str, torch.Tensor]:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    inputs, targets = tokens()
    for _ in range(steps):
        optimizer.zero_grad()
        loss(model(inputs), targets).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(WATCHED)}


@pytest.mark.parametrize(("build", "rules"), [(build_apertus, None), (build_qwen3, None),
                                             (build_gpt_oss, GPT_OSS_ATTENTION)], ids=["apertus", "qwen3", "gpt-oss"])
def test_every_rank_trains_them_as_one_process_does(world, build, rules):
    """Before: Apertus' alpha_p/alpha_n differed between the ranks (and from one process) by ~1.5e-3
    after one step; GPT-OSS failed in the workers with a torch.cat size error."""
    plan = sk.Plan(TP2, rules or sk.LayoutMap.from_hf(meta_model(build)))
    ranks = world(2).run(_trained, build, 2, plan=plan)
    reference = _one_process(build, 2)
    assert len(reference) >= 2 and all(set(found) == set(reference) for found in ranks)
    for name, expected in reference.items():
        for rank, found in enumerate(ranks):
            torch.testing.assert_close(found[name], expected, atol=1e-5, rtol=1e-4,
                                       msg=lambda m, name=name, rank=rank: f"{name} on rank {rank}: {m}")


def test_the_planner_finds_them_by_dataflow():
    apertus = sk.validate(sk.Plan(TP2, sk.LayoutMap.from_hf(meta_model(build_apertus))), meta_model(build_apertus))
    plan = apertus.facts.tensor_parallel["tp"]
    assert {n for n in plan.summed if n.startswith("model.layers.0.")} == {
        "model.layers.0.mlp.act_fn.alpha_p", "model.layers.0.mlp.act_fn.alpha_n",
        "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"}
    assert plan.sliced == ()
    gpt_oss = sk.validate(sk.Plan(TP2, GPT_OSS_ATTENTION), meta_model(build_gpt_oss)).facts.tensor_parallel["tp"]
    assert gpt_oss.sliced == (("model.layers.0.self_attn.sinks", 0), ("model.layers.1.self_attn.sinks", 0))
    assert gpt_oss.summed == ()
    written = sk.LayoutMap([(r".*\.sinks", ("tp",)), *GPT_OSS_ATTENTION.items()])  # the split written out: the same
    plan = sk.validate(sk.Plan(TP2, written), meta_model(build_gpt_oss)).facts.tensor_parallel["tp"]
    assert plan.sliced == gpt_oss.sliced and plan.splits == gpt_oss.splits


# -- the decision per parameter, on hand-written modules (no processes) ------------------------------
class _Block(nn.Module):
    """up (column-parallel) -> ``mix`` -> down (row-parallel); ``mix`` uses this block's own parameters."""

    def __init__(self, mix: str):
        super().__init__()
        self.up, self.down, self.mix = nn.Linear(8, 16), nn.Linear(16, 8), mix
        self.scale = nn.Parameter(torch.ones(()))
        self.bias = nn.Parameter(torch.zeros(16))
        self.head_gain = nn.Parameter(torch.ones(4))  # one per group of 4 features ("heads")
        self.outer = nn.Parameter(torch.ones(8))  # on the whole input only
        self.child = nn.Module()
        self.child.gain = nn.Parameter(torch.ones(()))  # read by this block's forward, not its own

    def forward(self, x):
        h = self.up(x * self.outer)
        if self.mix == "scale":
            h = torch.tanh(h) * self.scale
        elif self.mix == "bias":
            h = h + self.bias
        elif self.mix == "heads":
            h = (h.view(*h.shape[:-1], 4, 4) * self.head_gain.view(4, 1)).flatten(-2)
        elif self.mix == "both":
            h = h * self.scale + x.sum(-1, keepdim=True) * self.scale
        elif self.mix == "child":
            h = h * self.child.gain
        elif self.mix == "shuffled":
            h = h * self.bias.view(2, 8).t().reshape(16)
        return self.down(h)


_SPLIT = {"up.weight", "up.bias", "down.weight"}


def _uses(mix: str) -> dict[str, set[tuple[str, int | None]]]:
    flow = follow_splits(_Block(mix), (torch.zeros(2, 3, 8),), {"up"}, {"up", "down"}, _SPLIT)
    return {n: {(u.kind, u.dim) for u in uses} for n, uses in flow.uses.items()}


@pytest.mark.parametrize(("mix", "expected"), [
    ("scale", {"scale": {("summed", None)}}),  # a learnable scalar times split features
    ("bias", {"bias": {("sliced", 0)}}),  # a per-feature bias on split features: each rank its slice
    ("heads", {"head_gain": {("sliced", 0)}}),  # one value per group of split features
    ("both", {"scale": {("summed", None), ("whole", None)}}),
    ("shuffled", {"bias": {("mixed", None)}}),  # lined up with the split only after a transpose: no slice fits
], ids=["scale", "bias", "heads", "both", "shuffled"])
def test_each_use_is_classified(mix, expected):
    uses = _uses(mix)
    assert uses.pop("outer") == {("whole", None)}  # a parameter on unsplit activations: nothing to do
    assert uses == expected


def _plan_of(mix: str) -> sk.Plan:
    return sk.Plan(TP2, sk.LayoutMap([(r"up\.weight", ("tp", None)), (r"up\.bias", ("tp",)),
                                      (r"down\.weight", (None, "tp")), (".*", None)]))


@pytest.mark.parametrize(("mix", "message"), [
    ("both", r"parameter 'scale' is used in mul .* as a whole on each rank's part of split features and in mul as a "
             r"whole on whole activations"),
    ("child", r"parameter 'child.gain' acts on activations split over 'tp' \(summed\), but the forward reads it "
              r"outside its module's forward \(in the root\)"),
    ("shuffled", r"parameter 'bias' is combined with an activation computed from 'up', split over 'tp', in mul: .*"
                 r"valid: replicate 'up' and the layer it feeds \(layout None\), or drop 'tp'"),
])
def test_what_cannot_be_made_right_is_refused_naming_the_parameter(mix, message):
    with pytest.raises(sk.PlanError, match=message):
        sk.validate(_plan_of(mix), _Block(mix).to("meta"), example_inputs=(torch.zeros(2, 3, 8),))


def test_a_bias_on_split_features_is_sliced_and_a_wrong_size_refused():
    report = sk.validate(_plan_of("bias"), _Block("bias").to("meta"), example_inputs=(torch.zeros(2, 3, 8),))
    assert report.facts.tensor_parallel["tp"].sliced == (("bias", 0),)
    with pytest.raises(sk.PlanError, match=r"parameter 'head_gain' \(shape \[4\]\) lines its dim 0 up with the split "
                                           r"in mul .* but tp=8 does not divide 4; valid tp sizes: \[1, 2, 4\]"):
        sk.validate(sk.Plan(sk.Mesh(tp=8), _plan_of("heads").rules), _Block("heads").to("meta"),
                    example_inputs=(torch.zeros(2, 3, 8),))


def test_a_split_layout_on_a_module_without_a_tensor_parallel_mechanism_is_refused():
    """A Conv2d weight split over tp passed validate and failed in the workers."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 2))
    rules = sk.LayoutMap([(r"0\.weight", ("tp", None, None, None)), (".*", None)])
    with pytest.raises(sk.PlanError, match=r"parameter '0.weight' .*Conv2d.* split over 'tp'"):
        sk.validate(sk.Plan(TP2, rules), model.to("meta"), example_inputs=(torch.zeros(2, 3, 6, 6),))
