"""Where the planner's compute price of a step goes wrong: every operator of a one-process training
step timed against its price.

The reference GPT of ``benchmarks/planner.py`` at one rank's share of its batch, one thread: its
forward and backward are run under a dispatch mode that reads each operator's CPU seconds; matrix
products and attention kernels (priced by their FLOPs) are summed apart, every other operator is
priced as the planner prices it (its tensors' bytes over the memory bandwidth, plus the operator
overhead), views apart (the planner counts them as no call). The rates are measured in the same
process first (products at the planner's sizes, the bandwidth probe's operators, the overhead
probe's tiny step, the attention probe's shape: calibrate's probes need a process group and time a
world of processes, this one process on one thread), so the comparison is with its own figures; then the planner's
estimate of the same step on them is set against the step's CPU seconds (the named baseline).

    PYTHONPATH=src python benchmarks/op_prices.py [--steps 5]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time

import planner
import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import shardkit as sk
from shardkit.models.gpt import gpt_loss
from shardkit.observe.probes import ATTENTION_SHAPES
from shardkit.planner.counters import EXTRA_FLOPS, OpCounter
from shardkit.planner.estimate import estimate
from shardkit.planner.step_time import BACKWARD_TRAFFIC

ROWS = 2  # the per-rank batch of planner.py's 4-process world


class Timed(TorchDispatchMode):
    """Each operator's CPU seconds, calls and bytes (its tensors' inputs and outputs), by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds, self.calls, self.bytes = collections.Counter(), collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        started = time.process_time()
        out = func(*args, **(kwargs or {}))
        took = time.process_time() - started
        packet = func._overloadpacket
        if func.is_view:
            kind = "views"
        elif packet in flop_registry or packet in EXTRA_FLOPS:
            kind = "attention" if "attention" in packet.__name__ else "products"
        else:
            kind = packet.__name__
            self.bytes[kind] += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                                    if isinstance(t, torch.Tensor))
        self.seconds[kind] += took
        self.calls[kind] += 1
        return out


def _cpu_seconds(work, repeats: int) -> float:
    work()
    started = time.process_time()
    for _ in range(repeats):
        work()
    return (time.process_time() - started) / repeats


def rates() -> tuple[float, float, float, float]:
    """This process's float32 product rate (best of the planner's sizes), bandwidth (the calibrate
    probe's operators, in the bytes the planner books), operator overhead and SDPA's causal attention
    efficiency, on its CPU seconds."""
    best = 0.0
    for n in (128, 256, 512, 1024):
        a, b = torch.randn(n, n), torch.randn(n, n)
        best = max(best, 2 * n**3 / _cpu_seconds(lambda: a @ b, max(2, int(4e8 / n**3))))  # noqa: B023
    x = torch.randn(1024, 1024, requires_grad=True)
    weight, bias, grad = torch.ones(1024, requires_grad=True), torch.zeros(1024, requires_grad=True), torch.ones(1024, 1024)

    def norm_gelu() -> torch.Tensor:
        return torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (1024,), weight, bias)) + x

    booked: list[float] = []
    with OpCounter(lambda traffic, *_: booked.append(traffic)):
        norm_gelu()
    bandwidth = (1 + BACKWARD_TRAFFIC) * sum(booked) / _cpu_seconds(lambda: norm_gelu().backward(grad), 20)
    layer, tiny = torch.nn.Linear(4, 4), torch.randn(4, 4)
    ops: list[float] = []
    layer(tiny).sum().backward()
    with OpCounter(ops.append):
        layer(tiny).sum().backward()
    overhead = _cpu_seconds(lambda: layer(tiny).sum().backward(), 2000) / len(ops)
    shape, _ = ATTENTION_SHAPES["cpu"]
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))

    def attend() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS) as counter:  # as calibrate's probe counts
        attend()
    attention = 3 * counter.get_total_flops() / _cpu_seconds(lambda: attend().backward(torch.ones_like(q)), 20)
    return best, bandwidth, overhead, min(1.0, attention / best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    console = Console()
    flops, bandwidth, overhead, attention = rates()
    model = planner.build()
    inputs, targets = (t[:ROWS] for t in planner._batch())

    def step() -> None:
        model.zero_grad(set_to_none=True)
        gpt_loss(model(inputs), targets).backward()

    measured = _cpu_seconds(step, args.steps)
    timed = Timed()
    with timed:
        for _ in range(args.steps):
            step()
    table = Table("operators", "calls / step", "CPU ms / step", "priced ms / step",
                  title=f"one step's operators, {ROWS} x {planner.CONFIG.seq_len} tokens, one thread: "
                        f"{flops / 1e9:.0f} GFLOP/s, {bandwidth / 1e9:.1f} GB/s, {overhead * 1e6:.1f} µs a call, "
                        f"attention {attention:.2f}")
    kinds = sorted(timed.seconds, key=timed.seconds.get, reverse=True)
    for kind in kinds:
        priced = "by FLOPs" if kind in ("products", "attention") else "none" if kind == "views" else \
            f"{(timed.bytes[kind] / bandwidth + timed.calls[kind] * overhead) / args.steps * 1e3:.2f}"
        table.add_row(kind, f"{timed.calls[kind] / args.steps:.0f}", f"{timed.seconds[kind] / args.steps * 1e3:.2f}",
                      priced)
    console.print(table)
    hw = dataclasses.replace(sk.Hardware.preset("a100-80g"), flops={d: flops for d in ("float32", "bfloat16", "float16")},
                             matmul_efficiency=1.0, matmul_latency=0.0, memory_bandwidth=bandwidth,
                             op_overhead=overhead, attention_efficiency=attention, devices_per_node=1)
    parts = estimate(sk.meta_model(planner.build), sk.Plan(sk.Mesh(dp=1)), batch_size=ROWS,
                     seq_len=planner.CONFIG.seq_len, hardware=hw).step_time_parts
    console.print(f"forward + backward: priced {parts['compute'] * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms of CPU "
                  f"(priced / measured {parts['compute'] / measured:.2f})")


if __name__ == "__main__":
    main()
