"""The checks of ``benchmarks/gpu_check.py``, one function each, and the jobs they run in every process.

A check is ``check(env) -> str``: it returns what it measured (the table's detail column) or
raises :class:`Failed` (a wrong result: the row says FAIL) or :class:`Skipped` (the row says
``skipped: <reason>``, e.g. ``no CUDA``: never a silent omission). Every check runs at the sizes
of ``env.sizes`` (:data:`FULL` on CUDA, :data:`TINY` on CPU) within ``env.limit_s`` seconds: the
world jobs get it as their timeout, subprocesses as theirs. Jobs are top-level functions, so
they pickle into the world's processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardkit as sk
from shardkit.models.gpt import GPT, GPT_RULES, GPTConfig, gpt_loss
from shardkit.models.hf import build_llama, hf_loss, tiny_llama_config
from shardkit.runtime.devices import StepTimer, clock

SRC = Path(__file__).resolve().parents[1] / "src"


class Failed(Exception):
    """The check ran and its result is wrong (or a feature it needs is missing)."""


class Skipped(Exception):
    """The check cannot run here; the message is the reason the table shows."""


@dataclass(frozen=True)
class Sizes:
    """How big each check is: :data:`FULL` on CUDA (within 8 minutes on one H200), :data:`TINY` on CPU."""

    name: str
    gpt: dict  # GPTConfig fields of the verified model
    timed_gpt: dict  # GPTConfig fields of the model whose step is timed
    batch: int
    seq: int
    ring_lengths: tuple[int, ...]  # tokens of the one-device ring attention against SDPA
    ring_heads: int
    ring_head_dim: int
    accumulator_bytes: int  # the sp=2 ring's float32 output accumulator per rank
    accumulator_heads: tuple[int, int]  # its heads and head dim
    timed_steps: int
    train_model: str
    hang_timeout_s: float
    new_tokens: int
    slack: float  # each check's time bound (set for one GPU) times this


FULL = Sizes("full", gpt=dict(vocab=1024, layers=4, dim=256, heads=8, seq_len=256),
             timed_gpt=dict(vocab=8192, layers=8, dim=1024, heads=16, seq_len=1024), batch=8, seq=256,
             ring_lengths=(8192, 16384), ring_heads=8, ring_head_dim=64, accumulator_bytes=64 << 20,
             accumulator_heads=(16, 128), timed_steps=8, train_model="gpt-small", hang_timeout_s=20.0,
             new_tokens=16, slack=1.0)
TINY = Sizes("tiny", gpt=dict(vocab=256, layers=4, dim=32, heads=2, seq_len=16),
             timed_gpt=dict(vocab=256, layers=2, dim=64, heads=4, seq_len=32), batch=4, seq=16,
             ring_lengths=(128, 256), ring_heads=2, ring_head_dim=16, accumulator_bytes=64 << 10,
             accumulator_heads=(2, 16), timed_steps=3, train_model="gpt-tiny", hang_timeout_s=3.0,
             new_tokens=4, slack=3.0)  # 2 shared CPU cores


@dataclass
class Env:
    """What a check is given: the sizes, the devices, the worlds, where to write, its time bound."""

    sizes: Sizes
    world: int  # --world: processes of the multi-rank checks
    cuda: bool  # one CUDA device per rank (NCCL), else gloo on CPU
    worlds: Callable[[int], Any]  # size -> a live sk.LocalWorld (restarted after a failed job)
    out: Path
    limit_s: float = 60.0


# -- models and batches -------------------------------------------------------------------------------
def build_gpt(fields: dict) -> GPT:
    """The reference GPT of ``fields``, seeded (a builder for ``sk.verify``: ``partial(build_gpt, fields)``)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(**fields))


def build_gpt_on_meta(fields: dict) -> GPT:
    """The same GPT built on the meta device: ``sk.shard`` gives each rank only its shards."""
    return sk.meta_model(GPT, GPTConfig(**fields))


