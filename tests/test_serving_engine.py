"""The serving engine (continuous batching over a tp=2 model): each request's tokens equal transformers'
generate on its prompt alone, whatever shares its batch; seeded sampling; stop ids; cancel; close."""

from __future__ import annotations

import pytest
import torch

from shardkit.models.hf import LLAMA_RULES, build_tiny_llama
from shardkit.plan import Mesh, Plan
from shardkit.runtime.apply import shard
from shardkit.serving.engine import Engine
from shardkit.serving.requests import Finish, GenerationRequest, Inbox, Sampling

PROMPTS = {"a": (3, 141, 59, 26, 53), "b": (58, 97), "c": (9, 8, 7, 6, 5, 4, 3, 2), "e": (200, 100, 50)}
NEW = {"a": 9, "b": 6, "c": 4, "e": 5}
SAMPLED = GenerationRequest("s", (11, 12, 13, 14), 6, Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=3))
LONG = GenerationRequest("d", (5, 6, 7), 20)  # cancelled by its client after 3 tokens
CANCEL_AFTER = 3


def _hf_greedy(prompt: tuple[int, ...], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = build_tiny_llama().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class _Script:
    """Rank 0's clients: requests submitted as earlier ones stream (so they join at different steps), one
    client leaving mid-stream, and the inbox closed once the last request is in."""

    def __init__(self, inbox: Inbox, stop: GenerationRequest):
        self.inbox, self.events = inbox, {}
        self.after = {("a", 1): [GenerationRequest("b", PROMPTS["b"], NEW["b"]), LONG],  # a's first token: b, d join
                      ("b", 2): [stop, GenerationRequest("c", PROMPTS["c"], NEW["c"])],  # queued: 3 slots are busy
                      ("c", 1): [SAMPLED, GenerationRequest("e", PROMPTS["e"], NEW["e"])]}

    def submit(self, request: GenerationRequest) -> None:
        self.events[request.id] = []
        assert self.inbox.submit(request, self.sink)

    def sink(self, event) -> None:
        made = self.events[event.request_id]
        made.append(event)
        tokens = sum(e.token is not None for e in made)
        if event.request_id == LONG.id and tokens == CANCEL_AFTER and event.token is not None:
            self.inbox.cancel(LONG.id)
        for request in self.after.pop((event.request_id, tokens), []) if event.token is not None else []:
            self.submit(request)
        if event.request_id == "c" and tokens == 1 and event.token is not None:
            self.inbox.close()  # e and s are queued: closing drains them too


def _serve(ctx, stop: GenerationRequest):
    model = shard(build_tiny_llama(), Plan(mesh=Mesh(tp=2), rules=LLAMA_RULES), ctx)
    inbox = Inbox(max_queue=8) if ctx.rank == 0 else None
    script = _Script(inbox, stop) if inbox is not None else None
    if script is not None:
        script.submit(GenerationRequest("a", PROMPTS["a"], NEW["a"]))
    Engine(model, inbox, slots=3, max_len=32, quiet=True).run()
    if script is None:
        return None
    return {rid: ([e.token for e in events if e.token is not None], events[-1].finish)
            for rid, events in script.events.items()}


def _alone(request: GenerationRequest) -> list[int]:
    """One process, the request alone in the engine."""
    inbox, events = Inbox(max_queue=1), []
    inbox.submit(request, events.append)
    inbox.close()
    Engine(build_tiny_llama(), inbox, slots=1, max_len=32, quiet=True).run()
    return [e.token for e in events if e.token is not None]


@pytest.fixture(scope="module")
def served(world):
    expected = {rid: _hf_greedy(prompt, NEW[rid]) for rid, prompt in PROMPTS.items()}
    stop_prompt = (77, 78, 79)
    greedy = _hf_greedy(stop_prompt, 8)
    stop = GenerationRequest("stop", stop_prompt, 8, stop_ids=frozenset({greedy[2]}))
    assert greedy[2] not in greedy[:2]  # premise: the stop id comes first at new token 3
    return world(2).run(_serve, stop, plan=Plan(mesh=Mesh(tp=2)), timeout=300)[0], expected, greedy[:2]


def test_each_request_equals_transformers_generate_alone(served):
    results, expected, _ = served
    for rid, tokens in expected.items():
        assert results[rid] == (tokens, Finish.LENGTH), rid


def test_a_stop_id_ends_a_request_without_sending_it(served):
    results, _, before_stop = served
    assert results["stop"] == (before_stop, Finish.STOP)


def test_a_cancelled_request_leaves_and_its_slot_serves_the_queue(served):
    results, _, _ = served
    tokens, finish = results[LONG.id]
    assert finish is Finish.CANCELLED and len(tokens) == CANCEL_AFTER
    assert tokens == _hf_greedy(LONG.prompt, CANCEL_AFTER)
    assert results["e"][1] is Finish.LENGTH  # queued behind 3 busy slots, served after close: close drains


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(served):
    results, _, _ = served
    tokens, finish = results[SAMPLED.id]
    assert finish is Finish.LENGTH and len(tokens) == SAMPLED.max_new_tokens
    assert tokens == _alone(SAMPLED)
    assert tokens != _hf_greedy(SAMPLED.prompt, SAMPLED.max_new_tokens)  # it did sample


def test_a_request_that_does_not_fit_ends_with_the_reason():
    inbox, events = Inbox(max_queue=2), []
    inbox.submit(GenerationRequest("x", (1, 2, 3), 40), events.append)
    inbox.close()
    Engine(build_tiny_llama(), inbox, slots=1, max_len=32, quiet=True).run()
    assert events[0].finish is Finish.ERROR and "valid: max_new_tokens <= 29" in events[0].error


def test_a_sink_that_raises_cancels_only_its_request():
    inbox, events = Inbox(max_queue=2), []

    def gone(event):
        events.append(event)
        if event.token is not None:
            raise ConnectionError("client gone")

    inbox.submit(GenerationRequest("x", (1, 2, 3), 5), gone)
    inbox.submit(GenerationRequest("y", (1, 2), 3), events.append)
    inbox.close()
    Engine(build_tiny_llama(), inbox, slots=2, max_len=32, quiet=True).run()
    assert [e.finish for e in events if e.request_id == "x"] == [None, Finish.CANCELLED]
    assert [e.token for e in events if e.request_id == "y"][:3] == _hf_greedy((1, 2), 3)


def test_prefill_is_bounded_per_step_and_a_waiting_request_can_leave():
    inbox, events = Inbox(max_queue=4), []

    def sink(event):
        events.append(event)
        if event.request_id == "a" and event.token is not None and sum(e.request_id == "a" for e in events) == 1:
            inbox.cancel("c")  # c still waits for its prefill (behind a and b): it leaves at once

    for rid in ("a", "b", "c"):
        inbox.submit(GenerationRequest(rid, PROMPTS[rid], NEW[rid]), sink)
    inbox.close()
    Engine(build_tiny_llama(), inbox, slots=3, max_len=32, prefill_tokens=8, quiet=True).run()
    made = [(e.request_id, e.token) for e in events if e.token is not None]
    assert [t for rid, t in made if rid == "a"] == _hf_greedy(PROMPTS["a"], NEW["a"])
    assert [t for rid, t in made if rid == "b"] == _hf_greedy(PROMPTS["b"], NEW["b"])
    assert made.index(("b", _hf_greedy(PROMPTS["b"], 1)[0])) > 1  # b joined a step after a: 5 + 2 x 5 > 8 positions
    assert [e.finish for e in events if e.request_id == "c"] == [Finish.CANCELLED]
