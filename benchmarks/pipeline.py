"""Pipeline schedules on 4 local processes: sequential sharding vs GPipe vs 1F1B vs interleaved 1F1B.

Same model, batch and micro-batches for every schedule (sequential runs the whole batch at
once). Prints, against the ``sequential`` baseline measured in the same run: throughput
ratio, measured bubble fraction beside the theory ``(p-1)/(v*m+p-1)``, and the peak
activation memory per device (bytes autograd saved for backward and not yet freed), with the
1F1B / GPipe ratio. Writes a Chrome trace and a Gantt PNG per schedule under ``--out``.

    .venv/bin/python benchmarks/pipeline.py --out /tmp/pipeline-bench
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import shardkit as sk
from shardkit.models.gpt import GPT, GPTConfig, gpt_loss
from shardkit.plan.pipeline import theoretical_bubble
from shardkit.runtime import spans as timeline
from shardkit.runtime.devices import clock
from shardkit.runtime.world import LocalWorld

SCHEDULES = [("sequential", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]


def build(layers: int, dim: int, seq: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(layers=layers, dim=dim, heads=4, seq_len=seq))


def job(ctx, build_model, batch: int, seq: int, warmup: int, steps: int):
    model = sk.shard(build_model(), ctx.plan, ctx)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=generator)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    for _ in range(warmup):
        model.step(inputs, targets, gpt_loss)
        model.zero_grad(set_to_none=True)
    dist.barrier()
    start = clock()
    with timeline.recording(ctx.rank):
        for _ in range(steps):
            model.step(inputs, targets, gpt_loss)
            model.zero_grad(set_to_none=True)
        dist.barrier()
        elapsed = clock() - start
        return elapsed, timeline.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("pipeline-bench"))
    args = parser.parse_args()
    pp = 4
    build_model = partial(build, args.layers, args.dim, args.seq)
    rows = []
    with LocalWorld(pp) as world:
        threads = world.threads
        for schedule, virtual in SCHEDULES:
            m = 1 if schedule == "sequential" else args.microbatches
            plan = sk.Plan(mesh=sk.Mesh(pp=pp), pipeline=sk.Pipeline(schedule=schedule, microbatches=m,
                                                                      virtual_stages=virtual))
            results = world.run(job, build_model, args.batch, args.seq, args.warmup, args.steps, plan=plan)
            elapsed = max(r[0] for r in results)
            spans = {rank: r[1] for rank, r in enumerate(results)}
            report = timeline.write_profile(spans, args.out / schedule, schedule, pp * virtual, m, virtual)
            peaks = [timeline.peak_activations(s) for s in spans.values()]
            rows.append({"schedule": schedule, "m": m, "v": virtual,
                         "throughput": args.batch * args.steps / elapsed,
                         "bubble": report["bubble_measured"],
                         "theory": theoretical_bubble(schedule, pp, m, virtual),
                         "peak_bytes": [p[0] for p in peaks], "peak_mb": [p[1] for p in peaks]})
    base = rows[0]["throughput"]
    print(f"GPT layers={args.layers} dim={args.dim} seq={args.seq}, batch {args.batch}, pp={pp} "
          f"({pp} local gloo processes x {threads} thread(s), {os.cpu_count()} CPU cores), {args.steps} timed steps")
    print(f"{'schedule':18} {'m':>3} {'v':>2} {'samples/s':>10} {'vs seq':>7} {'bubble':>7} {'theory':>7}  "
          f"peak activations per device (KiB) [micro-batches held]")
    for r in rows:
        theory = "n/a" if r["theory"] is None else f"{r['theory']:.3f}"
        peaks = ", ".join(f"{b / 1024:.0f}[{n}]" for b, n in zip(r["peak_bytes"], r["peak_mb"]))
        print(f"{r['schedule']:18} {r['m']:>3} {r['v']:>2} {r['throughput']:>10.1f} {r['throughput'] / base:>6.2f}x "
              f"{r['bubble']:>7.3f} {theory:>7}  {peaks}")
    by_name = {r["schedule"]: r for r in rows}
    ratio = max(by_name["1f1b"]["peak_bytes"]) / max(by_name["gpipe"]["peak_bytes"])
    print(f"peak activation memory, 1F1B / GPipe (largest device): {ratio:.3f} "
          f"(1F1B holds <= pp={pp} micro-batches, GPipe all {args.microbatches})")
    print(f"traces and Gantt charts: {args.out}/<schedule>/timeline.{{json,png}}")


if __name__ == "__main__":
    main()