def build_tied_llama(hidden: int = 64) -> torch.nn.Module:
    """A four-layer Llama whose lm_head is its embedding (a tie across pipeline stages)."""
    return build_llama(tiny_llama_config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                                         tie_word_embeddings=True, max_position_embeddings=1024))


def tokens(vocab: int, batch: int, seq: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _verify(env: Env, build, plan: sk.Plan, loss_fn=gpt_loss, vocab: int | None = None, steps: int = 3) -> str:
    vocab = vocab or env.sizes.gpt["vocab"]
    result = sk.verify(build, plan, tokens(vocab, env.sizes.batch, env.sizes.seq), loss_fn=loss_fn, steps=steps,
                       world=env.worlds(plan.mesh.size))
    if not result.ok:
        raise Failed(" | ".join(str(result).splitlines()[:4]))
    worst = max(result.steps, key=lambda s: s.grad)
    where = worst.worst_grad if worst.grad else "every gradient equal"
    return f"{steps} steps, loss {result.losses[-1]:.4f}, worst grad diff {worst.grad:.1e} ({where})"


def _gpt(env: Env) -> Callable[[], GPT]:
    return partial(build_gpt, env.sizes.gpt)


# -- one device ------------------------------------------------------------------------------------------
def meta_verify(env: Env) -> str:
    """Built on meta, materialised on the device, verified against one CPU process."""
    return _verify(env, partial(build_gpt_on_meta, env.sizes.gpt), sk.Plan(sk.Mesh(fsdp=1)))


def bf16_verify(env: Env) -> str:
    plan = sk.Plan(sk.Mesh(fsdp=1), fsdp=sk.FSDPOptions(param_dtype="bfloat16", reduce_dtype="float32"))
    return _verify(env, _gpt(env), plan)


def fp16_scaled_verify(env: Env) -> str:
    """float16 compute with a loss scale (the ``fp16`` feature: ``Plan(loss_scale=...)``)."""
    if "loss_scale" not in {f.name for f in dataclasses.fields(sk.Plan)}:
        raise Failed("feature missing: Plan(loss_scale=...) for float16 (branch fp16 not merged)")
    plan = sk.Plan(sk.Mesh(fsdp=1), fsdp=sk.FSDPOptions(param_dtype="float16", reduce_dtype="float32"),
                   loss_scale="dynamic")
    return _verify(env, _gpt(env), plan) + f", loss scale {plan.loss_scaling}"


def _subprocess(env: Env, args: list[str], cwd: Path, extra: dict[str, str] | None = None,
                limit_s: float | None = None) -> subprocess.CompletedProcess:
    pythonpath = os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    run_env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               **(extra or {})}
    limit_s = limit_s or env.limit_s
    try:
        proc = subprocess.run(args, cwd=cwd, env=run_env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as exc:
        raise Failed(f"still running after {limit_s:.0f} s: {' '.join(args[2:])}") from exc
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        ours = [line for line in lines if line.startswith(("shardkit", "[default")) or "Error" in line]
        raise Failed(f"exit {proc.returncode}: {' / '.join((ours or lines)[-3:])[-400:]}")
    return proc


def train_cli(env: Env) -> str:
    """``shardkit train`` on one device; its log's step time."""
    run = env.out / "train"
    steps = env.sizes.timed_steps + 2
    _subprocess(env, [sys.executable, "-m", "shardkit", "train", "--model", env.sizes.train_model, "--mesh", "fsdp=1",
                      "--steps", str(steps), "--data-mb", "0.5", "--log-dir", str(run), "--timeout",
                      str(int(env.limit_s))], cwd=env.out)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in records if "loss" in r]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    if len(losses) < steps or not all(math.isfinite(x) for x in losses):
        raise Failed(f"{len(losses)} losses logged for {steps} steps: {losses}")
    return f"{steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, {statistics.median(rates):,.0f} tokens/s"


