"""``shardkit train``: train a registered model as a byte-level language model across a local world.

The plan is checked against the model on the meta device before any process starts; then a
local world (gloo on CPU, one process per device) trains with AdamW, rank 0 shows progress,
and every rank reports memory, step time and communication::

    shardkit train                                   # 4 CPU processes, mesh fsdp=2,tp=2
    shardkit train --mesh dp=2,tp=2 --verify
    shardkit train --plan plan.yaml --data ~/notes --steps 100
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from rich.console import Console

from ..io.data import DEFAULT_MAX_BYTES, TextShards
from ..models.registry import MODELS, model_entry
from ..observe.report import RankStats, print_summary
from ..plan import LayoutMap, Mesh, Plan, PlanError
from ..plan.pipeline import SCHEDULES, SPLITS, pipeline_from_args
from ..plan.text import format_bytes
from ..planner.meta import meta_model
from ..planner.validate import validate
from ..runtime.world import Context, LocalWorld, WorldError, in_torchrun, launch

DEFAULT_MODEL = "gpt-small"
DEFAULT_MESH = "fsdp=2,tp=2"
DEFAULT_STEPS = 60
DEFAULT_BATCH = 8
DEFAULT_LR = 3e-3
VERIFY_STEPS = 2


@dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs to train (sent to every process, so plain picklable data)."""

    model: str
    data: TextShards
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    seed: int
    profile: bool = False


def register(subparsers: argparse._SubParsersAction) -> None:
    trainable = sorted(name for name, entry in MODELS.items() if not entry.meta_only)
    parser = subparsers.add_parser(
        "train", help="train a model across a local world and report memory, time and communication per device",
        description="Train a registered model as a byte-level language model on local text (default: the Python "
                    "standard library's sources) across a local world of processes, as a plan says. The plan is "
                    "validated on the meta device before any process starts.")
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=trainable, help=f"default: {DEFAULT_MODEL}")
    parser.add_argument("--mesh", help=f"mesh axes such as 'fsdp=2,tp=2' (default: {DEFAULT_MESH}); one axis may be -1")
    parser.add_argument("--rules", type=Path, help="JSON/YAML file: a list of [regex, layout] pairs (default: the model's rules)")
    parser.add_argument("--plan", type=Path, help="a whole plan file (.json, .yaml, .yml); replaces --mesh and --rules")
    parser.add_argument("--world-size", type=int, help="number of processes (default: the mesh size; needed for a -1 axis)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps (default: {DEFAULT_STEPS})")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                        help=f"global batch, split over the data axes dp x fsdp (default: {DEFAULT_BATCH})")
    parser.add_argument("--seq-len", type=int, help="tokens (bytes) per sample (default: the model's positions)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default: {DEFAULT_LR})")
    parser.add_argument("--data", type=Path, help="folder of text files, searched recursively (default: Python stdlib sources)")
    parser.add_argument("--data-mb", type=float, default=DEFAULT_MAX_BYTES / 2**20,
                        help=f"read at most this many MiB of text (default: {DEFAULT_MAX_BYTES / 2**20:g})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch sampling (default: 0)")
    parser.add_argument("--verify", action="store_true",
                        help=f"first check the sharded model against a single-process run for {VERIFY_STEPS} steps")
    pipe = parser.add_argument_group("pipeline (with a 'pp' mesh axis)")
    pipe.add_argument("--schedule", choices=list(SCHEDULES), help="pipeline schedule (default: 1f1b)")
    pipe.add_argument("--microbatches", type=int, help="micro-batches per step (default: the pp size)")
    pipe.add_argument("--split", choices=list(SPLITS), help="how layers are split into stages (default: even)")
    pipe.add_argument("--split-points", help="comma-separated module names that begin a stage, e.g. layers.2")
    pipe.add_argument("--profile", type=Path, metavar="DIR",
                      help="write the pipeline timeline (Chrome/Perfetto trace and PNG) and the bubble fraction to DIR")
    parser.set_defaults(func=run)


