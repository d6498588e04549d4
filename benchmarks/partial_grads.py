"""Megatron sequence parallel without a data axis: the norms' gradients reduced once vs by the optimizer.

The reference GPT under ``Plan(mesh=Mesh(tp=2), sequence_parallel=True)`` in 2 local gloo
processes, AdamW, two models in the same processes, steps taking turns (so the machine's load
falls on both alike):

- **reduced**: what ``sk.shard`` does (:mod:`shardkit.runtime.partial_grads`): the ``Partial``
  gradients all-reduced in one flat all-reduce at the end of the backward;
- **lazy** (the baseline, shardkit before it): the same model with that reduction held off, so
  the optimizer runs on ``Partial`` DTensors and DTensor all-reduces them op by op.

Printed: median step time (zero_grad, ``model.step``, ``optimizer.step``) over ``--steps`` steps
after one warm-up, the ratio reduced / lazy, and the collectives of one step.

    python benchmarks/partial_grads.py [--steps 20] [--dim 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.models.gpt import GPT, GPT_RULES, GPTConfig, gpt_loss
from shardkit.observe.comm import CommCounter
from shardkit.runtime.devices import clock

VARIANTS = ("reduced", "lazy")


def _step(model, optimizer, inputs, targets) -> float:
    start = clock()
    optimizer.zero_grad()
    model.step(inputs, targets, gpt_loss)
    optimizer.step()
    return clock() - start


def _job(ctx, config: GPTConfig, steps: int, batch: tuple) -> dict:
    runs = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model = sk.shard(GPT(config), ctx.plan)
        model._sk_partial_grads.deferred = variant == "lazy"  # lazy: never reduced before the optimizer
        runs[variant] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    inputs, targets = ctx.shard_batch(*batch)
    found: dict = {v: {"times": []} for v in VARIANTS}
    for variant, (model, opt) in runs.items():
        _step(model, opt, inputs, targets)  # warm-up
        with CommCounter() as comm:
            _step(model, opt, inputs, targets)
        found[variant]["collectives"] = sum(n for n, _ in comm.summary().values())
    for _ in range(steps):
        for variant, (model, opt) in runs.items():
            found[variant]["times"].append(_step(model, opt, inputs, targets))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    config = GPTConfig(vocab=256, layers=args.layers, dim=args.dim, heads=8, seq_len=args.seq)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    plan = sk.Plan(mesh=sk.Mesh(tp=2), rules=GPT_RULES, sequence_parallel=True)
    with sk.LocalWorld(2) as world:
        found = world.run(_job, config, args.steps, (tokens[:, :-1], tokens[:, 1:]), plan=plan)[0]
    median = {v: statistics.median(found[v]["times"]) for v in VARIANTS}
    table = Table(title=f"tp=2 + sequence_parallel, no data axis (2 gloo processes, GPT dim {args.dim}, "
                        f"{args.layers} layers, batch {args.batch} x {args.seq}, median of {args.steps} steps)")
    for col in ("variant", "step ms", "ratio vs lazy", "collectives per step (rank 0)"):
        table.add_column(col)
    for v in VARIANTS:
        table.add_row(v, f"{median[v] * 1e3:.1f}", f"{median[v] / median['lazy']:.2f}", str(found[v]["collectives"]))
    Console().print(table)


if __name__ == "__main__":
    main()
