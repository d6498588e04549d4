"""Context parallel (ring attention over ``sp``): activation memory, step time and ring traffic.

The reference GPT at sequence lengths 1k..8k (batch 1), sharded with ``sk.shard`` on
``Plan(mesh=Mesh(sp=n))`` for n = 1, 2, 4, each in its own world of n gloo processes with one
torch thread per process. Baseline: ``sp=1`` (one process, torch SDPA), measured in the same run.

Printed per length and sp, as ratios against sp=1:

- **activations / device**: bytes of the tensors autograd saves for backward during one
  forward (``torch.autograd.graph.saved_tensors_hooks``; each storage counted once, parameters
  excluded), largest over ranks. Expected ratio: 1/sp.
- **peak RSS growth**: ``observe.memory.PeakMemory`` (CPU peak resident set growth over the
  step), which also sees transient buffers such as the ring's per-block attention scores.
- **step time**: forward + backward + gradient reduction, median over steps, slowest rank; and
  the rank's CPU time (``time.process_time``), the work each rank does, which stays meaningful
  when the processes outnumber free cores; its max/min over ranks shows the causal load balance.
- **ring bytes / rank / step** against theory: per attention layer, forward sends the packed
  k/v chunk ``sp-1`` times, backward sends it ``sp-1`` times again plus the float32 dk/dv
  accumulator ``sp`` times: ``layers x (3 sp - 2) x 2 x B x H x (T/sp) x head_dim x 4`` bytes
  in float32. Counted by wrapping ``torch.distributed.batch_isend_irecv``.

    python benchmarks/sequence.py [--seq 1024 2048 4096 8192] [--sp 1 2 4] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.models.gpt import GPT, GPTConfig, gpt_loss
from shardkit.observe.memory import PeakMemory
from shardkit.runtime.devices import clock


def _count_ring_bytes(counter: list[int]) -> None:
    """Wrap ``dist.batch_isend_irecv`` (what ring attention calls) to add up the bytes sent."""
    original = dist.batch_isend_irecv

    def counting(ops):
        counter[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return original(ops)

    dist.batch_isend_irecv = counting


class SavedBytes:
    """Bytes of activations autograd saves for backward (each storage once; parameters excluded)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        # read the parameters now: data parallel wrappers swap in unsharded copies during forward
        params = {_storage(p) for p in self.model.parameters()}
        if key not in params and key not in self.seen:
            self.seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr()


def _job(ctx, config: GPTConfig, seq_lens: list[int], steps: int) -> list[dict]:
    ring = [0]
    _count_ring_bytes(ring)
    model = sk.shard(_build(config), ctx.plan)
    out = []
    for seq in seq_lens:
        g = torch.Generator().manual_seed(seq)
        tokens = torch.randint(0, config.vocab, (1, seq + 1), generator=g)
        inputs, targets = ctx.shard_batch(tokens[:, :-1], tokens[:, 1:])
        times, cpu_times, ring_bytes = [], [], []
        saved = SavedBytes(model)
        for step in range(steps + 1):  # step 0 warms up
            model.zero_grad()
            dist.barrier()
            ring[0] = 0
            memory = PeakMemory(ctx.device).start()
            start, cpu_start = clock(), time.process_time()
            if step == 0:
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    model.step(inputs, targets, gpt_loss)
            else:
                model.step(inputs, targets, gpt_loss)
                times.append(clock() - start)
                cpu_times.append(time.process_time() - cpu_start)
                ring_bytes.append(ring[0])
            peak = memory.peak_bytes()
        out.append({"seq": seq, "saved": saved.bytes, "peak": peak, "step": statistics.median(times),
                    "cpu": statistics.median(cpu_times),
                    "ring": max(ring_bytes), "method": memory.method})
    return out


def _build(config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(config)


def ring_theory(config: GPTConfig, seq: int, sp: int) -> int:
    """Bytes one rank sends around the ring in one training step (float32)."""
    if sp == 1:
        return 0
    chunk = 2 * 1 * config.heads * (seq // sp) * (config.dim // config.heads) * 4  # packed k and v
    return config.layers * (3 * sp - 2) * chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    config = GPTConfig(vocab=256, layers=args.layers, dim=args.dim, heads=4, seq_len=max(args.seq))
    runs: dict[int, list[list[dict]]] = {}
    for sp in sorted(set(args.sp) | {1}):
        with sk.LocalWorld(sp, threads=1) as world:
            runs[sp] = world.run(_job, config, args.seq, args.steps, plan=sk.Plan(mesh=sk.Mesh(sp=sp)))
    table = Table(title=f"context parallel, GPT dim {args.dim}, {args.layers} layers, batch 1, "
                        f"{os.cpu_count()} CPU cores, 1 thread / process; ratios vs sp=1")
    for col in ("seq", "sp", "activations MiB/dev", "ratio", "peak RSS MiB/dev", "ratio", "step s", "ratio",
                "CPU s/rank", "ratio", "CPU max/min rank", "ring MiB/rank", "measured / theory"):
        table.add_column(col, justify="right")
    for i, seq in enumerate(args.seq):
        base = {k: max(r[i][k] for r in runs[1]) for k in ("saved", "peak", "step", "cpu")}
        for sp in sorted(runs):
            got = {k: max(r[i][k] for r in runs[sp]) for k in ("saved", "peak", "step", "cpu", "ring")}
            theory = ring_theory(config, seq, sp)
            balance = got["cpu"] / min(r[i]["cpu"] for r in runs[sp])
            table.add_row(str(seq), str(sp), f"{got['saved'] / 2**20:.1f}", f"{got['saved'] / base['saved']:.3f}",
                          f"{got['peak'] / 2**20:.1f}", f"{got['peak'] / max(base['peak'], 1):.3f}",
                          f"{got['step']:.3f}", f"{got['step'] / base['step']:.3f}", f"{got['cpu']:.3f}",
                          f"{got['cpu'] / base['cpu']:.3f}", f"{balance:.2f}", f"{got['ring'] / 2**20:.2f}",
                          "-" if sp == 1 else f"{got['ring'] / theory:.3f}")
    console = Console(width=180)
    console.print(table)
    console.print(f"activations: autograd saved tensors of one forward, largest rank; peak: {runs[1][0][0]['method']}; "
                  f"step: median of {args.steps} steps, slowest rank (wall clock; CPU s: the rank's own "
                  f"process time, which waiting for a core or a message does not count)")


if __name__ == "__main__":
    main()
