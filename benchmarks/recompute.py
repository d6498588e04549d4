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

``--tensor-parallel``: instead, the activations a rank holds under tensor parallel, where
selective recompute must not keep the output projection's partial sums and their all-reduce:
``sk.dry_run`` (the runtime on fake tensors, rank 0 of 8) of a Llama (hidden 512, 8 heads, 2
layers, a sequence of 1024 per data rank) for each mode; baseline ``none``, and the estimate's
ratio to the dry run.

    python benchmarks/recompute.py --tensor-parallel
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


def tensor_parallel_table() -> None:
    """Rank 0's activations in a dry run of 8 ranks per plan and mode, against ``none``'s; the estimate's ratio."""
    from functools import partial

    from shardkit.models.hf import ATTN_IMPLEMENTATION, LLAMA_RULES, build_llama, tiny_llama_config

    config = tiny_llama_config(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1024,
                               num_hidden_layers=2, vocab_size=2048, max_position_embeddings=1024)
    config._attn_implementation = ATTN_IMPLEMENTATION
    meshes = {"fsdp=4,tp=2": (sk.Mesh(fsdp=4, tp=2), False), "tp=8": (sk.Mesh(tp=8), False),
              "tp=8, SP": (sk.Mesh(tp=8), True)}
    print("Llama (hidden 512, 8 heads, 2 layers), 1 x 1024 tokens per data rank, sk.dry_run rank 0 of 8")
    print(f"{'plan':<13} {'recompute':<10} {'activations MiB':>16} {'/ none':>7} {'estimate / dry run':>19}")
    for name, (mesh, sequence_parallel) in meshes.items():
        held = {}
        for mode in MODES:
            plan = sk.Plan(mesh, rules=LLAMA_RULES, recompute=mode, sequence_parallel=sequence_parallel)
            dry = sk.dry_run(partial(build_llama, config), plan, world_size=8, batch=mesh.resolved(8).data_size,
                             seq_len=1024, ranks=(0,))
            held[mode] = dry.ranks[0].memory["activations"]
            print(f"{name:<13} {mode:<10} {held[mode] / 2**20:>16.2f} {held[mode] / held['none']:>7.3f} "
                  f"{dry.ratios(0)['activations']:>19.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--tensor-parallel", action="store_true", help="dry runs of 8 ranks under tensor parallel")
    args = parser.parse_args()
    if args.tensor_parallel:
        tensor_parallel_table()
        return
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
