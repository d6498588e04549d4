"""The decode step over pipeline stages (``--mesh pp=2`` by default): shardkit's plain path
(:class:`shardkit.runtime.plain_pipeline.PlainPipeline`, what ``sk.generate`` and the serving engine run
under ``pp``) against the DTensor path it replaces (:class:`shardkit.runtime.generate.Decoder`: the
stages' own forward through ``PipelinedModule.through_stages``, a shape header before each message).

A transformers Llama of about 250M parameters (hidden 1024, 16 layers, 16 heads, 8 KV heads,
intermediate 2816, vocabulary 32000, float32) is sharded with ``sk.shard`` over the mesh (even stages,
the ``sequential`` schedule) in a local gloo world (one intra-op thread per process). In the same
processes both decoders continue the same prompt (``--batch`` rows of ``--prompt`` tokens), one step
of each in turn (so the shared machine's load hits both alike; an untimed barrier before each step);
the median step time over every round is kept, on the last stage's first rank (where the logits
are). The first logits of the two are checked to agree. Printed: tokens/s and the ratio plain / DTensor.
At ``pp`` alone the parameters are plain tensors, so "DTensor" is then the stages' own forward without
dispatch overhead, and the difference is the model's own code and the headers only.

    python benchmarks/decode_pp.py [--mesh pp=2] [--new 16] [--rounds 3] [--batch 4] [--prompt 32]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.cli.plan_flags import parse_mesh_flag
from shardkit.models.hf import LLAMA_RULES, build_llama, tiny_llama_config
from shardkit.runtime.devices import clock
from shardkit.runtime.generate import Decoder
from shardkit.runtime.plain_pipeline import PlainPipeline

SIZES = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
             intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048)


def measure(ctx, batch: int, prompt_len: int, new: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    model = sk.shard(build_llama(tiny_llama_config(**SIZES)), ctx.plan, ctx).eval()
    with torch.no_grad():
        return _rounds(ctx, model, batch, prompt_len, new, rounds)


def _rounds(ctx, model, batch: int, prompt_len: int, new: int, rounds: int) -> dict:
    prompt = torch.randint(0, SIZES["vocab_size"], (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"plain": [], "DTensor": []}
    runtime = model._sk_runtime
    last = runtime.has_last
    chooser = [None] * dist.get_world_size()  # the global rank of the last stage's first tp rank
    dist.all_gather_object(chooser, last and ctx.coordinates().get("tp", 0) == 0)
    source = chooser.index(True)
    agree = None
    for _ in range(rounds):
        plain = PlainPipeline(model, slots=batch, max_len=prompt_len + new + 1)
        dtensor = Decoder(model)
        first = {"plain": plain.step(prompt, 0), "DTensor": _last(dtensor.step(prompt))}
        if last:
            agree = float((first["plain"] - first["DTensor"]).abs().max())
        ids = {name: _next(logits, batch, source) for name, logits in first.items()}
        for past in range(prompt_len, prompt_len + new):
            for name in times:  # one step of each in turn: the machine's load hits both alike
                dist.barrier()  # untimed: no step absorbs the ranks' skew from the one before
                start = clock()
                logits = plain.step(ids[name], past) if name == "plain" else _last(dtensor.step(ids[name]))
                times[name].append(clock() - start)
                ids[name] = _next(logits, batch, source)  # untimed: every stage feeds the same token
    return {"times": {name: statistics.median(t) for name, t in times.items()}, "agree": agree, "last": last}


def _last(logits: torch.Tensor | None) -> torch.Tensor | None:
    return None if logits is None else logits[:, -1]


def _next(logits: torch.Tensor | None, batch: int, source: int) -> torch.Tensor:
    """The greedy token of each row, from the last stage to every rank."""
    ids = torch.zeros(batch, 1, dtype=torch.long) if logits is None else logits.argmax(-1, keepdim=True)
    dist.broadcast(ids, src=source)
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="pp=2")
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    args = parser.parse_args()
    mesh = parse_mesh_flag(args.mesh)
    plan = sk.Plan(mesh=mesh, rules=LLAMA_RULES if mesh.size_of("tp") > 1 else None,
                   pipeline=sk.Pipeline(schedule="sequential"))
    results = sk.launch(measure, plan, args.batch, args.prompt, args.new, args.rounds, world_size=mesh.size)
    result = next(r for r in results if r["last"] and r["agree"] is not None)
    params = sum(p.numel() for p in sk.meta_model(lambda: build_llama(tiny_llama_config(**SIZES))).parameters())
    table = Table(title=f"decode step at {args.mesh} ({mesh.size} gloo processes), Llama {params / 1e6:.0f}M float32, "
                        f"batch {args.batch}, prompt {args.prompt}, {args.new} steps x {args.rounds} rounds (median)")
    for column in ("decoder", "ms / step", "tokens/s", "plain vs it"):
        table.add_column(column, justify="right")
    for name, seconds in result["times"].items():
        table.add_row(name, f"{seconds * 1e3:.1f}", f"{args.batch / seconds:.2f}",
                      f"{seconds / result['times']['plain']:.3f}")
    Console(width=160).print(table)
    print(f"first logits, max |plain - DTensor| = {result['agree']:.2e}")


if __name__ == "__main__":
    main()
