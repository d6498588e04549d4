"""Serving: output tokens/s and latency of ``shardkit serve`` under continuous batching, against one request
at a time through the same server and against transformers' ``generate`` with static batches.

One run, one model, the same prompts. The model is a transformers Llama of about 300 M parameters
(hidden 1024, 24 layers, 16 heads, 8 KV heads, vocabulary 256, random weights), written once as a
HuggingFace folder with a tokenizer of one character per token (so every streamed event is one token).
Each request is a prompt of ``--prompt`` token ids and asks for ``--new`` tokens, greedy, with no
end-of-sequence id (every request makes all its tokens).

1. ``shardkit serve``'s own job (``cli/serve.py``) on a ``--mesh`` world (default ``tp=2``), with
   ``--max-batch`` = the largest concurrency; ``--requests`` requests at each concurrency of
   ``--concurrency`` (clients each sending its next request when its last ends), streamed. Per request:
   time to first token, the gaps between tokens; per level: output tokens/s over the level's wall time.
2. baseline (a): one request at a time through the same server (concurrency 1).
3. baseline (b): transformers' ``generate`` in this process (the same weights, ``torch`` threads = the
   world's cores), static batches of each concurrency's size (two of them where ``--requests`` allows): time to first token is the batch's prefill and
   first step, inter-token gaps its later steps (timed by a stopping criterion called every step).

    python benchmarks/serve.py [--concurrency 1,4,16,64] [--requests 16] [--prompt 32] [--new 32]
                               [--layers 24] [--mesh tp=2] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table


def build_folder(folder: Path, layers: int) -> int:
    """The model and its tokenizer written to ``folder``; returns the parameter count."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from shardkit.models.hf import build_llama, tiny_llama_config

    config = tiny_llama_config(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
                               num_key_value_heads=8, intermediate_size=2816, vocab_size=256,
                               max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = build_llama(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, length), generator=g).tolist()


def start_server(folder: Path, mesh: str, max_batch: int, port: int, threads: int | None) -> threading.Thread:
    """``shardkit serve``'s job on a local world, on a thread of this process (its HTTP on rank 0); ``threads``:
    torch threads per rank (``None``: the world's own, the cores over the ranks)."""
    from shardkit.cli import build_parser
    from shardkit.cli.serve import check_job, serve_job
    from shardkit.runtime.world import LocalWorld, launch

    args = build_parser(["serve"]).parse_args(
        ["serve", "--model", str(folder), "--hf", str(folder), "--mesh", mesh, "--port", str(port),
         "--max-batch", str(max_batch), "--max-queue", "1024"])
    plan, job = check_job(args)
    world = None if threads is None else LocalWorld(plan.mesh.size, threads=threads)
    thread = threading.Thread(target=launch, args=(serve_job, plan, job),
                              kwargs={"world_size": plan.mesh.size, "world": world, "timeout": None}, daemon=True)
    thread.start()
    return thread


