"""Activation recompute (``Plan(recompute=...)``): activations held and step time, in one process.

The small reference GPT (4 layers, dim 128, 4 heads) on a batch of 8 x 128 tokens, one torch
thread, with ``sk.recompute(model, mode)`` (what ``sk.shard`` applies for the plan's
``recompute``) for ``none``, ``full`` and ``selective``. Baseline: ``none``, measured in the same
run. Twice: with the GPT's own attention (torch SDPA, which keeps only its output and
log-sum-exp for the backward) and with attention that materialises its scores (softmax(QK^T)V,
the setting of Korthikanti et al., where selective recompute pays off).

- **held**: bytes of the tensors the forward leaves alive for the backward
  (``sk.held_activations``: every storage made in the forward and still alive after it,
  whatever keeps it: autograd, a checkpoint's inputs, a selective checkpoint's cache), with the
  logits and loss; ratio against ``none``.
- **step**: forward + backward, median over ``--steps`` steps after one warm-up, the three modes
  taking turns step by step (so a change in the machine's load falls on all alike); ratio
  against ``none``.

    python benchmarks/recompute.py [--steps 20] [--batch 8] [--seq 128]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

import shardkit as sk
from shardkit.models.gpt import build_small_gpt, gpt_loss
from shardkit.runtime.devices import clock

MODES = ("none", "full", "selective")


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention that materialises its ``[B, H, T, T]`` scores and probabilities."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def build(attention: str) -> torch.nn.Module:
    model = build_small_gpt()
    if attention == "math":
        for layer in model.layers:
            layer.attn.attention_fn = math_attention
    return model


def held_bytes(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes the forward leaves alive for the backward (then runs the backward, a warm-up)."""
    with sk.held_activations() as held:
        loss = gpt_loss(model(inputs), targets)
    alive = held.bytes
    loss.backward()
    return alive


def step_seconds(models: dict[str, torch.nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
                 steps: int) -> dict[str, float]:
    """Median forward + backward time per mode; the modes take turns step by step, so a change in the
    machine's load falls on all of them alike."""
    times: dict[str, list[float]] = {mode: [] for mode in models}
    for _ in range(steps):
        for mode, model in models.items():
            model.zero_grad(set_to_none=True)
            start = clock()
            gpt_loss(model(inputs), targets).backward()
            times[mode].append(clock() - start)
    return {mode: statistics.median(t) for mode, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    print(f"small GPT (4 layers, dim 128, 4 heads), batch {args.batch} x {args.seq} tokens, 1 thread, "
          f"median of {args.steps} steps")
    print(f"{'attention':<10} {'recompute':<10} {'held MiB':>9} {'held / none':>12} {'step ms':>8} {'step / none':>12}")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    for attention in ("sdpa", "math"):
        models = {mode: sk.recompute(build(attention), mode) for mode in MODES}
        held = {mode: held_bytes(model, inputs, targets) for mode, model in models.items()}
        seconds = step_seconds(models, inputs, targets, args.steps)
        for mode in MODES:
            base_bytes, base_time = held["none"], seconds["none"]
            print(f"{attention:<10} {mode:<10} {held[mode] / 2**20:>9.2f} {held[mode] / base_bytes:>12.3f} "
                  f"{seconds[mode] * 1e3:>8.1f} {seconds[mode] / base_time:>12.3f}")


if __name__ == "__main__":
    main()
