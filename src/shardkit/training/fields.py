"""The job file (``shardkit train --config job.yaml``, ``TrainConfig.from_file``): one file for a whole
training job, read strictly, and the table of its fields.

The file is pure data, checked as a Plan is: an unknown key is named with the valid ones, a
value of the wrong type is named with what would be valid, and nothing is coerced (``"3e-3"``
is text, not a number; ``"false"`` is not a boolean). Each field is the :class:`TrainConfig` field
of the same meaning (:data:`FIELDS`), which the ``shardkit train`` flag of that name sets too.
Relative paths in the file are read from the file's folder.

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> _ = (folder / "job.yaml").write_text("steps: 10\\noptimizer: {name: sgd, lr: 0.1}\\n")
>>> sorted(load_job(folder / "job.yaml").items())
[('lr', 0.1), ('optimizer', 'sgd'), ('steps', 10)]
>>> _ = (folder / "bad.yaml").write_text("optimizer: {lr: 3e-3}\\n")
>>> load_job(folder / "bad.yaml")
Traceback (most recent call last):
    ...
shardkit.training.fields.JobError: job file ...: optimizer.lr must be a number > 0, got str '3e-3' (YAML reads 3e-3 as text: write 3.0e-3 or 0.003)

A problem of the job as a whole is a :class:`JobError` (``shardkit train: ...``); only a file whose
every problem lies in its ``plan`` is a :class:`PlanError` (``shardkit: invalid plan: ...``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..plan import Plan, PlanError, UsageError
from ..plan.dtypes import FLOATING
from ..plan.files import _describe, known_keys, mapping, read_file
from ..plan.loss_scale import check_loss_scale

OPTIMIZERS = ("adamw", "sgd")
BUILDS = ("meta", "full")
#: ``plan: auto`` in a job file, as ``--plan auto``: the planner chooses.
AUTO = "auto"
#: The largest seed: 64 bits, what ``torch.Generator.manual_seed`` (the text data's random windows, sampling)
#: and the sharded data's epoch order take; module initialisation hashes the seed, so any integer works there.
SEED_MAX = 2**64 - 1

Check = Callable[[Any, str, Path], Any]


class JobError(UsageError):
    """A training job that cannot run as written, not a plan: ``problems`` holds one line per problem,
    each naming the job file's field or the flag it came from; the message lists them all.

    >>> str(JobError(["steps must be an integer >= 1", "optimizer.lr must be a number > 0"]))
    '2 problems:\\n  - steps must be an integer >= 1\\n  - optimizer.lr must be a number > 0'
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(self.problems[0] if len(self.problems) == 1 else f"{len(self.problems)} problems:\n{lines}")


def _int(low: int, high: int | None = None, why: str = "") -> Check:
    """An integer >= ``low`` and, with ``high``, <= ``high`` (``why``: what the bound is); never a bool."""
    def check(value: Any, where: str, _: Path) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            bound = "" if high is None else f" and <= {high}{why}"
            raise PlanError(f"{where} must be an integer >= {low}{bound}, got {_describe(value)}")
        return value
    return check


