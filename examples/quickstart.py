"""shardkit in twenty lines: a plan, its explanation, a sharded step and a verification."""

import torch

import shardkit as sk
from shardkit.models.gpt import build_tiny_gpt, gpt_loss

rules = sk.LayoutMap([                          # ordered; the first re.fullmatch on the parameter name wins
    (r".*\.[qkv]_proj\.weight|.*\.up_proj\.weight|lm_head\.weight", ("tp", None)),  # column-parallel
    (r".*\.[qkv]_proj\.bias|.*\.up_proj\.bias", ("tp",)),
    (r".*\.(o_proj|down_proj)\.weight", (None, "tp")),                              # row-parallel
    (r".*", None),                              # explicit catch-all: replicate the rest
])
plan = sk.Plan(mesh=sk.Mesh(fsdp=2, tp=2), rules=rules)

def work(ctx, x, y):                            # runs in every process
    model = sk.shard(build_tiny_gpt(), plan)    # still an nn.Module; takes and returns plain tensors
    return model.step(*ctx.shard_batch(x, y), gpt_loss).item()

if __name__ == "__main__":                      # not in the worker processes, which import this file again
    print(sk.explain_plan(plan, sk.meta_model(build_tiny_gpt)))  # per parameter: rule, layout, local shape, bytes
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    print(sk.launch(work, plan, x, y))          # 4 local gloo processes, or joins a torchrun world
    print(sk.verify(build_tiny_gpt, plan, (x, y), loss_fn=gpt_loss, steps=3))  # per-step max |diff|
