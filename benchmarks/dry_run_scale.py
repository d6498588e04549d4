"""``sk.dry_run`` at scale: Llama-3 8B on 64 devices and 70B on 512, one rank each, on fake tensors.

Prints, per plan, the rank's bytes by component from the dry run, ``sk.estimate``'s prediction
for the same plan and their ratio (the planner's accuracy at scale; the goal is within 5 %), the
peak, and the CPU seconds of the dry run (shard and step of one rank)::

    python benchmarks/dry_run_scale.py             # the three plans
    python benchmarks/dry_run_scale.py --only 8b   # Llama-3 8B on 64 devices only

Models are built from the configs' numbers (``shardkit.planner.catalogue``: no hub), in bfloat16
compute with float32 sharded parameters, batch 1 sequence of 8192 tokens per data rank.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import shardkit as sk
from shardkit.models.hf import ATTN_IMPLEMENTATION, LLAMA_RULES, build_llama
from shardkit.plan.text import format_bytes
from shardkit.planner.catalogue import catalogue_config
from shardkit.training.dry_run import COMPARED

PRECISION = sk.FSDPOptions(param_dtype="bfloat16", reduce_dtype="float32")
SEQ = 8192

#: name -> (catalogue model, world size, mesh, pipeline)
PLANS = {
    "8b": ("llama3-8b", 64, sk.Mesh(fsdp=8, tp=8), None),
    "70b": ("llama3-70b", 512, sk.Mesh(fsdp=64, tp=8), None),
    "70b-pp": ("llama3-70b", 512, sk.Mesh(pp=4, fsdp=16, tp=8), sk.Pipeline(microbatches=4)),
}


def builder(name: str):
    config = catalogue_config(name)
    config._attn_implementation = ATTN_IMPLEMENTATION
    return partial(build_llama, config)


def run(key: str) -> None:
    model, world, mesh, pipeline = PLANS[key]
    plan = sk.Plan(mesh, rules=LLAMA_RULES, fsdp=PRECISION, pipeline=pipeline, recompute="full")
    batch = mesh.data_size * (pipeline.microbatches if pipeline else 1)
    start = time.process_time()
    result = sk.dry_run(builder(model), plan, world_size=world, batch=batch, seq_len=SEQ,
                        device_memory=80 * 2**30)
    cost = result.ranks[0]
    print(f"\n{model} on {world} devices, {mesh!r}{' x ' + str(pipeline.microbatches) + ' micro-batches' if pipeline else ''}, "
          f"recompute full, batch {batch} x {SEQ}: rank 0's step {cost.seconds:.1f} s CPU "
          f"(the whole dry run with the estimate {time.process_time() - start:.1f} s CPU)")
    ratios = result.ratios()
    print(f"  {'component':<12}{'dry run':>12}{'estimate':>12}{'est/dry':>9}")
    for part, keys in COMPARED.items():
        estimate = sum(result.estimate[k] for k in keys) if result.estimate else 0
        ratio = f"{ratios[part]:.3f}" if part in ratios else "-"
        print(f"  {part:<12}{format_bytes(cost.memory[part], digits=2):>12}{format_bytes(estimate, digits=2):>12}"
              f"{ratio:>9}")
    total = result.estimate["total"] - result.estimate["overhead"] if result.estimate else 0
    print(f"  {'peak':<12}{format_bytes(cost.memory['peak'], digits=2):>12}{format_bytes(total, digits=2):>12}"
          f"{total / cost.memory['peak']:>9.3f}   (estimate: its sum without allocator overhead)")
    for line in result.overflows():
        print(f"  {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(PLANS), action="append", help="run only these plans")
    args = parser.parse_args()
    for key in args.only or list(PLANS):
        run(key)


if __name__ == "__main__":
    main()
