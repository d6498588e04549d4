"""Does shardkit cost anything over writing torch.distributed by hand?

The same model, data and world (4 local gloo processes), sharded two ways:
- **shardkit**: ``sk.shard(model, plan)`` and ``model.step``;
- **hand-written** (the named baseline): torch's own APIs called directly — ``fully_shard`` per
  block and root, ``parallelize_module`` with explicit Colwise/Rowwise styles, ``DDP``.

Printed per strategy: the ratios shardkit / hand-written of median step time, of peak
tensor memory (observe.memory.TensorMemoryPeak) and of
the exact bytes of training state held (parameters, gradients, AdamW state), and
the parameter bytes per device against theory (exact per-layout shards; and total / N).
Step times: both variants live in the same processes and their steps alternate, so the
noise of a shared machine hits both alike. Memory: each variant in fresh worlds (alternating,
``--repeats`` each), the peak bytes of live tensors from torch's profiler (unlike RSS, only
tensors count). The peak of one rank moves from run to run in steps of one activation-sized
buffer (1 MiB at the defaults), for hand-written and shardkit code alike, most likely because gloo's background
thread releases a collective's buffers when the collective finishes, which races with the
training thread. So the peak is the mean over ranks and repeats, and the ratio is printed
with two standard errors.

    python benchmarks/apply_overhead.py [--steps 30] [--repeats 6] [--dim 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.models.gpt import GPT, GPT_RULES, GPTConfig, gpt_loss
from shardkit.observe.memory import TensorMemoryPeak, local_nbytes, state_bytes
from shardkit.planner.validate import validate
from shardkit.runtime.devices import clock

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


def _warm_imports() -> None:
    """Import what either variant uses before measuring: RSS growth should be tensors, not modules."""
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import shardkit.runtime.apply  # noqa: F401


def _make(variant: str, strategy: str, config: GPTConfig, ctx):
    model = sk.shard(build(config), ctx.plan) if variant == "shardkit" else hand_written(build(config), strategy, ctx)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_step(variant: str, model, optimizer, inputs, targets) -> float:
    start = clock()
    optimizer.zero_grad()
    if variant == "shardkit":
        model.step(inputs, targets, gpt_loss)
    else:
        gpt_loss(model(inputs), targets).backward()
    optimizer.step()
    return clock() - start


def _local_batch(ctx, batch):
    return ctx.shard_batch(*batch)


def _time_job(ctx, strategy: str, config: GPTConfig, steps: int, batch: tuple) -> dict:
    """Both variants in one process, steps alternating, so machine noise hits both alike."""
    _warm_imports()
    variants = {v: _make(v, strategy, config, ctx) for v in ("hand", "shardkit")}
    inputs, targets = _local_batch(ctx, batch)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(steps):
        for variant, (model, optimizer) in variants.items():
            times[variant].append(_train_step(variant, model, optimizer, inputs, targets))
    return {v: statistics.median(t[2:]) for v, t in times.items()}


def _memory_job(ctx, strategy: str, variant: str, config: GPTConfig, steps: int, batch: tuple) -> dict:
    """One variant in a fresh world: peak tensor memory over building, sharding and training."""
    _warm_imports()
    with TensorMemoryPeak(ctx.device) as memory:
        model, optimizer = _make(variant, strategy, config, ctx)
        inputs, targets = _local_batch(ctx, batch)
        for _ in range(steps):
            _train_step(variant, model, optimizer, inputs, targets)
    return {"peak": memory.peak_bytes(), "param_bytes": sum(local_nbytes(p) for p in model.parameters()),
            "state": state_bytes(model, optimizer).total}


def _standard_error(samples: list[float]) -> float:
    return statistics.stdev(samples) / math.sqrt(len(samples))


def theory_bytes(plan: sk.Plan, config: GPTConfig) -> tuple[int, int]:
    """(exact bytes per device from the layouts + FSDP dim-0 split, total bytes / N)."""
    model = sk.meta_model(GPT, config)
    fsdp = plan.mesh.size_of("fsdp")
    exact = 0
    for p in validate(plan, model).layouts.params.values():
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
    parser.add_argument("--repeats", type=int, default=6, help="fresh worlds per variant for the memory mean")
    args = parser.parse_args()
    config = GPTConfig(vocab=256, layers=args.layers, dim=args.dim, heads=8, seq_len=args.seq)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    table = Table(title=f"shardkit vs hand-written torch.distributed ({WORLD} gloo processes, GPT dim {args.dim}, "
                        f"{args.layers} layers, median of {args.steps - 2} steps)")
    for col in ("strategy", "step ms (sk / hand)", "step ratio", "peak tensor MiB (sk / hand)", "memory ratio",
                "state bytes ratio", "param bytes / theory", "theory total/N"):
        table.add_column(col, justify="right")
    for strategy, rules in STRATEGIES.items():
        plan = sk.Plan(mesh=sk.Mesh.parse(strategy), rules=rules)
        with sk.LocalWorld(WORLD) as world:
            timed = world.run(_time_job, strategy, config, args.steps, batch, plan=plan)
        step = {v: max(r[v] for r in timed) for v in ("hand", "shardkit")}
        memory: dict[str, list] = {"hand": [], "shardkit": []}
        for _ in range(args.repeats):  # alternating fresh worlds
            for variant in memory:
                with sk.LocalWorld(WORLD) as world:
                    memory[variant] += world.run(_memory_job, strategy, variant, config, 3, batch, plan=plan)
        peak = {v: statistics.fmean(r["peak"] for r in runs) for v, runs in memory.items()}
        memory_ratio = peak["shardkit"] / max(peak["hand"], 1)
        spread = memory_ratio * math.sqrt(sum((_standard_error([r["peak"] for r in runs]) / peak[v]) ** 2
                                              for v, runs in memory.items()))
        state = {v: max(r["state"] for r in runs) for v, runs in memory.items()}
        exact, naive = theory_bytes(plan, config)
        held = max(r["param_bytes"] for r in memory["shardkit"])
        table.add_row(strategy, f"{step['shardkit'] * 1e3:.1f} / {step['hand'] * 1e3:.1f}",
                      f"{step['shardkit'] / step['hand']:.3f}",
                      f"{peak['shardkit'] / 2**20:.1f} / {peak['hand'] / 2**20:.1f}",
                      f"{memory_ratio:.3f} ± {2 * spread:.3f}", f"{state['shardkit'] / state['hand']:.3f}",
                      f"{held / exact:.3f}", f"{held / naive:.3f}")
    console = Console(width=150)
    console.print(table)
    console.print("memory: peak bytes of live tensors (observe.memory.TensorMemoryPeak, torch's memory profiler) over "
                  "building, sharding and 3 steps, mean over ranks and repeats, ± two standard errors; state bytes: parameters + gradients + AdamW state held (exact); "
                  "step time: slowest rank's median. Targets: step ratio <= 1.05, memory ratio <= 1.02, "
                  "param bytes / theory = 1.000")


if __name__ == "__main__":
    main()
