"""Activation recompute (``Plan(recompute=...)``): the plan field, the refusals, proof that the
backward recomputes (activations held, blocks re-run, what the selective policy recomputes), and
every parallelism equal to one process (loss, gradients, weights after 3 steps)."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import shardkit as sk
from shardkit.cli import main
from shardkit.models.gpt import GPT, GPT_RULES, build_tiny_gpt, gpt_loss
from shardkit.models.hf import LLAMA_RULES, build_tiny_gpt2, build_tiny_llama, hf_loss
from shardkit.plan import Mesh, Pipeline, Plan, PlanError
from shardkit.planner.model_checks import recompute_targets
from shardkit.runtime.recompute import held_activations, recompute

MODES = ("none", "full", "selective")


# -- the plan field ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_recompute_round_trips_through_every_form(mode):
    plan = Plan(mesh=Mesh(fsdp=2), recompute=mode)
    assert plan.to_dict()["recompute"] == mode
    assert Plan.from_json(plan.to_json()) == plan == Plan.from_yaml(plan.to_yaml()) == Plan.from_dict(plan.to_dict())
    assert plan.resolved(2).recompute == mode


def test_recompute_defaults_to_none():
    assert Plan(mesh=Mesh(dp=2)).recompute == "none" == Plan.from_dict({"mesh": {"dp": 2}}).recompute


@pytest.mark.parametrize("value", [True, False, "true", "Full", "FULL", " full", "selective ", None, 1, "attention"])
def test_recompute_values_are_exact(value):
    valid = "must be one of ['none', 'full', 'selective']"
    with pytest.raises(PlanError, match=rf"Plan\(recompute=\.\.\.\) {re.escape(valid)}, got {type(value).__name__}"):
        Plan(mesh=Mesh(dp=2), recompute=value)
    with pytest.raises(PlanError, match=rf"plan field 'recompute' {re.escape(valid)}"):
        Plan.from_dict({"mesh": {"dp": 2}, "recompute": value})


def test_a_misspelt_key_is_named():
    with pytest.raises(PlanError, match=r"unknown keys \['recompte'\].*'recompute'"):
        Plan.from_yaml("mesh: {dp: 2}\nrecompte: full\n")


@pytest.mark.parametrize("schedule", ["zero-bubble", "zbv"])
def test_zero_bubble_schedules_are_refused_with_recompute(schedule):
    pipeline = Pipeline(schedule=schedule, microbatches=4, virtual_stages=2)
    assert Plan(mesh=Mesh(pp=2), pipeline=pipeline).problems() == []
    problems = Plan(mesh=Mesh(pp=2), pipeline=pipeline, recompute="full").problems()
    assert len(problems) == 1
    assert f"recompute='full' with schedule {schedule!r}" in problems[0] and "'1f1b'" in problems[0]


# -- refusals on meta, and what recompute applies to ------------------------------------------------
class Stack(nn.Module):
    """Repeated blocks with no attention shardkit knows."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build_stack() -> Stack:
    torch.manual_seed(0)
    return Stack()


