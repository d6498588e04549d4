"""Run by tests/test_torchrun.py under torchrun: sk.launch joins that world instead of spawning.

With the argument ``fail``, rank 1 raises after a collective while rank 0 waits in the next one.
With ``hang``, rank 0 naps past the job's 3 s timeout while rank 1 waits for it in a barrier."""

import sys
import time

import torch
import torch.distributed as dist

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt, gpt_loss


def work(ctx):
    model = sk.shard(build_tiny_gpt(), ctx.plan)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    loss = model.step(*ctx.shard_batch(tokens[:, :-1], tokens[:, 1:]), gpt_loss)
    return ctx.rank, ctx.world_size, round(loss.item(), 6), dist.get_backend()


def fail_on_rank_1(ctx):
    total = torch.ones(1)
    dist.all_reduce(total)
    if ctx.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.all_reduce(total)  # rank 0 waits here for a peer that is gone


def nap_forever():
    time.sleep(600)


def hang_on_rank_0(ctx):
    if ctx.rank == 0:
        nap_forever()
    dist.barrier()  # rank 1 waits here for rank 0


if __name__ == "__main__":
    if sys.argv[1:] == ["fail"]:
        sk.launch(fail_on_rank_1, sk.Plan(mesh=sk.Mesh(dp=-1)))
    if sys.argv[1:] == ["hang"]:
        sk.launch(hang_on_rank_0, sk.Plan(mesh=sk.Mesh(dp=-1)), timeout=3)
    results = sk.launch(work, sk.Plan(mesh=sk.Mesh(tp=-1), rules=GPT_RULES))
    if dist.get_rank() == 0:
        print("RESULTS", results)
