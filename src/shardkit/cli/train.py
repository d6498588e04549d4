"""``shardkit train``: train a model as a byte-level language model across a local world.

The model is a registered name or any importable builder, ``package.module:function``.

The plan is checked against the model on the meta device before any process starts; then a
local world (gloo on CPU, one process per device) trains with AdamW, rank 0 shows progress,
and every rank reports memory, step time and communication::

    shardkit train                                   # 4 CPU processes, mesh fsdp=2,tp=2
    shardkit train --mesh dp=2,tp=2 --verify
    shardkit train --plan plan.yaml --data ~/notes --steps 100
    shardkit train --model mypkg.models:build --mesh fsdp=2 --seq-len 256
    shardkit train --config job.yaml --steps 500     # a job file (cli/job.py); flags win over it
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.manifest import model_mismatch
from ..checkpoint.steps import checkpoint_to_load, latest_checkpoint, nothing_saved
from ..io.data import DEFAULT_MAX_BYTES
from ..models.registry import MODELS, ModelEntry
from ..plan import Plan, PlanError, UsageError
from ..runtime.limits import DEFAULT_TIMEOUT_S
from .job import BUILDS, OPTIMIZERS, RESUME_FROM_DIR, JobError, field_names, load_job
from .options import (
    AUTO_PLAN,
    add_model_option,
    add_plan_options,
    fraction,
    inferred_rules,
    meta_model_from_flag,
    model_from_flag,
    model_name,
    non_negative_float,
    non_negative_int,
    path,
    plan_from_args,
    positive_float,
    positive_int,
    rules_hint,
)
from .options import seed as seed_flag

if TYPE_CHECKING:  # torch and the rest are imported where a job runs, so a refused command line answers at once
    from torch import nn

    from ..io.batch_stream import BatchStream
    from ..observe.report import RankStats
    from ..runtime.context import Context
    from ..runtime.world import LocalWorld

DEFAULT_MODEL = "gpt-small"
DEFAULT_STEPS = 60
DEFAULT_BATCH = 8
DEFAULT_LR = 3e-3
VERIFY_STEPS = 2
RESUME_FROM_SAVE = Path("<the --save folder>")
BYTE_VOCAB = 256  # the data are bytes: token ids 0..255
TRAINABLE = MODELS.buildable()


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
    optimizer: str = "adamw"
    betas: tuple[float, float] | None = None  # None: the optimizer's defaults
    weight_decay: float | None = None
    momentum: float | None = None
    warmup_steps: int | None = None  # with min_lr: linear warmup, then cosine decay to min_lr
    min_lr: float | None = None
    grad_accum: int = 1
    clip_grad_norm: float | None = None
    log_dir: str | None = None
    log_every: int = 1
    eval_data: BatchStream | None = None
    eval_every: int | None = None
    eval_batches: int = 1
    start: int = 0  # the step the resumed checkpoint is at (0: a fresh run)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train a model across a local world and report memory, time and communication per device",
        description="Train a model as a byte-level language model on local text (default: the Python "
                    "standard library's sources) across a local world of processes, as a plan says. The plan is "
                    "validated on the meta device before any process starts.")
    add_model_option(parser, DEFAULT_MODEL, TRAINABLE)
    pipe = add_plan_options(parser)
    parser.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, metavar="N",
                        help=f"optimizer steps (default: {DEFAULT_STEPS})")
    parser.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH, metavar="N",
                        help=f"global batch, split over the data axes dp x fsdp (default: {DEFAULT_BATCH})")
    parser.add_argument("--seq-len", type=positive_int, metavar="N",
                        help="tokens (bytes) per sample (default: the model's positions)")
    parser.add_argument("--lr", type=positive_float, default=DEFAULT_LR, metavar="X",
                        help=f"learning rate, the peak with --warmup-steps (default: {DEFAULT_LR})")
    parser.add_argument("--data", type=path, metavar="DIR",
                        help="a data folder written by 'shardkit data shard' (every sample once per epoch, resumable "
                             "under any plan), or a folder of text files, searched recursively (random windows; "
                             "default: Python stdlib sources)")
    parser.add_argument("--data-mb", type=positive_float, default=DEFAULT_MAX_BYTES / 2**20, metavar="X",
                        help=f"text folders: read at most this many MiB (default: {DEFAULT_MAX_BYTES / 2**20:g})")
    parser.add_argument("--seed", type=seed_flag, default=0, metavar="N",
                        help="seed of the batch sampling and of the initialisation, 0 to 2**64 - 1 (default: 0)")
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
    # A flag's default applies only when neither the command line nor --config gives it (see with_config).
    parser.set_defaults(func=run, **{dest: _marked(value) for dest, value in DEFAULTS.items()},
                        **dict.fromkeys(FILE_ONLY))


class _DefaultInt(int):
    """A flag's default as the parser leaves it: equal to the value, but told apart from the same value
    given on the command line (which the flag's type makes a plain int, float or str)."""


class _DefaultFloat(float):
    __doc__ = _DefaultInt.__doc__


class _DefaultStr(str):
    __doc__ = _DefaultInt.__doc__


_MARKED = {int: _DefaultInt, float: _DefaultFloat, str: _DefaultStr}


def _marked(value: int | float | str) -> int | float | str:
    return _MARKED[type(value)](value)


def _given(value: object) -> bool:
    """Whether a flag's value came from the command line (not its default, not absent)."""
    return value is not None and type(value) not in _MARKED.values()


#: The defaults of the flags a job file may set; the parser leaves them marked (:func:`_marked`) so that
#: a flag given on the command line can be told from one left out, whatever its value.
DEFAULTS = {"model": DEFAULT_MODEL, "steps": DEFAULT_STEPS, "batch_size": DEFAULT_BATCH, "lr": DEFAULT_LR,
            "seed": 0, "build": "meta", "timeout": DEFAULT_TIMEOUT_S, "data_mb": DEFAULT_MAX_BYTES / 2**20,
            "optimizer": "adamw", "grad_accum": 1, "log_every": 1, "eval_batches": 1}
#: Job-file fields with no flag.
FILE_ONLY = ("betas", "momentum", "param_dtype", "reduce_dtype")
#: The flags that give a whole plan: either on the command line replaces the job file's plan.
PLAN_FLAGS = ("plan", "mesh")
#: The flags that set one option of the plan the --mesh flag builds, and where that option goes in a job
#: file's plan: with the file's plan and no --mesh or --plan they are refused, never dropped or merged.
PLAN_OPTION_FLAGS = {"rules": "rules", "recompute": "recompute", "zero": "zero", "schedule": "pipeline.schedule",
                     "microbatches": "pipeline.microbatches", "split": "pipeline.split",
                     "split_points": "pipeline.split_points"}


def with_config(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` completed from ``--config`` and the defaults: a flag given on the command line wins,
    then the job file, then the flag's default.

    >>> from shardkit.cli import build_parser
    >>> args = build_parser().parse_args(["train", "--steps", "60"])
    >>> with_config(args).steps, args.lr == DEFAULT_LR, type(args.lr)
    (60, True, <class 'float'>)
    """
    file = {} if args.config is None else load_job(args.config)
    if any(_given(getattr(args, flag)) for flag in PLAN_FLAGS):
        file.pop("plan", None)  # the command line's plan replaces the file's whole plan
    elif "plan" in file:
        _refuse_plan_options(args, file["plan"])
    if file.get("resume") == RESUME_FROM_DIR:
        file["resume"] = RESUME_FROM_SAVE
    if "model" in file:
        try:
            file["model"] = model_name(TRAINABLE)(file["model"])
        except argparse.ArgumentTypeError as exc:
            raise JobError(f"job file {str(args.config)!r}: model: {exc}") from None
    #: the destinations the user gave, on the command line or in the file (a default is not given)
    args.given = frozenset(dest for dest in DEFAULTS if _given(getattr(args, dest)) or dest in file)
    #: the destinations whose value comes from the file -> its field there, which messages then name
    fields = field_names()
    args.from_file = {dest: fields[dest] for dest in file if not _given(getattr(args, dest))}
    for dest, value in file.items():
        if not _given(getattr(args, dest)):
            setattr(args, dest, value)
    for dest, default in DEFAULTS.items():
        if not _given(getattr(args, dest)):
            setattr(args, dest, default)
    return args


def _refuse_plan_options(args: argparse.Namespace, plan: object) -> None:
    """Plan options given as flags while the job file gives the plan (and no --mesh or --plan): one line
    naming them, saying to put them into the file's plan or to give the whole plan by flags.

    >>> from shardkit.cli import build_parser
    >>> args = build_parser().parse_args(["train", "--zero", "2", "--schedule", "gpipe"])
    >>> _refuse_plan_options(args, Plan.from_dict({"mesh": {"dp": 2}}))
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.UsageError: --zero 2, --schedule gpipe: options of the plan, and the job file gives the plan (a flag would replace its whole plan with the default mesh): put them into the file's plan, plan: {..., zero: 2, pipeline: {schedule: gpipe}}, or give the whole plan by flags (--mesh AXES, or --plan FILE)
    """
    given = {dest: getattr(args, dest) for dest in PLAN_OPTION_FLAGS if getattr(args, dest) is not None}
    if not given:
        return
    flags = ", ".join(f"--{dest.replace('_', '-')} {_flag_text(value)}" for dest, value in given.items())
    them = "them" if len(given) > 1 else "it"
    if plan == AUTO_PLAN:
        raise UsageError(f"{flags}: the job file's plan is '{AUTO_PLAN}' (the planner chooses the whole plan), so "
                         f"{flags.split()[0] if len(given) == 1 else 'they'} cannot be combined with it; drop {them}, "
                         f"or give the whole plan by flags (--mesh AXES, or --plan FILE)")
    top, pipeline = [], []
    for dest, value in given.items():
        key = PLAN_OPTION_FLAGS[dest]
        text = "[[regex, layout], ...]" if dest == "rules" else \
            f"[{', '.join(value)}]" if isinstance(value, list) else str(value)
        (pipeline if key.startswith("pipeline.") else top).append(f"{key.removeprefix('pipeline.')}: {text}")
    fields = ", ".join(top + ([f"pipeline: {{{', '.join(pipeline)}}}"] if pipeline else []))
    where = f"plan: {{..., {fields}}}" if isinstance(plan, Plan) else f"the plan file {plan} ({fields})"
    raise UsageError(f"{flags}: {'options' if len(given) > 1 else 'an option'} of the plan, and the job file gives "
                     f"the plan (a flag would replace its whole plan with the default mesh): put {them} into the "
                     f"file's plan, {where}, or give the whole plan by flags (--mesh AXES, or --plan FILE)")


def _flag_text(value: object) -> str:
    return ",".join(value) if isinstance(value, list) else str(value)


def build_plan(args: argparse.Namespace) -> tuple[Plan, int]:
    """The plan and world size from the command line and ``--config`` (not yet checked against the model)."""
    with_config(args)
    if args.plan is not None and str(args.plan) == AUTO_PLAN:
        plan, world_size = auto_plan(args)
    else:
        if isinstance(args.plan, Plan):
            args.plan = _with_model_rules(args.plan, args)
        plan, world_size = plan_from_args(args, model_from_flag(args.model))
    plan = _with_precision(plan, args)
    if args.profile is not None and plan.pipeline is None:
        raise PlanError(f"--profile records the pipeline timeline (forward/backward per micro-batch and stage), but "
                        f"{plan.mesh!r} has no pipeline; add a 'pp' axis of size >= 2, e.g. --mesh pp=2")
    return plan, world_size


def _with_model_rules(plan: Plan, args: argparse.Namespace) -> Plan:
    """A job file's plan mapping with model axes and no ``rules``: the model's own rules, as ``--mesh`` gives
    them (built-in, transformers' tensor-parallel plan, or inferred from the dataflow); rules given are kept."""
    if plan.rules is not None or not plan.mesh.model_axes:
        return plan
    entry = model_from_flag(args.model)
    rules = entry.rules_for(plan.mesh) or inferred_rules(args.model, entry, plan.mesh)
    return plan if rules is None else replace(plan, rules=rules)


def _with_precision(plan: Plan, args: argparse.Namespace) -> Plan:
    """The job file's ``precision`` section as the plan's mixed-precision policy (``FSDPOptions``);
    a plan that already sets another dtype is refused, naming both."""
    given = {name: getattr(args, name) for name in ("param_dtype", "reduce_dtype") if getattr(args, name) is not None}
    clashes = [f"precision.{name} is {value!r} but the plan's fsdp.{name} is {getattr(plan.fsdp, name)!r}"
               for name, value in given.items() if getattr(plan.fsdp, name) not in (None, value)]
    if clashes:
        raise PlanError([f"{clash}: give it in one place" for clash in clashes])
    return replace(plan, fsdp=replace(plan.fsdp, **given)) if given else plan


def auto_plan(args: argparse.Namespace) -> tuple[Plan, int]:
    """``--plan auto``: the fastest plan ``sk.autoshard`` finds for this model, batch and sequence on
    the local world as calibrated (``shardkit calibrate``, measured once and kept)."""
    from ..planner.autoshard import autoshard
    from .plan import DEFAULT_LOCAL_WORLD, candidates_text, local_hardware

    given = [flag for flag, value in {"--mesh": args.mesh, "--rules": args.rules, "--schedule": args.schedule,
                                      "--microbatches": args.microbatches, "--split": args.split,
                                      "--split-points": args.split_points, "--recompute": args.recompute,
                                      "--zero": args.zero}.items()
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
    if "grad_accum" in args.given:  # the steps the user asked for: the fastest plan with them
        fitting = [c for c in candidates if c.grad_accum == args.grad_accum]
        if not fitting:
            raise PlanError(f"--plan auto: no plan among the best {len(candidates)} runs with --grad-accum "
                            f"{args.grad_accum}; they use {sorted({c.grad_accum for c in candidates})} steps: "
                            f"drop --grad-accum to let the planner choose")
        best = fitting[0]
    else:  # the planner's accumulation steps too
        best = candidates[0]
        args.grad_accum = best.grad_accum
    print(f"shardkit train: --plan auto chose {best.plan.mesh!r}"
          f"{f' with --grad-accum {best.grad_accum}' if best.grad_accum > 1 else ''}: {best.reason}", file=sys.stderr)
    return best.plan, world_size


def check_job(args: argparse.Namespace, plan: Plan, world_size: int) -> TrainJob:
    """Validate model, plan, sizes and data before launch: a :class:`PlanError` names each problem of the plan
    (the batch over its data axes included), a :class:`JobError` each other one, by its flag or job-file field."""
    from ..planner.initialisation import uninitialised
    from ..planner.validate import validate
    from ..runtime.materialize import open_weights

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
        problems.append(f"{_in_file(args, 'seq_len')}{_named(args, 'seq_len')}: model {args.model!r} has "
                        f"{positions} positions; valid: 1..{positions}")
    if args.batch_size % args.grad_accum:
        problems.append(f"{_in_file(args, 'batch_size', 'grad_accum')}{_named(args, 'batch_size')} does not split "
                        f"into {_named(args, 'grad_accum')} micro-batches; valid: a batch size that is a multiple "
                        f"of {args.grad_accum}")
    problems += _step_problems(args)
    if problems:
        raise JobError(problems)
    micro = args.batch_size // args.grad_accum
    what = f"{_named(args, 'batch_size')} / {_named(args, 'grad_accum')} = {micro}" if args.grad_accum > 1 \
        else _named(args, "batch_size")
    length = f"seq_len {seq_len}" if args.seq_len is None else _named(args, "seq_len")
    batch = [f"{_in_file(args, 'batch_size', 'grad_accum', 'seq_len')}{what} / {length}: {problem}"
             for problem in plan.resolved(world_size).batch_problems(micro, seq_len)]
    if batch:
        raise PlanError(batch)
    data, eval_data = _data(args, seq_len)
    resume, start = _resume_folder(args, model, data)
    problems = _interval_problems(args, start)
    if problems:
        raise JobError(problems)
    return TrainJob(args.model, data, args.steps, args.batch_size, seq_len, args.lr, args.seed, args.profile is not None,
                    args.build, _text(args.init_from), _text(args.save), args.save_every, args.keep_last, _text(resume),
                    args.optimizer, args.betas, args.weight_decay, args.momentum, args.warmup_steps, args.min_lr,
                    args.grad_accum, args.clip_grad_norm, _text(args.log_dir), args.log_every,
                    eval_data, args.eval_every, args.eval_batches, start)


def _named(args: argparse.Namespace, dest: str) -> str:
    """A value as an error names it: by its job-file field when it came from the file (``schedule.min_lr=0.1``,
    after :func:`_in_file`'s prefix), else by its flag (``--min-lr 0.1``)."""
    value = getattr(args, dest)
    name = _name(args, dest)
    if dest in getattr(args, "from_file", {}):
        text = "true" if value == RESUME_FROM_SAVE else str(list(value)) if isinstance(value, tuple) else \
            _value_text(value)
        return f"{name}={text}"
    return name if value == RESUME_FROM_SAVE else f"{name} {_value_text(value)}"


def _name(args: argparse.Namespace, dest: str) -> str:
    """The job-file field (``eval.batches``) or the flag (``--eval-batches``) a value came from."""
    return getattr(args, "from_file", {}).get(dest) or f"--{dest.replace('_', '-')}"


def _value_text(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else _flag_text(value)


def _in_file(args: argparse.Namespace, *dests: str) -> str:
    """``'job.yaml: '`` when a value of ``dests`` came from the job file (an error then names its fields), else ''."""
    from_file = getattr(args, "from_file", {})
    return f"{args.config}: " if any(dest in from_file for dest in dests) else ""


def _step_problems(args: argparse.Namespace) -> list[str]:
    """The optimizer, schedule, logging and evaluation settings that cannot run as given, each named."""
    problems = []
    if args.optimizer != "adamw" and args.betas is not None:
        problems.append(f"{_in_file(args, 'betas')}{_named(args, 'betas')}: only AdamW has betas, but the optimizer "
                        f"is {args.optimizer!r}")
    if args.optimizer != "sgd" and args.momentum is not None:
        problems.append(f"{_in_file(args, 'momentum')}{_named(args, 'momentum')}: only SGD has momentum, but the "
                        f"optimizer is {args.optimizer!r}")
    if (args.warmup_steps is None) != (args.min_lr is None):
        given = "warmup_steps" if args.min_lr is None else "min_lr"
        problems.append(f"{_in_file(args, given)}{_named(args, given)}: --warmup-steps and --min-lr "
                        f"(schedule.warmup_steps, schedule.min_lr) come together: the schedule is a linear warmup "
                        f"then a cosine decay to min_lr; give both, or neither for a constant learning rate")
    elif args.warmup_steps is not None:
        if args.warmup_steps >= args.steps:
            problems.append(f"{_in_file(args, 'warmup_steps', 'steps')}{_named(args, 'warmup_steps')} is not below "
                            f"{_named(args, 'steps')}, so the decay would never start; valid: 0..{args.steps - 1}")
        if args.min_lr > args.lr:
            problems.append(f"{_in_file(args, 'min_lr', 'lr')}{_named(args, 'min_lr')} is above {_named(args, 'lr')}; "
                            f"the decay ends at min_lr, valid: 0..{args.lr:g}")
    held_out = [dest for dest in ("eval_data", "eval_holdout") if getattr(args, dest) is not None]
    if len(held_out) == 2:
        problems.append(f"{_in_file(args, *held_out)}{_named(args, 'eval_data')} and {_named(args, 'eval_holdout')}: "
                        f"give one, a held-out folder or the fraction of the training data to hold out, not both")
    elif (args.eval_every is None) != (not held_out):
        given = held_out or ["eval_every"]
        problems.append(f"{_in_file(args, *given)}{_named(args, given[0])}: --eval-every and --eval-data or "
                        f"--eval-holdout (eval.every, eval.data or eval.holdout) come together: evaluate every N "
                        f"steps on a held-out folder or on a held-out fraction of the training data; give "
                        f"--eval-every with one of them, or none")
    given = getattr(args, "given", frozenset())
    if args.eval_every is None and "eval_batches" in given:
        problems.append(f"{_in_file(args, 'eval_batches')}{_named(args, 'eval_batches')} applies only with "
                        f"--eval-every (eval.every): evaluate every N steps on --eval-data or --eval-holdout, or "
                        f"drop it")
    if args.log_dir is None and "log_every" in given:
        problems.append(f"{_in_file(args, 'log_every')}{_named(args, 'log_every')} applies only with --log-dir "
                        f"(logging.log_dir): give the folder to log in, or drop it")
    if args.eval_data is not None and args.data is not None:
        held, train = args.eval_data.resolve(), args.data.resolve()
        where = _in_file(args, "eval_data", "data")
        if held == train:
            problems.append(f"{where}{_named(args, 'eval_data')} is the training data: give held-out data (e.g. a "
                            f"second folder written by 'shardkit data shard')")
        elif held.is_relative_to(train) or train.is_relative_to(held):
            how = "is inside" if held.is_relative_to(train) else "contains"
            problems.append(f"{where}{_named(args, 'eval_data')} {how} the training data {_named(args, 'data')}, so "
                            f"it would evaluate on training text: give a held-out folder outside it (e.g. a second "
                            f"folder written by 'shardkit data shard') or --eval-holdout F")
    if args.eval_data is not None and not args.eval_data.is_dir():
        problems.append(f"{_in_file(args, 'eval_data')}{_named(args, 'eval_data')}: no such folder")
    return problems


#: The options that act every N steps, and what they would never do when no multiple of N is a step the run trains.
INTERVALS = {"eval_every": "evaluate", "save_every": "save before the last step", "log_every": "log before the last step"}


def _interval_problems(args: argparse.Namespace, start: int) -> list[str]:
    """Every-N-steps values longer than the run: no multiple of N among the steps it trains, ``start + 1`` to
    ``--steps`` (after the checkpoint it resumed from), so they would have no effect; each named with what is valid.

    >>> from shardkit.cli import build_parser
    >>> args = with_config(build_parser().parse_args(["train", "--steps", "2", "--eval-every", "10"]))
    >>> _interval_problems(args, 0)
    ['--eval-every 10: this run trains steps 1..2 (--steps 2), and none is a multiple of 10, so it would never evaluate; valid: 1..2 (at most --steps)']
    >>> args.steps, args.eval_every = 10, 6
    >>> _interval_problems(args, 6)[0].split(": this run ")[1]
    'trains steps 7..10 (--steps 10, resuming at step 6), and none is a multiple of 6, so it would never evaluate; valid: 1..5, 7..10'
    """
    problems = []
    for dest, what in INTERVALS.items():
        every = getattr(args, dest)
        if every is None or args.steps // every > start // every:
            continue
        valid = _ranges([n for n in range(1, args.steps + 1) if args.steps // n > start // n])
        bound = " (at most --steps)" if start == 0 else ""
        resumed = "" if start == 0 else f", resuming at step {start}"
        trains = f"step {args.steps}" if start + 1 == args.steps else f"steps {start + 1}..{args.steps}"
        problems.append(f"{_in_file(args, dest, 'steps')}{_named(args, dest)}: this run trains {trains} "
                        f"({_named(args, 'steps')}{resumed}), and none is a multiple of "
                        f"{every}, so it would never {what}; valid: {valid}{bound}")
    return problems


def _ranges(numbers: list[int]) -> str:
    """Sorted integers as runs: ``[1, 2, 3, 5]`` -> ``'1..3, 5'``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def _data(args: argparse.Namespace, seq_len: int) -> tuple[BatchStream, BatchStream | None]:
    """The training data and the held-out data to evaluate on (``None``: no evaluation), checked before launch:
    ``--eval-holdout`` splits the training data (:meth:`BatchStream.split`), ``--eval-data`` is a folder."""
    from ..io.sharded_data import ShardedDataset

    max_bytes = int(args.data_mb * 2**20)
    data = _stream(args, "data", seq_len, max_bytes)
    if args.eval_holdout is not None:
        try:
            data, held = data.split(args.eval_holdout)
        except UsageError as exc:
            raise JobError(f"{_in_file(args, 'eval_holdout')}{_named(args, 'eval_holdout')}: {exc}") from None
    elif args.eval_data is not None:
        held = _stream(args, "eval_data", seq_len, max_bytes)
    else:
        return data, None
    if not isinstance(held.source, ShardedDataset):
        return data, held  # text: random windows, any number of batches
    where = _in_file(args, "eval_data", "eval_holdout", "batch_size", "eval_batches")
    named = _named(args, "eval_data" if args.eval_holdout is None else "eval_holdout")
    shards = "" if args.eval_holdout is None else \
        f"the last {len(held.source.shards)} of {len(held.source.manifest.shards)} shards"
    if len(held.source) < args.batch_size:
        raise JobError(f"{where}{named}{shards and ': ' + shards} has {len(held.source)} samples of {seq_len} tokens, "
                       f"fewer than one global batch of {args.batch_size}: give more held-out data or a smaller batch")
    if args.eval_batches * args.batch_size > len(held.source):
        fit = len(held.source) // args.batch_size
        raise JobError(f"{where}{_named(args, 'eval_batches')} x {_named(args, 'batch_size')} = "
                       f"{args.eval_batches * args.batch_size} samples, but {named}{shards and f' ({shards})'} has "
                       f"{len(held.source)} samples of {seq_len} tokens, so evaluation would repeat them; valid: "
                       f"{_name(args, 'eval_batches')} 1..{fit}")
    return data, held


def _stream(args: argparse.Namespace, dest: str, seq_len: int, max_bytes: int) -> BatchStream:
    """The batches of ``--data`` or ``--eval-data`` (default: the standard library's text), checked to hold text;
    a problem names the flag or field."""
    from ..io.batch_stream import BatchStream
    from ..io.data import TextShards

    try:
        stream = BatchStream.of(getattr(args, dest), seq_len, args.seed, max_bytes=max_bytes)
        if isinstance(stream.source, TextShards):
            stream.source.check()
    except PlanError as exc:
        name = _named(args, dest) if getattr(args, dest) is not None else "--data (the standard library's sources)"
        raise JobError([f"{_in_file(args, dest)}{name}: {problem}" for problem in exc.problems]) from None
    return stream


def _text(value: Path | None) -> str | None:
    return None if value is None else str(value)


def _resume_folder(args: argparse.Namespace, model: nn.Module, data: BatchStream) -> tuple[Path | None, int]:
    """The checkpoint ``--resume`` starts from and its step, checked against the model and data before launch
    (``(None, 0)``: nothing to resume yet, which is said)."""
    for dest in ("save_every", "keep_last"):
        if getattr(args, dest) is not None and args.save is None:
            what = "the folder to save checkpoints in" if dest == "save_every" else "the folder whose checkpoints it keeps"
            raise JobError(f"{_in_file(args, dest)}{_named(args, dest)}: needs --save DIR (checkpoint.dir), {what}")
    if args.resume is None:
        if args.save is not None and latest_checkpoint(args.save) is not None:
            raise JobError(f"{_in_file(args, 'save')}{_named(args, 'save')} already holds checkpoints (the latest: "
                           f"{latest_checkpoint(args.save).name}): add --resume (checkpoint.resume: true) to continue "
                           f"from it, or save in another folder")
        return None, 0
    if args.resume == RESUME_FROM_SAVE:
        if args.save is None:
            raise JobError(f"{_in_file(args, 'resume')}{_named(args, 'resume')} without a folder resumes from --save "
                           f"DIR (checkpoint.dir); give one: --resume DIR or --save DIR")
        args.resume = args.save
    if nothing_saved(args.resume):
        print(f"shardkit train: --resume: no complete checkpoint in {args.resume} yet: starting at step 0", flush=True)
        return None, 0
    folder, manifest = checkpoint_to_load(args.resume)
    from ..checkpoint.store import model_parameters

    problems = model_mismatch(manifest.parameters, model_parameters(model))
    if problems:
        raise UsageError(f"--resume {args.resume}: {folder.name} holds another model's parameters: "
                         f"{'; '.join(problems[:5])}")
    if manifest.step >= args.steps:
        raise JobError(f"{_in_file(args, 'resume', 'steps')}{_named(args, 'resume')}: {folder.name} is at step {manifest.step}, "
                       f"and {_named(args, 'steps')} counts from step 0: nothing left to train; raise it above "
                       f"{manifest.step}")
    data.check_position((manifest.extra or {}).get("data"))
    return folder, manifest.step


def _check_token_sizes(args: argparse.Namespace, entry: ModelEntry, model: nn.Module) -> int | None:
    """The model's positions (``None``: unknown, so ``--seq-len`` was given); it must read byte ids."""
    from ..families import token_sizes

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
    """One rank's training loop: shard, train, measure memory, time and communication, log, evaluate.

    Returns the rank's stats and, with ``job.profile``, its pipeline timeline spans (the
    last step's left out: it runs under the communication counter, which slows it).
    """
    from ..checkpoint.store import load, save
    from ..observe.comm import CommCounter
    from ..observe.memory import PeakMemory, state_bytes
    from ..observe.report import RankStats
    from ..runtime import spans as timeline
    from ..runtime.apply import shard
    from .train_step import (
        RunLog,
        accumulate,
        clip_grad_norm,
        evaluate,
        lr_schedule,
        make_optimizer,
    )

    memory = PeakMemory(ctx.device).start()
    entry = model_from_flag(job.model)
    model = shard(_builder(job)(), ctx.plan, ctx, seed=job.seed, weights=job.init_from)
    optimizer = make_optimizer(model, job.optimizer, job.lr, betas=job.betas, weight_decay=job.weight_decay,
                               momentum=job.momentum)  # ZeRO-1's partitioned optimizer under Plan(zero=1)
    _finish_setup(model)
    first, position = 0, None
    losses, times = [], []
    tokens_per_step = job.batch_size * job.seq_len
    comm = CommCounter()
    last = job.steps - 1
    recording = timeline.recording(ctx.rank) if job.profile else nullcontext()
    log = RunLog(job.log_dir, job.log_every, ctx.rank)
    with _Progress(ctx.rank == 0, job.steps) as progress, recording, log:
        if job.resume is not None:
            with progress.busy(f"loading {job.resume}"):
                info = load(job.resume, model, optimizer)
            first, position = info["step"], (info["extra"] or {}).get("data")
            progress.resumed(first)
            progress.say(f"resumed from {job.resume} at step {first}")
        schedule = lr_schedule(optimizer, first, job.steps, job.lr, job.warmup_steps, job.min_lr)
        eval_batches = None if job.eval_data is None else list(job.eval_data.batches(job.batch_size, job.eval_batches))
        batches = job.data.batches(job.batch_size, job.steps - first, position)
        for step, batch in enumerate(batches, start=first):
            done = step + 1
            logged = log.due(done, job.steps)
            if step == last or logged:
                comm.reset()
            start = time.perf_counter()
            # Communication is counted on the last (steady-state) step and on logged steps only: the counter
            # sees every op in Python, which slows the steps it counts.
            with comm if step == last or logged else nullcontext():
                loss = accumulate(model, ctx, batch, entry.loss_fn, job.grad_accum)
                norm = clip_grad_norm(model, job.clip_grad_norm) if logged or job.clip_grad_norm else None
                optimizer.step()
            lr = optimizer.param_groups[0]["lr"]
            if schedule is not None:
                schedule.step()
            if step == last:
                held = state_bytes(model, optimizer)  # grads still allocated
            optimizer.zero_grad()
            seconds = time.perf_counter() - start
            if step != last or not times:
                times.append(seconds)
            losses.append(loss.item())
            progress.advance(losses[-1], tokens_per_step / seconds)
            log.step_done(tokens_per_step, seconds)
            if logged:
                log.write(done, losses[-1], lr, norm, memory.peak_bytes(), comm.totals())
            if eval_batches is not None and done % job.eval_every == 0:
                eval_loss = evaluate(model, ctx, eval_batches, entry.loss_fn)
                log.eval(done, eval_loss)
                progress.say(f"step {done}: eval loss {eval_loss:.4f}, perplexity {math.exp(eval_loss):.2f}")
            if job.save is not None and (done == job.steps or (job.save_every and done % job.save_every == 0)):
                began = time.perf_counter()
                with progress.busy(f"saving step {done}"):
                    folder = save(job.save, model, optimizer, step=done,
                                  extra={"data": batch.position, "loss": losses[-1]}, keep_last=job.keep_last)
                progress.say(f"saved {folder} in {time.perf_counter() - began:.1f} s")
    spans = [s for s in timeline.collect() if s.step != last or job.steps == 1] if job.profile else []
    stats = RankStats(ctx.rank, ctx.coordinates(), held, memory.peak_bytes(), memory.method, times, comm.summary(), losses)
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
    from ..planner.meta import meta_model

    entry = model_from_flag(job.model)
    return partial(meta_model, entry.build) if job.build == "meta" else entry.build


def _verify(job: TrainJob, plan: Plan, world: LocalWorld | None) -> bool:
    from ..runtime.verify import verify

    entry = model_from_flag(job.model)
    first = next(job.data.batches(job.batch_size, 1))
    batch = (first.inputs, first.targets)
    result = verify(_builder(job), plan, batch, loss_fn=entry.loss_fn, steps=VERIFY_STEPS, optimizer=job.optimizer,
                    lr=job.lr, world=world)
    print(result, flush=True)
    return result.ok


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..observe.report import print_summary
    from ..runtime.torchrun import in_torchrun
    from ..runtime.world import LocalWorld, WorldError, launch

    plan, world_size = build_plan(args)
    job = check_job(args, plan, world_size)
    leader = not in_torchrun() or os.environ["RANK"] == "0"
    steps = _steps_text(job)
    if leader:
        zero = "" if plan.zero is None else f" with ZeRO stage {plan.zero}"
        print(f"shardkit train: {job.model} on {plan.mesh!r}{zero} ({world_size} processes), {steps} of "
              f"{job.batch_size} x {job.seq_len} tokens from {job.data.describe()}"
              f"{'' if job.eval_data is None else f', evaluating on {job.eval_data.describe()}'}", flush=True)
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
        print_summary([stats for stats, _ in results], console, title=f"per device: {job.model}, {plan.mesh!r}, {steps}")
        tokens = (job.steps - job.start) * job.batch_size * job.seq_len
        print(f"{tokens:,} tokens in {time.perf_counter() - start:.1f} s ({steps}, including process start)")
        if args.profile is not None:
            _write_profile(plan, {rank: spans for rank, (_, spans) in enumerate(results)}, args.profile)
    return 0


def _steps_text(job: TrainJob) -> str:
    """The steps this run trains: ``'4 steps'``, or after a resume ``'2 steps (3-4 of 4)'``."""
    count = job.steps - job.start
    text = f"{count} step{'s' if count != 1 else ''}"
    return text if job.start == 0 else f"{text} ({job.start + 1}-{job.steps} of {job.steps})"


def _write_profile(plan: Plan, spans_by_rank: dict, out_dir: Path) -> None:
    from ..observe.timeline import write_profile

    pipeline = plan.pipeline
    assert pipeline is not None
    profile = write_profile(spans_by_rank, out_dir, pipeline.schedule, pipeline.num_stages(plan.mesh),
                            pipeline.microbatches, pipeline.virtual_stages)
    print(profile["summary"])
