"""sk.generate: tensor-parallel decoding with a per-rank KV cache, equal to one process; its refusals."""

from __future__ import annotations

import pytest
import torch

from shardkit.models.gpt import GPT_RULES, build_tiny_gpt
from shardkit.models.hf import LLAMA_RULES, build_tiny_llama
from shardkit.plan import Mesh, Pipeline, Plan, PlanError, UsageError
from shardkit.planner.validate import validate
from shardkit.runtime.apply import shard
from shardkit.runtime.generate import Decoder, generate, generation_problems

PROMPT = torch.tensor([[3, 141, 59, 26, 53], [58, 97, 93, 238, 46]])
NEW = 10
SAMPLING = {"temperature": 1.0, "top_k": 20, "seed": 5}


def _greedy_without_cache(model: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    """The plainest greedy loop: the whole sequence re-run at every step (no cache)."""
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _hf_greedy(model: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    """transformers' own generate on the whole model (no stop token: every run makes ``new`` tokens)."""
    model.generation_config.eos_token_id = None
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          pad_token_id=0)


def _cache_heads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int]:
    """(KV heads held by this rank's cache of layer 0, cache bytes) after a prefill of ``ids``."""
    decoder = Decoder(model)
    with torch.no_grad():
        decoder.step(ids)
    return decoder.cache.layers[0].keys.shape[1], decoder.nbytes


def _tp_generation(ctx):
    """Every tp=2 check in one job: greedy and sampled tokens of Llama and the reference GPT, cache heads."""
    out = {}
    for name, build, rules in (("llama", build_tiny_llama, LLAMA_RULES), ("gpt", build_tiny_gpt, GPT_RULES)):
        model = shard(build(), Plan(mesh=Mesh(tp=2), rules=rules), ctx)
        streamed = []
        out[name, "greedy"] = generate(model, PROMPT, max_new_tokens=NEW, on_token=streamed.append)
        out[name, "streamed"] = torch.stack(streamed, dim=1)
        out[name, "sampled"] = generate(model, PROMPT, max_new_tokens=NEW, **SAMPLING)
        out[name, "cache"] = _cache_heads(model, PROMPT)
        out[name, "training"] = model.training
    return out


@pytest.fixture(scope="module")
def tp_results(world):
    return world(2).run(_tp_generation, plan=Plan(mesh=Mesh(tp=2)), timeout=300)


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_every_rank_generates_the_same_tokens(tp_results, name):
    for kind in ("greedy", "sampled"):
        assert torch.equal(tp_results[0][name, kind], tp_results[1][name, kind])
    assert torch.equal(tp_results[0][name, "streamed"], tp_results[0][name, "greedy"][:, PROMPT.shape[1]:])
    assert tp_results[0][name, "training"]  # the model's mode is given back


def test_llama_greedy_under_tp_equals_transformers_generate(tp_results):
    expected = _hf_greedy(build_tiny_llama(), PROMPT, NEW)
    assert expected.shape == (2, PROMPT.shape[1] + NEW)
    assert torch.equal(tp_results[0]["llama", "greedy"], expected)


def test_gpt_greedy_under_tp_equals_a_single_process_loop(tp_results):
    assert torch.equal(tp_results[0]["gpt", "greedy"], _greedy_without_cache(build_tiny_gpt().eval(), PROMPT, NEW))


@pytest.mark.parametrize("name,build", [("llama", build_tiny_llama), ("gpt", build_tiny_gpt)])
def test_sampling_under_tp_equals_one_process_with_the_same_seed(tp_results, name, build):
    single = generate(build(), PROMPT, max_new_tokens=NEW, **SAMPLING)
    assert torch.equal(tp_results[0][name, "sampled"], single)
    assert not torch.equal(single, generate(build(), PROMPT, max_new_tokens=NEW))  # it did sample
    assert torch.equal(single, generate(build(), PROMPT, max_new_tokens=NEW, **SAMPLING))  # seeded


