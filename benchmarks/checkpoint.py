"""Checkpoints and HuggingFace weights: how fast, and how much memory per rank.

For GPT-2 models of several sizes (transformers, built from configs), in a world of 4 local
gloo processes with ``fsdp=4``:

- **save / load**: ``sk.save`` and ``sk.load`` of the model and its AdamW state (each rank its
  shards, through DCP, with sha256 of every file and fsync), in MB/s of the whole state,
  against the named baseline measured in the same run: ``torch.save`` / ``torch.load`` of the
  same full state dict in one process (no hashing, no fsync, no resharding); and the time
  against DCP's own ``dcp.save`` / ``dcp.load`` of the same state in the same world.
- **memory, building from HuggingFace weights**: the peak bytes of live tensors on each rank
  (torch's profiler, ``observe.memory.TensorMemoryPeak``) while ``sk.meta_model(build)``
  constructs the model and while ``sk.shard(model, plan, weights=folder)`` splits it and reads
  the weights, and the process's peak RSS growth over both, against the baseline of every
  rank loading the whole model (``from_pretrained``) and then sharding it, and against the
  shard each rank holds.
- **memory, exporting**: the peak on each rank while ``sk.export_hf`` writes the folder,
  against the largest tensor (rank 0 holds one tensor being written and one arriving).

    python benchmarks/checkpoint.py [--sizes 256x4,512x8,768x12] [--repeats 3]

A size ``DxL`` is n_embd D and L layers (vocab 8192, 1024 positions). Times are the median of
``--repeats``; a shared machine is noisy, so compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.observe.memory import PeakMemory, TensorMemoryPeak, tensors_nbytes
from shardkit.plan.text import format_bytes
from shardkit.runtime.devices import clock

WORLD = 4
PLAN = sk.Plan(sk.Mesh(fsdp=WORLD))


def build(size: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    dim, layers = (int(x) for x in size.split("x"))
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=dim, n_layer=layers, n_head=max(1, dim // 64), vocab_size=8192,
                                      n_positions=1024))


def _state_bytes(model, optimizer) -> int:
    return tensors_nbytes(model.parameters()) + sum(
        tensors_nbytes(v for v in state.values() if isinstance(v, torch.Tensor)) for state in optimizer.state.values())


def _trained_optimizer(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW state exists
    optimizer.zero_grad()
    return optimizer


def save_load_job(ctx, size: str, folder: str, repeats: int) -> dict:
    """Median seconds of sk.save and sk.load, and of DCP alone on the same state (no checks,
    no manifest, no RNG, no rename)."""
    import torch.distributed.checkpoint as dcp

    from shardkit.checkpoint.state import state_dicts

    model = sk.shard(sk.meta_model(build, size), ctx.plan)
    optimizer = _trained_optimizer(model)
    times: dict[str, list[float]] = {"save": [], "load": [], "dcp_save": [], "dcp_load": []}

    def timed(name, fn) -> None:
        torch.distributed.barrier()
        start = clock()
        fn()
        torch.distributed.barrier()
        times[name].append(clock() - start)

    for step in range(repeats):
        timed("save", lambda step=step: sk.save(folder, model, optimizer, step=step + 1, keep_last=1))
        timed("load", lambda: sk.load(folder, model, optimizer))
        raw = f"{folder}-dcp-{step}"
        timed("dcp_save", lambda raw=raw: dcp.save(state_dicts(model, optimizer), checkpoint_id=raw))
        timed("dcp_load", lambda raw=raw: dcp.load(state_dicts(model, optimizer), checkpoint_id=raw))
        torch.distributed.barrier()
        if ctx.rank == 0:
            shutil.rmtree(raw)
    return {**{name: statistics.median(values) for name, values in times.items()},
            "bytes": _state_bytes(model, optimizer)}


def memory_job(ctx, size: str, weights: str, out: str, meta: bool, profile: bool) -> dict:
    """With ``profile``: peak tensor bytes of building the model, of ``sk.shard`` (+ weights), of
    exporting. Without (the profiler's own memory would count): the RSS growth over building and
    ``sk.shard``."""
    if not profile:
        rss = PeakMemory().start()
        model = sk.shard(sk.meta_model(build, size) if meta else _full_from(weights), ctx.plan,
                         weights=weights if meta else None)
        return {"rss": rss.peak_bytes()}
    with TensorMemoryPeak() as constructed:
        model = sk.meta_model(build, size) if meta else _full_from(weights)
    with TensorMemoryPeak() as sharded:
        model = sk.shard(model, ctx.plan, weights=weights if meta else None)
    held = tensors_nbytes(model.parameters())
    peak_export = None
    if meta:
        with TensorMemoryPeak() as exported:
            sk.export_hf(out, model, overwrite=True)
        peak_export = exported.peak_bytes()
    return {"construct": constructed.peak_bytes(), "shard": sharded.peak_bytes(), "held": held, "export": peak_export}


def _full_from(weights: str):
    """The baseline: the whole model built and its weights loaded on this rank, then sharded."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(weights)


def baseline_save_load(size: str, folder: Path, repeats: int) -> dict:
    model = build(size)
    optimizer = _trained_optimizer(model)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    saves, loads = [], []
    for _ in range(repeats):
        start = clock()
        torch.save(state, folder / "state.pt")
        saves.append(clock() - start)
        start = clock()
        loaded = torch.load(folder / "state.pt", weights_only=True)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        loads.append(clock() - start)
    return {"save": statistics.median(saves), "load": statistics.median(loads), "bytes": _state_bytes(model, optimizer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256x4,512x8,768x12")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    console = Console(width=220)
    speed = Table(title=f"save / load, {PLAN.mesh!r}: sk (4 ranks) vs torch.save/torch.load (1 process)")
    for column in ("model", "state (params + AdamW)", "sk.save MB/s", "torch.save MB/s", "save ratio",
                   "sk.save / DCP alone (time)", "sk.load MB/s", "torch.load MB/s", "load ratio",
                   "sk.load / DCP alone (time)"):
        speed.add_column(column, justify="right")
    memory = Table(title="peak memory per rank (max over ranks), fsdp=4, building from HuggingFace weights")
    for column in ("model", "params", "largest tensor", "shard held", "sk.shard(meta, weights=)", "vs shard",
                   "meta_model(build)", "RSS growth", "baseline", "baseline RSS",
                   "RSS ours / baseline", "export (rank 0)", "export / largest"):
        memory.add_column(column, justify="right")
    root = Path(tempfile.mkdtemp(prefix="sk-bench-ckpt-"))
    try:
        with sk.LocalWorld(WORLD) as world:
            for size in args.sizes.split(","):
                model = build(size)
                whole = tensors_nbytes(model.parameters())
                largest = max(p.numel() * p.element_size() for p in model.parameters())
                model.save_pretrained(root / f"hf-{size}")
                del model
                base = baseline_save_load(size, root, args.repeats)
                ours = world.run(save_load_job, size, str(root / f"ck-{size}"), args.repeats, plan=PLAN)
                total = sum(r["bytes"] for r in ours)
                save_s, load_s = max(r["save"] for r in ours), max(r["load"] for r in ours)
                mb = total / 1e6
                dcp_save, dcp_load = max(r["dcp_save"] for r in ours), max(r["dcp_load"] for r in ours)
                speed.add_row(f"{size}", format_bytes(total), f"{mb / save_s:.0f}", f"{base['bytes'] / 1e6 / base['save']:.0f}",
                              f"{base['save'] / save_s * total / base['bytes']:.2f}x", f"{save_s / dcp_save:.2f}x",
                              f"{mb / load_s:.0f}", f"{base['bytes'] / 1e6 / base['load']:.0f}",
                              f"{base['load'] / load_s * total / base['bytes']:.2f}x", f"{load_s / dcp_load:.2f}x")
                hf, out = str(root / f"hf-{size}"), str(root / f"out-{size}")
                meta = world.run(memory_job, size, hf, out, True, True, plan=PLAN)
                full = world.run(memory_job, size, hf, out, False, True, plan=PLAN)
                ours_rss = max(r["rss"] for r in world.run(memory_job, size, hf, out, True, False, plan=PLAN))
                base_rss = max(r["rss"] for r in world.run(memory_job, size, hf, out, False, False, plan=PLAN))
                shard_peak = max(r["shard"] for r in meta)
                held = max(r["held"] for r in meta)
                baseline = max(r["construct"] + r["shard"] for r in full)
                exported = meta[0]["export"]
                memory.add_row(size, format_bytes(whole), format_bytes(largest), format_bytes(held),
                               format_bytes(shard_peak), f"{shard_peak / held:.2f}x",
                               format_bytes(max(r["construct"] for r in meta)), format_bytes(ours_rss),
                               format_bytes(baseline), format_bytes(base_rss), f"{ours_rss / base_rss:.2f}x",
                               format_bytes(exported), f"{exported / largest:.2f}x")
                shutil.rmtree(root / f"ck-{size}", ignore_errors=True)
                shutil.rmtree(root / f"out-{size}", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    console.print(speed)
    console.print(memory)
    console.print("MB/s: bytes of the whole state (every rank's shards) over the slowest rank's time. Ratios > 1: sk "
                  "faster. torch.save neither fsyncs, hashes nor reshards; 'DCP alone' is dcp.save/dcp.load of the "
                  "same state in the same world, so its column is the cost of sk's checks, manifest and RNG. Memory: peak bytes of live tensors (torch's profiler) in each phase; meta_model(build) "
                  "creates each parameter (torch.empty, untouched) before moving it to meta, one at a time. RSS "
                  "growth: the process's peak resident memory over construction and sk.shard (VmHWM), "
                  "measured in runs without the profiler. The baseline builds the whole model on every rank with "
                  "from_pretrained, then shards it.")


if __name__ == "__main__":
    main()
