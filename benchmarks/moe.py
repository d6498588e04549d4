"""Expert parallelism (``ep``): expert memory, all-to-all traffic, step time and routing balance.

One MoE GPT (``GPTConfig(experts=8, top_k=2)``, dim 256, 2 layers: ``--dim``, ``--experts``, ...)
and one batch, trained with AdamW on ONE world of 4 gloo processes (one torch thread each) under
``dp=4`` (experts replicated: the baseline), ``fsdp=4`` (FSDP only), ``dp=2,ep=2``,
``fsdp=2,ep=2`` and ``ep=4``. Every model is built on the meta device and materialised by
``sk.shard`` (each rank allocates only what it holds; the weights are the same under every mesh,
so the routing is too).

- **expert bytes / device**: the local bytes of every experts module's parameters on the rank,
  against the whole experts' bytes; theory ``1 / (ep x fsdp)`` (``ep`` splits the expert dim,
  FSDP the rest), which must match exactly.
- **all-to-all bytes / rank / step**: counted by ``observe.comm.CommCounter`` over the first step
  (whose initial weights route alike under every mesh): the part addressed to other ranks
  (:meth:`CommCounter.remote`; what a rank sends itself is a local copy). Theory from the routing
  that happened (each experts module's ``_sk_rows``): per layer, the rows this rank sends to other
  ranks and those it received from them, each out and back, forward and backward:
  ``2 x (sent elsewhere + received from elsewhere) x dim x 4`` bytes, plus the int64 per-expert
  counts sent elsewhere, ``(E - E/ep) x 8``. "uniform": what an even routing would move,
  ``layers x 4 x tokens per rank x top_k x (ep-1)/ep x dim x 4``.
- **all-gather / reduce bytes / rank / step**: the payload of the same step's all-gathers (FSDP's
  weights, forward and backward) and of its reduce-scatters and all-reduces (the gradients), to set
  against the all-to-all (``CommCounter``'s convention: an all-gather counts the local shard, a
  reduction its whole input).
- **peak**: the most tensor memory held at once (torch's profiler, ``observe.memory.TensorMemoryPeak``)
  over materialising, building the optimizer and 2 steps, largest rank. **step**: median wall time
  of ``--steps`` steps after the profiled ones, slowest rank; **CPU**: the rank's own process time
  (what it computes, which waiting for a core does not count), largest rank.
- **routing** (``ep=4``): the (token, slot) rows each rank's experts received in the first forward
  (summed over layers) with the model's own router, a balanced one (token ``t`` to experts ``t ..
  t+k-1 mod E``) and one skewed to expert 0 (:data:`SKEW` added to its logit); max / mean over
  ranks, the step time and each rank's CPU time.

    python benchmarks/moe.py [--steps 3] [--batch 8] [--seq 64] [--dim 256] [--experts 8] [--top-k 2]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.models.gpt import GPT, GPTConfig, Router, gpt_loss
from shardkit.observe.comm import CommCounter
from shardkit.observe.memory import TensorMemoryPeak, local_nbytes
from shardkit.runtime.devices import clock

MESHES = ("dp=4", "fsdp=4", "dp=2,ep=2", "fsdp=2,ep=2", "ep=4")
BASELINE = "dp=4"
GATHERS = ("all_gather_into_tensor",)
REDUCTIONS = ("reduce_scatter_tensor", "all_reduce")
SKEW = 3.0


class BalancedRouter(Router):
    """Token ``t`` of a rank's batch to experts ``t, t+1, .. t+k-1 (mod E)``, weighted by the model's scores."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        experts = self.weight.shape[0]
        index = (torch.arange(x.shape[0], device=x.device)[:, None] + torch.arange(self.top_k, device=x.device)) % experts
        weights = F.softmax(logits.float(), dim=-1).gather(1, index)
        return logits, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), index


