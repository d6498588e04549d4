"""The checks of ``benchmarks/gpu_check.py``, one function each, and the jobs they run in every process.

A check is ``check(env) -> str``: it returns what it measured (the table's detail column) or
raises :class:`Failed` (a wrong result: the row says FAIL) or :class:`Skipped` (the row says
``skipped: <reason>``, e.g. ``no CUDA``: never a silent omission). Every check runs at the sizes
of ``env.sizes`` (:data:`FULL` on CUDA, :data:`TINY` on CPU) within ``env.limit_s`` seconds: the
world jobs get it as their timeout, subprocesses as theirs. Jobs are top-level functions, so
they pickle into the world's processes.
"""

from __future__ import annotations

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
BENCHMARKS = Path(__file__).resolve().parent


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
    train_model: str  # shardkit train --model: the timed GPT (a builder of this module)
    hang_timeout_s: float
    new_tokens: int
    slack: float  # each check's time bound (set for one GPU) times this


FULL = Sizes("full", gpt=dict(vocab=1024, layers=4, dim=256, heads=8, seq_len=256),
             timed_gpt=dict(vocab=8192, layers=8, dim=1024, heads=16, seq_len=1024), batch=8, seq=256,
             ring_lengths=(8192, 16384), ring_heads=8, ring_head_dim=64, accumulator_bytes=64 << 20,
             accumulator_heads=(16, 128), timed_steps=8, train_model="gpu_check_jobs:build_timed_gpt_full",
             hang_timeout_s=20.0,
             new_tokens=16, slack=1.0)
TINY = Sizes("tiny", gpt=dict(vocab=256, layers=4, dim=32, heads=2, seq_len=16),
             timed_gpt=dict(vocab=256, layers=2, dim=64, heads=4, seq_len=32), batch=4, seq=16,
             ring_lengths=(128, 256), ring_heads=2, ring_head_dim=16, accumulator_bytes=64 << 10,
             accumulator_heads=(2, 16), timed_steps=3, train_model="gpu_check_jobs:build_timed_gpt_tiny",
             hang_timeout_s=3.0,
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


def build_timed_gpt_full() -> GPT:
    """:data:`FULL`'s timed GPT (``shardkit train --model gpu_check_jobs:build_timed_gpt_full``)."""
    return build_gpt(FULL.timed_gpt)


def build_timed_gpt_tiny() -> GPT:
    """:data:`TINY`'s timed GPT."""
    return build_gpt(TINY.timed_gpt)


def build_tied_llama(hidden: int = 64) -> torch.nn.Module:
    """A four-layer Llama whose lm_head is its embedding (a tie across pipeline stages)."""
    return build_llama(tiny_llama_config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                                         tie_word_embeddings=True, max_position_embeddings=1024))


