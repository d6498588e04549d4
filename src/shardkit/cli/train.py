"""``shardkit train``: train a model as a byte-level language model across a local world.

The model is a registered name or any importable builder, ``package.module:function``.

The plan is checked against the model on the meta device before any process starts; then a
local world (gloo on CPU, one process per device) trains with AdamW, rank 0 shows progress,
and every rank reports memory, step time and communication::

    shardkit train                                   # 4 CPU processes, mesh fsdp=2,tp=2
    shardkit train --mesh dp=2,tp=2 --verify
    shardkit train --plan plan.yaml --data ~/notes --steps 100
    shardkit train --model mypkg.models:build --mesh fsdp=2 --seq-len 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from rich.console import Console
from torch import nn

from ..checkpoint.manifest import MANIFEST_NAME, model_mismatch
from ..checkpoint.store import checkpoint_to_load, latest_checkpoint, load, model_parameters, save
from ..families import token_sizes
from ..io.batch_stream import BatchStream
from ..io.data import DEFAULT_MAX_BYTES, TextShards
from ..models.registry import MODELS, ModelEntry, model_entry
from ..observe.report import RankStats, print_summary
from ..plan import Plan, PlanError, UsageError
from ..planner.initialisation import uninitialised
from ..planner.meta import meta_model
from ..planner.validate import validate
from ..runtime.context import Context
from ..runtime.materialize import open_weights
from ..runtime.torchrun import in_torchrun
from ..runtime.world import DEFAULT_TIMEOUT_S, LocalWorld, WorldError, launch
from .options import (
    AUTO_PLAN,
    add_model_option,
    add_plan_options,
    meta_model_from_flag,
    model_from_flag,
    non_negative_int,
    path,
    plan_from_args,
    positive_float,
    positive_int,
    rules_hint,
)

DEFAULT_MODEL = "gpt-small"
DEFAULT_STEPS = 60
DEFAULT_BATCH = 8
DEFAULT_LR = 3e-3
VERIFY_STEPS = 2
RESUME_FROM_SAVE = Path("<the --save folder>")
BUILDS = ("meta", "full")
BYTE_VOCAB = 256  # the data are bytes: token ids 0..255


@dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs to train (sent to every process, so plain picklable data).

    ``model`` is a registered name or a builder path, resolved again in each process.
    """

    model: str
    data: BatchStream
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    seed: int
    profile: bool = False
    build: str = "meta"
    init_from: str | None = None
    save: str | None = None
    save_every: int | None = None
    keep_last: int | None = None
    resume: str | None = None  # the checkpoint folder to start from


def register(subparsers: argparse._SubParsersAction) -> None:
    trainable = sorted(name for name, entry in MODELS.items() if not entry.meta_only)
    parser = subparsers.add_parser(
        "train", help="train a model across a local world and report memory, time and communication per device",
        description="Train a model as a byte-level language model on local text (default: the Python "
                    "standard library's sources) across a local world of processes, as a plan says. The plan is "
                    "validated on the meta device before any process starts.")
    add_model_option(parser, DEFAULT_MODEL, trainable)
    pipe = add_plan_options(parser)
    parser.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, metavar="N",
                        help=f"optimizer steps (default: {DEFAULT_STEPS})")
    parser.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH, metavar="N",
                        help=f"global batch, split over the data axes dp x fsdp (default: {DEFAULT_BATCH})")
    parser.add_argument("--seq-len", type=positive_int, metavar="N",
                        help="tokens (bytes) per sample (default: the model's positions)")
    parser.add_argument("--lr", type=positive_float, default=DEFAULT_LR, metavar="X",
                        help=f"AdamW learning rate (default: {DEFAULT_LR})")
    parser.add_argument("--data", type=path, metavar="DIR",
                        help="a data folder written by 'shardkit data shard' (every sample once per epoch, resumable "
                             "under any plan), or a folder of text files, searched recursively (random windows; "
                             "default: Python stdlib sources)")
    parser.add_argument("--data-mb", type=positive_float, default=DEFAULT_MAX_BYTES / 2**20, metavar="X",
                        help=f"text folders: read at most this many MiB (default: {DEFAULT_MAX_BYTES / 2**20:g})")
    parser.add_argument("--seed", type=non_negative_int, default=0, metavar="N",
                        help="seed of the batch sampling and of the initialisation (default: 0)")
    parser.add_argument("--build", choices=BUILDS, default="meta",
                        help="meta (default): build the model on the meta device and allocate only each process's "
                             "shards, initialised the same whatever the plan; full: every process builds the whole "
                             "model first (for models whose initialisation shardkit cannot replay on meta)")
    parser.add_argument("--init-from", type=path, metavar="DIR",
                        help="start from a HuggingFace model folder (safetensors): each process reads only its shards; "
                             "names and shapes are checked before any process starts")
    saving = parser.add_argument_group("checkpoints (docs/checkpoints.md)")
    saving.add_argument("--save", type=path, metavar="DIR",
                        help="save checkpoints (model, optimizer, RNG, data position) as DIR/step-N, after the last "
                             "step and every --save-every steps")
    saving.add_argument("--save-every", type=positive_int, metavar="N", help="also save every N steps (needs --save)")
    saving.add_argument("--keep-last", type=positive_int, metavar="K",
                        help="keep only the newest K checkpoints in --save DIR (default: keep all)")
    saving.add_argument("--resume", nargs="?", const=RESUME_FROM_SAVE, type=path, metavar="DIR",
                        help="continue from the latest complete checkpoint in DIR (default: the --save folder), under "
                             "this run's plan, whatever the plan it was saved under; --steps counts from step 0. "
                             "With no checkpoint there yet, training starts at step 0 and says so")
    parser.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"stop every process and exit 1 when the job runs longer (default: {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--verify", action="store_true",
                        help=f"first check the sharded model against a single-process run for {VERIFY_STEPS} steps")
    pipe.add_argument("--profile", type=path, metavar="DIR",
                      help="write the pipeline timeline (Chrome/Perfetto trace and PNG) and the bubble fraction to DIR")
    parser.set_defaults(func=run)


