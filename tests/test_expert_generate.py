"""sk.generate under expert parallelism (``ep=2``, ``fsdp=2 x ep=2``, ``dp=2 x ep=2``, ``tp=2 x ep=2``, ``pp=2 x
ep=2``): each data rank continues its own prompts (batches and lengths differ by rank; under ``pp`` through its own
pipeline), every rank joins every all-to-all and FSDP gather of every step, and a rank whose prompts have all
stopped runs on until every rank has.

Greedy tokens equal transformers' ``generate`` (tiny Mixtral and Qwen2-MoE) and a one-process loop
without a cache (the reference MoE GPT). One job per world runs every case; the references run here.
"""

from __future__ import annotations

import pytest
import torch

from shardkit.models.gpt import GPT_RULES, build_tiny_gpt_moe
from shardkit.models.hf import build_tiny_mixtral, build_tiny_qwen2_moe
from shardkit.plan import LayoutMap, Mesh, Pipeline, Plan, UsageError
from shardkit.planner.meta import meta_model
from shardkit.runtime.apply import shard
from shardkit.runtime.generate import generate, stop_tokens

NEW = 8
BUILDERS = {"gpt-moe": build_tiny_gpt_moe, "mixtral": build_tiny_mixtral, "qwen2-moe": build_tiny_qwen2_moe}
HF = ("mixtral", "qwen2-moe")
#: (model, mesh, whether data rank 0's prompts stop after their first new token): world size by mesh
CASES = {2: [("mixtral", "ep=2", False), ("qwen2-moe", "ep=2", False), ("gpt-moe", "ep=2", True)],
         4: [("mixtral", "tp=2,ep=2", False), ("gpt-moe", "tp=2,ep=2", True), ("mixtral", "pp=2,ep=2", False),
             ("gpt-moe", "pp=2,ep=2", True), ("gpt-moe", "pp=2,fsdp=2", True), ("mixtral", "fsdp=2,ep=2", False), ("gpt-moe", "dp=2,ep=2", True)]}


def plan_of(name: str, mesh: str) -> Plan:
    """``mesh`` for model ``name``: with ``tp``, attention over ``tp`` (transformers' plan beside ``ep``:
    ``LayoutMap.from_hf(ep=True)``); with ``pp``, even stages."""
    parsed = Mesh.parse(mesh)
    rules = None if "tp" not in parsed else GPT_RULES if name == "gpt-moe" else \
        LayoutMap.from_hf(meta_model(BUILDERS[name]), ep=True)
    return Plan(mesh=parsed, rules=rules, pipeline=Pipeline(schedule="sequential") if "pp" in parsed else None)


def prompts(data_rank: int) -> torch.Tensor:
    """Data rank ``r``'s prompts: ``1 + r % 2`` of them, ``5 + 2r`` tokens long (no two ranks alike)."""
    generator = torch.Generator().manual_seed(10 + data_rank)
    return torch.randint(0, 256, (1 + data_rank % 2, 5 + 2 * data_rank), generator=generator)


def _greedy_without_cache(model: torch.nn.Module, ids: torch.Tensor, eos: list[int] | None) -> torch.Tensor:
    """The plainest greedy loop, the whole sequence re-run each step; rows stop at ``eos`` (pad: its first)."""
    finished = torch.zeros(ids.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(NEW):
            token = model(ids)[:, -1].argmax(-1)
            if eos is not None:
                token = token.masked_fill(finished, eos[0])
                finished |= torch.isin(token, torch.tensor(eos))
            ids = torch.cat([ids, token[:, None]], dim=1)
            if bool(finished.all()):
                break
    return ids


def reference(name: str, ids: torch.Tensor, eos: list[int] | None) -> torch.Tensor:
    """One process: transformers' greedy ``generate`` (HF models), the cache-free loop (the reference GPT)."""
    model = BUILDERS[name]().eval()
    if name not in HF:
        return _greedy_without_cache(model, ids, eos)
    model.generation_config.eos_token_id = None
    pad = 0 if eos is None else stop_tokens(model, eos)[1]
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=eos, pad_token_id=pad)