async def one(client, url: str, prompt: list[int], new: int) -> tuple[float, list[float], int]:
    """A streamed request: (time to first token, gaps between tokens, tokens)."""
    body = {"model": MODEL_NAME[0], "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
    start = time.perf_counter()
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    times.append(time.perf_counter())
    assert len(times) == new, f"{len(times)} tokens streamed, {new} asked"
    return times[0] - start, [b - a for a, b in zip(times, times[1:])], len(times)


async def level(url: str, work: list[list[int]], new: int, concurrency: int) -> dict:
    import httpx

    queue = list(work)
    results = []
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(limits=limits) as client:
        async def worker():
            while queue:
                results.append(await one(client, url, queue.pop(), new))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summary([r[0] for r in results], [g for r in results for g in r[1]], sum(r[2] for r in results), wall)


def summary(ttft: list[float], gaps: list[float], tokens: int, wall: float) -> dict:
    gaps = sorted(gaps)
    return {"tokens/s": tokens / wall, "ttft p50": statistics.median(ttft), "itl p50": statistics.median(gaps),
            "itl p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], "tokens": tokens, "wall": wall}


def transformers_static(model, work: list[list[int]], new: int, batch: int) -> dict:
    """transformers' generate on static batches of ``batch`` prompts, in this process."""
    from transformers import StoppingCriteria

    class Clock(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ttft, gaps, tokens = [], [], 0
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(work), batch):
            ids = torch.tensor(work[i:i + batch])
            clock = Clock()
            begin = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                                 stopping_criteria=[clock])
            tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
            ttft += [clock.times[0] - begin] * ids.shape[0]
            gaps += [b - a for a, b in zip(clock.times, clock.times[1:])] * ids.shape[0]
    return summary(ttft, gaps, tokens, time.perf_counter() - start)


MODEL_NAME = [""]


def show(console: Console, name: str, r: dict) -> None:
    """One row as soon as it is measured (the table at the end has them all, with the ratios)."""
    console.print(f"{name}: {r['tokens/s']:.2f} tokens/s, time to first token p50 {r['ttft p50']:.3f} s, "
                  f"inter-token p50 {r['itl p50']:.3f} s, p99 {r['itl p99']:.3f} s ({r['tokens']} tokens in "
                  f"{r['wall']:.1f} s)")


def stop_server(thread: threading.Thread) -> None:
    for child in multiprocessing.active_children():
        if child.name == "shardkit-rank0":
            os.kill(child.pid, signal.SIGTERM)
    thread.join(600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--requests", type=int, default=16, help="requests at each concurrency (at least it)")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--mesh", default="tp=2")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default: the cores over the ranks)")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    console = Console(width=150)
    folder = Path(tempfile.mkdtemp(prefix="shardkit-serve-bench-"))
    params = build_folder(folder, args.layers)
    MODEL_NAME[0] = str(folder)
    console.print(f"model: Llama, {params / 1e6:.0f} M parameters ({args.layers} layers, hidden 1024), random "
                  f"weights; prompts of {args.prompt} tokens, {args.new} new tokens each, greedy; mesh {args.mesh}; "
                  f"{os.cpu_count()} cores")
    work = prompts(max(args.requests, max(levels)), args.prompt)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = start_server(folder, args.mesh, max(levels), port, args.threads)
    import httpx

    deadline = time.monotonic() + 1800
    while True:
        try:
            httpx.get(f"{url}/health", timeout=5)
            break
        except httpx.HTTPError:
            assert server.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(1)
    asyncio.run(level(url, work[:2], args.new, 2))  # warm-up
    rows = {}
    for c in levels:
        name = "one at a time (same server)" if c == 1 else f"continuous batching, {c} clients"
        rows[name] = asyncio.run(level(url, work[:max(args.requests, c)], args.new, c))
        show(console, name, rows[name])
    stop_server(server)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))  # the cores the world's ranks shared
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():  # warm-up
        model.generate(torch.tensor(work[:1]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    for b in levels:
        name = f"transformers generate, static batch {b}"
        rows[name] = transformers_static(model, work[:max(b, min(args.requests, 2 * b))], args.new, b)
        show(console, name, rows[name])
    base = rows["one at a time (same server)"]["tokens/s"]
    table = Table(title="shardkit serve: output tokens/s and latency (seconds)")
    for column in ("run", "tokens/s", "x one at a time", "ttft p50", "inter-token p50", "inter-token p99"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, r in rows.items():
        table.add_row(name, f"{r['tokens/s']:.1f}", f"{r['tokens/s'] / base:.2f}", f"{r['ttft p50']:.3f}",
                      f"{r['itl p50']:.3f}", f"{r['itl p99']:.3f}")
    console.print(table)
    console.print(f"load average at the end: {os.getloadavg()[0]:.1f} (a shared machine)")
    sys.stdout.flush()
    os._exit(0)  # the world's thread and the 1 GB folder's teardown are not worth waiting for


if __name__ == "__main__":
    main()
