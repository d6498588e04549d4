"""One rank's training loop (``sk.train`` runs it on every process of the world): shard the model, step the
optimizer over this rank's part of each global batch, resume, save, log, evaluate, and measure memory, step time
and communication.

The hot loop does not wait for the device: a step's loss and gradient norm stay device tensors, read to the
host (together, in one transfer: :class:`~.step.HostReads`) only at the steps that log, evaluate or save
and at the end; gathers of per-rank numbers happen only at logged steps. A float16 step (loss scaling) also
reads its overflow flag, which decides whether the optimizer steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from torch import nn

from ..checkpoint.store import load, save
from ..observe.report import RankStats
from ..runtime.context import Context
from ..runtime.devices import StepTimer, StepTimes, clock
from .checks import CheckedJob
from .model import model_builder, model_from_flag
from .step import HostReads, RunLog, evaluate, lr_schedule, make_optimizer, train_step


def train_rank(ctx: Context, job: CheckedJob) -> tuple[RankStats, list]:
    """One rank's training loop: shard, train, measure memory, time and communication, log, evaluate.

    Returns the rank's stats and, with ``profile``, its pipeline timeline spans (the
    last step's left out: it runs under the communication counter, which slows it).
    """

    from ..observe.comm import CommCounter
    from ..observe.memory import PeakMemory, state_bytes
    from ..runtime import spans as timeline
    from ..runtime.apply import shard

    config = job.config
    memory = PeakMemory(ctx.device).start()
    entry = model_from_flag(config.model)
    weights = None if config.init_from is None else str(config.init_from)
    model = shard(model_builder(config.model, config.build)(), ctx.plan, ctx, seed=config.seed, weights=weights)
    optimizer = make_optimizer(model, config.optimizer, config.lr, betas=config.betas,
                               weight_decay=config.weight_decay,
                               momentum=config.momentum)  # ZeRO-1's partitioned optimizer under Plan(zero=1)
    _finish_setup(model)
    scaler = model.loss_scaler  # float16: the plan's loss scale, which model.step applies
    first, position = 0, None
    reads, times = HostReads(), []
    tokens_per_step = config.batch_size * job.seq_len
    comm = CommCounter()
    last = config.steps - 1
    recording = timeline.recording(ctx.rank) if config.profile is not None else nullcontext()
    log = RunLog(None if config.log_dir is None else str(config.log_dir), config.log_every, ctx.rank)
    with _Progress(ctx.rank == 0, config.steps) as progress, recording, log:
        if job.resume is not None:
            with progress.busy(f"loading {job.resume}"):
                info = load(job.resume, model, optimizer)
            extra = info["extra"] or {}
            first, position = info["step"], extra.get("data")
            if scaler is not None and "loss_scale" in extra:
                scaler.load_state_dict(extra["loss_scale"])
            progress.resumed(first)
            progress.say(f"resumed from {job.resume} at step {first}")
        schedule = lr_schedule(optimizer, first, config.steps, config.lr, config.warmup_steps, config.min_lr)
        eval_batches = None if job.eval_data is None else \
            list(job.eval_data.batches(config.batch_size, config.eval_batches))
        batches = job.data.batches(config.batch_size, config.steps - first, position)
        pending = StepTimes()
        for step, batch in enumerate(batches, start=first):
            done = step + 1
            logged = log.due(done, config.steps)
            evaluating = eval_batches is not None and done % config.eval_every == 0
            saving = config.save is not None and (done == config.steps or
                                                  bool(config.save_every and done % config.save_every == 0))
            if step == last or logged:
                comm.reset()
            timer = StepTimer(ctx.device).start()  # CUDA events on a GPU, read at shown steps (StepTimes)
            # Communication is counted on the last (steady-state) step and on logged steps only: the counter
            # sees every op in Python, which slows the steps it counts.
            with comm if step == last or logged else nullcontext():
                loss, norm = train_step(model, ctx, batch, entry.loss_fn, optimizer, micro_steps=config.grad_accum,
                                        max_norm=config.clip_grad_norm, measure_norm=logged)
            lr = optimizer.param_groups[0]["lr"]
            if schedule is not None:
                schedule.step()
            if step == last:
                held = state_bytes(model, optimizer)  # grads still allocated
            optimizer.zero_grad()
            pending.add(step, timer)  # the step's end, read with the next numbers shown: no host sync here
            reads.add(loss)
            shown = logged or evaluating or saving or step == last  # a number someone asked for: read now
            rate = None
            if shown:
                for timed, seconds in pending.read():
                    if timed != last or not times:
                        times.append(seconds)
                    log.step_done(tokens_per_step, seconds)
                rate = tokens_per_step / seconds
            (norm_value,) = reads.read(norm) if shown else (None,)
            progress.advance(reads.last if shown else None, rate)
            if logged:
                log.write(done, reads.last, lr, norm_value, memory.peak_bytes(), comm.totals())
            if evaluating:
                eval_loss = evaluate(model, ctx, eval_batches, entry.loss_fn)
                log.eval(done, eval_loss)
                progress.say(f"step {done}: eval loss {eval_loss:.4f}, perplexity {math.exp(eval_loss):.2f}")
            if saving:
                began = clock(ctx.device)
                extra = {"data": batch.position, "loss": reads.last,
                         **({} if scaler is None else {"loss_scale": scaler.state_dict()})}
                with progress.busy(f"saving step {done}"):
                    folder = save(config.save, model, optimizer, step=done, extra=extra, keep_last=config.keep_last)
                progress.say(f"saved {folder} in {clock(ctx.device) - began:.1f} s")
        if scaler is not None and scaler.skipped:
            progress.say(f"loss scaling: {scaler.skipped} step(s) skipped (gradients overflowed on some rank), "
                         f"scale now {scaler.state.scale:g}")
    spans = [s for s in timeline.collect() if s.step != last or config.steps == 1] if config.profile is not None else []
    reads.read()
    stats = RankStats(ctx.rank, ctx.coordinates(), held, memory.peak_bytes(), memory.method, times, comm.summary(),
                      reads.losses, comm.remote())
    return stats, spans


def _finish_setup(model: nn.Module) -> None:
    """Run now the one-time set-up DDP (torch's composable ``replicate``) defers to the first forward, its
    broadcast of every parameter, so that the first step's communication is the step's own (metrics.jsonl)."""
    from torch.distributed._composable import replicate

    for module in model.modules():
        state = replicate.state(module)
        if state is not None and state._init_args:  # what its forward pre-hook checks before the set-up
            state.lazy_init()


class _Progress:
    """A rich progress bar on rank 0 (loss, tokens/s) and its notes; a no-op elsewhere."""

    def __init__(self, show: bool, steps: int):
        self.bar = None
        if show:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[stats]}"), TimeElapsedColumn())
            self.task = self.bar.add_task("train", total=steps, stats="")

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def resumed(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step)

    def advance(self, loss: float | None, tokens_per_s: float | None) -> None:
        """One step more; the stats shown change at steps whose loss and time were read (not ``None``)."""
        if self.bar is not None:
            stats = {} if loss is None or tokens_per_s is None else \
                {"stats": f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"}
            self.bar.update(self.task, advance=1, **stats)

    @contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """A pulsing bar under the training bar while ``what`` runs (a save, a load)."""
        task = None if self.bar is None else self.bar.add_task(what, total=None, stats="")
        try:
            yield
        finally:
            if task is not None:
                self.bar.remove_task(task)

    def say(self, line: str) -> None:
        """A line above the bar (rank 0 only)."""
        if self.bar is not None:
            self.bar.console.print(line, highlight=False, soft_wrap=True)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


__all__ = ["train_rank"]
