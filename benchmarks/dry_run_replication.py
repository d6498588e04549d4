"""``sk.estimate``'s memory against ``sk.dry_run``'s, component by component, under replication (issue 17 §5):
over ``sp`` alone and with ``dp`` (DDP), with tensor parallel (FSDP2's ``replicate``, also in bfloat16), under a
pipeline (``pp x dp``), a pipeline's tied vocab-split embedding (``pp x tp``), and DDP without accumulation.

For the reference GPT (``gpt-tiny``) and a transformers Qwen2 built from a config here (hidden 64, 2 layers,
4 heads, 2 kv heads, intermediate 128, vocab 256; ``qwen-tied``: its head tied to its embedding; no hub), batch
4 x 16, float32 but where named; each cell est/dry of the rank's component against the estimate of a device in
its place (the peak: the estimate's total less allocator overhead over the dry run's most bytes live at once).

    python benchmarks/dry_run_replication.py [--models gpt,qwen,qwen-tied] [--cases 'sp=2;dp=2,tp=2']

``--ddp-buckets``: instead, whether a real 2-process gloo DDP run (torch's composable ``replicate``, as the
runtime applies it to the reference GPT) keeps its gradient buckets through the next step's forward (weak
references to their storages, taken by a communication hook), which the estimate counts in every phase.
"""

from __future__ import annotations

import argparse

import shardkit as sk

BF16 = sk.FSDPOptions(param_dtype="bfloat16", reduce_dtype="float32")
#: case -> (mesh axes, other Plan arguments, world size, dry_run arguments)
CASES = {
    "sp=2": (dict(sp=2), {}, 2, {}),
    "dp=2,sp=2": (dict(dp=2, sp=2), {}, 4, {}),
    "dp=2,tp=2": (dict(dp=2, tp=2), {}, 4, {}),
    "dp=2,tp=2 bf16": (dict(dp=2, tp=2), dict(fsdp=BF16), 4, {}),
    "pp=2,dp=2": (dict(pp=2, dp=2), dict(pipeline=sk.Pipeline(microbatches=2)), 4, {}),
    "pp=2,tp=2": (dict(pp=2, tp=2), dict(pipeline=sk.Pipeline(microbatches=2)), 4, {}),
    "dp=2": (dict(dp=2), {}, 2, {}),
    "dp=2 sgd": (dict(dp=2), {}, 2, dict(optimizer="sgd")),
}
#: other plans of earlier comparisons (``--cases``): FSDP2, with accumulation, tensor parallel alone
OTHERS = {
    "fsdp=2": (dict(fsdp=2), {}, 2, {}),
    "fsdp=2 accum": (dict(fsdp=2), {}, 2, dict(grad_accum=2)),
    "dp=2 accum sgd": (dict(dp=2), {}, 2, dict(grad_accum=2, optimizer="sgd")),
    "tp=2": (dict(tp=2), {}, 2, {}),
    "fsdp=2,tp=2 bf16": (dict(fsdp=2, tp=2), dict(fsdp=BF16), 4, {}),
}
KEYS = ("parameters", "gradients", "optimizer", "gathered", "activations", "temporaries", "peak")


def build_qwen(tied: bool = False):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from shardkit.models.hf import ATTN_IMPLEMENTATION

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    config._attn_implementation = ATTN_IMPLEMENTATION
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def build_qwen_tied():
    return build_qwen(tied=True)


def model(name: str):
    """(builder, tensor-parallel rules, loss) of ``name``."""
    from shardkit.models.gpt import GPT_RULES, build_tiny_gpt, gpt_loss
    from shardkit.models.hf import hf_loss

    if name == "gpt":
        return build_tiny_gpt, GPT_RULES, gpt_loss
    build = build_qwen_tied if name == "qwen-tied" else build_qwen
    return build, sk.LayoutMap.from_hf(sk.meta_model(build)), hf_loss


def rows(name: str, case: str) -> list[str]:
    """One markdown row per dry-run rank: est/dry of each of :data:`KEYS`."""
    build, rules, loss = model(name)
    mesh, extra, world, kwargs = {**CASES, **OTHERS}[case]
    plan = sk.Plan(sk.Mesh(**mesh), rules=rules if "tp" in mesh else None, **extra)
    dry = sk.dry_run(build, plan, world_size=world, batch=4, seq_len=16, loss_fn=loss, **kwargs)
    out = []
    for rank in dry.ranks:
        est = {**rank.estimate, "peak": rank.estimate["total"] - rank.estimate["overhead"]}
        cells = [f"{est[k] / rank.memory[k]:.3f}" if rank.memory[k] else "-" for k in KEYS]
        out.append(f"| {name}, `{case}` | {rank.name} | " + " | ".join(cells) + " |")
    return out


def _bucket_worker(rank: int) -> None:
    import os
    import weakref

    import torch
    import torch.distributed as dist
    from torch.distributed._composable import replicate
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from shardkit.models.gpt import build_tiny_gpt, gpt_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = build_tiny_gpt()
    replicate(model)
    seen: list = []

    def hook(state, bucket):
        storage = bucket.buffer().untyped_storage()
        seen.append((weakref.ref(storage), storage.data_ptr(), storage.nbytes()))
        return allreduce_hook(state, bucket)

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    for step in range(4):
        if step == 1:  # after DDP's first step (its buckets are rebuilt in the second)
            replicate.state(model)._ddp.register_comm_hook(None, hook)
        before = list(seen)
        seen.clear()
        logits = model(tokens[:, :-1])
        alive = [ref() is not None for ref, _, _ in before]  # after this step's forward, before its backward
        gpt_loss(logits, tokens[:, 1:]).backward()
        same = sorted(p for _, p, _ in before) == sorted(p for _, p, _ in seen)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and before:
            print(f"step {step}: the previous step's {len(before)} bucket(s), {sum(n for *_, n in before):,} bytes "
                  f"(parameters: {sum(p.nbytes for p in model.parameters()):,}): alive after this forward "
                  f"{all(alive)}, the same storages reduced in this backward {same}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,qwen,qwen-tied")
    parser.add_argument("--cases", default=";".join(CASES))
    parser.add_argument("--ddp-buckets", action="store_true")
    args = parser.parse_args()
    if args.ddp_buckets:
        import torch.multiprocessing as mp

        mp.spawn(_bucket_worker, nprocs=2)
        return
    print("| model, mesh | rank | " + " | ".join(KEYS) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in KEYS) + " |")
    for case in args.cases.split(";"):
        for name in args.models.split(","):
            try:
                print("\n".join(rows(name, case)), flush=True)
            except Exception as exc:  # an old tree's dry run may fail on a case: say so in the table
                print(f"| {name}, `{case}` | fails: {type(exc).__name__} |", flush=True)


if __name__ == "__main__":
    main()