def build_plan(args: argparse.Namespace) -> tuple[Plan, int]:
    """The plan and world size from the command line (not yet checked against the model)."""
    if args.plan is not None and str(args.plan) == AUTO_PLAN:
        plan, world_size = auto_plan(args)
    else:
        plan, world_size = plan_from_args(args, model_from_flag(args.model))
    if args.profile is not None and plan.pipeline is None:
        raise PlanError(f"--profile records the pipeline timeline (forward/backward per micro-batch and stage), but "
                        f"{plan.mesh!r} has no pipeline; add a 'pp' axis of size >= 2, e.g. --mesh pp=2")
    return plan, world_size


def auto_plan(args: argparse.Namespace) -> tuple[Plan, int]:
    """``--plan auto``: the fastest plan ``sk.autoshard`` finds for this model, batch and sequence on
    the local world as calibrated (``shardkit calibrate``, measured once and kept)."""
    from ..planner.autoshard import autoshard
    from .plan import DEFAULT_LOCAL_WORLD, candidates_text, local_hardware

    given = [flag for flag, value in {"--mesh": args.mesh, "--rules": args.rules, "--schedule": args.schedule,
                                      "--microbatches": args.microbatches, "--split": args.split,
                                      "--split-points": args.split_points, "--recompute": args.recompute}.items()
             if value is not None]
    if given:
        raise PlanError(f"--plan auto chooses the whole plan, so {', '.join(given)} cannot be combined with it; "
                        f"drop them, or give the plan yourself")
    entry = model_from_flag(args.model)
    model = meta_model_from_flag(args.model, entry)
    positions = _check_token_sizes(args, entry, model)
    seq_len = positions if args.seq_len is None else args.seq_len
    world_size = args.world_size or DEFAULT_LOCAL_WORLD
    hardware = local_hardware(world_size)
    candidates = autoshard(model, devices=world_size, hardware=hardware, global_batch=args.batch_size,
                           seq_len=seq_len, top=10, param_dtype=None)
    print(candidates_text(candidates, args.model, world_size, hardware), end="", file=sys.stderr)
    fitting = [c for c in candidates if c.grad_accum == 1]  # shardkit train does not accumulate gradients yet
    if not fitting:
        raise PlanError(f"--plan auto: every plan for a batch of {args.batch_size} needs gradient accumulation "
                        f"(the best: {candidates[0].grad_accum} steps), which shardkit train does not do yet; "
                        f"lower --batch-size")
    best = fitting[0]
    print(f"shardkit train: --plan auto chose {best.plan.mesh!r}: {best.reason}", file=sys.stderr)
    return best.plan, world_size


