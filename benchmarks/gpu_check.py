"""The checks to run when a GPU machine is lent: every strategy against one process, and sharded generation.

On ``N`` devices (CUDA GPUs with NCCL when there are at least ``--world`` of them, else local CPU
processes with gloo), for the reference GPT and a transformers Llama:

- ``sk.verify`` (3 steps, AdamW, against one process) under dp, fsdp, tp, pp, sp and fsdp x tp
  on ``N`` devices (meshes of size 1 when ``N`` is 1: the CUDA code path of one rank);
- ``sk.generate`` greedy under tp=N and pp=N equal to the whole model's tokens.

Prints a table and exits 1 when any check fails. Run by ``benchmarks/gpu_check.sh``.

    python benchmarks/gpu_check.py [--world N]
"""

from __future__ import annotations

import argparse
import sys

import torch
from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt, gpt_loss
from shardkit.models.hf import LLAMA_RULES, build_tiny_llama, hf_loss

PROMPT = torch.tensor([[3, 141, 59, 26, 53], [58, 97, 93, 238, 46]])


def plans(n: int, rules) -> dict[str, sk.Plan]:
    """Each strategy on ``n`` devices (``fsdp x tp`` only when ``n`` splits in two)."""
    found = {"dp": sk.Plan(sk.Mesh(dp=n)), "fsdp": sk.Plan(sk.Mesh(fsdp=n)), "tp": sk.Plan(sk.Mesh(tp=n), rules),
             "sp": sk.Plan(sk.Mesh(sp=n))}
    if n > 1:
        found["pp"] = sk.Plan(sk.Mesh(pp=n), pipeline=sk.Pipeline(microbatches=n))
    if n % 2 == 0 and n > 2:
        found["fsdp x tp"] = sk.Plan(sk.Mesh(fsdp=n // 2, tp=2), rules)
    return found


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (8, 17), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _generate(ctx, build):
    model = sk.shard(build(), ctx.plan, ctx)
    return sk.generate(model, PROMPT, max_new_tokens=8).cpu()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser.add_argument("--world", type=int, default=gpus or 2, help="devices (default: every GPU, else 2 CPU processes)")
    args = parser.parse_args()
    n = args.world
    where = f"{n} CUDA GPU(s), NCCL" if gpus >= n else f"{n} CPU processes, gloo ({gpus} GPU(s) seen)"
    rows, failed = [], 0
    models = {"gpt": (build_tiny_gpt, GPT_RULES, gpt_loss), "llama": (build_tiny_llama, LLAMA_RULES, hf_loss)}
    with sk.LocalWorld(n) as world:
        for name, (build, rules, loss_fn) in models.items():
            for strategy, plan in plans(n, rules).items():
                try:
                    result = sk.verify(build, plan, batch(256), loss_fn=loss_fn, steps=3, world=world)
                    ok, detail = result.ok, "" if result.ok else str(result).splitlines()[0]
                except Exception as exc:  # noqa: BLE001 - every failure is a row of the table
                    ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                rows.append((name, f"verify {strategy}", ok, detail))
            expected = sk.generate(build(), PROMPT, max_new_tokens=8)
            for strategy, plan in (("tp", sk.Plan(sk.Mesh(tp=n), rules)),
                                   ("pp", sk.Plan(sk.Mesh(pp=n), pipeline=sk.Pipeline(schedule="sequential")))):
                if strategy == "pp" and n == 1:
                    continue
                try:
                    tokens = world.run(_generate, build, plan=plan, timeout=300)
                    ok = all(torch.equal(t, expected) for t in tokens)
                    detail = "" if ok else f"rank 0: {tokens[0].tolist()}, one process: {expected.tolist()}"
                except Exception as exc:  # noqa: BLE001
                    ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                rows.append((name, f"generate {strategy}={n}", ok, detail))
    table = Table(title=f"shardkit GPU check: {where}, torch {torch.__version__}")
    for column in ("model", "check", "result", "detail"):
        table.add_column(column)
    for name, check, ok, detail in rows:
        failed += not ok
        table.add_row(name, check, "OK" if ok else "FAILED", detail)
    Console(width=200).print(table)
    print(f"{len(rows) - failed} of {len(rows)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
