"""``shardkit train``: train a model as a byte-level language model across a local world.

The flags (and ``--config``, a job file) become one :class:`~shardkit.training.TrainConfig`
(:func:`build_config`), which ``sk.train`` checks before any process starts and trains; this module
only parses, builds the configuration, and prints::

    shardkit train                                   # 4 CPU processes, mesh fsdp=2,tp=2
    shardkit train --mesh dp=2,tp=2 --verify
    shardkit train --plan plan.yaml --data ~/notes --steps 100
    shardkit train --model mypkg.models:build --mesh fsdp=2 --seq-len 256
    shardkit train --model hf/llama --mesh tp=2      # a model folder: built from its config.json
    shardkit train --init-from hf/llama --mesh fsdp=2  # ... and started from its weights
    shardkit train --config job.yaml --steps 500     # a job file (docs/train.md); flags win over it
    shardkit train --dry-run --mesh fsdp=8,tp=8 --world-size 64   # one rank's step on fake tensors (cli/dry_run.py)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import replace

from ..io.data import DEFAULT_MAX_BYTES
from ..plan import Plan, PlanError, UsageError
from ..runtime.limits import DEFAULT_TIMEOUT_S
from ..training.config import CONFIG_FIELDS, DEFAULT_MODEL, VERIFY_STEPS, TrainConfig, job_config
from ..training.fields import BUILDS, OPTIMIZERS
from ..training.model import TRAINABLE
from ..training.plans import AUTO_PLAN, PlanFlags, flag_text, job_plan
from . import dry_run
from .options import (
    add_model_option,
    fraction,
    loss_scale,
    meta_model_from_flag,
    model_from_flag,
    non_negative_float,
    non_negative_int,
    path,
    positive_float,
    positive_int,
)
from .options import seed as seed_flag
from .plan_flags import add_plan_options

#: The defaults the flags show (a default is never taken for a value given: see :class:`_Given`).
DEFAULTS = TrainConfig()


class _Given(argparse.Action):
    """Stores a flag's value and records that the user gave it (``args.given_flags``), so that a flag
    given with its default's value still wins over the job file, and a default never does."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given_flags = namespace.given_flags | {self.dest}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train a model across a local world and report memory, time and communication per device",
        description="Train a model as a byte-level language model on local text (default: the Python "
                    "standard library's sources) across a local world of processes, as a plan says. The plan is "
                    "validated on the meta device before any process starts.")
    parser.register("action", None, _Given)  # every flag below but --verify records that it was given
    add_model_option(parser, DEFAULT_MODEL, TRAINABLE)
    pipe = add_plan_options(parser)
    parser.add_argument("--steps", type=positive_int, default=DEFAULTS.steps, metavar="N",
                        help=f"optimizer steps (default: {DEFAULTS.steps})")
    parser.add_argument("--batch-size", type=positive_int, default=DEFAULTS.batch_size, metavar="N",
                        help=f"global batch, split over the data axes dp x fsdp (default: {DEFAULTS.batch_size})")
    parser.add_argument("--seq-len", type=positive_int, metavar="N",
                        help="tokens (bytes) per sample (default: the model's positions)")
    parser.add_argument("--lr", type=positive_float, default=DEFAULTS.lr, metavar="X",
                        help=f"learning rate, the peak with --warmup-steps (default: {DEFAULTS.lr})")
    parser.add_argument("--data", type=path, metavar="DIR",
                        help="a data folder written by 'shardkit data shard' (every sample once per epoch, resumable "
                             "under any plan), or a folder of text files, searched recursively (random windows; "
                             "default: Python stdlib sources)")
    parser.add_argument("--data-mb", type=positive_float, default=DEFAULT_MAX_BYTES / 2**20, metavar="X",
                        help=f"text folders: read at most this many MiB (default: {DEFAULT_MAX_BYTES / 2**20:g})")
    parser.add_argument("--seed", type=seed_flag, default=DEFAULTS.seed, metavar="N",
                        help="seed of the batch sampling and of the initialisation, 0 to 2**64 - 1 (default: 0)")
    parser.add_argument("--build", choices=BUILDS, default=DEFAULTS.build,
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
    saving.add_argument("--resume", nargs="?", const=True, type=path, metavar="DIR",
                        help="continue from the latest complete checkpoint in DIR (default: the --save folder), under "
                             "this run's plan, whatever the plan it was saved under; --steps counts from step 0. "
                             "With no checkpoint there yet, training starts at step 0 and says so")
    parser.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"stop every process and exit 1 when the job runs longer (default: {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--verify", action="store_true",
                        help=f"first check the sharded model against a single-process run for {VERIFY_STEPS} steps")
    pipe.add_argument("--profile", type=path, metavar="DIR",
                      help="write the pipeline timeline (Chrome/Perfetto trace and PNG) and the bubble fraction to DIR")
    parser.add_argument("--config", type=path, metavar="FILE",
                        help="a job file (YAML/JSON, docs/train.md): model, data, optimizer, schedule, batch, "
                             "precision, plan, checkpoint, logging, eval; a flag given here wins over the file")
    step = parser.add_argument_group("optimizer and step")
    step.add_argument("--optimizer", choices=OPTIMIZERS, help="default: adamw")
    step.add_argument("--weight-decay", type=non_negative_float, metavar="X",
                      help="default: the optimizer's (AdamW 0.01, SGD 0)")
    step.add_argument("--warmup-steps", type=non_negative_int, metavar="N",
                      help="linear warmup over N steps, then cosine decay to --min-lr (default: constant --lr)")
    step.add_argument("--min-lr", type=non_negative_float, metavar="X",
                      help="the learning rate the cosine decay ends at (with --warmup-steps)")
    step.add_argument("--grad-accum", type=positive_int, metavar="K",
                      help="split each global batch into K micro-batches, one optimizer step (default: 1)")
    step.add_argument("--clip-grad-norm", type=positive_float, metavar="X",
                      help="clip the global gradient norm (over every shard and pipeline stage) to X")
    step.add_argument("--loss-scale", type=loss_scale, metavar="S",
                      help="float16 loss scaling: dynamic (the default with float16), a fixed scale such as 1024, or "
                           "off (refused with float16: use bfloat16)")
    seeing = parser.add_argument_group("logging and evaluation")
    seeing.add_argument("--log-dir", type=path, metavar="DIR",
                        help="TensorBoard event files and metrics.jsonl (loss, learning rate, gradient norm, "
                             "tokens/s, memory per rank, communication bytes, eval loss and perplexity)")
    seeing.add_argument("--log-every", type=positive_int, metavar="N", help="log every N steps (default: 1)")
    seeing.add_argument("--eval-data", type=path, metavar="DIR",
                        help="held-out data (a folder of either kind, not the training data) to evaluate on")
    seeing.add_argument("--eval-holdout", type=fraction, metavar="F",
                        help="evaluate on the last fraction F (0 < F < 1) of the training data instead, never trained "
                             "on: whole shards of a sharded folder (the last ceil(F x shards)), the last bytes of text")
    seeing.add_argument("--eval-every", type=positive_int, metavar="N", help="evaluate every N steps")
    seeing.add_argument("--eval-batches", type=positive_int, metavar="N",
                        help="global batches per evaluation (default: 1)")
    dry_run.add_options(parser)
    parser.set_defaults(func=run, given_flags=frozenset())


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The job's one configuration from the flags given and ``--config`` (a flag given wins over the file,
    the file over the default); ``--plan auto`` / ``plan: auto`` resolved by the planner."""
    given = {dest: getattr(args, dest) for dest in args.given_flags}
    plan_flags = PlanFlags.of(given)
    values = {dest: value for dest, value in given.items() if dest in CONFIG_FIELDS and dest not in
              plan_flags.given()}
    if args.verify:
        values["verify"] = True
    config = job_config(args.config, values, plan_flags)
    plan = config.plan
    if plan == AUTO_PLAN or (isinstance(plan, PlanFlags) and str(plan.plan) == AUTO_PLAN):
        return auto_plan(config)
    return config


def build_plan(args: argparse.Namespace) -> tuple[Plan, int]:
    """The plan and world size the flags and ``--config`` give (not yet checked against the model)."""
    return job_plan(build_config(args))


def auto_plan(config: TrainConfig) -> TrainConfig:
    """``--plan auto``: the fastest plan ``sk.autoshard`` finds for this model, batch and sequence on the world
    that will run (the local world, or under ``torchrun`` the torchrun world) as calibrated on its own devices
    (``shardkit calibrate``, measured once and kept; under torchrun every rank measures together, rank 0 writes
    the file and every rank plans on rank 0's figures, so every rank chooses the same plan), and its
    accumulation steps unless ``--grad-accum`` is given."""
    from ..planner.autoshard import autoshard
    from ..runtime.torchrun import in_torchrun
    from ..training.checks import model_positions
    from ..training.run import is_leader
    from .plan import DEFAULT_LOCAL_WORLD, candidates_text, local_hardware

    flags = config.plan.given() if isinstance(config.plan, PlanFlags) else {}
    given = [flag_text(dest, value).split()[0] for dest, value in flags.items() if dest != "plan"]
    if given:
        raise PlanError(f"--plan auto chooses the whole plan, so {', '.join(given)} cannot be combined with it; "
                        f"drop them, or give the plan yourself")
    entry = model_from_flag(config.model)
    model = meta_model_from_flag(config.model, entry)
    positions = model_positions(config, entry, model)
    seq_len = positions if config.seq_len is None else config.seq_len
    world_size = config.world_size or DEFAULT_LOCAL_WORLD
    if in_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        if config.world_size not in (None, world_size):
            raise PlanError(f"--plan auto under torchrun plans its world of {world_size} processes, but "
                            f"--world-size is {config.world_size}; drop --world-size or give {world_size}")
    hardware = local_hardware(world_size)
    candidates = autoshard(model, devices=world_size, hardware=hardware, global_batch=config.batch_size,
                           seq_len=seq_len, top=10, param_dtype=None)
    leader = is_leader()
    if leader:
        print(candidates_text(candidates, config.model, world_size, hardware), end="", file=sys.stderr)
    best = candidates[0]
    if config.given("grad_accum"):  # the steps the user asked for: the fastest plan with them
        fitting = [c for c in candidates if c.grad_accum == config.grad_accum]
        if not fitting:
            raise PlanError(f"--plan auto: no plan among the best {len(candidates)} runs with --grad-accum "
                            f"{config.grad_accum}; they use {sorted({c.grad_accum for c in candidates})} steps: "
                            f"drop --grad-accum to let the planner choose")
        best = fitting[0]
    if leader:
        print(f"shardkit train: --plan auto chose {best.plan.mesh!r}"
              f"{f' with --grad-accum {best.grad_accum}' if best.grad_accum > 1 else ''}: {best.reason}",
              file=sys.stderr)
    return replace(config, plan=best.plan, world_size=world_size, grad_accum=best.grad_accum)


def run(args: argparse.Namespace) -> int:
    """Build the configuration, check it, train it on a local world (or the torchrun world), print the summary."""
    from rich.console import (
        Console,  # torch and the rest only where a job runs: a refused line answers at once
    )

    from ..observe import report
    from ..runtime import world as runtime_world
    from ..runtime.torchrun import in_torchrun
    from ..training.run import is_leader, prepare, start_line, train

    if args.dry_run:
        return dry_run.run(args, build_config(args))
    if {"ranks", "device_memory"} & args.given_flags:
        raise UsageError("--ranks and --device-memory choose what a dry run runs and compares with; add --dry-run")
    job = prepare(build_config(args))
    config, leader = job.config, is_leader()
    if leader:
        print(start_line(job), flush=True)
    start = time.perf_counter()
    try:
        with nullcontext() if in_torchrun() else runtime_world.LocalWorld(job.world_size) as world:  # closed on exit, killed on error
            result = train(job, world=world)
    except runtime_world.WorldError as exc:
        print(f"shardkit train: {exc}", file=sys.stderr)
        return 1
    if result.verified is False:
        print("shardkit train: verify FAILED, not training (the sharded model differs from one device)",
              file=sys.stderr)
        return 1
    if leader:
        console = Console(width=None if sys.stdout.isatty() else 120)
        steps = job.steps_text()
        report.print_summary(result.stats, console, title=f"per device: {config.model}, {job.plan.mesh!r}, {steps}")
        print(f"{result.tokens:,} tokens in {time.perf_counter() - start:.1f} s ({steps}, including process start)")
    return 0