def test_a_model_without_repeated_blocks_is_refused():
    model = sk.meta_model(lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    sk.validate(Plan(mesh=Mesh(dp=2)), model)
    for mode in ("full", "selective"):
        with pytest.raises(PlanError, match=rf"recompute={mode!r} needs repeated blocks .* Sequential has none; "
                                            r"use recompute='none'"):
            sk.validate(Plan(mesh=Mesh(dp=2), recompute=mode), model)


def test_selective_without_known_attention_is_refused_and_full_is_not():
    model = sk.meta_model(build_stack)
    report = sk.validate(Plan(mesh=Mesh(dp=2), recompute="full"), model)
    assert report.facts.blocks == ("layers.0", "layers.1", "layers.2")
    with pytest.raises(PlanError, match=r"recompute='selective' .* no attention module in the blocks of Stack "
                                        r"\(family 'chain'.*use recompute='full'"):
        sk.validate(Plan(mesh=Mesh(dp=2), recompute="selective"), model)
    with pytest.raises(PlanError, match="no attention module"):
        recompute(build_stack(), "selective")


@pytest.mark.parametrize("build, blocks, attention", [
    (build_tiny_gpt, "layers.{}", "layers.{}.attn"),
    (build_tiny_llama, "model.layers.{}", "model.layers.{}.self_attn"),
    (build_tiny_gpt2, "transformer.h.{}", "transformer.h.{}.attn"),
], ids=["gpt", "llama", "gpt2"])
def test_blocks_and_attentions_of_each_family(build, blocks, attention):
    assert recompute_targets(sk.meta_model(build)) == (tuple(blocks.format(i) for i in range(2)),
                                                       tuple(attention.format(i) for i in range(2)))


def test_cli_flag_and_explain(capsys, no_processes):
    code = main(["explain", "--model", "gpt-tiny", "--mesh", "fsdp=2", "--recompute", "selective"])
    assert code == 0 and "recompute=selective" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["explain", "--model", "gpt-tiny", "--mesh", "fsdp=2", "--recompute", "Full"])
    err = capsys.readouterr().err
    assert "argument --recompute: invalid choice: 'Full'" in err and "selective" in err


def test_cli_recompute_cannot_be_combined_with_a_plan_file(tmp_path, capsys, no_processes):
    file = tmp_path / "plan.yaml"
    Plan(mesh=Mesh(fsdp=2), recompute="full").save(file)
    assert main(["explain", "--model", "gpt-tiny", "--plan", str(file)]) == 0
    assert "recompute=full" in capsys.readouterr().out
    assert main(["explain", "--model", "gpt-tiny", "--plan", str(file), "--recompute", "none"]) == 2
    assert "--recompute cannot be combined with it" in capsys.readouterr().err


# -- proof in one process: what is held, what re-runs, what the policy recomputes -------------------
def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention that materialises its scores (the setting of Korthikanti et al.)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def build_math_gpt() -> GPT:
    model = build_tiny_gpt()
    for layer in model.layers:
        layer.attn.attention_fn = math_attention
    return model


