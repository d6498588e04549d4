"""``sk.dry_run`` at scale: Llama-3 8B on 64 devices and 70B on 512, one rank each, on fake tensors.

Prints, per plan, the rank's bytes by component from the dry run, ``sk.estimate``'s prediction
for a device in its place and their ratio (the planner's accuracy at scale; the goal is within
5 %), the peak, and the CPU seconds of the dry run (shard and step of one rank; for a later
pipeline stage's rank, also the earlier stages' ranks run up to sending it their outputs' shapes)::

    python benchmarks/dry_run_scale.py                  # every plan
    python benchmarks/dry_run_scale.py --only 8b        # Llama-3 8B on 64 devices, fsdp x tp, only
    python benchmarks/dry_run_scale.py --only 70b-pp-last   # the last pipeline stage's first rank
    python benchmarks/dry_run_scale.py --recompute none --only 8b-pp   # another recompute (default full)

A pipeline plan's row runs rank 0 (the first stage); its ``-last`` row the last stage's first rank.

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
from shardkit.training.dry_run import COMPARED, default_ranks

PRECISION = sk.FSDPOptions(param_dtype="bfloat16", reduce_dtype="float32")
SEQ = 8192

#: name -> (catalogue model, world size, mesh, pipeline)
PLANS = {
    "8b": ("llama3-8b", 64, sk.Mesh(fsdp=8, tp=8), None),
    "8b-pp": ("llama3-8b", 64, sk.Mesh(pp=2, fsdp=4, tp=8), sk.Pipeline(microbatches=2)),
    "70b": ("llama3-70b", 512, sk.Mesh(fsdp=64, tp=8), None),
    "70b-pp": ("llama3-70b", 512, sk.Mesh(pp=4, fsdp=16, tp=8), sk.Pipeline(microbatches=4)),
}
#: the rows: a plan's rank 0, and a pipeline's last stage's first rank (``-last``)
ROWS = [*PLANS, *(f"{key}-last" for key, (_, _, _, pipeline) in PLANS.items() if pipeline is not None)]


def builder(name: str):
    config = catalogue_config(name)
    config._attn_implementation = ATTN_IMPLEMENTATION
    return partial(build_llama, config)


def run(row: str, recompute: str = "full") -> None:
    key = row.removesuffix("-last")
    model, world, mesh, pipeline = PLANS[key]
    plan = sk.Plan(mesh, rules=LLAMA_RULES, fsdp=PRECISION, pipeline=pipeline, recompute=recompute)
    batch = mesh.data_size * (pipeline.microbatches if pipeline else 1)
    rank = default_ranks(plan.resolved(world))[-1] if row.endswith("-last") else 0
    start = time.process_time()
    result = sk.dry_run(builder(model), plan, world_size=world, batch=batch, seq_len=SEQ, ranks=(rank,),
                        device_memory=80 * 2**30)
    cost = result.ranks[0]
    print(f"\n{model} on {world} devices, {mesh!r}{' x ' + str(pipeline.microbatches) + ' micro-batches' if pipeline else ''}, "
          f"recompute {recompute}, batch {batch} x {SEQ}: {cost.name}'s dry run {cost.seconds:.1f} s CPU "
          f"(the whole call with the check and the estimate {time.process_time() - start:.1f} s CPU)")
    ratios = result.ratios()
    print(f"  {'component':<12}{'dry run':>12}{'estimate':>12}{'est/dry':>9}")
    for part, keys in COMPARED.items():
        estimate = sum(cost.estimate[k] for k in keys) if cost.estimate else 0
        ratio = f"{ratios[part]:.3f}" if part in ratios else "-"
        print(f"  {part:<12}{format_bytes(cost.memory[part], digits=2):>12}{format_bytes(estimate, digits=2):>12}"
              f"{ratio:>9}")
    total = cost.estimate["total"] - cost.estimate["overhead"] if cost.estimate else 0
    print(f"  {'peak':<12}{format_bytes(cost.memory['peak'], digits=2):>12}{format_bytes(total, digits=2):>12}"
          f"{total / cost.memory['peak']:>9.3f}   (estimate: its sum without allocator overhead)")
    for line in result.overflows():
        print(f"  {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=ROWS, action="append", help="run only these rows")
    parser.add_argument("--recompute", choices=("full", "selective", "none"), default="full")
    args = parser.parse_args()
    for row in args.only or ROWS:
        run(row, args.recompute)


if __name__ == "__main__":
    main()
