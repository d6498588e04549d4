"""One training job as typed data (:class:`TrainConfig`), built in one place (:func:`job_config`) from a
job file and the flags: a flag given wins over the file, the file over the default, and a default is
never taken for something the user wrote.

>>> config = TrainConfig(model="gpt-tiny", steps=4)
>>> config.given("steps"), config.given("lr"), config.named("steps")
(True, False, 'steps=4')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..plan import Plan, UsageError
from .fields import JobError, field_names, load_job
from .model import check_model_name
from .plans import AUTO_PLAN, PLAN_OPTIONS, WHOLE_PLAN, PlanFlags, flag_text

DEFAULT_MODEL = "gpt-small"
#: Steps ``verify`` compares with one process before training.
VERIFY_STEPS = 2


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training job is (``sk.train(config)``, ``shardkit train``, a job file: docs/train.md).

    ``model``: a registered name, a builder ``package.module:function``, a transformers ``config.json``,
    or a model folder with one (default: ``init_from``'s folder when that is given, else ``gpt-small``).
    ``plan``: a :class:`Plan` (without rules, it gets the model's, as ``--mesh`` does), a plan file,
    the command line's :class:`PlanFlags`, or ``None``: the mesh ``fsdp=2,tp=2`` with the model's rules.
    ``data``: a folder written by ``sk.write_shards`` or a folder of text (default: the standard library's
    sources, at most ``data_mb`` MiB); ``seq_len``: default the model's positions. ``resume``: a checkpoint
    folder, or ``True`` for ``save``'s. ``timeout``: seconds, default the runtime's (30 minutes).

    ``written`` is the fields the user wrote (``None``: those that differ from their defaults);
    ``file_fields`` maps the fields a job file gave to their names there, which errors then use; with
    ``flags`` the other fields are named by their ``shardkit train`` flags (``--min-lr``).

    >>> TrainConfig(model="gpt-tiny", plan=Plan.from_dict({"mesh": {"fsdp": 2}}), steps=10).plan.mesh
    Mesh(fsdp=2)
    """

    model: str = DEFAULT_MODEL
    plan: Plan | Path | str | PlanFlags | None = None
    world_size: int | None = None
    data: Path | None = None
    data_mb: float | None = None
    seq_len: int | None = None
    steps: int = 60
    batch_size: int = 8
    grad_accum: int = 1
    optimizer: str = "adamw"
    lr: float = 3e-3
    betas: tuple[float, float] | None = None
    weight_decay: float | None = None
    momentum: float | None = None
    warmup_steps: int | None = None
    min_lr: float | None = None
    clip_grad_norm: float | None = None
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    loss_scale: str | float | None = None
    seed: int = 0
    build: str = "meta"
    init_from: Path | None = None
    save: Path | None = None
    save_every: int | None = None
    keep_last: int | None = None
    resume: Path | bool | None = None
    log_dir: Path | None = None
    log_every: int = 1
    eval_data: Path | None = None
    eval_holdout: float | None = None
    eval_every: int | None = None
    eval_batches: int = 1
    timeout: float | None = None
    verify: bool = False
    profile: Path | None = None
    written: frozenset[str] | None = None
    file_fields: Mapping[str, str] = field(default_factory=dict)
    file: Path | None = None
    flags: bool = False

    def __post_init__(self) -> None:
        if self.init_from is not None and not self.given("model"):  # the folder's own model
            object.__setattr__(self, "model", str(self.init_from))

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """A job file (YAML/JSON, docs/train.md), with ``overrides`` given as the fields they name."""
        return job_config(Path(path), overrides, flags=False)

    def given(self, name: str) -> bool:
        """Whether the user wrote ``name`` (a default is not written)."""
        if self.written is not None:
            return name in self.written
        default = next(f.default for f in fields(self) if f.name == name)
        return getattr(self, name) != default

    def name(self, name: str) -> str:
        """How errors name a field: its job-file field (``eval.batches``), its flag (``--eval-batches``), or
        itself (``eval_batches``)."""
        if name in self.file_fields:
            return self.file_fields[name]
        return f"--{name.replace('_', '-')}" if self.flags else name

    def named(self, name: str) -> str:
        """A value as an error names it: ``schedule.min_lr=0.1`` (after :meth:`in_file`'s prefix),
        ``--min-lr 0.1`` or ``min_lr=0.1``."""
        value = getattr(self, name)
        if name in self.file_fields or not self.flags:
            text = ("true" if name in self.file_fields else "True") if value is True else \
                str(list(value)) if isinstance(value, tuple) else _value_text(value)
            return f"{self.name(name)}={text}"
        return self.name(name) if value is True else f"{self.name(name)} {_value_text(value)}"

    def in_file(self, *names: str) -> str:
        """``'job.yaml: '`` when a value of ``names`` came from the job file (an error then names its
        fields), else ''."""
        return f"{self.file}: " if any(name in self.file_fields for name in names) else ""


