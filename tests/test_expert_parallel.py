"""Expert parallelism (``ep``) against one process: loss, gradients of the router and of every
expert, and weights after 3 SGD steps; the edge cases that break other libraries; and the
refusals of ``sk.validate``.

One job per world runs every case (a world costs seconds to start on 2 cores); the
one-process references run here.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn.functional as F

import shardkit as sk
from shardkit.models.gpt import (
    GPT,
    GPTConfig,
    Router,
    build_tiny_gpt,
    build_tiny_gpt_moe,
    gpt_loss,
    tiny_moe_config,
)
from shardkit.models.hf import build_tiny_mixtral, build_tiny_qwen2_moe, hf_loss
from shardkit.models.registry import model_entry
from shardkit.plan import LayoutMap
from shardkit.planner.meta import meta_model

STEPS, LR = 3, 0.5


class OneSidedRouter(Router):
    """A router whose logits favour experts ``0 .. top_k - 1`` by 30: every token goes to them, so
    under ``ep`` the ranks holding the other experts receive no rows at all."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        skew = torch.zeros(self.weight.shape[0], dtype=x.dtype, device=x.device)
        skew[: self.top_k] = 30.0
        logits = F.linear(x, self.weight) + skew
        weights, index = torch.topk(F.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        return logits, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), index


def build_one_sided_gpt_moe() -> GPT:
    """The tiny MoE GPT with every router :class:`OneSidedRouter`."""
    model = build_tiny_gpt_moe()
    for layer in model.layers:
        layer.mlp.gate.__class__ = OneSidedRouter
    return model


def build_all_experts_gpt_moe() -> GPT:
    """The tiny MoE GPT with ``top_k`` equal to the number of experts (every token to every expert)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**tiny_moe_config().__dict__, "top_k": 4}))


def build_tiny_gpt_oss() -> torch.nn.Module:
    """transformers GPT-OSS, tiny: experts with biases, stored transposed, its own clamped gating."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=128, layer_types=["full_attention"] * 2,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          attn_implementation="eager")
    torch.manual_seed(0)
    return GptOssForCausalLM(config)


def build_bf16_gpt_moe() -> GPT:
    """The tiny MoE GPT in bfloat16 (grouped GEMM and the exchanges in bfloat16)."""
    return build_tiny_gpt_moe().to(torch.bfloat16)


def build_bf16_mixtral() -> torch.nn.Module:
    """The tiny Mixtral in bfloat16."""
    return build_tiny_mixtral().to(torch.bfloat16)


def build_bf16_qwen2_moe() -> torch.nn.Module:
    """The tiny Qwen2-MoE in bfloat16 (its shared expert too)."""
    return build_tiny_qwen2_moe().to(torch.bfloat16)


BUILDERS = {"gpt-moe": (build_tiny_gpt_moe, gpt_loss), "mixtral": (build_tiny_mixtral, hf_loss),
            "qwen2-moe": (build_tiny_qwen2_moe, hf_loss), "one-sided": (build_one_sided_gpt_moe, gpt_loss),
            "top-k=E": (build_all_experts_gpt_moe, gpt_loss), "gpt-moe-bf16": (build_bf16_gpt_moe, gpt_loss),
            "mixtral-bf16": (build_bf16_mixtral, hf_loss), "qwen2-moe-bf16": (build_bf16_qwen2_moe, hf_loss),
            "gpt-oss": (build_tiny_gpt_oss, hf_loss)}


