"""Everything about a training job checked before any process starts: the model (bytes in, its positions,
its initialisation or weights), the plan against it (``sk.validate``, the batch over the data axes), the
optimizer and schedule, logging and evaluation, the data, and the checkpoint to resume from.

A :class:`~shardkit.plan.PlanError` names each problem of the plan; a :class:`JobError` each other one, by
its flag or job-file field, with what would be valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.manifest import model_mismatch
from ..checkpoint.steps import nothing_saved
from ..checkpoint.store import checkpoint_to_load, latest_checkpoint, model_parameters
from ..families import token_sizes
from ..io.batch_stream import BatchStream
from ..models.registry import ModelEntry
from ..plan import Plan, PlanError, UsageError
from ..planner.initialisation import uninitialised
from ..planner.routing import micro_batch_problems
from ..planner.validate import validate
from ..runtime.materialize import open_weights
from .config import TrainConfig
from .data import held_out_problems, job_data
from .fields import JobError
from .model import meta_model_from_flag, model_from_flag
from .plans import PlanFlags, with_rules_hint

BYTE_VOCAB = 256  # the data are bytes: token ids 0..255


@dataclass(frozen=True)
class CheckedJob:
    """A training job checked before launch, with what the checks found (sent to every process).

    ``seq_len``: the tokens per sample; ``data`` / ``eval_data``: the batches; ``resume``: the checkpoint
    folder to start from (``None``: a fresh run) at step ``start``.
    """

    config: TrainConfig
    plan: Plan
    world_size: int
    seq_len: int
    data: BatchStream
    eval_data: BatchStream | None = None
    resume: str | None = None
    start: int = 0

    def steps_text(self) -> str:
        """The steps this run trains: ``'4 steps'``, or after a resume ``'2 steps (3-4 of 4)'``."""
        steps = self.config.steps
        count = steps - self.start
        text = f"{count} step{'s' if count != 1 else ''}"
        return text if self.start == 0 else f"{text} ({self.start + 1}-{steps} of {steps})"


def check_job(config: TrainConfig, plan: Plan, world_size: int) -> CheckedJob:
    """``config`` under ``plan`` checked before launch (see the module's docstring)."""
    entry = model_from_flag(config.model)
    model = meta_model_from_flag(config.model, entry)
    positions = model_positions(config, entry, model)
    try:
        validate(plan, model, world_size=world_size)
    except PlanError as exc:
        flags = PlanFlags() if config.plan is None else config.plan if isinstance(config.plan, PlanFlags) else None
        raise with_rules_hint(exc, flags, config.model) from None
    if config.init_from is not None:
        open_weights(config.init_from, model)  # every name and shape, before any process starts
    elif config.build == "meta":
        missing = uninitialised(model)
        if missing:
            raise UsageError(f"--build meta: the model's initialisation writes no values for {len(missing)} "
                             f"parameter(s) ({', '.join(map(repr, missing[:5]))}), so they cannot be made on the "
                             f"meta device; use --build full, --init-from DIR, or give their modules a "
                             f"reset_parameters()")
    seq_len = positions if config.seq_len is None else config.seq_len
    problems = []
    if positions is not None and seq_len > positions:
        problems.append(f"{config.in_file('seq_len')}{config.named('seq_len')}: model {config.model!r} has "
                        f"{positions} positions; valid: 1..{positions}")
    if config.batch_size % config.grad_accum:
        problems.append(f"{config.in_file('batch_size', 'grad_accum')}{config.named('batch_size')} does not split "
                        f"into {config.named('grad_accum')} micro-batches; valid: a batch size that is a multiple "
                        f"of {config.grad_accum}")
    problems += step_problems(config) + held_out_problems(config)
    problems += micro_batch_problems(model, config.grad_accum, config.named("grad_accum"))
    if problems:
        raise JobError(problems)
    _check_batch(config, plan, world_size, seq_len)
    data, eval_data = job_data(config, seq_len)
    resume, start = resume_point(config, model, data)
    problems = interval_problems(config, start)
    if problems:
        raise JobError(problems)
    return CheckedJob(config, plan, world_size, seq_len, data, eval_data, None if resume is None else str(resume),
                      start)


def model_positions(config: TrainConfig, entry: ModelEntry, model) -> int | None:
    """The model's positions (``None``: unknown, so ``seq_len`` must be given); it must read byte ids."""
    vocab, positions = token_sizes(model) if entry.vocab is None else (entry.vocab, entry.seq_len)
    flag = f"--model {config.model!r}"
    if vocab is None:
        raise UsageError(f"{flag}: cannot tell its vocabulary (no config.vocab_size, no nn.Embedding); the "
                         f"training data are bytes, so it must embed token ids 0..{BYTE_VOCAB - 1}")
    if vocab < BYTE_VOCAB:
        raise UsageError(f"{flag}: its vocabulary has {vocab} tokens, but the training data are bytes "
                         f"(token ids 0..{BYTE_VOCAB - 1}); give it a vocabulary of at least {BYTE_VOCAB}")
    if positions is None and config.seq_len is None:
        raise UsageError(f"{flag}: cannot tell how many positions it takes (no config.max_position_embeddings "
                         f"or n_positions, no position embedding); pass --seq-len N")
    return positions


def _check_batch(config: TrainConfig, plan: Plan, world_size: int, seq_len: int) -> None:
    """Each micro-batch splits over the plan's data axes (and its pipeline's micro-batches)."""
    micro = config.batch_size // config.grad_accum
    what = f"{config.named('batch_size')} / {config.named('grad_accum')} = {micro}" if config.grad_accum > 1 \
        else config.named("batch_size")
    length = f"seq_len {seq_len}" if config.seq_len is None else config.named("seq_len")
    batch = [f"{config.in_file('batch_size', 'grad_accum', 'seq_len')}{what} / {length}: {problem}"
             for problem in plan.resolved(world_size).batch_problems(micro, seq_len)]
    if batch:
        raise PlanError(batch)


def step_problems(config: TrainConfig) -> list[str]:
    """The optimizer, schedule and logging settings that cannot run as given, each named."""
    problems = []
    if config.optimizer != "adamw" and config.betas is not None:
        problems.append(f"{config.in_file('betas')}{config.named('betas')}: only AdamW has betas, but the "
                        f"optimizer is {config.optimizer!r}")
    if config.optimizer != "sgd" and config.momentum is not None:
        problems.append(f"{config.in_file('momentum')}{config.named('momentum')}: only SGD has momentum, but the "
                        f"optimizer is {config.optimizer!r}")
    if (config.warmup_steps is None) != (config.min_lr is None):
        given = "warmup_steps" if config.min_lr is None else "min_lr"
        problems.append(f"{config.in_file(given)}{config.named(given)}: --warmup-steps and --min-lr "
                        f"(schedule.warmup_steps, schedule.min_lr) come together: the schedule is a linear warmup "
                        f"then a cosine decay to min_lr; give both, or neither for a constant learning rate")
    elif config.warmup_steps is not None:
        if config.warmup_steps >= config.steps:
            problems.append(f"{config.in_file('warmup_steps', 'steps')}{config.named('warmup_steps')} is not below "
                            f"{config.named('steps')}, so the decay would never start; valid: 0..{config.steps - 1}")
        if config.min_lr > config.lr:
            problems.append(f"{config.in_file('min_lr', 'lr')}{config.named('min_lr')} is above "
                            f"{config.named('lr')}; the decay ends at min_lr, valid: 0..{config.lr:g}")
    if config.log_dir is None and config.given("log_every"):
        problems.append(f"{config.in_file('log_every')}{config.named('log_every')} applies only with --log-dir "
                        f"(logging.log_dir): give the folder to log in, or drop it")
    return problems


def resume_point(config: TrainConfig, model, data: BatchStream) -> tuple[Path | None, int]:
    """The checkpoint to resume from and its step, checked against the model and data before launch
    (``(None, 0)``: nothing to resume yet, which is said)."""
    for name in ("save_every", "keep_last"):
        if getattr(config, name) is not None and config.save is None:
            what = "the folder to save checkpoints in" if name == "save_every" else \
                "the folder whose checkpoints it keeps"
            raise JobError(f"{config.in_file(name)}{config.named(name)}: needs --save DIR (checkpoint.dir), {what}")
    if config.resume is None or config.resume is False:
        if config.save is not None and latest_checkpoint(config.save) is not None:
            raise JobError(f"{config.in_file('save')}{config.named('save')} already holds checkpoints (the latest: "
                           f"{latest_checkpoint(config.save).name}): add --resume (checkpoint.resume: true) to "
                           f"continue from it, or save in another folder")
        return None, 0
    folder = config.resume
    if folder is True:
        if config.save is None:
            raise JobError(f"{config.in_file('resume')}{config.named('resume')} without a folder resumes from "
                           f"--save DIR (checkpoint.dir); give one: --resume DIR or --save DIR")
        folder = config.save
    if nothing_saved(folder):
        print(f"shardkit train: --resume: no complete checkpoint in {folder} yet: starting at step 0", flush=True)
        return None, 0
    found, manifest = checkpoint_to_load(folder)
    problems = model_mismatch(manifest.parameters, model_parameters(model))
    if problems:
        raise UsageError(f"--resume {folder}: {found.name} holds another model's parameters: "
                         f"{'; '.join(problems[:5])}")
    if manifest.step >= config.steps:
        raise JobError(f"{config.in_file('resume', 'steps')}{config.named('resume')}: {found.name} is at step "
                       f"{manifest.step}, and {config.named('steps')} counts from step 0: nothing left to train; "
                       f"raise it above {manifest.step}")
    data.check_position((manifest.extra or {}).get("data"))
    return found, manifest.step


#: The options that act every N steps, and what they would never do when no multiple of N is a step the run trains.
INTERVALS = {"eval_every": "evaluate", "save_every": "save before the last step", "log_every": "log before the last step"}


def interval_problems(config: TrainConfig, start: int) -> list[str]:
    """Every-N-steps values longer than the run: no multiple of N among the steps it trains, ``start + 1`` to
    ``steps`` (after the checkpoint it resumed from), so they would have no effect; each named with what is valid.

    >>> interval_problems(TrainConfig(steps=2, eval_every=10, flags=True), 0)
    ['--eval-every 10: this run trains steps 1..2 (--steps 2), and none is a multiple of 10, so it would never evaluate; valid: 1..2 (at most --steps)']
    >>> interval_problems(TrainConfig(steps=10, eval_every=6, flags=True), 6)[0].split(": this run ")[1]
    'trains steps 7..10 (--steps 10, resuming at step 6), and none is a multiple of 6, so it would never evaluate; valid: 1..5, 7..10'
    """
    problems = []
    steps = config.steps
    for name, what in INTERVALS.items():
        every = getattr(config, name)
        if every is None or steps // every > start // every:
            continue
        valid = _ranges([n for n in range(1, steps + 1) if steps // n > start // n])
        bound = " (at most --steps)" if start == 0 else ""
        resumed = "" if start == 0 else f", resuming at step {start}"
        trains = f"step {steps}" if start + 1 == steps else f"steps {start + 1}..{steps}"
        problems.append(f"{config.in_file(name, 'steps')}{config.named(name)}: this run trains {trains} "
                        f"({config.named('steps')}{resumed}), and none is a multiple of "
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


__all__ = ["BYTE_VOCAB", "CheckedJob", "check_job", "interval_problems", "model_positions", "resume_point",
           "step_problems"]