class SkewedRouter(Router):
    """The model's router with :data:`SKEW` added to expert 0's logit: most tokens pick expert 0."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bias = torch.zeros(self.weight.shape[0], dtype=x.dtype, device=x.device)
        bias[0] = SKEW
        logits = F.linear(x, self.weight) + bias
        weights, index = torch.topk(F.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        return logits, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), index


ROUTERS = {"model's own": Router, "balanced": BalancedRouter, f"skewed (+{SKEW:g} on expert 0)": SkewedRouter}


def _build(config: GPTConfig, router: type) -> GPT:
    model = sk.meta_model(GPT, config)
    for layer in model.layers:
        layer.mlp.gate.__class__ = router
    return model


def _step(model, optimizer, inputs, targets) -> None:
    optimizer.zero_grad()
    model.step(inputs, targets, gpt_loss)
    optimizer.step()


def _experts(model) -> list:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


def _a2a_theory(model, config: GPTConfig) -> tuple[int, int]:
    """(bytes this rank's exchanges send to other ranks in one step, rows its experts received) from
    the routing of the last forward (each experts module's ``_sk_rows``); ``(0, 0)`` without ``ep``."""
    sent = received = 0
    for m in _experts(model):
        rows, ep = getattr(m, "_sk_rows", None), getattr(m, "_sk_expert_group", None)
        if rows is None:
            continue
        me = ep.group.rank()
        elsewhere = sum(rows.sent) - rows.sent[me] + sum(rows.received) - rows.received[me]
        sent += 2 * elsewhere * config.dim * 4 + (config.experts - ep.local_experts) * 8
        received += sum(rows.received)
    return sent, received


def _job(ctx, config: GPTConfig, batch: tuple, steps: int, router: type, profile: bool) -> dict:
    gc.collect()
    inputs, targets = ctx.shard_batch(*batch)
    memory = TensorMemoryPeak(ctx.device) if profile else None
    with memory or nullcontext():
        model = sk.shard(_build(config, router), ctx.plan, ctx)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with CommCounter() as comm:  # the first step: the initial weights' routing, the same under every mesh
            _step(model, optimizer, inputs, targets)
        theory, received = _a2a_theory(model, config)
        _step(model, optimizer, inputs, targets)  # the first allocated AdamW's state: the peak needs a second
    times, cpu = [], []
    for _ in range(steps):
        torch.distributed.barrier()
        start, cpu_start = clock(), time.process_time()
        _step(model, optimizer, inputs, targets)
        times.append(clock() - start)
        cpu.append(time.process_time() - cpu_start)
    summary = comm.summary()
    return {"experts": sum(local_nbytes(p) for m in _experts(model) for p in m.parameters(recurse=False)),
            "params": sum(local_nbytes(p) for p in model.parameters()),
            "peak": memory.peak_bytes() if memory else 0, "step": statistics.median(times),
            "cpu": statistics.median(cpu), "a2a": comm.remote().get("all_to_all_single", 0),
            "a2a_payload": summary.get("all_to_all_single", (0, 0))[1], "theory": theory, "received": received,
            "gather": sum(summary.get(op, (0, 0))[1] for op in GATHERS),
            "reduce": sum(summary.get(op, (0, 0))[1] for op in REDUCTIONS)}


def _mesh_ep(mesh: str) -> tuple[int, int]:
    parsed = sk.Mesh.parse(mesh)
    return parsed.size_of("ep"), parsed.size_of("fsdp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    config = GPTConfig(vocab=256, layers=args.layers, dim=args.dim, heads=4, seq_len=args.seq,
                       experts=args.experts, top_k=args.top_k)
    tokens = torch.randint(0, config.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    whole = sum(p.numel() for m in _experts(_build(config, Router)) for p in m.parameters(recurse=False)) * 4
    began = clock()
    with sk.LocalWorld(4, threads=1) as world:
        runs = {mesh: world.run(_job, config, batch, args.steps, Router, True, plan=sk.Plan(mesh=sk.Mesh.parse(mesh)))
                for mesh in MESHES}
        routed = {name: runs["ep=4"] if router is Router else  # the model's own router: the ep=4 run above
                  world.run(_job, config, batch, args.steps, router, False, plan=sk.Plan(mesh=sk.Mesh(ep=4)))
                  for name, router in ROUTERS.items()}
    console = Console(width=240)
    console.print(_mesh_table(config, args, runs, whole))
    console.print(_routing_table(routed))
    console.print(f"{os.cpu_count()} CPU cores, 4 processes, 1 torch thread each; whole experts: {whole / 2**20:.2f} MiB; "
                  f"step: median of {args.steps}, slowest rank; peak: torch's profiler, largest rank; "
                  f"all-to-all: bytes to other ranks; ran in {clock() - began:.0f} s")


def _mesh_table(config: GPTConfig, args, runs: dict[str, list[dict]], whole: int) -> Table:
    tokens = args.batch * args.seq
    table = Table(title=f"MoE GPT dim {config.dim}, {config.layers} layers, {config.experts} experts top {config.top_k}, "
                        f"batch {args.batch} x {args.seq}, AdamW, 4 ranks; ratios vs {BASELINE} (experts replicated)")
    for col in ("mesh", "expert MiB/dev", "/ whole", "theory 1/(ep fsdp)", "params MiB/dev", "peak MiB/dev", "ratio",
                "step s", "ratio", "CPU s/rank", "ratio", "a2a KiB/rank", "measured / theory", "uniform KiB/rank",
                "all-gather KiB/rank", "reduce KiB/rank"):
        table.add_column(col, justify="right")
    base = {k: max(r[k] for r in runs[BASELINE]) for k in ("peak", "step", "cpu")}
    for mesh, ranks in runs.items():
        ep, fsdp = _mesh_ep(mesh)
        got = {k: max(r[k] for r in ranks) for k in ("experts", "params", "peak", "step", "cpu", "a2a", "gather", "reduce")}
        exact = all(r["experts"] == whole // (ep * fsdp) for r in ranks)
        uniform = config.layers * 4 * (tokens // 4) * config.top_k * (ep - 1) // ep * config.dim * 4
        table.add_row(mesh, f"{got['experts'] / 2**20:.2f}", f"{got['experts'] / whole:.4f}",
                      f"{1 / (ep * fsdp):.4f}" + (" exact" if exact else " MISMATCH"),
                      f"{got['params'] / 2**20:.2f}", f"{got['peak'] / 2**20:.1f}", f"{got['peak'] / base['peak']:.3f}",
                      f"{got['step']:.3f}", f"{got['step'] / base['step']:.3f}", f"{got['cpu']:.3f}",
                      f"{got['cpu'] / base['cpu']:.3f}", f"{got['a2a'] / 2**10:.1f}", _agreement(ranks) if ep > 1 else "-",
                      f"{uniform / 2**10:.1f}" if ep > 1 else "-", f"{got['gather'] / 2**10:.1f}",
                      f"{got['reduce'] / 2**10:.1f}")
    return table


def _agreement(ranks: list[dict]) -> str:
    """``1 (exact)`` when every rank's counted all-to-all bytes equal its theory, else the ratios' range."""
    if all(r["a2a"] == r["theory"] for r in ranks):
        return "1 (exact)"
    ratios = [r["a2a"] / r["theory"] for r in ranks]
    return f"{min(ratios):.3f}..{max(ratios):.3f}"


def _routing_table(routed: dict[str, list[dict]]) -> Table:
    table = Table(title="routing under ep=4: rows each rank's experts received (all layers, one forward)")
    for col in ("router", "rank 0", "rank 1", "rank 2", "rank 3", "max / mean", "step s", "CPU s max / min rank",
                "a2a KiB max rank", "measured / theory"):
        table.add_column(col, justify="right" if col != "router" else "left")
    for name, ranks in routed.items():
        rows = [r["received"] for r in ranks]
        cpu = [r["cpu"] for r in ranks]
        table.add_row(name, *map(str, rows), f"{max(rows) / statistics.fmean(rows):.2f}",
                      f"{max(r['step'] for r in ranks):.3f}", f"{max(cpu):.3f} / {min(cpu):.3f}",
                      f"{max(r['a2a'] for r in ranks) / 2**10:.1f}", _agreement(ranks))
    return table


if __name__ == "__main__":
    main()