def check_job(args: argparse.Namespace, plan: Plan, world_size: int) -> TrainJob:
    """Validate model, plan, sizes and data before launch; :class:`PlanError` / :class:`UsageError` name each problem."""
    entry = model_from_flag(args.model)
    model = meta_model_from_flag(args.model, entry)
    positions = _check_token_sizes(args, entry, model)
    with rules_hint(args):
        validate(plan, model, world_size=world_size)
    if args.init_from is not None:
        open_weights(args.init_from, model)  # every name and shape, before any process starts
    elif args.build == "meta":
        missing = uninitialised(model)
        if missing:
            raise UsageError(f"--build meta: the model's initialisation writes no values for {len(missing)} "
                             f"parameter(s) ({', '.join(map(repr, missing[:5]))}), so they cannot be made on the "
                             f"meta device; use --build full, --init-from DIR, or give their modules a "
                             f"reset_parameters()")
    seq_len = positions if args.seq_len is None else args.seq_len
    problems = []
    if positions is not None and seq_len > positions:
        problems.append(f"--seq-len {seq_len}: model {args.model!r} has {positions} positions; valid: 1..{positions}")
    problems += [f"--batch-size {args.batch_size} / --seq-len {seq_len}: {p}"
                 for p in plan.resolved(world_size).batch_problems(args.batch_size, seq_len)]
    if problems:
        raise PlanError(problems)
    data = BatchStream.of(args.data, seq_len, args.seed, max_bytes=int(args.data_mb * 2**20))
    if isinstance(data.source, TextShards):
        data.source.check()
    resume = _resume_folder(args, model, data)
    return TrainJob(args.model, data, args.steps, args.batch_size, seq_len, args.lr, args.seed, args.profile is not None,
                    args.build, _text(args.init_from), _text(args.save), args.save_every, args.keep_last, _text(resume))


def _text(value: Path | None) -> str | None:
    return None if value is None else str(value)


def _resume_folder(args: argparse.Namespace, model: nn.Module, data: BatchStream) -> Path | None:
    """The checkpoint ``--resume`` starts from, checked against the model and data before launch
    (None: nothing to resume yet, which is said)."""
    if args.save_every is not None and args.save is None:
        raise UsageError("--save-every N: needs --save DIR, the folder to save checkpoints in")
    if args.keep_last is not None and args.save is None:
        raise UsageError("--keep-last K: needs --save DIR, the folder whose checkpoints it keeps")
    if args.resume is None:
        if args.save is not None and latest_checkpoint(args.save) is not None:
            raise UsageError(f"--save {args.save} already holds checkpoints (the latest: "
                             f"{latest_checkpoint(args.save).name}): add --resume to continue from it, or save in "
                             f"another folder")
        return None
    if args.resume == RESUME_FROM_SAVE:
        if args.save is None:
            raise UsageError("--resume without a folder resumes from --save DIR; give one: --resume DIR or --save DIR")
        args.resume = args.save
    if latest_checkpoint(args.resume) is None and not (args.resume / MANIFEST_NAME).is_file():
        print(f"shardkit train: --resume: no complete checkpoint in {args.resume} yet: starting at step 0", flush=True)
        return None
    folder, manifest = checkpoint_to_load(args.resume)
    problems = model_mismatch(manifest.parameters, model_parameters(model))
    if problems:
        raise UsageError(f"--resume {args.resume}: {folder.name} holds another model's parameters: "
                         f"{'; '.join(problems[:5])}")
    if manifest.step >= args.steps:
        raise UsageError(f"--resume {args.resume}: {folder.name} is at step {manifest.step}, and --steps is "
                         f"{args.steps}: nothing left to train; raise --steps (it counts from step 0)")
    data.check_position((manifest.extra or {}).get("data"))
    return folder


def _check_token_sizes(args: argparse.Namespace, entry: ModelEntry, model: nn.Module) -> int | None:
    """The model's positions (``None``: unknown, so ``--seq-len`` was given); it must read byte ids."""
    vocab, positions = token_sizes(model) if entry.vocab is None else (entry.vocab, entry.seq_len)
    flag = f"--model {args.model!r}"
    if vocab is None:
        raise UsageError(f"{flag}: cannot tell its vocabulary (no config.vocab_size, no nn.Embedding); the "
                         f"training data are bytes, so it must embed token ids 0..{BYTE_VOCAB - 1}")
    if vocab < BYTE_VOCAB:
        raise UsageError(f"{flag}: its vocabulary has {vocab} tokens, but the training data are bytes "
                         f"(token ids 0..{BYTE_VOCAB - 1}); give it a vocabulary of at least {BYTE_VOCAB}")
    if positions is None and args.seq_len is None:
        raise UsageError(f"{flag}: cannot tell how many positions it takes (no config.max_position_embeddings "
                         f"or n_positions, no position embedding); pass --seq-len N")
    return positions


