"""Serving and plain decode over pipeline stages: the engine under ``pp=2`` and ``pp=2 x tp=2`` (requests
joining and leaving; each equal to transformers' ``generate`` on its prompt alone, a seeded sample equal to
one process's), and ``sk.generate`` under ``pp`` on the plain path. ``shardkit serve --mesh pp=2`` is
tested in tests/test_serve.py (its server for a killed worker is a pipeline's: no extra server start)."""

from __future__ import annotations

import pytest
import torch
from test_serving_engine import _alone, _hf_greedy

from shardkit.models.hf import LLAMA_RULES, build_tiny_llama
from shardkit.plan import Mesh, Pipeline, Plan
from shardkit.runtime import plain_pipeline
from shardkit.runtime.apply import shard
from shardkit.runtime.generate import generate
from shardkit.serving.engine import Engine
from shardkit.serving.requests import Finish, GenerationRequest, Inbox, Sampling

PROMPTS = {"a": (3, 141, 59, 26, 53), "b": (58, 97), "c": (9, 8, 7, 6, 5, 4, 3, 2), "d": (200, 100, 50)}
NEW = {"a": 8, "b": 3, "c": 5, "d": 4}
SAMPLED = GenerationRequest("s", (11, 12, 13, 14), 5, Sampling(temperature=1.0, top_k=20, seed=3))
#: after a request's n-th token, these join (two slots: c and d wait in the queue for a slot to free)
AFTER = {("a", 1): ["b", "c"], ("b", 2): ["d", "s"]}
GENERATE_PROMPT = torch.tensor([[5, 6, 7, 8], [40, 41, 42, 43]])
PLANS = {"pp2": Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="sequential")),
         "pp2xtp2": Plan(mesh=Mesh(pp=2, tp=2), rules=LLAMA_RULES, pipeline=Pipeline(schedule="sequential"))}


def _request(rid: str) -> GenerationRequest:
    return SAMPLED if rid == SAMPLED.id else GenerationRequest(rid, PROMPTS[rid], NEW[rid])


def _serve(ctx):
    """Every rank: the engine over the pipelined Llama (rank 0 submits as the script says), then sk.generate
    (counting the plain pipeline's steps). Rank 0 returns each request's tokens and finish; each its step count."""
    model = shard(build_tiny_llama(), ctx.plan, ctx)
    inbox, events, after = (Inbox(max_queue=8), {}, dict(AFTER)) if ctx.rank == 0 else (None, None, None)

    def sink(event) -> None:
        made = events[event.request_id]
        made.append(event)
        if event.token is not None:
            for rid in after.pop((event.request_id, sum(e.token is not None for e in made)), []):
                submit(_request(rid))
            if not after:
                inbox.close()

    def submit(request: GenerationRequest) -> None:
        events[request.id] = []
        assert inbox.submit(request, sink)

    if inbox is not None:
        submit(_request("a"))
    Engine(model, inbox, slots=2, max_len=32, quiet=True).run()
    steps = []
    original = plain_pipeline.PlainPipeline.step
    plain_pipeline.PlainPipeline.step = lambda self, *a, **k: steps.append(1) or original(self, *a, **k)
    try:
        generated = generate(model, GENERATE_PROMPT, max_new_tokens=4, eos_token_id=None)
    finally:
        plain_pipeline.PlainPipeline.step = original
    served = None if events is None else {rid: ([e.token for e in made if e.token is not None], made[-1].finish)
                                          for rid, made in events.items()}
    return served, generated, len(steps)


@pytest.fixture(scope="module")
def runs(world):
    return {name: world(plan.mesh.size).run(_serve, plan=plan, timeout=300) for name, plan in PLANS.items()}


@pytest.fixture(scope="module")
def expected():
    """Each request alone: transformers' greedy generate; the sampled one in a one-process engine."""
    return {**{rid: _hf_greedy(prompt, NEW[rid]) for rid, prompt in PROMPTS.items()}, SAMPLED.id: _alone(SAMPLED)}


@pytest.mark.parametrize("plan", list(PLANS))
def test_each_request_under_a_pipeline_equals_transformers_generate_alone(runs, expected, plan):
    served = runs[plan][0][0]
    assert served == {rid: (tokens, Finish.LENGTH) for rid, tokens in expected.items()}


@pytest.mark.parametrize("plan", list(PLANS))
def test_sk_generate_under_a_pipeline_runs_the_plain_path_and_equals_transformers(runs, plan):
    model = build_tiny_llama()
    expected = model.generate(GENERATE_PROMPT, attention_mask=torch.ones_like(GENERATE_PROMPT), max_new_tokens=4,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    for _, generated, steps in runs[plan]:
        assert torch.equal(generated, expected)
        assert steps == 4  # a prefill and three decode steps, on every rank



def test_serve_refuses_a_mesh_axis_other_than_tp_and_pp_before_launch(no_processes, capsys):
    from shardkit.cli import main

    assert main(["serve", "--model", "llama-tiny", "--hf", "unused", "--mesh", "pp=2,dp=2", "--port", "0"]) == 2
    assert "splits a model over 'tp' and 'pp' only, but dp=2; valid: e.g. --mesh tp=2 or --mesh pp=2,tp=2" in \
        capsys.readouterr().err