class _DeviceClock:
    """Seconds of work queued on the device between ``start`` and ``stop``, measured independently of
    shardkit's timer: CUDA events recorded here on CUDA; on CPU (work done when a call returns)
    the synchronised clock."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            self._begin, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._began = clock(self.device)

    def stop(self) -> float:
        if self.device.type != "cuda":
            return clock(self.device) - self._began
        self._end.record()
        self._end.synchronize()
        return self._begin.elapsed_time(self._end) / 1000


def _step_timer_job(ctx, fields: dict, batch: tuple, steps: int) -> list[tuple[float, float, float]]:
    """Per step: shardkit's StepTimer, the independent device clock, and the synchronised host clock."""
    model = sk.shard(build_gpt(fields), ctx.plan, ctx)
    opt = sk.optimizer(model, torch.optim.AdamW, lr=1e-4)
    inputs, targets = ctx.shard_batch(*batch)
    events, found = _DeviceClock(ctx.device), []
    for _ in range(steps + 1):  # the first step (allocations, autotuning) is left out
        began = clock(ctx.device)
        events.start()
        timer = StepTimer(ctx.device).start()
        model.step(inputs, targets, gpt_loss)
        opt.step()
        opt.zero_grad()
        found.append((timer.stop(), events.stop(), clock(ctx.device) - began))
    return found[1:]


def step_time(env: Env) -> str:
    """shardkit's step timer (``runtime/devices.py``) and its synchronised clock against CUDA events."""
    fields = env.sizes.timed_gpt
    batch = tokens(fields["vocab"], env.sizes.batch, fields["seq_len"])
    found = env.worlds(1).run(_step_timer_job, fields, batch, env.sizes.timed_steps, plan=sk.Plan(sk.Mesh(fsdp=1)),
                              timeout=env.limit_s)[0]
    timer, events, host = (statistics.median(f[i] for f in found) for i in range(3))
    what = "CUDA events" if env.cuda else "the synchronised clock"
    text = f"StepTimer {timer * 1e3:.2f} ms/step, {what} {events * 1e3:.2f} ms, clock() {host * 1e3:.2f} ms"
    if abs(timer - events) > 0.1 * events + 0.002 or abs(host - events) > 0.1 * events + 0.002:
        raise Failed(f"more than 10% + 2 ms apart: {text}")
    return text


# -- ring attention ---------------------------------------------------------------------------------------
def _qkv(batch: int, heads: int, length: int, head_dim: int, device, dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, head_dim, generator=g).to(device, dtype) for _ in range(3)]


