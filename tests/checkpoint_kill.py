"""Run by tests/test_checkpoint.py: a 2-rank world (fsdp=2) saving in a loop, killed with SIGKILL
at random moments, again and again; after each kill ``sk.load`` must give a saved step with
exactly its weights.

    python tests/checkpoint_kill.py ROOT KILLS SEED

Each round forks the two ranks from this process (a fork costs milliseconds, a fresh Python
seconds), waits until they have saved twice, sleeps a random fraction of the time a save took and kills
both at once, as a power cut would. The weights saved at step ``s`` are the model's initial
weights plus ``s``, so the weights a load gives say which step they belong to. Prints one JSON
line per round: the delay, the last step the saver reported complete, the step loaded, whether
its weights were exact, and what the kill left behind (a temporary folder: killed mid-save).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardkit as sk
from shardkit.runtime.context import Context, run_job

RANKS = 2
PLAN = sk.Plan(mesh=sk.Mesh(fsdp=RANKS))
KEEP_LAST = 2
WIDTH = 128  # 2 x 128 x 128 floats: a save writes about 130 KB


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


def weights_at(step: int) -> dict[str, torch.Tensor]:
    """The full weights saved at ``step``."""
    return {name: p.detach() + step for name, p in build().named_parameters()}


def exact(model: nn.Module, step: int) -> bool:
    expected = weights_at(step)
    return all(torch.equal(p.detach(), expected[name]) for name, p in model.named_parameters())


def save_forever(ctx: Context, root: Path, first_step: int, log: Path) -> None:
    model = sk.shard(build(), PLAN)
    initial = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    for step in itertools.count(first_step):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(initial[name] + step)
        sk.save(root, model, step=step, extra={"step": step}, keep_last=KEEP_LAST)
        if ctx.rank == 0:
            with log.open("a") as file:
                file.write(f"{step} {time.monotonic()}\n")


def rank_process(rank: int, port: int, root: Path, first_step: int, log: Path) -> None:
    """A forked rank: join the world, save until killed."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    run_job(Context(rank, RANKS, rank, torch.device("cpu"), PLAN), save_forever, (root, first_step, log), {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fork_ranks(root: Path, first_step: int, log: Path) -> list[int]:
    port, pids = free_port(), []
    for rank in range(RANKS):
        pid = os.fork()
        if pid == 0:
            try:
                rank_process(rank, port, root, first_step, log)
            finally:
                os._exit(1)
        pids.append(pid)
    return pids


def completed(log: Path) -> list[tuple[int, float]]:
    """(step, time) of every save the saver reported complete."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [(int(step), float(at)) for step, at in (line.split() for line in lines)]


def leftovers(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.name.startswith(".")}


def one_round(root: Path, rng: random.Random, first_step: int, log: Path) -> dict:
    before, done = leftovers(root), len(completed(log))
    pids = fork_ranks(root, first_step, log)
    started = time.monotonic()
    while len(completed(log)) < done + 2:  # the loop is running: two saves are complete
        time.sleep(0.002)
        if time.monotonic() - started > 120:
            raise RuntimeError("the ranks did not save twice in 120 s")
    (_, first), (_, second) = completed(log)[-2:]
    delay = rng.uniform(0, second - first)  # anywhere in the next save
    time.sleep(delay)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)
    last = completed(log)[-1][0]
    model = build()
    info = sk.load(root, model)
    return {"delay": round(delay, 4), "save_seconds": round(second - first, 4), "last_complete": last, "loaded": info["step"],
            "extra": info["extra"], "exact": exact(model, info["step"]),
            "left": sorted(n.split(".")[-1].split("-")[0] for n in leftovers(root) - before)}


def main(root: Path, kills: int, seed: int) -> None:
    torch.set_num_threads(1)
    root.mkdir(parents=True, exist_ok=True)
    rng, log, first_step = random.Random(seed), root.parent / "completed.log", 0
    for _ in range(kills):
        result = one_round(root, rng, first_step, log)
        print(json.dumps(result), flush=True)
        first_step = result["loaded"] + 1


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