def load_rules(path: Path) -> LayoutMap:
    """A layout rule file: a JSON or YAML list of ``[regex, layout]`` pairs, first match wins."""
    example = '[["lm_head\\\\.weight", ["tp", null]], [".*", null]]'
    try:
        data = yaml.safe_load(path.read_text())  # YAML reads JSON too
    except OSError as exc:
        raise PlanError(f"cannot read rules file {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise PlanError(f"rules file {str(path)!r} is neither JSON nor YAML: {exc}") from None
    if not isinstance(data, list) or not data:
        raise PlanError(f"rules file {str(path)!r} must hold a non-empty list of [regex, layout] pairs, "
                        f"e.g. {example}; got {type(data).__name__}")
    try:
        return LayoutMap.from_list(data)
    except PlanError as exc:
        raise PlanError(f"rules file {str(path)!r}: {exc}") from None


def build_plan(args: argparse.Namespace) -> tuple[Plan, int]:
    """The plan and world size from the command line (not yet checked against the model)."""
    pipeline_options = {"--schedule": args.schedule, "--microbatches": args.microbatches, "--split": args.split,
                        "--split-points": args.split_points}
    if args.plan is not None:
        given = [flag for flag, value in {"--mesh": args.mesh, "--rules": args.rules, **pipeline_options}.items()
                 if value is not None]
        if given:
            raise PlanError(f"--plan is a whole plan, so {', '.join(given)} cannot be combined with it; "
                            f"edit the plan file or drop --plan")
        plan = Plan.load(args.plan)
    else:
        mesh = Mesh.parse(args.mesh or DEFAULT_MESH)
        rules = load_rules(args.rules) if args.rules is not None else model_entry(args.model).rules_for(mesh)
        plan = Plan(mesh=mesh, rules=rules)
    world_size = args.world_size
    if world_size is None:
        if not plan.mesh.is_resolved:
            raise PlanError(f"{plan.mesh!r} has an inferred (-1) axis; pass --world-size N to infer it")
        world_size = plan.mesh.size
    if world_size < 1:
        raise PlanError(f"--world-size {world_size}: a world needs at least 1 process")
    plan = plan.resolved(world_size)
    if args.plan is None:
        pipeline = pipeline_from_args(plan.mesh, args.schedule, args.microbatches, args.split, args.split_points)
        plan = replace(plan, pipeline=pipeline)
    if args.profile is not None and plan.pipeline is None:
        raise PlanError(f"--profile records the pipeline timeline (forward/backward per micro-batch and stage), but "
                        f"{plan.mesh!r} has no pipeline; add a 'pp' axis of size >= 2, e.g. --mesh pp=2")
    return plan, world_size


def check_job(args: argparse.Namespace, plan: Plan, world_size: int) -> TrainJob:
    """Validate plan, sizes and data before launch; :class:`PlanError` names each problem."""
    entry = model_entry(args.model)
    meta = meta_model(entry.build)
    validate(plan, meta, world_size=world_size)
    seq_len = args.seq_len or entry.seq_len
    problems = []
    if not 1 <= seq_len <= entry.seq_len:
        problems.append(f"--seq-len {seq_len}: model {args.model!r} has {entry.seq_len} positions; "
                        f"valid: 1..{entry.seq_len}")
    if args.steps < 1:
        problems.append(f"--steps {args.steps}: train at least 1 step")
    if args.data_mb <= 0:
        problems.append(f"--data-mb {args.data_mb}: read a positive amount of text, e.g. 4")
    problems += [f"--batch-size {args.batch_size} / --seq-len {seq_len}: {p}"
                 for p in plan.resolved(world_size).batch_problems(args.batch_size, seq_len)]
    if problems:
        raise PlanError(problems)
    data = TextShards(args.data, max_bytes=int(args.data_mb * 2**20))
    data.check()
    return TrainJob(args.model, data, args.steps, args.batch_size, seq_len, args.lr, args.seed, args.profile is not None)


def train_job(ctx: Context, job: TrainJob) -> tuple[RankStats, list]:
    """One rank's training loop: shard, train with AdamW, measure memory, time and communication.

    Returns the rank's stats and, with ``job.profile``, its pipeline timeline spans (the
    last step's left out: it runs under the communication counter, which slows it).
    """
    import torch

    from ..observe import timeline
    from ..observe.comm import CommCounter
    from ..observe.memory import PeakMemory, state_bytes
    from ..runtime.apply import shard

    memory = PeakMemory(ctx.device).start()
    entry = model_entry(job.model)
    model = shard(entry.build(), ctx.plan, ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
    batches = job.data.batches(job.seq_len, job.batch_size, job.seed, job.steps)
    losses, times = [], []
    tokens_per_step = job.batch_size * job.seq_len
    comm = CommCounter()
    last = job.steps - 1
    recording = timeline.recording(ctx.rank) if job.profile else nullcontext()
    with _Progress(ctx.rank == 0, job.steps) as advance, recording:
        for step, batch in enumerate(batches):
            inputs, targets = ctx.shard_batch(*batch)
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
            advance(losses[-1], tokens_per_step / seconds)
    spans = [s for s in timeline.collect() if s.step != last or job.steps == 1] if job.profile else []
    stats = RankStats(ctx.rank, ctx.coordinates(), held, memory.peak_bytes(), memory.method, times, comm.summary(), losses)
    return stats, spans


class _Progress:
    """A rich progress bar on rank 0 (loss, tokens/s); a no-op elsewhere."""

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

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                                TimeElapsedColumn())
            self.task = self.bar.add_task("train", total=steps, loss=float("nan"), tps=0.0)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self.advance

    def advance(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, loss=loss, tps=tokens_per_s)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _verify(job: TrainJob, plan: Plan, world: LocalWorld | None) -> bool:
    from ..runtime.verify import verify

    entry = model_entry(job.model)
    batch = next(job.data.batches(job.seq_len, job.batch_size, job.seed, 1))
    result = verify(entry.build, plan, batch, loss_fn=entry.loss_fn, steps=VERIFY_STEPS, optimizer="adamw",
                    lr=job.lr, world=world)
    print(result, flush=True)
    return result.ok


def run(args: argparse.Namespace) -> int:
    plan, world_size = build_plan(args)
    job = check_job(args, plan, world_size)
    leader = not in_torchrun() or os.environ["RANK"] == "0"
    if leader:
        print(f"shardkit train: {job.model} on {plan.mesh!r} ({world_size} processes), {job.steps} steps of "
              f"{job.batch_size} x {job.seq_len} bytes from {job.data.root} (up to {format_bytes(job.data.max_bytes)})",
              flush=True)
    start = time.perf_counter()
    try:
        with nullcontext() if in_torchrun() else LocalWorld(world_size) as world:  # closed on exit, killed on error
            if args.verify and not _verify(job, plan, world):
                print("shardkit train: verify FAILED, not training (the sharded model differs from one device)",
                      file=sys.stderr)
                return 1
            results = launch(train_job, plan, job, world=world)
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
