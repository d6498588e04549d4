"""Does shardkit cost anything over writing torch.distributed by hand?

The same model, data and world (4 local gloo processes), sharded two ways:
- **shardkit**: ``sk.shard(model, plan)`` and ``model.step``;
- **hand-written** (the named baseline): torch's own APIs called directly — ``fully_shard`` per
  block and root, ``parallelize_module`` with explicit Colwise/Rowwise styles, ``DDP``.

Printed per strategy: the ratios shardkit / hand-written of median step time and of peak
memory growth (observe.memory.PeakMemory: CPU peak RSS growth, CUDA max allocated), and
the parameter bytes per device against theory (exact per-layout shards; and total / N).
Each variant runs in a fresh world so allocator state does not leak between them.

    python benchmarks/apply_overhead.py [--steps 20] [--dim 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.models.gpt import GPT, GPT_RULES, GPTConfig, gpt_loss
from shardkit.observe.memory import PeakMemory, local_nbytes

WORLD = 4
STRATEGIES = {"dp=4": None, "fsdp=4": None, "tp=4": GPT_RULES, "fsdp=2,tp=2": GPT_RULES}


def build(config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(config)


def _hand_tp(model: GPT, mesh) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.layers)):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.up_proj"):
            styles[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            styles[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, styles)


def _hand_fsdp(model: GPT, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def hand_written(model: GPT, strategy: str, ctx) -> torch.nn.Module:
    """What a user writes without shardkit, for each strategy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    mesh_spec = sk.Mesh.parse(strategy)
    mesh = init_device_mesh("cpu", mesh_spec.shape, mesh_dim_names=mesh_spec.names)
    if strategy == "dp=4":
        return DistributedDataParallel(model)
    if "tp" in mesh_spec:
        _hand_tp(model, mesh["tp"])
    if "fsdp" in mesh_spec:
        _hand_fsdp(model, mesh["fsdp"])
    return model


def _job(ctx, strategy: str, variant: str, config: GPTConfig, steps: int, batch: tuple) -> dict:
    memory = PeakMemory(ctx.device).start()
    model = build(config)
    if variant == "shardkit":
        model = sk.shard(model, ctx.plan)
    else:
        model = hand_written(model, strategy, ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data_world = ctx.plan.mesh.size_of("dp") * ctx.plan.mesh.size_of("fsdp")
    data_rank = ctx.data_rank
    inputs, targets = (t.chunk(data_world)[data_rank] for t in batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        if variant == "shardkit":
            model.step(inputs, targets, gpt_loss)
        else:
            gpt_loss(model(inputs), targets).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return {"step": statistics.median(times[2:]), "peak": memory.peak_bytes(),
            "param_bytes": sum(local_nbytes(p) for p in model.parameters()), "method": memory.method}


def theory_bytes(plan: sk.Plan, config: GPTConfig) -> tuple[int, int]:
    """(exact bytes per device from the layouts + FSDP dim-0 split, total bytes / N)."""
    model = sk.meta_model(GPT, config)
    fsdp = plan.mesh.size_of("fsdp")
    exact = 0
    for p in plan.validate(model).layouts.params.values():
        local = p.local_shape(plan.mesh)
        exact += -(-local[0] // fsdp) * math.prod(local[1:]) * 4
    total = sum(p.numel() for p in model.parameters()) * 4
    return exact, total // plan.mesh.size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    config = GPTConfig(vocab=256, layers=args.layers, dim=args.dim, heads=8, seq_len=args.seq)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    table = Table(title=f"shardkit vs hand-written torch.distributed ({WORLD} gloo processes, GPT dim {args.dim}, "
                        f"{args.layers} layers, median of {args.steps - 2} steps)")
    for col in ("strategy", "step ms (sk / hand)", "step ratio", "peak MiB (sk / hand)", "memory ratio",
                "param bytes / theory", "theory total/N"):
        table.add_column(col, justify="right")
    method = ""
    for strategy, rules in STRATEGIES.items():
        plan = sk.Plan(mesh=sk.Mesh.parse(strategy), rules=rules)
        results = {}
        for variant in ("hand", "shardkit"):
            with sk.LocalWorld(WORLD) as world:
                per_rank = world.run(_job, strategy, variant, config, args.steps, batch, plan=plan)
            results[variant] = per_rank
            method = per_rank[0]["method"]
        step = {v: max(r["step"] for r in results[v]) for v in results}
        peak = {v: max(r["peak"] for r in results[v]) for v in results}
        exact, naive = theory_bytes(plan, config)
        held = max(r["param_bytes"] for r in results["shardkit"])
        table.add_row(strategy, f"{step['shardkit'] * 1e3:.1f} / {step['hand'] * 1e3:.1f}",
                      f"{step['shardkit'] / step['hand']:.3f}",
                      f"{peak['shardkit'] / 2**20:.1f} / {peak['hand'] / 2**20:.1f}",
                      f"{peak['shardkit'] / max(peak['hand'], 1):.3f}", f"{held / exact:.3f}", f"{held / naive:.3f}")
    console = Console()
    console.print(table)
    console.print(f"memory: {method}; step time: slowest rank's median. Targets: step ratio <= 1.05, "
                  f"memory ratio <= 1.02, param bytes / theory = 1.000")


if __name__ == "__main__":
    main()