@pytest.mark.parametrize("name,build,local_heads", [("llama", build_tiny_llama, 1), ("gpt", build_tiny_gpt, 2)])
def test_each_rank_caches_only_its_own_kv_heads(tp_results, name, build, local_heads):
    heads, nbytes = _cache_heads(build(), PROMPT)
    assert heads == 2 * local_heads
    for rank in (0, 1):
        assert tp_results[rank][name, "cache"] == (local_heads, nbytes // 2)


# -- one process: the reference GPT's cache, argument checks, refusals ---------------------------
def test_gpt_cache_gives_the_logits_of_the_whole_sequence():
    model = build_tiny_gpt()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = model.kv_cache()
    pieces = [model(ids[:, :5], cache=cache), model(ids[:, 5:9], cache=cache)]
    pieces += [model(ids[:, i:i + 1], cache=cache) for i in range(9, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(ids), atol=1e-5, rtol=1e-5)
    assert cache.length == 12


def test_gqa_with_fewer_kv_heads_than_tp_ranks_is_refused_before_launch():
    with pytest.raises(PlanError, match=r"4 query heads and 2 key/value heads.*valid tp sizes: \[1, 2\]"):
        validate(Plan(mesh=Mesh(tp=4), rules=LLAMA_RULES), build_tiny_llama(), 4)


@pytest.mark.parametrize("plan,expected", [
    (Plan(mesh=Mesh(pp=2, tp=2), rules=GPT_RULES, pipeline=Pipeline(microbatches=2)),
     r"does not run pipeline-parallel models \(mesh pp=2\)"),
    (Plan(mesh=Mesh(fsdp=2, tp=2)), r"mesh axis 'fsdp' has size 2"),
    (Plan(mesh=Mesh(tp=2), sequence_parallel=True), r"sequence_parallel=True\) .* one token"),
])
def test_plans_generate_cannot_run_are_refused_with_the_reason(plan, expected):
    with pytest.raises(PlanError, match=expected):
        raise PlanError(generation_problems(plan))
    model = build_tiny_gpt()
    model._sk_plan = plan  # as sk.shard leaves it: generate refuses before any collective
    with pytest.raises(PlanError, match=expected):
        generate(model, PROMPT, max_new_tokens=2)


@pytest.mark.parametrize("ids,kwargs,expected", [
    (PROMPT.float(), {"max_new_tokens": 2}, r"input_ids must be an integer tensor .*torch.float32"),
    (PROMPT[0], {"max_new_tokens": 2}, r"integer tensor \[batch, prompt\].*shape \[5\]"),
    (PROMPT, {"max_new_tokens": 0}, r"max_new_tokens must be a positive integer, got 0"),
    (PROMPT, {"max_new_tokens": True}, r"max_new_tokens must be a positive integer, got True"),
    (PROMPT, {"max_new_tokens": 2, "temperature": -1.0}, r"temperature must be a finite number >= 0"),
    (PROMPT, {"max_new_tokens": 2, "temperature": float("nan")}, r"temperature must be a finite number"),
    (PROMPT, {"max_new_tokens": 2, "top_k": 5}, r"top_k=5 applies only to sampling"),
    (PROMPT, {"max_new_tokens": 2, "seed": 1}, r"seed=1 applies only to sampling"),
    (PROMPT, {"max_new_tokens": 2, "temperature": 1.0, "top_k": 0}, r"top_k must be a positive integer"),
    (PROMPT, {"max_new_tokens": 2, "temperature": 1.0, "top_k": 257}, r"top_k=257 is more than .* 256"),
    (PROMPT + 200, {"max_new_tokens": 2}, r"ids from 203 to 438.*valid ids: 0 to 255"),
    (PROMPT, {"max_new_tokens": 28}, r"33 positions, but GPT has 32; valid: max_new_tokens <= 27"),
])
def test_bad_arguments_are_refused_naming_the_argument(ids, kwargs, expected):
    with pytest.raises(UsageError, match=expected):
        generate(build_tiny_gpt(), ids, **kwargs)


def test_a_model_without_a_cache_is_refused():
    with pytest.raises(UsageError, match=r"cannot decode Sequential: it needs a transformers model"):
        generate(torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)), PROMPT % 8, max_new_tokens=1)
