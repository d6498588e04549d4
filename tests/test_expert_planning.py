"""Mixtures of experts seen and planned: ``sk.analyse`` / ``sk.estimate`` know experts (active
parameters, FLOPs of ``top_k`` experts, expert memory per device, the all-to-all), ``shardkit
explain`` shows who holds which experts and the exchanges, ``sk.autoshard`` searches ``ep``.

The estimate's parameter bytes are checked against what the ranks of a real world hold, its
FLOPs against torch's count of a real forward; the rest is pure arithmetic on the meta device.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import shardkit as sk
from shardkit.models.gpt import (
    GPT,
    GPTConfig,
    build_tiny_gpt,
    build_tiny_gpt_moe,
    gpt_loss,
    tiny_moe_config,
)
from shardkit.models.hf import build_tiny_mixtral
from shardkit.planner.counters import EXTRA_FLOPS
from shardkit.planner.experts import composition_problems
from shardkit.planner.explain import explain_plan
from shardkit.planner.hardware import hardware
from shardkit.planner.meta import meta_model


def _gpt_moe() -> torch.nn.Module:
    return meta_model(build_tiny_gpt_moe)


def build_two_expert_gpt_moe() -> GPT:
    """The tiny MoE GPT with 2 experts (top 1): under ``fsdp=2,ep=2`` a rank's one expert is fewer
    than the 2 FSDP shards."""
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**tiny_moe_config().__dict__, "experts": 2, "top_k": 1}))


BUILDERS = {"gpt-moe": build_tiny_gpt_moe, "two-experts": build_two_expert_gpt_moe}
#: (model, mesh) of 4 ranks whose parameter bytes the estimate must state exactly.
CASES = (("gpt-moe", "fsdp=2,ep=2"), ("gpt-moe", "ep=4"), ("two-experts", "fsdp=2,ep=2"))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _held(ctx, cases, root: str):
    """Per case, on this rank: the parameter bytes held, each expert parameter's local shape and
    FSDP placement, and for the 2 experts (rank 0) the full weights before and after 3 SGD steps,
    with the losses, saved to ``root``."""
    from shardkit.runtime.apply import full_state_dict

    out = []
    for name, mesh in cases:
        plan = sk.Plan(mesh=sk.Mesh.parse(mesh))
        model = sk.shard(BUILDERS[name](), plan, ctx)
        held = sum(_local(p).numel() * p.element_size() for p in model.parameters())
        experts = {n: (tuple(_local(p).shape), str(p.placements[0])) for n, p in model.named_parameters()
                   if ".experts." in n}
        if name != "two-experts":
            out.append((held, experts, None))
            continue
        initial = full_state_dict(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        data, index = plan.mesh.data_size, plan.mesh.data_index(ctx.rank)
        inputs, targets = (t.chunk(data)[index] for t in _batch())
        losses = []
        for _ in range(3):
            optimizer.zero_grad()
            losses.append(model.step(inputs, targets, gpt_loss).item())
            optimizer.step()
        weights = full_state_dict(model)
        sk.save(root, model, step=3)
        out.append((held, experts, (initial, losses, weights) if ctx.rank == 0 else None))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("two-experts")


@pytest.fixture(scope="module")
def held(world, checkpoint):
    ranks = world(4).run(_held, CASES, str(checkpoint))
    return {case: [rank[i] for rank in ranks] for i, case in enumerate(CASES)}


def test_estimate_states_the_parameter_bytes_every_rank_holds(held):
    """E / ep experts per rank, FSDP over the data axes but ep for them, over all for the rest."""
    for name, mesh in CASES:
        e = sk.estimate(meta_model(BUILDERS[name]), sk.Plan(mesh=sk.Mesh.parse(mesh)), batch_size=8, seq_len=16)
        bytes_held = {rank[0] for rank in held[name, mesh]}
        if name == "two-experts":  # the router [2, 64] over 4 shards: FSDP2 pads 1, 1, 0, 0 rows to 1 each
            bytes_held = {max(bytes_held)}
        assert bytes_held == {e.memory["parameters"]}, mesh
        text = explain_plan(sk.Plan(mesh=sk.Mesh.parse(mesh)), meta_model(BUILDERS[name]))
        assert int(re.search(r"parameter bytes per device: ([\d,]+) B", text).group(1).replace(",", "")) in bytes_held
        assert e.memory["gradients"] == e.memory["parameters"]


def test_fewer_experts_per_rank_than_fsdp_shards_are_sharded_on_another_dim_unpadded(held, checkpoint):
    """2 experts, fsdp=2 x ep=2: each rank holds half of one expert (FSDP shards dim 1), 1/4 of
    the experts exactly, not a whole padded expert; trains as one process; its checkpoint loads
    into one process."""
    whole = {n: p.shape for n, p in build_two_expert_gpt_moe().named_parameters() if ".experts." in n}
    ranks = held["two-experts", "fsdp=2,ep=2"]
    for _, experts, _ in ranks:
        assert experts.keys() == whole.keys()
        for n, (shape, placement) in experts.items():
            assert shape == (1, whole[n][1] // 2, *whole[n][2:]) and placement == "S(1)", (n, shape)
    per_rank = sum(math.prod(s) for s, _ in ranks[0][1].values())
    assert per_rank * 4 == sum(math.prod(s) for s in whole.values())
    e = sk.estimate(meta_model(build_two_expert_gpt_moe), sk.Plan(mesh=sk.Mesh(fsdp=2, ep=2)), batch_size=8,
                    seq_len=16)
    assert e.experts.bytes == per_rank * 4  # float32
    initial, losses, weights = ranks[0][2]
    model = build_two_expert_gpt_moe()
    assert _max_diff(initial, dict(model.named_parameters())) == 0  # full_state_dict puts each half in its place
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    inputs, targets = _batch()
    expected = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = gpt_loss(model(inputs), targets)
        loss.backward()
        expected.append(loss.item())
        optimizer.step()
    assert losses == pytest.approx(expected, abs=1e-5)
    assert _max_diff(weights, dict(model.named_parameters())) <= 1e-5
    loaded = build_two_expert_gpt_moe()
    sk.load(checkpoint, loaded)
    assert _max_diff(weights, dict(loaded.named_parameters())) == 0


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n].detach() - b[n].detach()).abs().max()) for n in a)


def test_analyse_counts_active_parameters_and_the_flops_of_top_k_experts():
    model = build_tiny_gpt_moe()
    a = sk.analyse(model, seq_len=16)
    experts = {n: p.numel() for n, p in model.named_parameters() if ".experts." in n}
    assert (a.experts.num_experts, a.experts.top_k) == (4, 2)
    assert a.total_params == sum(p.numel() for p in model.parameters())
    assert a.active_params == a.total_params - sum(experts.values()) + sum(experts.values()) * 2 // 4
    ids = torch.randint(0, 256, (3, 16))
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS) as counter:
        model(ids)
    assert counter.get_total_flops() == a.flops_per_token() * ids.numel()
    grouped = counter.flop_counts["Global"][torch.ops.aten._grouped_mm]
    # 2 FLOPs per weight element of each of the top 2 experts a token visits, not of all 4
    assert grouped == ids.numel() * 2 * 2 * sum(experts.values()) // 4 == a.layers * a.experts.flops_per_token * 48


def test_transformers_experts_are_found_with_their_own_top_k():
    model = meta_model(build_tiny_mixtral)
    a = sk.analyse(model, seq_len=8)
    assert (a.experts.num_experts, a.experts.top_k) == (model.config.num_local_experts,
                                                        model.config.num_experts_per_tok)
    assert sk.analyse(meta_model(build_tiny_gpt), seq_len=8).experts is None


def test_all_to_all_bytes_and_time_per_step_at_balanced_routing():
    hw = hardware("h100-80g")
    batch, seq, dim, top_k, experts, layers = 8, 16, 64, 2, 4, 2
    for ep, mesh in ((2, "fsdp=2,ep=2"), (4, "ep=4")):
        e = sk.estimate(_gpt_moe(), sk.Plan(mesh=sk.Mesh.parse(mesh)), batch_size=batch, seq_len=seq, hardware=hw)
        tokens = batch * seq // 4  # per rank: ep is a data axis
        rows = tokens * top_k * dim * 4 * (ep - 1) // ep  # float32 rows leaving the rank; 1/ep stays
        counts = experts * 8 * (ep - 1) // ep
        assert e.experts.all_to_all_bytes == layers * (counts + 4 * rows)  # out, back, and both backward
        link = hw.link("p2p", across_nodes=False)
        seconds = layers * (5 * (ep - 1) * link.latency + (counts + 4 * rows) / link.bandwidth)
        assert e.step_time_parts["ep"] == pytest.approx(seconds)
        assert e.experts.local == experts // ep
    assert "ep" not in sk.estimate(_gpt_moe(), sk.Plan(mesh=sk.Mesh(fsdp=4)), batch_size=8, seq_len=16).step_time_parts


def test_estimate_refuses_what_validate_refuses_of_ep_by_name():
    with pytest.raises(sk.PlanError, match="MoE layer 'layers.0.mlp.experts' has 4 experts, not divisible by ep=3"):
        sk.estimate(_gpt_moe(), sk.Plan(mesh=sk.Mesh(ep=3)), batch_size=6, seq_len=16)
    with pytest.raises(sk.PlanError, match="mesh axis 'ep' \\(size 2\\) splits the experts of MoE layers, but GPT"):
        sk.estimate(meta_model(build_tiny_gpt), sk.Plan(mesh=sk.Mesh(ep=2)), batch_size=8, seq_len=16)


def test_estimate_summary_says_experts_per_device_and_active_share():
    model = _gpt_moe()
    e = sk.estimate(model, sk.Plan(mesh=sk.Mesh(fsdp=2, ep=2)), batch_size=8, seq_len=16)
    line = next(line for line in e.summary().splitlines() if line.startswith("experts:"))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert e.experts.bytes == experts // 4 * 4  # 1 of 4 experts per device (ep=2, then fsdp=2), float32
    total = sum(p.numel() for p in model.parameters())
    assert line.startswith("experts: 2 of 4 per device in each of 2 MoE layers, 384.00 KiB of expert parameters")
    assert f"top 2: {total - experts // 2:,} of {total:,} parameters active per token" in line


# -- shardkit explain ------------------------------------------------------------------------------------------------
def test_explain_shows_each_ranks_experts_and_the_all_to_all_the_estimate_prices():
    from shardkit.planner.explain import explain_plan

    plan, model = sk.Plan(mesh=sk.Mesh(fsdp=2, ep=2)), _gpt_moe()
    text = explain_plan(plan, model, batch_size=8, seq_len=16)
    assert "ep rank 0 (ranks 0, 2): experts 0-1 of every MoE layer" in text
    assert "ep rank 1 (ranks 1, 3): experts 2-3 of every MoE layer" in text
    rows = {m.group(1): int(m.group(3).replace(",", "")) for m in re.finditer(
        r"^  (counts|rows out|rows back|rows back's gradient|rows out's gradient) +(forward|backward) +([\d,]+)$",
        text, re.MULTILINE)}
    assert rows["rows out"] == 32 * 2 * 64 * 4 // 2 and len(rows) == 5  # 32 tokens per rank x top 2, half stays
    per_step = int(re.search(r"per step: ([\d,]+) B per rank", text).group(1).replace(",", ""))
    e = sk.estimate(model, plan, batch_size=8, seq_len=16)
    assert per_step == 2 * sum(rows.values()) == e.experts.all_to_all_bytes
    assert "experts:" not in explain_plan(sk.Plan(mesh=sk.Mesh(fsdp=4)), model)


# -- sk.autoshard and shardkit plan ----------------------------------------------------------------------------------
def test_autoshard_searches_ep_as_validate_allows_and_says_why_not():
    found = sk.autoshard(_gpt_moe(), devices=8, hardware="h100-80g", global_batch=16, seq_len=16, param_dtype=None,
                         axes=("fsdp", "ep"), top=100)
    assert {c.plan.mesh.size_of("ep") for c in found} == {1, 2, 4}
    for c in found:
        if c.plan.mesh.size_of("ep") > 1:
            assert composition_problems(c.plan) == [] and c.estimate.step_time_parts["ep"] > 0
    refused = {r.family: r.reason for r in found.rejected}
    assert refused["ep=8"] == ("MoE layer 'layers.0.mlp.experts' has 4 experts, not divisible by ep=8; "
                               "valid ep sizes: [1, 2, 4]")
    sk.validate(next(c for c in found if c.plan.mesh.size_of("ep") == 4).plan, _gpt_moe())


def test_the_ep_degrees_searched_follow_what_composes():
    """With tp, pp or sp the search keeps the degrees composition_problems allows, and says why not."""
    from shardkit.planner.costs import Setting
    from shardkit.planner.expert_search import expert_degrees
    from shardkit.planner.experts import model_experts

    def plan(base: Setting, ep: int) -> sk.Plan:
        return sk.Plan(mesh=sk.Mesh(**{a: base.size(a) for a in ("pp", "sp", "tp") if base.size(a) > 1}, ep=ep),
                       pipeline=sk.Pipeline(microbatches=2) if base.pp > 1 else None)

    for base in (Setting(tp=2), Setting(pp=2), Setting(sp=2), Setting()):
        refused: dict[str, str] = {}
        allowed = [ep for ep in (2, 4) if not composition_problems(plan(base, ep))]
        assert expert_degrees(model_experts(_gpt_moe()), ("dp", "ep"), 4, base, refused.setdefault) == [1, *allowed]
        first = next((ep for ep in (2, 4) if ep not in allowed), None)
        assert list(refused.values()) == ([composition_problems(plan(base, first))[0]] if first else [])


def test_plan_refuses_ep_for_a_dense_model_by_name(capsys, no_processes):
    from shardkit.cli import main

    argv = ["plan", "--model", "gpt-tiny", "--devices", "4", "--global-batch", "8", "--seq", "16", "--axes", "fsdp,ep"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert re.search(r"ep > 1 +mesh axis 'ep' \(size 2\) splits the experts of MoE layers, but GPT has none", out)
    assert main([*argv[:2], "gpt-moe", *argv[3:]]) == 0
    assert re.search(r"^\d+ +ep=4 ", capsys.readouterr().out, re.MULTILINE)


def test_autoshard_offers_tp_with_ep_for_transformers_experts():
    """Mixtral's default rules keep the experts whole over tp (its ep plan), so tp x ep is searched
    (before, every tp degree was refused: its tp plan splits the experts), each candidate a plan
    sk.validate takes."""
    model = meta_model(build_tiny_mixtral)
    found = sk.autoshard(model, devices=4, hardware="h100-80g", global_batch=8, seq_len=16, param_dtype=None,
                         axes=("tp", "ep"), top=1000)
    meshes = {(c.plan.mesh.size_of("tp"), c.plan.mesh.size_of("ep")) for c in found}
    assert {(2, 2), (1, 4)} <= meshes, meshes
    assert [r.family for r in found.rejected] == ["tp=4"], found.rejected  # 2 KV heads
    tp_ep = next(c for c in found if c.plan.mesh.size_of("tp") == 2 and c.plan.mesh.size_of("ep") == 2)
    sk.validate(tp_ep.plan, model)
    a = sk.analyse(model, seq_len=16, tp=2)
    assert a.experts.params == a.experts.global_params  # whole on every tp rank: ep splits them, tp does not
