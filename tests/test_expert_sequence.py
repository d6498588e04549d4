"""Expert parallelism with the sequence split, against one process: context parallel (``sp``:
each rank routes its chunks of the sequence, the experts per token) and Megatron sequence
parallel (``tp`` with ``sequence_parallel=True``: each ``tp`` rank routes its own part of the
residual stream; Qwen2-MoE's shared expert and gate, replicated, get their gradient summed over ``tp``). Loss of every step, step 0's gradients and the weights after 3 SGD steps, as
:mod:`test_expert_compose` checks the other axes, on one shared 4-process world."""

from __future__ import annotations

import pytest
from test_expert_compose import _train_cases, check_matches_one_process

CASES = [("gpt-moe", "sp=2,ep=2"), ("gpt-moe@seqpar", "tp=2,ep=2"), ("mixtral@seqpar", "tp=2,ep=2"),
         ("qwen2-moe@seqpar", "tp=2,ep=2")]


@pytest.fixture(scope="module")
def results(world):
    runs = world(4).run(_train_cases, CASES)
    for i, case in enumerate(CASES):
        print(f"{case}: {max(run[i][-1] for run in runs):.1f} s")
    return {case: [run[i] for run in runs] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_expert_parallel_with_the_sequence_split_matches_one_process(results, case):
    check_matches_one_process(case, results[case])


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_each_rank_routes_only_its_own_part_of_the_sequence(results, case):
    """8 samples of 16 tokens over 2 data ranks, the sequence halved over sp or tp: each rank sends
    32 tokens x top 2 = 64 rows per MoE layer (64 tokens' 128 if every tp rank routed them all)."""
    for rank in results[case]:
        assert rank[8] == [64, 64]


# -- the sequence checks follow the experts as one per-token op, nothing else ----------------------------------------
def _cp_problems(model) -> list[str]:
    from shardkit.families import family_of
    from shardkit.planner.sequence_checks import context_parallel_checks

    return context_parallel_checks(model, family_of(model), sp=2)[1]


def test_the_experts_dispatch_is_per_token_but_what_follows_it_is_still_checked():
    """The experts' sort, exchange and combine keep each token's row its own: no problem under sp.
    A scan over the tokens on the experts' output (a forward hook) is still found."""
    from shardkit.models.gpt import build_tiny_gpt_moe
    from shardkit.planner.meta import meta_model

    model = meta_model(build_tiny_gpt_moe)
    assert _cp_problems(model) == []
    model.get_submodule("layers.1.mlp.experts").register_forward_hook(lambda _m, _a, out: out.cumsum(0))
    problems = _cp_problems(model)
    assert len(problems) == 1 and "computes a cumulative sum over the sequence (a scan) (aten.cumsum)" in problems[0]


def _refused(plan, build) -> str:
    import shardkit as sk
    from shardkit.planner.meta import meta_model

    with pytest.raises(sk.PlanError) as info:
        sk.validate(plan, meta_model(build))
    return str(info.value)


def test_what_sequence_parallel_with_ep_cannot_keep_is_refused_by_name():
    """Router losses and bias balancing (batch totals not summed over tp), and a MoE block whose
    layers are split over tp (it runs on the rank's own plain part of the sequence)."""
    import dataclasses

    import shardkit as sk
    from shardkit.models.gpt import GPT, GPT_RULES, tiny_moe_config
    from shardkit.models.hf import build_tiny_qwen2_moe

    plan = sk.Plan(mesh=sk.Mesh(tp=2, ep=2), rules=GPT_RULES, sequence_parallel=True)
    text = _refused(plan, lambda: GPT(dataclasses.replace(tiny_moe_config(), router_aux_loss_coef=0.01,
                                                          balance="bias", bias_update_rate=0.01)))
    assert ("GPT's forward computes a router auxiliary loss (shardkit.models.gpt.load_balancing_loss_func) over the "
            "whole batch; with sequence_parallel=True and ep=2 each of the tp=2 ranks routes its own part") in text
    assert "routers ['layers.0.mlp.gate', 'layers.1.mlp.gate'] balance their experts with a bias" in text
    shared = sk.LayoutMap([(r".*shared_expert\.(gate|up)_proj\.weight", ("tp", None)),
                           (r".*shared_expert\.down_proj\.weight", (None, "tp")), (".*", None)])
    text = _refused(sk.Plan(mesh=sk.Mesh(tp=2, ep=2), rules=shared, sequence_parallel=True), build_tiny_qwen2_moe)
    assert ("MoE block 'model.layers.0.mlp' routes each rank's own part of the sequence under sequence_parallel=True "
            "with 'ep', but its ['model.layers.0.mlp.shared_expert.gate_proj'") in text
