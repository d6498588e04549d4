"""Sharded generation: decode tokens/s and KV-cache bytes per device at tp = 1, 2, 4 and pipelines.

A transformers Llama (hidden 256, 4 layers, 8 heads, 4 KV heads, vocabulary 1024) split over
``tp`` and ``pp`` (stages split evenly) in a local gloo world, one prompt of each length. Decode
speed is timed by ``sk.generate``'s ``on_token`` callback: the ``N`` tokens after the first (which
ends the prefill) over the time from the first to the last (``eos_token_id=None``: no stop token,
so always ``1 + N`` tokens); the faster of ``--rounds`` rounds is kept. The baseline is tp = 1 in
the same run (one process, the same ``sk.generate``). The KV-cache bytes are the most any rank's
cache holds after the prefill (``Decoder.nbytes``), against the planner's estimate
(``sk.kv_cache_bytes``: keys and values x layers / pp x batch x positions x KV heads / tp x
head_dim x 4 bytes); the script stops if they ever differ.

    python benchmarks/generate.py [--meshes "tp=1 tp=2 tp=4 pp=2 pp=2,tp=2"] [--prompts 128,512,2048]
                                  [--new 32] [--rounds 2]
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.models.hf import LLAMA_RULES, build_llama, tiny_llama_config
from shardkit.plan.text import format_bytes
from shardkit.planner.estimate import kv_cache_bytes
from shardkit.runtime.devices import clock
from shardkit.runtime.generate import Decoder

SIZES = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=512, vocab_size=1024, max_position_embeddings=4096)


def build():
    return build_llama(tiny_llama_config(**SIZES))


def expected_cache_bytes(positions: int, mesh: sk.Mesh, batch: int = 1) -> int:
    """The planner's estimate of one rank's cache (``sk.kv_cache_bytes``, from the model's measured sizes)."""
    return kv_cache_bytes(sk.meta_model(build), tp=mesh.size_of("tp"), pp=mesh.size_of("pp"), batch_size=batch,
                          seq_len=positions, dtype=torch.float32)


def _decode_seconds(model, prompt: torch.Tensor, new: int) -> float:
    """Seconds from the first token (the prefill's) to the last of ``1 + new``."""
    times: list[float] = []
    sk.generate(model, prompt, max_new_tokens=1 + new, eos_token_id=None,  # a fixed number of tokens: no stop
                on_token=lambda _: times.append(clock()))
    return times[-1] - times[0]


def measure(ctx, prompts: list[int], new: int, rounds: int) -> list[dict]:
    """On every rank: per prompt length, decode tokens/s and this rank's cache bytes."""
    model = sk.shard(build(), ctx.plan, ctx)
    rows = []
    for length in prompts:
        prompt = torch.randint(0, SIZES["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))
        best = min(_decode_seconds(model, prompt, new) for _ in range(rounds))
        decoder = Decoder(model)
        with torch.no_grad():
            decoder.step(prompt)
        rows.append({"prompt": length, "tokens_per_s": new / best, "cache_bytes": decoder.nbytes})
    return rows


def plan_for(mesh: sk.Mesh) -> sk.Plan:
    """Llama's tensor-parallel rules; with ``pp``, stages split evenly (decoding runs no schedule)."""
    pipeline = sk.Pipeline(schedule="sequential") if mesh.size_of("pp") > 1 else None
    if mesh.size_of("tp") == 1:
        return sk.Plan(mesh=mesh, pipeline=pipeline)
    return sk.Plan(mesh=mesh, rules=LLAMA_RULES, pipeline=pipeline)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="tp=1 tp=2 tp=4 pp=2 pp=2,tp=2",
                        help="space-separated meshes; the first is the baseline (tp=1)")
    parser.add_argument("--prompts", default="128,512,2048")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    meshes = [sk.Mesh.parse(m) for m in args.meshes.split()]
    prompts = [int(p) for p in args.prompts.split(",")]
    results = {}
    for mesh in meshes:
        ranks = sk.launch(measure, plan_for(mesh), prompts, args.new, args.rounds, world_size=mesh.size)
        # speed as rank 0 saw it (every rank receives each token); the cache of the rank holding the most
        results[mesh] = [{**row, "cache_bytes": max(r[i]["cache_bytes"] for r in ranks)}
                         for i, row in enumerate(ranks[0])]
    table = Table(title=f"sk.generate, Llama hidden 256 / 4 layers / 8 heads / 4 KV heads, {args.new} decoded tokens, "
                        f"batch 1; baseline {meshes[0]} in the same run")
    for column in ("mesh", "prompt", "decode tokens/s", "vs base", "KV cache / device", "planner's estimate",
                   "vs base cache"):
        table.add_column(column, justify="right")
    base = {row["prompt"]: row for row in results[meshes[0]]}
    for mesh in meshes:
        for row in results[mesh]:
            ref, expected = base[row["prompt"]], expected_cache_bytes(row["prompt"], mesh)
            table.add_row(",".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.shape)), str(row["prompt"]),
                          f"{row['tokens_per_s']:.1f}", f"{row['tokens_per_s'] / ref['tokens_per_s']:.2f}x",
                          format_bytes(row["cache_bytes"]), format_bytes(expected),
                          f"{row['cache_bytes'] / ref['cache_bytes']:.3f}")
            if row["cache_bytes"] != expected:
                raise SystemExit(f"{mesh}, prompt {row['prompt']}: the cache holds {row['cache_bytes']} bytes, the "
                                 f"planner's estimate says {expected}")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
