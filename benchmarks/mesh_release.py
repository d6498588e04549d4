"""What freeing a world's unused meshes costs at the end of a job (runtime/meshes.py's release_unused).

On a 4-process gloo LocalWorld: a tiny GPT trained one step on dp=2 x tp=2, then a job on another
plan calls the release itself, as the end of a job does, and times it on every rank: after a plan
change (torch's DTensor caches emptied, a collection for the dead model's cycles, the groups
destroyed), then with nothing to free (the one all-reduce that agrees on it), and how long the
freed plan's meshes take to make again.

    PYTHONPATH=src python benchmarks/mesh_release.py
"""

from __future__ import annotations

import time

import torch

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt, gpt_loss
from shardkit.runtime.world import LocalWorld

TP = sk.Plan(mesh=sk.Mesh(dp=2, tp=2), rules=GPT_RULES)
DP = sk.Plan(mesh=sk.Mesh(dp=4))


def _train(ctx) -> None:
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(1))
    sk.shard(build_tiny_gpt(), ctx.plan).step(*ctx.shard_batch(tokens[:, :-1], tokens[:, 1:]), gpt_loss)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _release_times(ctx) -> dict[str, float]:
    from shardkit.runtime import meshes

    live = torch.distributed.distributed_c10d._world.pg_map
    groups_before = len(live)
    meshes.meshes_for(ctx.plan, ctx.device.type)  # this job's plan, asked for: kept
    changed = _timed(lambda: meshes.release_unused(ctx.device))  # the last job's plan: unused, freed
    groups_after = len(live)
    nothing = _timed(lambda: meshes.release_unused(ctx.device))
    remake = _timed(lambda: meshes.meshes_for(TP, ctx.device.type).data())
    return {"release after a plan change (ms)": changed, "release with nothing to free (ms)": nothing,
            "making dp=2 x tp=2's meshes again (ms)": remake, "groups before": groups_before,
            "groups after": groups_after}


def main() -> None:
    with LocalWorld(4, backend="gloo") as world:
        rows = []
        for _ in range(3):
            world.run(_train, plan=TP)
            rows.append(world.run(_release_times, plan=DP))
    print("| measure | " + " | ".join(f"run {i + 1} (ranks min-max)" for i in range(len(rows))) + " |")
    print("| --- |" + " ---: |" * len(rows))
    for name in rows[0][0]:
        cells = [f"{min(r[name] for r in run):.0f}-{max(r[name] for r in run):.0f}" for run in rows]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(open("/proc/loadavg").read().strip())


if __name__ == "__main__":
    main()
