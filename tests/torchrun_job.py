"""Run by tests/test_torchrun.py under torchrun: sk.launch joins that world instead of spawning."""

import sys

import torch
import torch.distributed as dist

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt, gpt_loss


def work(ctx):
    model = sk.shard(build_tiny_gpt(), ctx.plan)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    loss = model.step(*ctx.shard_batch(tokens[:, :-1], tokens[:, 1:]), gpt_loss)
    return ctx.rank, ctx.world_size, round(loss.item(), 6), dist.get_backend()


if __name__ == "__main__":
    results = sk.launch(work, sk.Plan(mesh=sk.Mesh(tp=-1), rules=GPT_RULES))
    if dist.get_rank() == 0:
        print("RESULTS", results)
    sys.exit(0)