def _batch(samples: int = 8, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (samples, seq + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


#: (model, mesh, (samples, seq)) per world size. ``@meta``: built on meta and initialised per module;
#: ``@accumulate``: 2 micro-batches per step; ``@clip``: gradients clipped to :data:`MAX_NORM`.
CASES = {
    2: [("gpt-moe", "ep=2", (8, 16)), ("mixtral", "ep=2", (8, 16)), ("qwen2-moe", "ep=2", (8, 16)),
        ("one-sided", "ep=2", (8, 16)), ("top-k=E", "ep=2", (4, 8)), ("gpt-moe", "ep=2", (2, 1)),
        ("gpt-moe-bf16", "ep=2", (8, 16)), ("mixtral-bf16", "ep=2", (8, 16)), ("gpt-oss", "ep=2", (8, 16))],
    4: [("gpt-moe", "ep=4", (8, 16)), ("gpt-moe", "fsdp=2,ep=2", (8, 16)), ("gpt-moe", "dp=2,ep=2", (8, 16)),
        ("mixtral", "fsdp=2,ep=2", (8, 16)), ("mixtral", "ep=4", (8, 16)),
        ("qwen2-moe", "ep=4", (8, 16)), ("qwen2-moe", "fsdp=2,ep=2", (8, 16)), ("qwen2-moe-bf16", "fsdp=2,ep=2", (8, 16)), ("one-sided", "ep=4", (8, 16)), ("gpt-moe@meta", "fsdp=2,ep=2", (8, 16)),
        ("gpt-moe@accumulate@clip", "fsdp=2,ep=2", (8, 16))],
}
ROUTER = re.compile(r"\.(gate|router)\.(weight|bias)$")  # the routers of gpt-moe, Mixtral, Qwen2-MoE, GPT-OSS
MAX_NORM = 0.05  # below every step's gradient norm: clipping acts


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _train_cases(ctx, cases):
    """Every case on this rank: 3 SGD steps sharded; the losses, step 0's full gradients, the
    final full weights (rank 0), this rank's own router gradients and the rows its experts got."""
    from shardkit.runtime.apply import full_grads, full_state_dict

    out = []
    for name, mesh, shape in cases:
        model_name, *options = name.split("@")
        build, loss_fn = BUILDERS[model_name]
        plan = sk.Plan(mesh=sk.Mesh.parse(mesh))
        model = sk.shard(meta_model(build) if "meta" in options else build(), plan, ctx)
        initial = full_state_dict(model)
        held = sum(_local(p).numel() * p.element_size() for p in model.parameters())
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        data, index = plan.mesh.data_size, plan.mesh.data_index(ctx.rank)
        inputs, targets = (t.chunk(data)[index] for t in _batch(*shape))
        losses, grads, routers, rows = [], None, None, {}
        for step in range(STEPS):
            optimizer.zero_grad()
            losses.append(model.step(inputs, targets, loss_fn, accumulate=2 if "accumulate" in options else 1).item())
            if "clip" in options:
                sk.clip_grad_norm_(model, MAX_NORM)
            if step == 0:
                grads = full_grads(model)
                routers = {n: _local(p.grad).clone() for n, p in model.named_parameters() if ROUTER.search(n)}
                rows = {n: m._sk_rows.received for n, m in model.named_modules() if hasattr(m, "_sk_rows")}
            optimizer.step()
        weights = full_state_dict(model)
        out.append((losses, grads if ctx.rank == 0 else None, weights if ctx.rank == 0 else None, routers, rows,
                    initial if ctx.rank == 0 else None, held))
    return out


def _reference(name: str, shape: tuple[int, int], initial: dict[str, torch.Tensor] | None = None):
    """One process: the losses, step 0's gradients and the final weights of 3 SGD steps (from
    the ``initial`` weights when given: a model built on meta is initialised per module). Each
    is computed once: two tests read the same reference."""
    if initial is None:
        return _built_reference(name, shape)
    return _run_reference(name, shape, initial)


@functools.cache
def _built_reference(name: str, shape: tuple[int, int]):
    return _run_reference(name, shape, None)


def _run_reference(name: str, shape: tuple[int, int], initial: dict[str, torch.Tensor] | None):
    model_name, *options = name.split("@")
    build, loss_fn = BUILDERS[model_name]
    model = build()
    if initial is not None:
        model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    inputs, targets = _batch(*shape)
    losses, grads = [], None
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        losses.append(loss.item())
        if "clip" in options:
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM) > MAX_NORM
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results(world):
    return world.run_cases(CASES, _train_cases)


ALL = [c for cases in CASES.values() for c in cases]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys()
    return max((float((a[n] - b[n]).abs().max()), n) for n in a)


@pytest.mark.parametrize("case", ALL, ids=[f"{c[0]}-{c[1]}-{c[2][0]}x{c[2][1]}" for c in ALL])
def test_expert_parallel_matches_one_process(results, case):
    name, mesh, shape = case
    ranks = results[case]
    sharded_losses, sharded_grads, sharded_weights, _, _, initial, _ = ranks[0]
    losses, grads, weights = _reference(name, shape, initial if "@meta" in name else None)
    # float32: sk.verify's tolerances; bfloat16 (reductions rounded in bf16): its mixed-precision ones
    loss_tol, grad_rel, weight_tol = (0.031 * losses[0], 0.078, 0.01 * LR) if "bf16" in name else (1e-5, 1e-4, 1e-5)
    assert sharded_losses == pytest.approx(losses, abs=loss_tol)
    grad_diff, where = _max_diff(sharded_grads, grads)
    scale = max(float(g.abs().max()) for g in grads.values())
    assert grad_diff <= 1e-5 + grad_rel * scale, (grad_diff, where)
    assert any(float(g.abs().max()) > 0 for n, g in grads.items() if ".experts." in n)
    weight_diff, where = _max_diff(sharded_weights, weights)
    assert weight_diff <= weight_tol, (weight_diff, where)
    for rank in ranks:  # every rank reports the same global loss
        assert rank[0] == pytest.approx(sharded_losses, abs=1e-6)


@pytest.mark.parametrize("case", [c for c in ALL if "fsdp" not in c[1]], ids=lambda c: f"{c[0]}-{c[1]}-{c[2][1]}")
def test_router_gradient_is_the_same_on_every_rank(results, case):
    """The router is reduced over every data rank, ep included (torchtitan #2387 was not)."""
    ranks = results[case]
    _, grads, _ = _reference(case[0], case[2])
    first = ranks[0][3]
    assert first, "no router gradient seen"
    for name, grad in first.items():
        tolerance = dict(rtol=0.078, atol=1e-3) if "bf16" in case[0] else dict(rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(grad, grads[name], **tolerance)
        for rank in ranks[1:]:
            assert torch.equal(rank[3][name], grad)


def test_experts_hold_a_share_and_skewed_routing_leaves_ranks_idle(results):
    """Under a router that picks experts 0 and 1 only, the ranks holding 2 and 3 receive no rows
    and the step still matches one process (above); balanced routing reaches every rank."""
    for size, mesh in ((2, "ep=2"), (4, "ep=4")):
        ranks = results["one-sided", mesh, (8, 16)]
        received = [sum(sum(r) for r in rank[4].values()) for rank in ranks]
        assert received[size // 2:] == [0] * (size - size // 2) and min(received[:size // 2]) > 0
    balanced = results["gpt-moe", "ep=4", (8, 16)]
    assert all(sum(sum(r) for r in rank[4].values()) > 0 for rank in balanced)
    one_token = results["gpt-moe", "ep=2", (2, 1)]
    assert sum(sum(sum(r) for r in rank[4].values()) for rank in one_token) == 2 * 2 * 2  # 2 tokens x top 2 x 2 layers


@pytest.mark.parametrize("mesh", ["ep=2", "ep=4", "fsdp=2,ep=2", "dp=2,ep=2"])
def test_explain_counts_the_bytes_each_rank_holds(results, mesh):
    """``shardkit explain``'s parameter bytes per device: E / ep experts per rank, FSDP over the rest."""
    from shardkit.planner.explain import explain_plan

    text = explain_plan(sk.Plan(mesh=sk.Mesh.parse(mesh)), meta_model(build_tiny_gpt_moe))
    stated = int(re.search(r"parameter bytes per device: ([\d,]+) B", text).group(1).replace(",", ""))
    held = {rank[-1] for rank in results["gpt-moe", mesh, (8, 16)]}
    assert held == {stated}


# -- refusals before launch --------------------------------------------------------------------------------------------
def _problems(plan: sk.Plan, build) -> str:
    with pytest.raises(sk.PlanError) as info:
        sk.validate(plan, meta_model(build))
    return str(info.value)


def test_ep_on_a_model_without_experts_is_refused_by_axis():
    text = _problems(sk.Plan(mesh=sk.Mesh(ep=2)), build_tiny_gpt)
    assert "mesh axis 'ep' (size 2) splits the experts of MoE layers, but GPT has none" in text


def test_experts_not_divisible_by_ep_name_the_layer_and_valid_sizes():
    text = _problems(sk.Plan(mesh=sk.Mesh(ep=3)), build_tiny_gpt_moe)
    assert "MoE layer 'layers.1.mlp.experts' has 4 experts, not divisible by ep=3; valid ep sizes: [1, 2, 4]" in text
    text = _problems(sk.Plan(mesh=sk.Mesh(ep=8)), build_tiny_mixtral)
    assert "MoE layer 'model.layers.0.mlp.experts' has 4 experts, not divisible by ep=8" in text


def test_a_layout_rule_naming_ep_is_refused():
    text = _problems(sk.Plan(mesh=sk.Mesh(ep=2), rules=LayoutMap([(r".*gate_up_proj", ("ep", None, None)),
                                                                  (".*", None)])), build_tiny_gpt_moe)
    assert "uses axis 'ep': 'ep' splits every MoE layer's experts by itself" in text


def test_experts_with_another_forward_are_refused_by_module():
    class Stacked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.zeros(4, 4, 4))

        def forward(self, x):
            return x

    text = _problems(sk.Plan(mesh=sk.Mesh(ep=2)), lambda: torch.nn.Sequential(Stacked()))
    assert "module '0' (Stacked) stacks expert weights ['gate_up_proj', 'down_proj'] but its forward takes ['x']" in text


def test_ep_splits_the_batch_like_a_data_axis():
    mesh = sk.Mesh(fsdp=2, ep=2)
    assert mesh.data_size == 4 and [mesh.data_index(r) for r in range(4)] == [0, 1, 2, 3]
    assert sk.Plan(mesh=mesh).batch_problems(6) == [
        "batch of 6 samples does not split evenly over 4 data-parallel replicas (dp=1 x fsdp=2 x ep=2); "
        "use a multiple of 4"]


def test_gpt_moe_is_registered_for_the_command_line():
    entry = model_entry("gpt-moe")
    mesh = sk.Mesh.parse("fsdp=2,ep=2")
    report = sk.validate(sk.Plan(mesh=mesh, rules=entry.rules_for(mesh)), entry.on_meta())
    assert [(layer.name, layer.num_experts) for layer in report.facts.experts] == [
        ("layers.0.mlp.experts", 4), ("layers.1.mlp.experts", 4)]


def _loop_over_experts(experts, hidden, index, weights):
    """transformers' eager experts: one expert at a time, ``index_add_`` into the output."""
    out = torch.zeros_like(hidden)
    for expert in range(experts.num_experts):
        token, slot = torch.where(index == expert)
        gate, up = F.linear(hidden[token], experts.gate_up_proj[expert]).chunk(2, dim=-1)
        y = F.linear(experts.act_fn(gate) * up, experts.down_proj[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


@pytest.mark.parametrize("dtype, dim, grouped", [(torch.float32, 64, True), (torch.float64, 64, False),
                                                 (torch.float32, 6, False)])
def test_grouped_experts_equal_a_loop_over_experts(dtype, dim, grouped):
    """grouped_mm where torch runs it (float32, rows of 16 bytes), one expert at a time elsewhere:
    the same outputs and gradients as transformers' eager loop, with idle experts and empty groups."""
    from shardkit.models.experts import grouped_mm_runs
    from shardkit.models.gpt import Experts

    torch.manual_seed(0)
    experts = Experts(GPTConfig(dim=dim, heads=2, experts=4, top_k=2, mlp_ratio=2)).to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    hidden = torch.randn(9, dim, dtype=dtype, requires_grad=True)
    index = torch.tensor([[0, 2]] * 8 + [[2, 0]])  # experts 1 and 3 get nothing
    weights = torch.rand(9, 2, dtype=dtype)
    assert grouped_mm_runs(hidden, experts.gate_up_proj.transpose(-2, -1)) is grouped
    ours = experts(hidden, index, weights)
    ours.sum().backward()  # an expanded gradient, which grouped_mm's backward takes only made contiguous
    mine = [hidden.grad.clone()] + [p.grad.clone() for p in experts.parameters()]
    hidden.grad = None
    experts.zero_grad()
    theirs = _loop_over_experts(experts, hidden, index, weights)
    theirs.sum().backward()
    torch.testing.assert_close(ours, theirs)
    for a, b in zip(mine, [hidden.grad] + [p.grad for p in experts.parameters()]):
        torch.testing.assert_close(a, b)