def stop_for_rank0(name: str, size: int) -> list[int]:
    """End-of-sequence ids that stop data rank 0's prompts at their first new token and no other
    rank's (a premise checked on one process's tokens)."""
    eos = sorted(set(reference(name, prompts(0), None)[:, -NEW].tolist()))
    for other in range(1, size):
        assert not set(eos) & set(reference(name, prompts(other), None)[:, -NEW:].flatten().tolist()), other
    return eos


def _generate_cases(ctx, cases):
    """Every case on this rank: the tokens of this data rank's prompts; then refusals agreed by every rank."""
    out = {}
    for case, eos in cases:
        plan = plan_of(*case[:2])
        model = shard(BUILDERS[case[0]](), plan, ctx)
        streamed = []
        out[case] = generate(model, prompts(plan.mesh.data_index(ctx.rank)), max_new_tokens=NEW, eos_token_id=eos,
                             on_token=streamed.append)
        out[case, "streamed"] = torch.stack(streamed, dim=1)
    ids = prompts(0) + (300 if ctx.rank == 1 else 0)  # rank 1's ids outside the vocabulary
    for key, call in (("ids", lambda: generate(model, ids, max_new_tokens=2)),
                      ("steps", lambda: generate(model, prompts(0), max_new_tokens=2 + ctx.rank))):
        try:
            call()
        except UsageError as exc:
            out[key] = str(exc)
    if ctx.rank == 1:  # rank 1's output head made nan: its logits only (its experts, serving the others, are sound)
        with torch.no_grad():
            weight = model.lm_head.weight
            (weight.to_local() if hasattr(weight, "to_local") else weight).fill_(float("nan"))
    try:
        generate(model, prompts(0), max_new_tokens=NEW)
    except UsageError as exc:
        out["nan"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(world):
    """``{(name, mesh, stops): (expected tokens by rank, each rank's output)}``."""
    found = {}
    for size, cases in CASES.items():
        eos = {case: stop_for_rank0(case[0], size) if case[2] else None for case in cases}
        outs = world(size).run(_generate_cases, [(case, eos[case]) for case in cases], timeout=300)
        for name, mesh, stops in cases:
            data = Plan(mesh=Mesh.parse(mesh)).mesh
            expected = [reference(name, prompts(data.data_index(r)), eos[name, mesh, stops]) for r in range(size)]
            found[name, mesh, stops] = expected, outs
        found[size] = outs
    return found


ALL = [c for cases in CASES.values() for c in cases]


@pytest.mark.parametrize("case", ALL, ids=[f"{n}-{m}" + ("-rank0-stops" if s else "") for n, m, s in ALL])
def test_greedy_tokens_under_ep_equal_one_process(runs, case):
    name, mesh, stops = case
    expected, outs = runs[case]
    for rank, out in enumerate(outs):
        assert torch.equal(out[case], expected[rank]), (rank, out[case], expected[rank])
        assert torch.equal(out[case, "streamed"], expected[rank][:, -out[case, "streamed"].shape[1]:])
    data = Mesh.parse(mesh).data_index
    lengths = [e.shape[1] - prompts(data(r)).shape[1] for r, e in enumerate(expected)]
    # premise: data rank 0 stopped after one token while the others made every token (and ran on with them)
    assert lengths == [1 if stops and data(r) == 0 else NEW for r in range(len(outs))]


@pytest.mark.parametrize("size", sorted(CASES))
def test_a_call_refused_or_failing_on_one_rank_stops_every_rank(runs, size):
    """No rank enters a step that another has refused or stopped at (it would wait there forever)."""
    outs = runs[size]
    assert "input_ids holds ids from" in outs[1]["ids"]
    for rank, out in enumerate(outs):
        if rank != 1:
            assert out["ids"].startswith("sk.generate: rank 1's call was refused, so no rank generates: ")
        assert f"max_new_tokens differs between ranks ({list(range(2, 2 + size))}, by rank)" in out["steps"]
        where = "prompt(s) [0]" if rank == 1 else "rank 1's prompt(s)"  # every rank stops at the first token
        assert f"logits for new token 1 of {where} are nan or +inf" in out["nan"], out["nan"]