def _tokens(batch: int = 4, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _count_forwards(model: nn.Module, names) -> dict[str, list[int]]:
    """Hooks counting each named module's forwards: ``[outside the backward, during the backward]``."""
    calls = {name: [0, 0] for name in names}
    modules = dict(model.named_modules())

    def count(name: str):
        def hook(_module: nn.Module, _args: tuple) -> None:
            calls[name][int(torch._C._current_graph_task_id() != -1)] += 1
        return hook

    for name in names:
        modules[name].register_forward_pre_hook(count(name))
    return calls


def _one_step(build, mode: str, loss_fn) -> tuple[int, float, dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """(bytes held after the forward, loss, gradients, {module: (forwards, forwards during the backward)})."""
    model = recompute(build(), mode)
    calls = _count_forwards(model, [name for name, _ in model.named_modules() if name.count(".") <= 3])
    inputs, targets = _tokens()
    with held_activations() as held:
        loss = loss_fn(model(inputs), targets)
    held_bytes = held.bytes
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return held_bytes, loss.item(), grads, {n: tuple(c) for n, c in calls.items()}


@pytest.mark.parametrize("build, loss_fn, core_bytes", [
    (build_tiny_gpt, gpt_loss, 0),
    (build_tiny_llama, hf_loss, 0),
    (build_tiny_gpt2, hf_loss, 0),
    (build_math_gpt, gpt_loss, 2 * 4 * 4 * 32 * 32 * 4),  # 2 layers of softmax probabilities [B, H, T, T] in fp32
], ids=["gpt", "llama", "gpt2", "gpt-math-attention"])
def test_recompute_holds_fewer_activations_and_computes_the_same(build, loss_fn, core_bytes):
    none, full, selective = (_one_step(build, mode, loss_fn) for mode in MODES)
    assert full[0] < selective[0] < none[0]
    # selective frees the core's saved tensors and its output ([B, T, 64] fp32 in each of 2 layers, which the
    # output projection reads), and keeps nothing of what that projection makes after the core
    assert none[0] - selective[0] >= core_bytes + 2 * 4 * 32 * 64 * 4
    assert full[0] < none[0] / 2
    for other in (full, selective):
        assert other[1] == none[1]
        assert all(torch.equal(other[2][n], g) for n, g in none[2].items())
    assert all(backward == 0 for _, backward in none[3].values())


def test_full_reruns_each_block_and_selective_each_attention_in_the_backward():
    _, _, _, full = _one_step(build_tiny_gpt, "full", gpt_loss)
    _, _, _, selective = _one_step(build_tiny_gpt, "selective", gpt_loss)
    for i in range(2):
        assert full[f"layers.{i}"] == (1, 1) and full[f"layers.{i}.mlp"] == (1, 1)
        assert selective[f"layers.{i}.attn"] == (1, 1) and selective[f"layers.{i}.attn.q_proj"] == (1, 1)
        assert selective[f"layers.{i}"] == (1, 0) and selective[f"layers.{i}.mlp"] == (1, 0)
    assert full["lm_head"] == (1, 0) == selective["lm_head"]


@pytest.mark.parametrize("build, core_ops", [
    (build_tiny_gpt, ["scaled_dot_product"]), (build_math_gpt, ["_softmax", "bmm"]),
    (build_tiny_llama, ["scaled_dot_product"]),
], ids=["gpt", "gpt-math", "llama"])
def test_selective_policy_saves_the_projections_before_the_core_and_recomputes_the_core(build, core_ops):
    model = recompute(build(), "selective")
    model(_tokens()[0])  # the policy decides in the forward
    decisions = model._sk_recompute.policy.decisions
    recomputed = {op for (choice, op) in decisions if choice == "recompute"}
    assert all(any(core in op for op in recomputed) for core in core_ops)
    products = {choice: sum(n for (c, op), n in decisions.items() if c == choice and op.startswith(("aten.mm.",
                                                                                                  "aten.addmm.")))
                for choice in ("save", "recompute")}
    # each of 2 layers: q, k and v's products saved, the output projection's (after the core) not kept
    assert products == {"save": 2 * 3, "recompute": 2 * 1}, products


def test_recompute_refuses_a_model_twice_and_a_bad_mode():
    model = recompute(build_tiny_gpt(), "full")
    with pytest.raises(sk.UsageError, match="already recomputes"):
        recompute(model, "selective")
    with pytest.raises(sk.UsageError, match=r"must be one of \['none', 'full', 'selective'\], got 'Full'"):
        recompute(build_tiny_gpt(), "Full")


def test_a_transformers_model_under_recompute_builds_no_cache():
    model = recompute(build_tiny_llama(), "full")
    assert list(model(_tokens()[0]).keys()) == ["logits"]  # no cache
    with pytest.raises(PlanError, match="use_cache=True under activation recompute"):
        model(_tokens()[0], use_cache=True)


# -- every parallelism, equal to one process ----------------------------------------------------------
PIPE_1F1B = Pipeline(schedule="1f1b", microbatches=2)
PIPE_GPIPE = Pipeline(schedule="gpipe", microbatches=2)
CASES = {  # id: (mesh, plan fields, GPT rules?)
    "dp2": ("dp=2", {}, False),
    "fsdp2": ("fsdp=2", {}, False),
    "tp2": ("tp=2", {}, True),
    "tp2-megatron-sp": ("tp=2", {"sequence_parallel": True}, True),
    "sp2": ("sp=2", {}, False),
    "pp2-1f1b": ("pp=2", {"pipeline": PIPE_1F1B}, False),
    "pp2-gpipe": ("pp=2", {"pipeline": PIPE_GPIPE}, False),
    "fsdp2xtp2": ("fsdp=2,tp=2", {}, True),
}
LLAMA_CASES = ("fsdp2", "tp2-megatron-sp", "sp2", "pp2-1f1b")


def _plan(case: str, mode: str, rules) -> Plan:
    mesh, fields, tp = CASES[case]
    return Plan(mesh=Mesh.parse(mesh), rules=rules if tp else None, recompute=mode, **fields)


#: what a backward must not run again under selective recompute: the projections' matrix products (DTensor's
#: at the level of the DTensor) and the collectives tensor parallel and FSDP2 run
_MATMULS_AND_COLLECTIVES = {"aten.mm", "aten.addmm", "_c10d_functional.all_reduce",
                            "_c10d_functional.reduce_scatter_tensor", "_c10d_functional.all_gather_into_tensor"}


class _BackwardOps(TorchDispatchMode):
    """Counts the operators of :data:`_MATMULS_AND_COLLECTIVES` run inside a backward."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in _MATMULS_AND_COLLECTIVES and torch._C._current_graph_task_id() != -1:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _backward_reruns(ctx, build, plans: list[Plan], loss_fn) -> list[tuple[dict[str, tuple[int, int]], Counter]]:
    """Per plan: ({checkpointed module held here: (forwards, forwards during the backward)}, the matrix products
    and collectives its backward ran) over the second step (a pipeline's first step also runs each stage once to
    infer its shapes)."""
    out = []
    for plan in plans:
        model = sk.shard(build(), plan, ctx)
        batch = ctx.shard_batch(*_tokens(batch=8))
        model.step(*batch, loss_fn)
        recomputing = getattr(model, "_sk_recompute", None)
        calls = _count_forwards(model, recomputing.checkpointed if recomputing else ())
        with _BackwardOps() as ops:
            model.step(*batch, loss_fn)
        out.append(({n: tuple(c) for n, c in calls.items()}, ops.counts))
    return out


@pytest.mark.world
@pytest.mark.parametrize("case", list(CASES))
def test_gpt_recompute_equals_one_process(world, case):
    for mode in ("full", "selective"):
        plan = _plan(case, mode, GPT_RULES)
        result = sk.verify(build_tiny_gpt, plan, _tokens(batch=8), loss_fn=gpt_loss, steps=3,
                           world=world(plan.mesh.size))
        assert result.ok, f"{mode}: {result}"
    plans = [_plan(case, mode, GPT_RULES) for mode in ("full", "selective", "none")]
    per_rank = world(plans[0].mesh.size).run(_backward_reruns, build_tiny_gpt, plans, gpt_loss, plan=plans[0])
    for (full, full_ops), (selective, selective_ops), (_, none_ops) in per_rank:
        assert set(full) <= {f"layers.{i}" for i in range(2)} and set(selective) <= {f"layers.{i}.attn" for i in range(2)}
        assert full and selective and set(selective) == {f"{b}.attn" for b in full}
        for name, (forwards, in_backward) in (*full.items(), *selective.items()):
            assert forwards >= 1 and in_backward == forwards, name  # every forward re-run once in the backward
        # selective re-runs the core alone: no projection's product and no collective again (the output
        # projection's neither: torch stops recomputing at its input), where full re-runs them all
        assert selective_ops == none_ops and none_ops["aten.mm"] + none_ops["aten.addmm"] > 0, (selective_ops, none_ops)
        assert full_ops["aten.mm"] + full_ops["aten.addmm"] > none_ops["aten.mm"] + none_ops["aten.addmm"]


@pytest.mark.world
@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama_recompute_equals_one_process(world, case):
    for mode in ("full", "selective"):
        plan = _plan(case, mode, LLAMA_RULES)
        result = sk.verify(build_tiny_llama, plan, _tokens(batch=8), loss_fn=hf_loss, steps=3,
                           world=world(plan.mesh.size))
        assert result.ok, f"{mode}: {result}"