def _value_text(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else ",".join(value) if isinstance(value, list) else str(value)


#: The fields a job file or ``TrainConfig`` sets that are not written with a default.
CONFIG_FIELDS = tuple(f.name for f in fields(TrainConfig) if f.name not in ("written", "file_fields", "file", "flags"))


def job_config(file: Path | None, values: Mapping[str, Any], plan_flags: PlanFlags | None = None, *,
               flags: bool = True) -> TrainConfig:
    """The one place a training job's configuration is built: the job ``file`` (``None``: none), then
    ``values`` given (by :class:`TrainConfig` field; a value not given is absent, not its default) winning
    over it, and the command line's ``plan_flags``.

    ``--plan`` or ``--mesh`` replaces the file's whole plan; a plan option flag (``--zero 2``) with the
    file's plan is refused, never dropped or merged.
    """
    unknown = sorted(set(values) - set(CONFIG_FIELDS))
    if unknown:
        raise UsageError(f"TrainConfig has no field {', '.join(unknown)}; valid: {', '.join(CONFIG_FIELDS)}")
    from_file = {} if file is None else load_job(file)
    plan_flags = plan_flags or PlanFlags()
    if any(dest in plan_flags.given() for dest in WHOLE_PLAN):
        from_file.pop("plan", None)  # the command line's plan replaces the file's whole plan
    elif "plan" in from_file:
        refuse_plan_options(plan_flags, from_file["plan"])
    if "model" in from_file:
        try:
            check_model_name(from_file["model"])
        except UsageError as exc:
            raise JobError(f"job file {str(file)!r}: model: {exc}") from None
    chosen = {**from_file, **values}
    if "plan" not in chosen and plan_flags.given():
        chosen["plan"] = plan_flags
    names = field_names()
    written = frozenset(from_file) | frozenset(values) | (frozenset({"plan"}) if plan_flags.given() else frozenset())
    return TrainConfig(**chosen, written=written, file=file, flags=flags,
                       file_fields={name: names[name] for name in from_file if name not in values})


def refuse_plan_options(flags: PlanFlags, plan: object) -> None:
    """Plan options given as flags while the job file gives the plan (and no --mesh or --plan): one line
    naming them, saying to put them into the file's plan or to give the whole plan by flags.

    >>> refuse_plan_options(PlanFlags(zero=2, schedule="gpipe"), Plan.from_dict({"mesh": {"dp": 2}}))
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.UsageError: --zero 2, --schedule gpipe: options of the plan, and the job file gives the plan (a flag would replace its whole plan with the default mesh): put them into the file's plan, plan: {..., zero: 2, pipeline: {schedule: gpipe}}, or give the whole plan by flags (--mesh AXES, or --plan FILE)
    """
    given = flags.options()
    if not given:
        return
    text = ", ".join(flag_text(dest, value) for dest, value in given.items())
    them = "them" if len(given) > 1 else "it"
    if plan == AUTO_PLAN:
        raise UsageError(f"{text}: the job file's plan is '{AUTO_PLAN}' (the planner chooses the whole plan), so "
                         f"{text.split()[0] if len(given) == 1 else 'they'} cannot be combined with it; drop {them}, "
                         f"or give the whole plan by flags (--mesh AXES, or --plan FILE)")
    top, pipeline = [], []
    for dest, value in given.items():
        key = PLAN_OPTIONS[dest]
        shown = "[[regex, layout], ...]" if dest == "rules" else \
            f"[{', '.join(value)}]" if isinstance(value, (list, tuple)) else str(value)
        (pipeline if key.startswith("pipeline.") else top).append(f"{key.removeprefix('pipeline.')}: {shown}")
    parts = ", ".join(top + ([f"pipeline: {{{', '.join(pipeline)}}}"] if pipeline else []))
    where = f"plan: {{..., {parts}}}" if isinstance(plan, Plan) else f"the plan file {plan} ({parts})"
    raise UsageError(f"{text}: {'options' if len(given) > 1 else 'an option'} of the plan, and the job file gives "
                     f"the plan (a flag would replace its whole plan with the default mesh): put {them} into the "
                     f"file's plan, {where}, or give the whole plan by flags (--mesh AXES, or --plan FILE)")


__all__ = ["CONFIG_FIELDS", "DEFAULT_MODEL", "VERIFY_STEPS", "TrainConfig", "job_config", "refuse_plan_options"]