def _number(low: float, *, above: bool, below: float | None = None) -> Check:
    """A number >= ``low`` (``above``: > ``low``) and, with ``below``, < ``below``; never a string."""
    def check(value: Any, where: str, _: Path) -> float:
        valid = f"a number {'>' if above else '>='} {low:g}" + ("" if below is None else f" and < {below:g}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < low or (above and value == low) or (below is not None and value >= below):
            hint = ""
            if isinstance(value, str) and "e" in value.lower():
                hint = f" (YAML reads {value} as text: write {_yaml_float(value)})"
            raise PlanError(f"{where} must be {valid}, got {_describe(value)}{hint}")
        return float(value)
    return check


def _yaml_float(text: str) -> str:
    mantissa, _, exponent = text.lower().partition("e")
    try:
        plain = f"{float(text):g}"
    except ValueError:
        return "a number such as 0.001"
    return f"{mantissa if '.' in mantissa else mantissa + '.0'}e{exponent} or {plain}"


def _choice(valid: tuple[str, ...]) -> Check:
    def check(value: Any, where: str, _: Path) -> str:
        if value not in valid or not isinstance(value, str):
            raise PlanError(f"{where} must be one of {list(valid)}, got {_describe(value)}")
        return value
    return check


def _loss_scale(value: Any, where: str, _: Path) -> str | float:
    """``dynamic``, ``off`` or a positive number (``Plan(loss_scale=...)``; null is not a choice: leave it out)."""
    if value is None:
        raise PlanError(f"{where} must be 'dynamic', 'off' or a positive number, got null (leave it out for the "
                        f"plan's default: 'dynamic' with float16, else off)")
    scale = check_loss_scale(value, where)
    assert scale is not None
    return scale


def _text(value: Any, where: str, _: Path) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PlanError(f"{where} must be a non-empty string, got {_describe(value)}")
    return value


def _path(value: Any, where: str, base: Path) -> Path:
    return base / _text(value, where, base)


def _model(value: Any, where: str, base: Path) -> str:
    """A registered name or builder path as written; a ``.json`` transformers config or a model folder
    (with its ``config.json``) relative to the file."""
    text = _text(value, where, base)
    return str(base / text) if text.endswith(".json") or (base / text).is_dir() else text


def _betas(value: Any, where: str, base: Path) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise PlanError(f"{where} must be a list of two numbers in [0, 1) such as [0.9, 0.95], got {_describe(value)}")
    betas = tuple(_number(0, above=False)(beta, f"{where}[{i}]", base) for i, beta in enumerate(value))
    if any(beta >= 1 for beta in betas):
        raise PlanError(f"{where} must be two numbers in [0, 1) such as [0.9, 0.95], got {value}")
    return betas


def _resume(value: Any, where: str, base: Path) -> Path | bool | None:
    """``true``: the latest checkpoint in ``checkpoint.dir``; ``false``: none; else a folder."""
    if value is True:
        return True
    if value is False:
        return None
    valid = "true (the latest checkpoint in checkpoint.dir), false, or a folder"
    if not isinstance(value, str):
        raise PlanError(f"{where} must be {valid}, got {_describe(value)}")
    if value.lower() in ("true", "false", "yes", "no"):
        raise PlanError(f"{where} must be {valid}, got str {value!r}: write true or false without quotes, "
                        f"or ./{value} for a folder of that name")
    return _path(value, where, base)


def _plan(value: Any, where: str, base: Path) -> Plan | Path | str:
    if value == AUTO:
        return AUTO
    if isinstance(value, str):
        return _path(value, where, base)
    if not isinstance(value, Mapping):
        raise PlanError(f"{where} must be a plan mapping such as {{mesh: {{fsdp: 2}}}}, a plan file, or "
                        f"'{AUTO}', got {_describe(value)}")
    try:
        return Plan.from_dict(value)
    except PlanError as exc:
        raise PlanError([f"{where}: {problem}" for problem in exc.problems]) from None


#: Every field of a job file: ``(section, key)`` (section ``None``: top level) -> the :class:`TrainConfig`
#: field (and ``shardkit train`` flag destination) it sets, and the check of its value.
FIELDS: dict[tuple[str | None, str], tuple[str, Check]] = {
    (None, "model"): ("model", _model),
    (None, "build"): ("build", _choice(BUILDS)),
    (None, "init_from"): ("init_from", _path),
    (None, "steps"): ("steps", _int(1)),
    (None, "seed"): ("seed", _int(0, SEED_MAX, " (2**64 - 1, a 64-bit seed)")),
    (None, "timeout"): ("timeout", _number(0, above=True)),
    (None, "world_size"): ("world_size", _int(1)),
    (None, "plan"): ("plan", _plan),
    (None, "clip_grad_norm"): ("clip_grad_norm", _number(0, above=True)),
    ("data", "folder"): ("data", _path),
    ("data", "seq_len"): ("seq_len", _int(1)),
    ("data", "max_mb"): ("data_mb", _number(0, above=True)),
    ("optimizer", "name"): ("optimizer", _choice(OPTIMIZERS)),
    ("optimizer", "lr"): ("lr", _number(0, above=True)),
    ("optimizer", "betas"): ("betas", _betas),
    ("optimizer", "weight_decay"): ("weight_decay", _number(0, above=False)),
    ("optimizer", "momentum"): ("momentum", _number(0, above=False)),
    ("schedule", "warmup_steps"): ("warmup_steps", _int(0)),
    ("schedule", "min_lr"): ("min_lr", _number(0, above=False)),
    ("batch", "global"): ("batch_size", _int(1)),
    ("batch", "grad_accum"): ("grad_accum", _int(1)),
    ("precision", "param_dtype"): ("param_dtype", _choice(FLOATING)),
    ("precision", "reduce_dtype"): ("reduce_dtype", _choice(FLOATING)),
    ("precision", "loss_scale"): ("loss_scale", _loss_scale),
    ("checkpoint", "dir"): ("save", _path),
    ("checkpoint", "every"): ("save_every", _int(1)),
    ("checkpoint", "keep_last"): ("keep_last", _int(1)),
    ("checkpoint", "resume"): ("resume", _resume),
    ("logging", "log_dir"): ("log_dir", _path),
    ("logging", "every"): ("log_every", _int(1)),
    ("eval", "data"): ("eval_data", _path),
    ("eval", "every"): ("eval_every", _int(1)),
    ("eval", "batches"): ("eval_batches", _int(1)),
    ("eval", "holdout"): ("eval_holdout", _number(0, above=True, below=1)),
}
SECTIONS = tuple(dict.fromkeys(section for section, _ in FIELDS if section is not None))


def load_job(path: str | Path) -> dict[str, Any]:
    """The fields of a job file as :class:`TrainConfig` field names, each checked.

    A :class:`JobError` lists every problem, each naming its field (``optimizer.lr``) and what would
    be valid (a :class:`PlanError` when they all lie in ``plan``). Only the fields the file gives are
    returned (a flag's default is not a field).
    """
    path = Path(path)
    what = f"job file {str(path)!r}"
    try:
        data = mapping(read_file(path, "job"), what, "{model: gpt-tiny, steps: 100, optimizer: {lr: 0.001}}")
        top = [key for section, key in FIELDS if section is None]
        known_keys(data, top + list(SECTIONS), what)
    except PlanError as exc:
        raise JobError(exc.problems) from None
    found: dict[str, Any] = {}
    problems: list[str] = []
    in_plan = True  # every problem lies in the plan field
    for key, value in data.items():
        if key in SECTIONS:
            if value is None:
                problems.append(f"{what}: section {key!r} is empty (null); give its fields or leave it out")
                in_plan = False
                continue
            try:
                section = mapping(value, f"{what}: {key}", _example(key))
                known_keys(section, [k for s, k in FIELDS if s == key], f"{what}: section {key!r}")
            except PlanError as exc:
                problems += exc.problems
                in_plan = False
                continue
            items = [((key, field), f"{key}.{field}", v) for field, v in section.items()]
        else:
            items = [((None, key), key, value)]
        for field, where, given in items:
            dest, check = FIELDS[field]
            try:
                found[dest] = check(given, where, path.parent)
            except PlanError as exc:
                problems += [f"{what}: {problem}" for problem in exc.problems]
                in_plan = in_plan and field == (None, "plan")
    if problems:
        raise PlanError(problems) if in_plan else JobError(problems)
    return found


def _example(section: str) -> str:
    return "{" + ", ".join(f"{key}: ..." for s, key in FIELDS if s == section) + "}"


def field_names() -> dict[str, str]:
    """Each :class:`TrainConfig` field -> its job-file field as written (``schedule.min_lr``)."""
    return {dest: key if section is None else f"{section}.{key}" for (section, key), (dest, _) in FIELDS.items()}


__all__ = ["FIELDS", "SEED_MAX", "JobError", "field_names", "load_job"]