def tokens(vocab: int, batch: int, seq: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _verify(env: Env, build, plan: sk.Plan, loss_fn=gpt_loss, vocab: int | None = None, steps: int = 3) -> str:
    vocab = vocab or env.sizes.gpt["vocab"]
    samples = math.lcm(env.sizes.batch, plan.mesh.data_size)  # at least one sample per data rank
    result = sk.verify(build, plan, tokens(vocab, samples, env.sizes.seq), loss_fn=loss_fn, steps=steps,
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


#: The float16 row's loss is multiplied by this: without a scale nearly every float16 gradient underflows to zero.
FP16_SMALL = 2.0**-20


def small_gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``gpt_loss`` times :data:`FP16_SMALL` (in float32): a loss whose float16 gradients need the scale."""
    return gpt_loss(logits.float(), targets) * FP16_SMALL


def fp16_scaled_verify(env: Env) -> str:
    """float16 compute under ``Plan(loss_scale="dynamic")`` on a loss whose float16 gradients underflow without a
    scale: ``model.step`` on the device scales and unscales, one CPU process under the same scaler agrees (each step's
    scale and skip, gradients, weights), and the gradients are float16's rounding away from float32 ones, not
    zeros (an unscaled run's gap would be the whole float32 gradient)."""
    plan = sk.Plan(sk.Mesh(fsdp=1), fsdp=sk.FSDPOptions(param_dtype="float16", reduce_dtype="float32"),
                   loss_scale="dynamic")
    samples = math.lcm(env.sizes.batch, plan.mesh.data_size)
    batch = tokens(env.sizes.gpt["vocab"], samples, env.sizes.seq)
    result = sk.verify(_gpt(env), plan, batch, loss_fn=small_gpt_loss, steps=3, optimizer="sgd",
                       lr=0.01 / FP16_SMALL, world=env.worlds(plan.mesh.size))
    if not result.ok:
        raise Failed(" | ".join(str(result).splitlines()[:4]))
    if len(result.loss_scales) != 3:
        raise Failed(f"no loss scale ran: loss_scales {result.loss_scales}")
    float32 = _gpt(env)()
    small_gpt_loss(float32(batch[0]), batch[1]).backward()
    largest = max(p.grad.abs().max().item() for p in float32.parameters() if p.grad is not None)
    gap = result.float32_gap
    if gap is None or not gap < 0.1 * largest:
        raise Failed(f"float16 gradients {gap} away from float32 ones (largest {largest:.1e}): they underflowed")
    return (f"3 steps, loss scales {', '.join(f'{s:g}' for s in result.loss_scales)}, skipped {result.skipped or 'none'}"
            f", gap from float32 {gap:.1e} of largest grad {largest:.1e}")


def _subprocess(env: Env, args: list[str], cwd: Path, extra: dict[str, str] | None = None,
                limit_s: float | None = None) -> subprocess.CompletedProcess:
    pythonpath = os.pathsep.join([str(SRC), str(BENCHMARKS), *filter(None, [os.environ.get("PYTHONPATH")])])
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


#: The file each rank of a ``shardkit train`` run under :func:`_train_witnessed` appends its steps to.
STEP_LOG = "GPU_CHECK_STEP_LOG"


class WitnessedStepTimer(StepTimer):
    """``devices.StepTimer`` as the training loop uses it (marked at each step's end, read at the steps
    whose numbers are shown), inside an independent :class:`_DeviceClock` (CUDA events on a GPU, waited
    for at the step's end): each step's (reported, witnessed) seconds go to ``$GPU_CHECK_STEP_LOG`` when
    the loop reads it. The reported seconds are StepTimer's own, what ``shardkit train`` logs and prints."""

    def start(self) -> WitnessedStepTimer:
        self._witness = _DeviceClock(self.device)
        self._witness.start()
        return super().start()

    def mark(self) -> WitnessedStepTimer:
        super().mark()
        self._witnessed = self._witness.stop()
        return self

    def seconds(self) -> float:
        seconds = super().seconds()
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(os.environ[STEP_LOG], "a") as log:
            log.write(json.dumps({"rank": rank, "reported": seconds, "witnessed": self._witnessed}) + "\n")
        return seconds


def _witness_steps() -> None:
    """Time the training loop's steps with :class:`WitnessedStepTimer` in this process."""
    from shardkit.training import loop

    loop.StepTimer = WitnessedStepTimer


def _train_witnessed(env: Env, flags: list[str], folder: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """``shardkit train FLAGS`` run as its CLI does (a local world of spawned processes), with every rank's
    steps witnessed: this module is the main script, so each spawned rank runs it again and times its loop
    with :class:`WitnessedStepTimer`. Returns the process and ``{rank: [(reported, witnessed) per step]}``."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "steps.jsonl"
    log.unlink(missing_ok=True)
    proc = _subprocess(env, [sys.executable, str(Path(__file__).resolve()), "train", *flags,
                             "--timeout", str(int(env.limit_s))], cwd=folder, extra={STEP_LOG: str(log)})
    steps: dict[int, list[tuple[float, float]]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        record = json.loads(line)
        steps.setdefault(record["rank"], []).append((record["reported"], record["witnessed"]))
    if not steps:
        raise Failed("the training loop timed no step with devices.StepTimer (no step witnessed)")
    return proc, steps


def _apart(reported: float, witnessed: float) -> bool:
    """More than 10% + 2 ms apart (the step timers' tolerance)."""
    return abs(reported - witnessed) > 0.1 * witnessed + 0.002


def _mean_step_ms(stdout: str, rank: int = 0) -> float:
    """The ``mean step`` of ``rank`` in the per-device table ``shardkit train`` prints."""
    lines = stdout.splitlines()
    header = next((line for line in lines if "┃" in line and "mean step" in line), None)
    row = next((line for line in lines if line.count("│") > 2 and line.split("│")[1].strip() == str(rank)), None)
    if header is None or row is None:
        raise Failed(f"shardkit train printed no per-device table with a mean step for rank {rank}")
    column = [cell.strip() for cell in header.split("┃")].index("mean step")
    return float(row.split("│")[column].split()[0])


def train_cli(env: Env) -> str:
    """``shardkit train`` on one device: a finite loss logged, and the step time it reports (its table's mean
    step) against CUDA events recorded around the same steps. Only the last step is logged: a logged step
    counts its collectives in Python (observe/comm.py), which would make it the CPU's time, not the GPU's."""
    run = env.out / "train"
    steps = env.sizes.timed_steps + 2
    proc, witnessed = _train_witnessed(env, ["--model", env.sizes.train_model, "--mesh", "fsdp=1", "--steps",
                                             str(steps), "--batch-size", str(env.sizes.batch), "--data-mb", "0.5",
                                             "--log-dir", str(run), "--log-every", str(steps)], run)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in records if "loss" in r]
    if not losses or not all(math.isfinite(x) for x in losses):
        raise Failed(f"losses logged for {steps} steps: {losses}")
    events = [w for _, w in witnessed[0]]
    if len(events) != steps:
        raise Failed(f"{len(events)} steps witnessed for {steps}")
    # the table's mean step: StepTimer's seconds of every step but the first (set-up) and the last (logged)
    reported, witnessed_mean = _mean_step_ms(proc.stdout) / 1e3, statistics.fmean(events[1:-1])
    what = "CUDA events" if env.cuda else "the synchronised clock"
    text = (f"{steps} steps, loss {losses[-1]:.3f}; mean step {reported * 1e3:.1f} ms as printed, "
            f"{witnessed_mean * 1e3:.1f} ms by {what} around the same steps")
    if _apart(reported, witnessed_mean):
        raise Failed(f"more than 10% + 2 ms apart: {text}")
    return text


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


def _ring_job(ctx, lengths: tuple[int, ...], heads: int, head_dim: int, dtype_name: str,
              over_sp: bool = False) -> list[dict]:
    """Ring attention over every rank of the world (``over_sp``: of the mesh's ``sp`` group) on each length,
    against SDPA on the whole sequence: output and gradient errors (both against float32 SDPA) and each
    one's peak device memory."""
    from shardkit.context_parallel import gather_sequence, ring_attention, shard_sequence

    dtype, group = getattr(torch, dtype_name), ctx.mesh["sp"].get_group() if over_sp else dist.group.WORLD
    size = dist.get_world_size(group)
    found = []
    for length in lengths:
        q, k, v = _qkv(1, heads, length, head_dim, ctx.device, dtype)
        exact, exact_grads = _forward_backward(partial(F.scaled_dot_product_attention, is_causal=True),
                                               *(t.float() for t in (q, k, v)))
        (sdpa, sdpa_grads), sdpa_bytes = _peak_bytes(ctx.device, lambda q=q, k=k, v=v: _forward_backward(
            partial(F.scaled_dot_product_attention, is_causal=True), q, k, v))
        local = [shard_sequence(t, dist.get_rank(group), size, dim=2) for t in (q, k, v)]
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


def ring_sp2_output(env: Env) -> str:
    """Ring attention in bfloat16 over an ``sp=2`` group (two ring blocks per rank, the diagonal one causal,
    merged by their log-sum-exp; the flash kernel on CUDA) is as close to float32 attention on the whole
    sequence as bfloat16 SDPA is, output and gradients: the row ``one: ring vs sdpa output`` runs one
    block, with no merge across blocks; ``sp=2 accumulator`` runs float32 (the memory-efficient kernel)."""
    _even(env)
    s = env.sizes
    rows = env.worlds(env.world).run(_ring_job, s.ring_lengths, s.ring_heads, s.ring_head_dim, "bfloat16", True,
                                     plan=sk.Plan(sk.Mesh(dp=env.world // 2, sp=2)), timeout=env.limit_s)[0]
    text = ", ".join(f"{r['length']} tokens over 2 ranks: err {r['ring_err']:.1e} (SDPA {r['sdpa_err']:.1e}), "
                     f"grad {r['ring_grad_err']:.1e} (SDPA {r['sdpa_grad_err']:.1e})" for r in rows)
    if not all(_within_sdpa(r) for r in rows):
        raise Failed(f"bfloat16 sp=2 ring attention further from float32 attention than SDPA: {text}")
    return text


def ring_memory_bound(sdpa_bytes: int, length: int, heads: int, head_dim: int) -> int:
    """The most ring attention's forward+backward may allocate on one device: twice SDPA's measured peak
    (both keep q, k, v's gradients, the output and its log-sum-exp) plus 16 float32 ``[heads, length,
    head_dim]`` tensors (its float32 output accumulator and the rescaled partial outputs and gradients).
    Linear in the length: the math kernel's float32 ``length x length`` scores (1 GiB per head at 16k
    tokens, 8 GiB for 8 heads, against 712 MiB for an SDPA peak of 100 MiB) are far above it.

    >>> ring_memory_bound(100 << 20, 16384, 8, 64) / 2**20
    712.0
    """
    return 2 * sdpa_bytes + 16 * 4 * heads * length * head_dim


def ring_memory(env: Env) -> str:
    """Peak device memory of ring attention's forward+backward against SDPA's (flash or memory-efficient)
    at each length: within :func:`ring_memory_bound`, so a return to the math kernel fails (CUDA only)."""
    if not env.cuda:
        raise Skipped("no CUDA (CPU has no allocator peak to compare)")
    rows = _ring_rows(env)
    s = env.sizes
    text = ", ".join(f"{r['length']} tokens: ring {r['ring_bytes'] / 2**20:,.0f} MiB, SDPA "
                     f"{r['sdpa_bytes'] / 2**20:,.0f} MiB" for r in rows)
    if any(r["sdpa_bytes"] <= 0 for r in rows):
        raise Failed(f"SDPA's peak was not measured: {text}")
    over = [r for r in rows if r["ring_bytes"] > ring_memory_bound(r["sdpa_bytes"], r["length"], s.ring_heads,
                                                                   s.ring_head_dim)]
    if over:
        r = over[0]
        bound = ring_memory_bound(r["sdpa_bytes"], r["length"], s.ring_heads, s.ring_head_dim)
        raise Failed(f"ring attention at {r['length']} tokens above 2x SDPA's peak + O(L d) = {bound / 2**20:,.0f} "
                     f"MiB (a quadratic score matrix: the math kernel?): {text}")
    return text + " (each within 2x SDPA + 16 float32 L x d per head)"


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


#: The serving rows' requests: a greedy one, and the same sampled one twice (temperature 1, one seed).
SERVE_PROMPTS = {"greedy": (3, 141, 59, 26, 53), "sampled": (11, 12, 13, 14), "sampled again": (11, 12, 13, 14)}


def _serve_requests(new: int) -> list:
    from shardkit.serving.requests import GenerationRequest, Sampling

    sampled = Sampling(temperature=1.0, seed=5)
    return [GenerationRequest(rid, prompt, new, sampled if rid.startswith("sampled") else Sampling())
            for rid, prompt in SERVE_PROMPTS.items()]


def _engine(model, requests: list, max_len: int, leader: bool) -> dict | None:
    """Every request through a serving :class:`~shardkit.serving.engine.Engine` of ``model`` (one batch of
    three slots): on the leader ``{id: (tokens, finish)}``, elsewhere ``None``."""
    from shardkit.serving.engine import Engine
    from shardkit.serving.requests import Inbox

    inbox, events = (Inbox(max_queue=len(requests)), {}) if leader else (None, None)
    for request in requests if leader else []:
        events[request.id] = []
        inbox.submit(request, events[request.id].append)
    if leader:
        inbox.close()
    Engine(model, inbox, slots=len(requests), max_len=max_len, quiet=True).run()
    if not leader:
        return None
    return {rid: ([e.token for e in made if e.token is not None], made[-1].finish.value, made[-1].error)
            for rid, made in events.items()}


SERVE_HEADS = 8  # the served Llama's attention and key-value heads: tp may be any divisor


def build_serve_llama() -> torch.nn.Module:
    """The served Llama: hidden 128, 2 layers, 8 heads and 8 key-value heads, vocab 256 (seed 0)."""
    return build_llama(tiny_llama_config(hidden_size=128, intermediate_size=256, num_attention_heads=SERVE_HEADS,
                                         num_key_value_heads=SERVE_HEADS))


def _serve_job(ctx, requests: list, max_len: int) -> dict | None:
    from shardkit.models.hf import LLAMA_RULES

    model = sk.shard(build_serve_llama(), sk.Plan(ctx.plan.mesh, LLAMA_RULES), ctx)
    return _engine(model, requests, max_len, ctx.rank == 0)


def _serve(env: Env, tp: int) -> str:
    """The serving engine over ``tp`` devices: the greedy request equals transformers' ``generate`` (each
    token the whole model's best by its logits within a tolerance: devices may break near-ties
    differently), and the sampled request (temperature 1, a seed) finishes, repeats itself in the same
    batch, and draws what one CPU process draws with the same seed."""
    if SERVE_HEADS % tp:
        raise Skipped(f"tp={tp} does not divide the served Llama's {SERVE_HEADS} heads")
    new = env.sizes.new_tokens
    requests = _serve_requests(new)
    max_len = max(len(p) for p in SERVE_PROMPTS.values()) + new
    served = env.worlds(tp).run(_serve_job, requests, max_len, plan=sk.Plan(sk.Mesh(tp=tp)), timeout=env.limit_s)[0]
    failed = {rid: r for rid, r in served.items() if r[1] != "length" or len(r[0]) != new}
    if failed:
        raise Failed(f"requests did not finish with {new} tokens: {failed}")
    whole = build_serve_llama().eval()
    prompt = torch.tensor([SERVE_PROMPTS["greedy"]])
    with torch.no_grad():
        expected = whole.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
        ids = torch.tensor([[*SERVE_PROMPTS["greedy"], *served["greedy"][0]]])
        logits = whole(ids[:, :-1]).logits[0, prompt.shape[1] - 1:].float()
    chosen = logits.gather(-1, torch.tensor(served["greedy"][0])[:, None]).squeeze(-1)
    gap, tolerance = (logits.max(-1).values - chosen).max().item(), 1e-3 * max(1.0, logits.abs().max().item())
    if gap > tolerance:
        raise Failed(f"a greedy token {gap:.2e} below the whole model's best logit (tolerance {tolerance:.1e}): "
                     f"{served['greedy'][0]}, transformers' generate {expected}")
    same = served["greedy"][0] == expected
    sampled = served["sampled"][0]
    alone = _engine(whole, [requests[1]], max_len, True)["sampled"][0]  # one CPU process, the same seed
    if served["sampled again"][0] != sampled or alone != sampled:
        raise Failed(f"the seeded sampled request drew {sampled}, again in the same batch "
                     f"{served['sampled again'][0]}, in one CPU process {alone}")
    return (f"tp={tp}: greedy {'equal to' if same else 'within the logit tolerance of'} transformers' generate "
            f"({new} tokens); sampled (temperature 1, seed 5) the same twice and as one CPU process")


def serve_one(env: Env) -> str:
    return _serve(env, 1)


def serve_tp(env: Env) -> str:
    return _serve(env, env.world)


# -- every strategy on the world ----------------------------------------------------------------------------
def _even(env: Env, at_least: int = 2) -> None:
    if env.world < at_least or env.world % 2:
        raise Skipped(f"needs an even number of at least {at_least} devices (--world {env.world})")


def _expert_rows_job(ctx, build, batch: tuple) -> list[tuple[int, ...]]:
    """The rows this rank sent to each ``ep`` rank in one forward, per MoE layer (``_sk_rows``)."""
    model = sk.shard(build(), ctx.plan, ctx)
    with torch.no_grad():
        model(ctx.shard_batch(*batch)[0])
    return [m._sk_rows.sent for _, m in model.named_modules() if hasattr(m, "_sk_rows")]


def verify_expert_parallel(env: Env) -> str:
    """A mixture-of-experts GPT (2 experts per device, top 2) over ``ep=N``: its ``all_to_all`` exchanges
    carry uneven splits (each rank sends each other a different number of rows: checked), and 3 steps
    equal one process."""
    n = env.world
    fields = {**env.sizes.gpt, "experts": 2 * n, "top_k": 2}
    build, plan = partial(build_gpt, fields), sk.Plan(sk.Mesh(ep=n))
    batch = tokens(fields["vocab"], math.lcm(env.sizes.batch, n), env.sizes.seq)
    sent = env.worlds(n).run(_expert_rows_job, build, batch, plan=plan, timeout=env.limit_s)
    first = [rank[0] for rank in sent]  # layer 0: [rank][to rank]
    if not first[0] or len({count for row in first for count in row}) < 2:
        raise Failed(f"the routing sent even splits {first}: the uneven all_to_all is not exercised")
    counts = [count for row in first for count in row]
    return _verify(env, build, plan) + (f"; layer 0's all_to_all splits uneven: {min(counts)} to {max(counts)} rows "
                                         f"(rank 0 sent {list(first[0])})")


def verify_strategy(env: Env, name: str) -> str:
    n = env.world
    plans = {"dp": lambda: sk.Plan(sk.Mesh(dp=n)), "fsdp": lambda: sk.Plan(sk.Mesh(fsdp=n)),
             "tp": lambda: sk.Plan(sk.Mesh(tp=n), GPT_RULES), "sp": lambda: sk.Plan(sk.Mesh(sp=n)),
             "tp+sp": lambda: sk.Plan(sk.Mesh(tp=n), GPT_RULES, sequence_parallel=True),
             "zero=1": lambda: sk.Plan(sk.Mesh(dp=n), zero=1),
             "recompute": lambda: sk.Plan(sk.Mesh(fsdp=n), recompute="full")}
    if name in plans:
        return _verify(env, _gpt(env), plans[name]())
    if name == "ep":
        return verify_expert_parallel(env)
    if name == "hsdp":
        _even(env, 4)
        return _verify(env, _gpt(env), sk.Plan(sk.Mesh(dp=2, fsdp=n // 2)))
    if name == "fsdp x tp":
        _even(env, 4)
        return _verify(env, _gpt(env), sk.Plan(sk.Mesh(fsdp=n // 2, tp=2), GPT_RULES))
    if name == "pp x fsdp x tp":
        if n < 8 or n % 4:
            raise Skipped(f"needs a multiple of 4 devices, at least 8 (pp=2 x fsdp=N/4 >= 2 x tp=2; --world {n})")
        plan = sk.Plan(sk.Mesh(pp=2, fsdp=n // 4, tp=2), GPT_RULES,
                       pipeline=sk.Pipeline(schedule="1f1b", microbatches=2))
        return _verify(env, _gpt(env), plan)
    _even(env)
    schedule, virtual = {"pp 1f1b": ("1f1b", 1), "pp gpipe": ("gpipe", 1), "pp interleaved": ("interleaved-1f1b", 2),
                         "pp zbv": ("zbv", 2)}[name]
    plan = sk.Plan(sk.Mesh(pp=2, fsdp=n // 2), pipeline=sk.Pipeline(schedule=schedule, microbatches=2,
                                                                      virtual_stages=virtual))
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


def profile_events(env: Env) -> str:
    """``shardkit train --profile`` under ``pp=2`` x ``fsdp=N/2`` (1F1B): the trace it writes has a step span
    for each rank and step, each within the CUDA events recorded around that rank's same step (which also
    hold the optimizer's step: at most 30% + 5 ms longer)."""
    _even(env)
    folder = env.out / "profile"
    steps = env.sizes.timed_steps + 1
    proc, witnessed = _train_witnessed(env, ["--model", env.sizes.train_model, "--mesh", f"pp=2,fsdp={env.world // 2}",
                                             "--schedule", "1f1b", "--microbatches", "2", "--steps", str(steps),
                                             "--batch-size", str(env.sizes.batch), "--data-mb", "0.5",
                                             "--profile", str(folder)], folder)
    trace = folder / "timeline.json"
    if not trace.is_file() or not (folder / "timeline.png").is_file() or "bubble fraction" not in proc.stdout:
        raise Failed(f"--profile wrote no timeline.json / timeline.png or printed no bubble fraction in {folder}")
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e["name"] == "step"]
    what = "CUDA events" if env.cuda else "the synchronised clock"
    pairs = [(e["dur"] / 1e6, witnessed[e["pid"]][e["args"]["step"]]) for e in spans]
    ranks = {e["pid"] for e in spans}
    if ranks != set(range(env.world)) or len(pairs) != env.world * (steps - 1):  # the last step is not drawn
        raise Failed(f"{len(pairs)} step spans from ranks {sorted(ranks)}: expected {steps - 1} per rank of {env.world}")
    pairs = [(span, events) for span, (_, events) in pairs]
    worst = max(pairs, key=lambda p: abs(p[1] - p[0]) / p[1])
    if not worst[1] - 0.3 * worst[1] - 0.005 <= worst[0] <= worst[1] + 0.002:
        raise Failed(f"a step span of {worst[0] * 1e3:.2f} ms against {worst[1] * 1e3:.2f} ms by {what} for the "
                     f"same step")
    return (f"{len(pairs)} step spans within {what} around their steps (worst {worst[0] * 1e3:.2f} vs "
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


if __name__ in ("__main__", "__mp_main__") and os.environ.get(STEP_LOG):
    # python benchmarks/gpu_check_jobs.py train ...: shardkit's CLI with every step witnessed (_train_witnessed);
    # the ranks it spawns run this module again as __mp_main__ and witness theirs
    _witness_steps()
    if __name__ == "__main__":
        from shardkit.cli import main

        sys.exit(main())