def _peak_bytes(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the device memory it allocated at its peak above what was allocated before (0 on CPU)."""
    if device.type != "cuda":
        return fn(), 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - before


def _forward_backward(attention: Callable, q, k, v) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v)
    out.float().square().sum().backward()
    return out.detach(), [q.grad, k.grad, v.grad]


def _ring_job(ctx, lengths: tuple[int, ...], heads: int, head_dim: int, dtype_name: str) -> list[dict]:
    """Ring attention over every rank of the world on each length, against SDPA on the whole sequence:
    output and gradient errors (both against float32 SDPA) and each one's peak device memory."""
    from shardkit.context_parallel import gather_sequence, ring_attention, shard_sequence

    dtype, group, size = getattr(torch, dtype_name), dist.group.WORLD, ctx.world_size
    found = []
    for length in lengths:
        q, k, v = _qkv(1, heads, length, head_dim, ctx.device, dtype)
        exact, exact_grads = _forward_backward(partial(F.scaled_dot_product_attention, is_causal=True),
                                               *(t.float() for t in (q, k, v)))
        (sdpa, sdpa_grads), sdpa_bytes = _peak_bytes(ctx.device, lambda q=q, k=k, v=v: _forward_backward(
            partial(F.scaled_dot_product_attention, is_causal=True), q, k, v))
        local = [shard_sequence(t, ctx.rank, size, dim=2) for t in (q, k, v)]
        (ring, ring_grads), ring_bytes = _peak_bytes(ctx.device, lambda local=local: _forward_backward(
            partial(ring_attention, group=group), *local))
        ring = gather_sequence(ring, group, dim=2)
        grads = [gather_sequence(g, group, dim=2) for g in ring_grads]
        found.append({"length": length, "ring_bytes": ring_bytes, "sdpa_bytes": sdpa_bytes,
                      "ring_err": (ring.float() - exact).abs().max().item(),
                      "sdpa_err": (sdpa.float() - exact).abs().max().item(),
                      "ring_grad_err": max((g.float() - e).abs().max().item() for g, e in zip(grads, exact_grads)),
                      "sdpa_grad_err": max((g.float() - e).abs().max().item() for g, e in zip(sdpa_grads, exact_grads)),
                      "scale": exact.abs().max().item(),
                      "grad_scale": max(e.abs().max().item() for e in exact_grads)})
        del q, k, v, exact, exact_grads, sdpa, sdpa_grads, local, ring, ring_grads, grads
    return found


_CACHE: dict = {}


def _ring_rows(env: Env) -> list[dict]:
    key = ("ring", env.world)
    if key not in _CACHE:  # the output row and the memory row read one run
        s = env.sizes
        _CACHE[key] = env.worlds(1).run(_ring_job, s.ring_lengths, s.ring_heads, s.ring_head_dim, "bfloat16",
                                        timeout=env.limit_s)[0]
    return _CACHE[key]


def _within_sdpa(row: dict) -> bool:
    """bfloat16 ring attention is as close to float32 attention as bfloat16 SDPA is (2x + 1% of scale)."""
    return (row["ring_err"] <= 2 * row["sdpa_err"] + 0.01 * row["scale"]
            and row["ring_grad_err"] <= 2 * row["sdpa_grad_err"] + 0.01 * row["grad_scale"])


def ring_output(env: Env) -> str:
    """Ring attention (bfloat16, one device) equals SDPA on the whole sequence, forward and backward."""
    rows = _ring_rows(env)
    text = ", ".join(f"{r['length']} tokens: err {r['ring_err']:.1e} (SDPA {r['sdpa_err']:.1e}), grad "
                     f"{r['ring_grad_err']:.1e} (SDPA {r['sdpa_grad_err']:.1e})" for r in rows)
    if not all(_within_sdpa(r) for r in rows):
        raise Failed(f"bfloat16 ring attention further from float32 attention than SDPA: {text}")
    return text


def ring_memory(env: Env) -> str:
    """Peak device memory of ring attention's forward+backward against SDPA's, per length (CUDA only)."""
    if not env.cuda:
        raise Skipped("no CUDA (CPU has no allocator peak to compare)")
    rows = _ring_rows(env)
    s = env.sizes
    text = ", ".join(f"{r['length']} tokens: ring {r['ring_bytes'] / 2**20:,.0f} MiB, SDPA "
                     f"{r['sdpa_bytes'] / 2**20:,.0f} MiB" for r in rows)
    # the math kernel on one device is quadratic: at most 8 float32 L x L matrices per head live at once
    bound = max(32 * s.ring_heads * r["length"] ** 2 + 64 * s.ring_heads * r["length"] * s.ring_head_dim
                for r in rows)
    if max(r["ring_bytes"] for r in rows) > bound:
        raise Failed(f"ring attention above its bound of {bound / 2**20:,.0f} MiB: {text}")
    return text


# -- checkpoints and generation -----------------------------------------------------------------------------
def _checkpoint_job(ctx, build, batch: tuple, folder: str) -> dict:
    from safetensors.torch import load_file

    model = sk.shard(build(), ctx.plan, ctx)
    opt = sk.optimizer(model, torch.optim.AdamW, lr=1e-3)
    inputs, targets = ctx.shard_batch(*batch)
    model.step(inputs, targets, hf_loss)
    opt.step()
    saved = sk.full_state_dict(model)
    sk.save(Path(folder) / "ckpt", model, opt, step=1)
    fresh = sk.shard(build(), ctx.plan, ctx)
    fresh_opt = sk.optimizer(fresh, torch.optim.AdamW, lr=1e-3)
    sk.load(Path(folder) / "ckpt", fresh, fresh_opt)
    loaded = sk.full_state_dict(fresh)
    sk.export_hf(Path(folder) / "hf", fresh)
    dist.barrier()
    exported = {}
    for file in sorted((Path(folder) / "hf").glob("*.safetensors")):
        exported.update(load_file(file))
    load_diff = max((saved[n].float().cpu() - loaded[n].float().cpu()).abs().max().item() for n in saved)
    missing = [n for n in saved if n not in exported and n != "lm_head.weight"]
    export_diff = max((saved[n].float().cpu() - exported[n].float()).abs().max().item() for n in saved if n in exported)
    return {"load_diff": load_diff, "export_diff": export_diff, "missing": missing, "files": len(exported)}


def _checkpoint(env: Env, plan: sk.Plan) -> str:
    folder = Path(tempfile.mkdtemp(prefix="ckpt-", dir=env.out))
    batch = tokens(256, env.sizes.batch, env.sizes.seq)
    results = env.worlds(plan.mesh.size).run(_checkpoint_job, build_tied_llama, batch, str(folder), plan=plan,
                                             timeout=env.limit_s)
    worst = max(results, key=lambda r: (r["load_diff"], r["export_diff"]))
    if worst["load_diff"] or worst["export_diff"] or worst["missing"]:
        raise Failed(f"after save+load the weights differ by {worst['load_diff']:.1e}, the export by "
                     f"{worst['export_diff']:.1e}; missing from the export: {worst['missing'][:3]}")
    return f"saved, loaded and exported exactly ({worst['files']} tensors) under {plan.mesh!r}"


def checkpoint_one(env: Env) -> str:
    return _checkpoint(env, sk.Plan(sk.Mesh(fsdp=1)))


def checkpoint_multi(env: Env) -> str:
    return _checkpoint(env, sk.Plan(sk.Mesh(fsdp=env.world)))


def _generate_job(ctx, build, prompt: torch.Tensor, new: int) -> torch.Tensor:
    model = sk.shard(build(), ctx.plan, ctx)
    return sk.generate(model, prompt.to(ctx.device), max_new_tokens=new, eos_token_id=None).cpu()


def _generate(env: Env, plan: sk.Plan) -> str:
    """Greedy tokens of the sharded model, checked by the whole model's logits: each chosen token's logit
    is within a tolerance of the best one (devices may break near-ties differently: never exact tokens)."""
    fields = env.sizes.gpt
    build = partial(build_gpt, fields)
    prompt = tokens(fields["vocab"], 2, 5, seed=3)[0]
    new = env.sizes.new_tokens
    runs = env.worlds(plan.mesh.size).run(_generate_job, build, prompt, new, plan=plan, timeout=env.limit_s)
    whole = build().eval()
    for rank, ids in enumerate(runs):
        if ids.shape != (prompt.shape[0], prompt.shape[1] + new) or not torch.equal(ids[:, :5], prompt):
            raise Failed(f"rank {rank} returned shape {tuple(ids.shape)} not starting with the prompt")
        with torch.no_grad():
            logits = whole(ids[:, :-1])[:, prompt.shape[1] - 1:].float()
        chosen = logits.gather(-1, ids[:, prompt.shape[1]:, None]).squeeze(-1)
        gap = (logits.max(-1).values - chosen).max().item()
        tolerance = 1e-3 * max(1.0, logits.abs().max().item())
        if gap > tolerance:
            raise Failed(f"rank {rank} chose a token {gap:.2e} below the whole model's best logit "
                         f"(tolerance {tolerance:.1e}): {ids.tolist()}")
    return f"{new} tokens x {prompt.shape[0]} prompts under {plan.mesh!r}: every choice the whole model's best"


def generate_one(env: Env) -> str:
    return _generate(env, sk.Plan(sk.Mesh(tp=1), GPT_RULES))


def generate_tp(env: Env) -> str:
    return _generate(env, sk.Plan(sk.Mesh(tp=env.world), GPT_RULES))


def generate_pp(env: Env) -> str:
    return _generate(env, sk.Plan(sk.Mesh(pp=2, dp=env.world // 2), pipeline=sk.Pipeline(schedule="sequential")))


# -- every strategy on the world ----------------------------------------------------------------------------
def _even(env: Env, at_least: int = 2) -> None:
    if env.world < at_least or env.world % 2:
        raise Skipped(f"needs an even number of at least {at_least} devices (--world {env.world})")


def verify_strategy(env: Env, name: str) -> str:
    n = env.world
    plans = {"dp": lambda: sk.Plan(sk.Mesh(dp=n)), "fsdp": lambda: sk.Plan(sk.Mesh(fsdp=n)),
             "tp": lambda: sk.Plan(sk.Mesh(tp=n), GPT_RULES), "sp": lambda: sk.Plan(sk.Mesh(sp=n)),
             "zero=1": lambda: sk.Plan(sk.Mesh(dp=n), zero=1),
             "recompute": lambda: sk.Plan(sk.Mesh(fsdp=n), recompute="full")}
    if name in plans:
        return _verify(env, _gpt(env), plans[name]())
    if name == "hsdp":
        _even(env, 4)
        return _verify(env, _gpt(env), sk.Plan(sk.Mesh(dp=2, fsdp=n // 2)))
    if name == "fsdp x tp":
        _even(env, 4)
        return _verify(env, _gpt(env), sk.Plan(sk.Mesh(fsdp=n // 2, tp=2), GPT_RULES))
    _even(env)
    schedule = {"pp interleaved": "interleaved-1f1b", "pp zbv": "zbv"}[name]
    plan = sk.Plan(sk.Mesh(pp=2, fsdp=n // 2), pipeline=sk.Pipeline(schedule=schedule, microbatches=2,
                                                                      virtual_stages=2))
    return _verify(env, build_tied_llama, plan, loss_fn=hf_loss, vocab=256) + " (embedding tied to lm_head)"


def _accumulator_job(ctx, heads: int, head_dim: int, length: int) -> dict:
    """Ring attention over the mesh's ``sp`` group at a length where each rank's float32 accumulator is the
    asked size, against SDPA on the whole sequence (float32, so the difference is the ring's alone)."""
    from shardkit.context_parallel import gather_sequence, ring_attention, shard_sequence

    group = ctx.mesh["sp"].get_group()
    sp_rank, sp = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = _qkv(1, heads, length, head_dim, ctx.device, torch.float32, seed=ctx.mesh.get_coordinate()[0])
    exact, exact_grads = _forward_backward(partial(F.scaled_dot_product_attention, is_causal=True), q, k, v)
    local = [shard_sequence(t, sp_rank, sp, dim=2) for t in (q, k, v)]
    out, grads = _forward_backward(partial(ring_attention, group=group), *local)
    out = gather_sequence(out, group, dim=2)
    grads = [gather_sequence(g, group, dim=2) for g in grads]
    return {"err": (out - exact).abs().max().item(),
            "grad_err": max((g - e).abs().max().item() for g, e in zip(grads, exact_grads))}


def sp_accumulator(env: Env) -> str:
    """sp=2 ring attention whose float32 accumulator is ``accumulator_bytes`` per rank, within 120 s."""
    _even(env)
    s = env.sizes
    heads, head_dim = s.accumulator_heads
    local = s.accumulator_bytes // (heads * head_dim * 4)
    plan = sk.Plan(sk.Mesh(dp=env.world // 2, sp=2))
    found = env.worlds(env.world).run(_accumulator_job, heads, head_dim, 2 * local, plan=plan,
                                      timeout=min(env.limit_s, 120))
    worst = max(max(r["err"], r["grad_err"]) for r in found)
    if worst > 1e-4:
        raise Failed(f"ring attention differs from SDPA by {worst:.1e} (float32)")
    return (f"{2 * local} tokens, accumulator {s.accumulator_bytes / 2**20:g} MiB per rank: max diff "
            f"{worst:.1e} from SDPA")


def _profile_job(ctx, batch: tuple, steps: int, folder: str) -> list[tuple[float, float]]:
    from shardkit.observe.timeline import write_profile
    from shardkit.runtime.spans import collect, recording

    model = sk.shard(build_tied_llama(), ctx.plan, ctx)
    inputs, targets = ctx.shard_batch(*batch)
    clock, seconds = _DeviceClock(ctx.device), []
    with recording(ctx.rank):
        for _ in range(steps + 1):
            clock.start()
            model.step(inputs, targets, hf_loss)
            seconds.append(clock.stop())
            model.zero_grad(set_to_none=True)
        spans = collect()
    recorded = [s.duration_ns / 1e9 for s in spans if s.kind == "step"]
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, spans)
    if ctx.rank == 0:
        pipeline = ctx.plan.pipeline
        write_profile(dict(enumerate(everyone)), folder, pipeline.schedule, pipeline.num_stages(ctx.plan.mesh),
                      pipeline.microbatches, pipeline.virtual_stages)
    return list(zip(recorded, seconds))[1:]


def profile_events(env: Env) -> str:
    """The profile's step spans (what ``--profile`` draws) against CUDA events around the same steps."""
    _even(env)
    plan = sk.Plan(sk.Mesh(pp=2, fsdp=env.world // 2), pipeline=sk.Pipeline(schedule="1f1b", microbatches=2))
    folder = env.out / "profile"
    runs = env.worlds(env.world).run(_profile_job, tokens(256, env.sizes.batch, env.sizes.seq),
                                     env.sizes.timed_steps, str(folder), plan=plan, timeout=env.limit_s)
    what = "CUDA events" if env.cuda else "the host clock"
    pairs = [pair for run in runs for pair in run]
    if not pairs:
        raise Failed("no step spans recorded")
    worst = max(pairs, key=lambda p: abs(p[0] - p[1]) / p[1])
    if abs(worst[0] - worst[1]) > 0.1 * worst[1] + 0.002:
        raise Failed(f"a step span of {worst[0] * 1e3:.2f} ms against {worst[1] * 1e3:.2f} ms by {what}")
    return (f"{len(pairs)} step spans within 10% + 2 ms of {what} (worst {worst[0] * 1e3:.2f} vs "
            f"{worst[1] * 1e3:.2f} ms); trace in {folder.name}/")


def _real_peak_job(ctx, fields: dict, batch: tuple) -> int:
    """The CUDA allocator's peak over what the dry run runs: shard a meta-built model, one AdamW step."""
    from shardkit.runtime.devices import memory_mark, peak_growth

    mark = memory_mark(ctx.device)
    model = sk.shard(build_gpt_on_meta(fields), ctx.plan, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.step(*ctx.shard_batch(*batch), gpt_loss)
    opt.step()
    return peak_growth(ctx.device, mark)


def dry_run_memory(env: Env) -> str:
    """``sk.dry_run``'s peak bytes of a rank (fake tensors, no device) against the CUDA allocator's peak
    for the same step under fsdp over every device (within 30%)."""
    try:
        dry_run = sk.dry_run
    except AttributeError as exc:
        raise Failed("feature missing: sk.dry_run (branch dryrun not merged)") from exc
    fields, plan = env.sizes.timed_gpt, sk.Plan(sk.Mesh(fsdp=env.world))
    batch = tokens(fields["vocab"], env.sizes.batch, fields["seq_len"])
    predicted = dry_run(partial(build_gpt, fields), plan, world_size=env.world, batch=env.sizes.batch,
                        seq_len=fields["seq_len"], loss_fn=gpt_loss, estimate=False).ranks[0].memory["peak"]
    if not env.cuda:
        raise Skipped(f"no CUDA (the dry run's {predicted / 2**20:,.1f} MiB on rank 0 is compared with the CUDA "
                      f"allocator's peak)")
    real = env.worlds(env.world).run(_real_peak_job, fields, batch, plan=plan, timeout=env.limit_s)[0]
    text = f"dry run {predicted / 2**20:,.0f} MiB, CUDA peak {real / 2**20:,.0f} MiB on rank 0 (ratio {predicted / real:.2f})"
    if not 0.7 <= predicted / real <= 1.3:
        raise Failed(f"more than 30% apart: {text}")
    return text


# -- failures and launchers -----------------------------------------------------------------------------
def _ready(ctx) -> int:
    return ctx.rank


def _hang_job(ctx) -> None:
    if ctx.rank == ctx.world_size - 1:
        time.sleep(3600)  # the hung rank: never joins the all-reduce below
    ones = torch.ones(1, device=ctx.device)
    dist.all_reduce(ones)
    ones.cpu()  # NCCL returns before the collective ends: wait for it here


def hung_rank(env: Env) -> str:
    """A rank that never joins a collective: the world's timeout reports every stack (no SIGABRT)."""
    timeout = env.sizes.hang_timeout_s
    world = sk.LocalWorld(env.world)
    try:
        world.run(_ready, timeout=env.limit_s)  # every rank started: the timeout below is the hang's alone
        began = clock()
        world.run(_hang_job, timeout=timeout)
    except sk.WorldTimeout as exc:
        took, hung = clock() - began, env.world - 1
        if exc.finished or any("in _hang_job" not in exc.stacks.get(r, "") for r in range(env.world)):
            raise Failed(f"the timeout report does not show every rank in _hang_job (finished: {exc.finished}): "
                         f"{str(exc)[:300]}") from exc
        waiting = sum("in all_reduce" in exc.stacks[r] for r in range(hung))
        return (f"WorldTimeout after {took:.1f} s (timeout {timeout:g} s) with every rank's stack: rank {hung} "
                f"asleep, {waiting} of {hung} others inside all_reduce")
    except sk.WorldError as exc:
        raise Failed(f"a process died instead of a timeout report: {str(exc).splitlines()[0]}") from exc
    finally:
        world.close()
    raise Failed("the hung job returned")


def torchrun_plan_auto(env: Env) -> str:
    """``torchrun ... -m shardkit train --plan auto`` on every device."""
    if env.world < 2:
        raise Skipped("needs at least 2 devices")
    folder = env.out / "torchrun"
    folder.mkdir(parents=True, exist_ok=True)
    # the torchrun world measures itself on its GPUs, once (rank 0 writes the kept file)
    cache = folder / "cache"
    proc = _subprocess(env, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={env.world}", "-m", "shardkit", "train", "--model", "gpt-tiny",
                             "--plan", "auto", "--world-size", str(env.world), "--steps", "3", "--data-mb", "0.5",
                             "--timeout", str(int(env.limit_s))], cwd=folder, extra={"SHARDKIT_CACHE": str(cache)})
    chose = [line for line in proc.stderr.splitlines() if "--plan auto chose" in line]
    kept = sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []
    where = "-nccl-" if env.cuda else "-gloo-cpu"
    if proc.stderr.count("measuring the torchrun world") != 1 or len(kept) != 1 or where not in kept[0]:
        raise Failed(f"the torchrun world was not measured once on its own devices ({where}): kept {kept}")
    if not chose:
        raise Failed("--plan auto printed no choice")
    return f"{chose[0].split('chose', 1)[1].split(':')[0].strip()} on {kept[0]}"