def train_job(ctx: Context, job: TrainJob) -> tuple[RankStats, list]:
    """One rank's training loop: shard, train with AdamW, measure memory, time and communication.

    Returns the rank's stats and, with ``job.profile``, its pipeline timeline spans (the
    last step's left out: it runs under the communication counter, which slows it).
    """
    import torch

    from ..observe.comm import CommCounter
    from ..observe.memory import PeakMemory, state_bytes
    from ..runtime import spans as timeline
    from ..runtime.apply import shard
    from ..runtime.optimizer import optimizer as make_optimizer

    memory = PeakMemory(ctx.device).start()
    entry = model_entry(job.model)
    model = shard(_builder(job)(), ctx.plan, ctx, seed=job.seed, weights=job.init_from)
    optimizer = make_optimizer(model, torch.optim.AdamW, lr=job.lr)  # ZeRO-1's under Plan(zero=1)
    first, position = 0, None
    losses, times = [], []
    tokens_per_step = job.batch_size * job.seq_len
    comm = CommCounter()
    last = job.steps - 1
    recording = timeline.recording(ctx.rank) if job.profile else nullcontext()
    with _Progress(ctx.rank == 0, job.steps) as progress, recording:
        if job.resume is not None:
            with progress.busy(f"loading {job.resume}"):
                info = load(job.resume, model, optimizer)
            first, position = info["step"], (info["extra"] or {}).get("data")
            progress.resumed(first)
            progress.say(f"resumed from {job.resume} at step {first}")
        batches = job.data.batches(job.batch_size, job.steps - first, position)
        for step, batch in enumerate(batches, start=first):
            inputs, targets = ctx.shard_batch(batch.inputs, batch.targets)
            start = time.perf_counter()
            # Communication is counted on the last (steady-state) step only: the counter sees every op
            # in Python, which would slow the timed steps.
            with comm if step == last else nullcontext():
                loss = model.step(inputs, targets, entry.loss_fn)
                optimizer.step()
            if step == last:
                held = state_bytes(model, optimizer)  # grads still allocated
            optimizer.zero_grad()
            seconds = time.perf_counter() - start
            if step != last or not times:
                times.append(seconds)
            losses.append(loss.item())
            progress.advance(losses[-1], tokens_per_step / seconds)
            done = step + 1
            if job.save is not None and (done == job.steps or (job.save_every and done % job.save_every == 0)):
                began = time.perf_counter()
                with progress.busy(f"saving step {done}"):
                    folder = save(job.save, model, optimizer, step=done,
                                  extra={"data": batch.position, "loss": losses[-1]}, keep_last=job.keep_last)
                progress.say(f"saved {folder} in {time.perf_counter() - began:.1f} s")
    spans = [s for s in timeline.collect() if s.step != last or job.steps == 1] if job.profile else []
    stats = RankStats(ctx.rank, ctx.coordinates(), held, memory.peak_bytes(), memory.method, times, comm.summary(), losses)
    return stats, spans


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

    def advance(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, stats=f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s")

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


def _builder(job: TrainJob) -> Callable[[], nn.Module]:
    """The model's builder as ``--build`` says: on meta (only shards are allocated) or in full."""
    entry = model_entry(job.model)
    return partial(meta_model, entry.build) if job.build == "meta" else entry.build


def _verify(job: TrainJob, plan: Plan, world: LocalWorld | None) -> bool:
    from ..runtime.verify import verify

    entry = model_entry(job.model)
    first = next(job.data.batches(job.batch_size, 1))
    batch = (first.inputs, first.targets)
    result = verify(_builder(job), plan, batch, loss_fn=entry.loss_fn, steps=VERIFY_STEPS, optimizer="adamw",
                    lr=job.lr, world=world)
    print(result, flush=True)
    return result.ok


def run(args: argparse.Namespace) -> int:
    plan, world_size = build_plan(args)
    job = check_job(args, plan, world_size)
    leader = not in_torchrun() or os.environ["RANK"] == "0"
    if leader:
        print(f"shardkit train: {job.model} on {plan.mesh!r} ({world_size} processes), {job.steps} steps of "
              f"{job.batch_size} x {job.seq_len} tokens from {job.data.describe()}",
              flush=True)
    start = time.perf_counter()
    try:
        with nullcontext() if in_torchrun() else LocalWorld(world_size) as world:  # closed on exit, killed on error
            if args.verify and not _verify(job, plan, world):
                print("shardkit train: verify FAILED, not training (the sharded model differs from one device)",
                      file=sys.stderr)
                return 1
            results = launch(train_job, plan, job, world=world, timeout=args.timeout)
    except WorldError as exc:
        print(f"shardkit train: {exc}", file=sys.stderr)
        return 1
    if leader:
        console = Console(width=None if sys.stdout.isatty() else 120)
        print_summary([stats for stats, _ in results], console,
                      title=f"per device: {job.model}, {plan.mesh!r}, {job.steps} steps")
        tokens = job.steps * job.batch_size * job.seq_len
        print(f"{tokens:,} tokens in {time.perf_counter() - start:.1f} s (including process start)")
        if args.profile is not None:
            _write_profile(plan, {rank: spans for rank, (_, spans) in enumerate(results)}, args.profile)
    return 0


def _write_profile(plan: Plan, spans_by_rank: dict, out_dir: Path) -> None:
    from ..observe.timeline import write_profile

    pipeline = plan.pipeline
    assert pipeline is not None
    profile = write_profile(spans_by_rank, out_dir, pipeline.schedule, pipeline.num_stages(plan.mesh),
                            pipeline.microbatches, pipeline.virtual_stages)
    print(profile["summary"])
