"""The HTTP server against a fake engine (tests/serve_fake.py) in this process: OpenAI's own client for
completions, chat and streams, plain HTTP for the errors, the queue bound, clients that leave, an engine
that fails, draining. The real engine behind the same server: tests/test_serve.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import replace

import httpx
import openai
import pytest
import torch
from serve_fake import FakeEngine, expected_tokens

from shardkit.serving.requests import Inbox
from shardkit.serving.server import HttpThread, ModelInfo, Server
from shardkit.serving.text import ByteTokenizer, HFTokenizer

MODEL = "gpt-tiny"
POSITIONS = 64


class Running:
    def __init__(self, tokenizer=None, max_queue=16, slots=4, step_s=0.002, engine=True):
        self.inbox = Inbox(max_queue)
        self.engine = FakeEngine(self.inbox, slots, step_s) if engine else None
        state = self.engine.state if engine else (lambda: None)
        self.server = Server(self.inbox, tokenizer or ByteTokenizer(), ModelInfo(MODEL, POSITIONS, 256, frozenset()),
                             state)
        self.http = HttpThread(self.server.app, "127.0.0.1", 0, drain_s=2)
        self.url = f"http://127.0.0.1:{self.http.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)
        self.http_client = httpx.Client(base_url=self.url)


@pytest.fixture(scope="module")
def served():
    running = Running()
    yield running
    running.http.stop()


def text_of(prompt: str, n: int) -> str:
    return bytes(expected_tokens(list(prompt.encode()), n)).decode()


def test_openai_client_completions_whole_and_streamed(served):
    whole = served.client.completions.create(model=MODEL, prompt="abc", max_tokens=7, temperature=0)
    assert whole.choices[0].text == text_of("abc", 7) and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (3, 7, 10)
    chunks = list(served.client.completions.create(model=MODEL, prompt="abc", max_tokens=7, temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 7 and not chunks[-1].choices
    sampled = [served.client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=5, temperature=0.8, seed=3)
               for _ in range(2)]
    assert sampled[0].choices[0].text == sampled[1].choices[0].text == bytes(expected_tokens([1, 2], 5, 0.8, 3)).decode()


def test_stop_strings_and_ids_end_the_text_before_them(served):
    out = served.client.completions.create(model=MODEL, prompt="hello world", max_tokens=20, temperature=0,
                                           stop=["wor"])
    assert out.choices[0].text == "hello " and out.choices[0].finish_reason == "stop"
    streamed = served.client.completions.create(model=MODEL, prompt="hello world", max_tokens=20, temperature=0,
                                                stop="o w", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "hell"
    ids = served.client.completions.create(model=MODEL, prompt="hello", max_tokens=20, temperature=0,
                                           extra_body={"stop_token_ids": [ord("l")]})
    assert ids.choices[0].text == "he" and ids.choices[0].finish_reason == "stop" and ids.usage.completion_tokens == 2


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer folder with a chat template, as ``save_pretrained`` writes one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template).save_pretrained(folder)
    return HFTokenizer(folder)


def test_openai_client_chat_uses_the_folders_chat_template(chat_tokenizer):
    running = Running(chat_tokenizer)
    try:
        messages = [{"role": "user", "content": "hi"}]
        prompt = chat_tokenizer.chat(messages)
        assert chat_tokenizer.decode(prompt) == "<user>hi\n<assistant>"
        whole = running.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0)
        assert whole.choices[0].message.content == chat_tokenizer.decode(expected_tokens(prompt, 9))
        assert whole.choices[0].message.role == "assistant" and whole.usage.prompt_tokens == len(prompt)
        chunks = list(running.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9,
                                                             temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "length"
        default = running.client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
        assert default.usage.completion_tokens == POSITIONS - len(prompt)  # the rest of the context
    finally:
        running.http.stop()


BAD = [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"prompt": "a"}), "model"),
    (json.dumps({"model": "other", "prompt": "a"}), "model"),
    (json.dumps({"model": MODEL, "prompt": "a", "max_tokens": "3"}), "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 0}), "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "a", "max_tokens": POSITIONS}), "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "a" * POSITIONS}), "prompt"),
    (json.dumps({"model": MODEL, "prompt": [1, 300]}), "prompt"),
    (json.dumps({"model": MODEL, "prompt": 5}), "prompt"),
    (json.dumps({"model": MODEL, "prompt": "a", "temperature": True}), "temperature"),
    (json.dumps({"model": MODEL, "prompt": "a", "top_p": 0}), "top_p"),
    (json.dumps({"model": MODEL, "prompt": "a", "stop": 7}), "stop"),
    (json.dumps({"model": MODEL, "prompt": "a", "stop": ["a", 1]}), "stop"),
    (json.dumps({"model": MODEL, "prompt": "a", "stream": "yes"}), "stream"),
    (json.dumps({"model": MODEL, "prompt": "a", "n": 2}), "n"),
    (json.dumps({"model": MODEL, "prompt": "a", "bogus": 1}), "bogus"),
]


def test_bad_requests_get_400_with_openais_error_body_and_the_server_keeps_serving(served):
    for body, param in BAD:
        got = served.http_client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert got.status_code == 400, (body, got.text)
        error = got.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param, (body, error)
    chat = httpx.post(f"{served.url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "bot"}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages.[0].role"
    assert served.client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0).choices[0].text == "ok"


def test_models_health_metrics_state_and_the_page(served):
    assert [m.id for m in served.client.models.list()] == [MODEL]
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{served.url}/metrics").text
    for name in ("requests_total", "queue_length", "batch_size", "tokens_per_second", "kv_cache_used_bytes"):
        assert f"# TYPE shardkit_{name} " in metrics
    assert 'shardkit_kv_cache_capacity_bytes{rank="0"} 1024' in metrics  # each rank its own bytes per position
    assert 'shardkit_kv_cache_capacity_bytes{rank="1"} 512' in metrics
    assert 'shardkit_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    state = httpx.get(f"{served.url}/state").json()
    assert state["slots"] == 4 and len(state["kv_cache"]) == 2
    page = httpx.get(f"{served.url}/")
    assert page.status_code == 200 and f'data-model="{MODEL}"' in page.text


def _wait(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_a_full_queue_answers_429_and_a_client_that_leaves_frees_its_place():
    running = Running(max_queue=1, engine=False)  # nothing takes requests from the inbox
    try:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 3}
        outcome = []

        def give_up_after_half_a_second():
            try:
                httpx.post(f"{running.url}/v1/completions", json=body, timeout=0.5)
            except httpx.ReadTimeout as exc:
                outcome.append(exc)

        waiting = threading.Thread(target=give_up_after_half_a_second)
        waiting.start()
        _wait(lambda: running.inbox.waiting() == 1)
        full = httpx.post(f"{running.url}/v1/completions", json=body)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        waiting.join()  # its client gave up: the request leaves the queue
        assert outcome
        _wait(lambda: running.inbox.waiting() == 0 and not running.server.open)
    finally:
        running.http.stop(wait_s=1)


def test_a_stream_whose_client_leaves_is_cancelled_in_the_engine():
    running = Running(step_s=0.05)
    try:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 50, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{running.url}/v1/completions", json=body) as response:
            assert next(response.iter_lines()).startswith("data: ")
        _wait(lambda: running.engine.cancelled and not running.engine.running and not running.server.open)
    finally:
        running.http.stop()


def test_an_engine_failure_ends_every_open_request_with_5xx():
    running = Running(step_s=0.05)
    try:
        running.engine.paused.set()  # nothing moves: one request queued, one stream waiting for its first token
        results = {}
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 50}
        threads = [threading.Thread(target=lambda k=k, b=b: results.__setitem__(k, httpx.post(
            f"{running.url}/v1/completions", json=b))) for k, b in (("whole", body), ("stream", {**body, "stream": True}))]
        for t in threads:
            t.start()
        _wait(lambda: len(running.server.open) == 2)
        running.server.fail_all("rank 1 died")
        for t in threads:
            t.join(5)
        for got in results.values():
            assert got.status_code == 500 and "rank 1 died" in got.json()["error"]["message"]
        refused = httpx.post(f"{running.url}/v1/completions", json=body)
        assert refused.status_code == 503 and httpx.get(f"{running.url}/health").status_code == 503
    finally:
        running.http.stop(wait_s=1)


def test_draining_refuses_new_requests_and_finishes_those_in_flight():
    running = Running(step_s=0.02)
    try:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 20, "temperature": 0}
        results = []
        thread = threading.Thread(target=lambda: results.append(httpx.post(f"{running.url}/v1/completions", json=body)))
        thread.start()
        _wait(lambda: running.engine.running)
        running.server.drain()
        assert httpx.post(f"{running.url}/v1/completions", json=body).status_code == 503
        thread.join(5)
        assert results[0].status_code == 200 and results[0].json()["choices"][0]["text"] == text_of("abc", 20)
        running.engine.thread.join(5)
        assert not running.engine.thread.is_alive()  # the engine saw the inbox close and stopped
    finally:
        running.http.stop()


def test_text_is_held_back_only_while_a_character_may_be_unfinished():
    from shardkit.serving.text import MAX_HELD, TextStream

    stream = TextStream(ByteTokenizer().decode)
    invalid = [stream.push(b)[0] for b in (0xFF,) * (MAX_HELD + 1)]  # bytes no character starts with
    assert invalid == [""] * MAX_HELD + ["\ufffd" * (MAX_HELD + 1)]
    assert [stream.push(b)[0] for b in "€!".encode()] == ["", "", "€", "!"]  # 3 bytes, then one


def test_metrics_print_counters_exactly(served):
    served.server.stats.prompt_tokens = 1234567
    metrics = httpx.get(f"{served.url}/metrics").text
    assert "shardkit_prompt_tokens_total 1234567\n" in metrics  # not 1.23457e+06
    from shardkit.serving.server import _number

    assert _number(0.1 + 0.2) == "0.30000000000000004" and _number(2.0) == "2" and _number(10**15) == str(10**15)


def test_stop_ids_in_stop_get_a_400_naming_stop_token_ids(served):
    got = served.http_client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "stop": [7]})
    assert got.status_code == 400 and "stop_token_ids" in got.json()["error"]["message"]


def test_the_kv_cache_of_each_rank_in_bytes_from_the_shared_schedule():
    from types import SimpleNamespace

    from shardkit.serving.run import _state

    engine = SimpleNamespace(batch=SimpleNamespace(rows=[SimpleNamespace(length=5), SimpleNamespace(length=7)]),
                             decoder=SimpleNamespace(slots=4), max_len=32)
    state = _state(engine, [256, 128])  # two stages of 2 and 1 layers
    assert (state.batch, state.kv_used, state.kv_capacity) == (2, [12 * 256, 12 * 128], [128 * 256, 128 * 128])


def test_the_kv_cache_is_sized_and_checked_against_memory_before_it_is_allocated():
    from shardkit.models.gpt import build_tiny_gpt
    from shardkit.plan import UsageError
    from shardkit.serving.run import ServeOptions, cache_slots, free_memory

    model = build_tiny_gpt()  # 32768 bytes per sequence of 32 positions
    options = ServeOptions(MODEL, max_len=32)
    assert cache_slots(model, options, 1) == 8
    assert cache_slots(model, replace(options, max_batch=None, cache_memory=float(2**20)), 1) == 32
    with pytest.raises(UsageError, match=r"--max-batch 33 x --max-tokens 32 takes 1081344 bytes.*holds 32 .*"
                                         r"--max-batch at most 32, or --max-tokens at most 31 with --max-batch 33"):
        cache_slots(model, replace(options, max_batch=33, cache_memory=float(2**20)), 1)
    free = free_memory(torch.device("cpu"), 1)
    with pytest.raises(UsageError, match="more than is free"):
        cache_slots(model, replace(options, cache_memory=float(2 * free + 2**30)), 1)
    with pytest.raises(UsageError, match=r"--max-batch 9 x --max-tokens 32 .*--kv-cache-memory 1e-09 of the free"):
        cache_slots(model, replace(options, max_batch=9, cache_memory=1e-9), 1)
    huge = 2 * (free // 32768)  # twice the sequences the free memory holds (which moves between two reads): refused
    with pytest.raises(UsageError, match=rf"--max-batch {huge} x --max-tokens 32 .*but the free memory"):
        cache_slots(model, replace(options, max_batch=huge), 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import shardkit as sk
    from shardkit.models.gpt import build_tiny_gpt

    root = tmp_path_factory.mktemp("gpt")
    sk.save(root, build_tiny_gpt(), step=1)
    return root


def test_check_job_plans_the_cache_and_refuses_before_launch(checkpoint, capsys):
    from shardkit.cli import build_parser
    from shardkit.cli.serve import check_job
    from shardkit.plan import PlanError, UsageError
    from shardkit.serving.text import load_tokenizer

    def job(*flags):
        argv = ["serve", "--checkpoint", str(checkpoint), "--port", "0", *flags]
        return check_job(build_parser(argv).parse_args(argv))

    plan, ready = job("--kv-cache-memory", "1MiB")
    assert ready.options.max_batch == 32 and ready.checkpoint and ready.hf is None
    assert "KV cache plan: 32 sequences of 32 positions, 1048576 of 1048576 bytes per rank" in capsys.readouterr().err
    assert job("--kv-cache-memory", "0.5")[1].options.max_batch is None  # sized on the ranks, weights loaded
    with pytest.raises(UsageError, match=r"--max-batch at most 32, or --max-tokens at most 10 with --max-batch 100"):
        job("--kv-cache-memory", "1MiB", "--max-batch", "100")
    with pytest.raises(UsageError, match=r"--kv-cache-memory at least 32768"):
        job("--kv-cache-memory", "1000")
    with pytest.raises(PlanError, match=r"--mesh fsdp=2: the server splits a model over 'tp' and 'pp' only"):
        job("--mesh", "fsdp=2")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        with pytest.raises(UsageError, match=rf"--port {port}: cannot listen there"):
            job("--port", port)
    with pytest.raises(UsageError, match="the server needs a tokenizer: --checkpoint has none.*vocabulary is 300"):
        load_tokenizer(None, 300)  # what check_job asks of a model that is not byte-level


def test_sigterms_drain_cancels_what_is_still_running_after_the_timeout():
    from shardkit.serving.run import _drain

    running = Running(step_s=0.05)
    try:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 60, "temperature": 0}  # 3 s of steps
        results = []
        thread = threading.Thread(target=lambda: results.append(httpx.post(f"{running.url}/v1/completions", json=body)))
        thread.start()
        _wait(lambda: running.engine.running)
        start = time.monotonic()
        _drain(running.server, 0.3)
        thread.join(5)
        assert time.monotonic() - start < 2 and results[0].status_code == 503  # cancelled at the bound, answered
        assert running.engine.cancelled
        running.engine.thread.join(5)
        assert not running.engine.thread.is_alive()
    finally:
        running.http.stop()
