"""The plan of a training job: the one place where plan flags (``--plan``, ``--mesh``, ``--rules``,
``--recompute``, ``--zero`` and the pipeline flags, :class:`PlanFlags`) become a :class:`Plan`, for
``shardkit train``, ``explain``, ``plan`` and ``generate`` alike, and where a job's plan gets the
model's rules, its world size, the job's precision section, and its checks that need no model.

>>> from shardkit.models.registry import model_entry
>>> plan, world_size = plan_from_flags(PlanFlags(mesh="fsdp=2"), "gpt-tiny", model_entry("gpt-tiny"))
>>> plan.mesh, plan.rules, world_size
(Mesh(fsdp=2), None, 2)
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..models.registry import ModelEntry, is_builder_path
from ..plan import FSDPOptions, LayoutMap, Mesh, Plan, PlanError
from ..plan.files import read_file
from ..plan.loss_scale import loss_scale_problems
from ..plan.pipeline import pipeline_from_args
from .model import meta_model_from_flag, model_from_flag

if TYPE_CHECKING:
    from .config import TrainConfig

#: The mesh the plan flags give when neither ``--mesh`` nor ``--plan`` is given.
DEFAULT_MESH = "fsdp=2,tp=2"
#: ``--plan auto`` / ``plan: auto``: the planner chooses the plan (``sk.autoshard`` on the calibrated local world).
AUTO_PLAN = "auto"
#: Where a model given by its builder path gets layout rules from.
RULES_HINT = "pass --rules FILE (see docs/your-model.md)"
_NO_RULE = "is used by no layout rule"  # the problem Plan.problems() reports for an unsplit model axis
#: The flags that give a whole plan: either replaces a job file's plan.
WHOLE_PLAN = ("plan", "mesh")
#: The flags that set one option of the plan ``--mesh`` builds -> where that option goes in a plan file.
PLAN_OPTIONS = {"rules": "rules", "recompute": "recompute", "zero": "zero", "schedule": "pipeline.schedule",
                "microbatches": "pipeline.microbatches", "split": "pipeline.split",
                "split_points": "pipeline.split_points"}


@dataclass(frozen=True)
class PlanFlags:
    """A plan as the command line's flags describe it; ``None`` where a flag is not given.

    ``plan`` is a plan file (or ``'auto'``), the whole plan; otherwise ``mesh`` (default
    :data:`DEFAULT_MESH`) with the model's rules (or ``rules``, a rules file) and the options.
    """

    plan: Path | str | None = None
    mesh: str | None = None
    rules: Path | None = None
    recompute: str | None = None
    zero: int | None = None
    schedule: str | None = None
    microbatches: int | None = None
    split: str | None = None
    split_points: tuple[str, ...] | list[str] | None = None

    @classmethod
    def of(cls, values: Mapping[str, Any] | object) -> PlanFlags:
        """The plan flags among ``values`` (a mapping or an ``argparse.Namespace``)."""
        get = values.get if isinstance(values, Mapping) else lambda name: getattr(values, name, None)
        return cls(**{f.name: get(f.name) for f in fields(cls)})

    def given(self) -> dict[str, Any]:
        """The flags given, by destination."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def options(self) -> dict[str, Any]:
        """The options given for the plan ``--mesh`` builds (not ``--plan`` or ``--mesh`` themselves)."""
        return {dest: value for dest, value in self.given().items() if dest in PLAN_OPTIONS}


def flag_text(dest: str, value: object) -> str:
    """A flag as typed: ``--split-points layers.2,layers.4``."""
    return f"--{dest.replace('_', '-')} {','.join(value) if isinstance(value, (list, tuple)) else value}"


def plan_from_flags(flags: PlanFlags, name: str, entry: ModelEntry, world_size: int | None = None) -> tuple[Plan, int]:
    """The resolved plan and world size ``flags`` describe for model ``name`` (not yet checked against it)."""
    if flags.plan is not None:
        given = [flag_text(d, v).split()[0] for d, v in flags.given().items() if d != "plan"]
        if given:
            raise PlanError(f"--plan is a whole plan, so {', '.join(given)} cannot be combined with it; "
                            f"edit the plan file or drop --plan")
        plan = flags.plan if isinstance(flags.plan, Plan) else Plan.load(flags.plan)
    else:
        mesh = parse_mesh_flag(DEFAULT_MESH if flags.mesh is None else flags.mesh)
        rules = model_rules(name, entry, mesh, flags.rules)
        # --zero 2 is FSDP2 kept gathered between forward and backward: the flag asks for exactly that
        fsdp = FSDPOptions(reshard_after_forward=False) if flags.zero == 2 else FSDPOptions()
        plan = Plan(mesh=mesh, rules=rules, recompute=flags.recompute or "none", zero=flags.zero, fsdp=fsdp)
    plan, world_size = resolved(plan, world_size)
    if flags.plan is None:
        pipeline = pipeline_from_args(plan.mesh, flags.schedule, flags.microbatches, flags.split, flags.split_points)
        plan = replace(plan, pipeline=pipeline)
    return plan, world_size


def resolved(plan: Plan, world_size: int | None) -> tuple[Plan, int]:
    """``plan`` with its ``-1`` axis resolved from ``world_size`` (default: the mesh size)."""
    if world_size is None:
        if not plan.mesh.is_resolved:
            raise PlanError(f"{plan.mesh!r} has an inferred (-1) axis; pass --world-size N to infer it")
        world_size = plan.mesh.size
    return plan.resolved(world_size), world_size


def model_rules(name: str, entry: ModelEntry, mesh: Mesh, rules_file: Path | None = None) -> LayoutMap | None:
    """The layout rules of a plan built from a mesh: ``rules_file``, else the model's own (built-in, or
    transformers' tensor-parallel plan, used only when the mesh has their axes), else inferred."""
    if rules_file is not None:
        return load_rules(rules_file)
    return entry.rules_for(mesh) or inferred_rules(name, entry, mesh)


def inferred_rules(name: str, entry: ModelEntry, mesh: Mesh) -> LayoutMap | None:
    """With a ``tp`` axis larger than 1 and no built-in or transformers rules: the rules inferred from
    the model's dataflow (:func:`shardkit.planner.tp_infer.infer_tp_rules`), said on stderr with every
    rule. A ``tp`` axis of size 1 splits nothing and needs no rules."""
    if mesh.size_of("tp") == 1:
        return None
    from ..planner.tp_infer import infer_tp_rules

    try:
        rules = infer_tp_rules(meta_model_from_flag(name, entry))
    except PlanError as exc:
        raise PlanError(f"mesh axis 'tp': model {name!r} has no built-in layout rules and no transformers "
                        f"tensor-parallel plan, and none could be inferred from its dataflow: {exc}; "
                        f"{RULES_HINT}") from None
    print(f"tensor-parallel rules inferred from the model's dataflow: {len(rules)} rules", file=sys.stderr)
    for pattern, layout in rules.items():
        print(f"  {pattern}  {layout}", file=sys.stderr)
    return rules


def parse_mesh_flag(text: str) -> Mesh:
    """``--mesh`` as a Mesh; a problem names the flag."""
    try:
        return Mesh.parse(text)
    except PlanError as exc:
        raise PlanError(f"--mesh: {exc}") from None


def load_rules(file: Path) -> LayoutMap:
    """A layout rule file: a JSON or YAML list of ``[regex, layout]`` pairs, first match wins (read
    strictly, as plan files are: a key given twice is an error)."""
    example = '[["lm_head\\\\.weight", ["tp", null]], [".*", null]]'
    data = read_file(file, "rules")
    if not isinstance(data, list) or not data:
        raise PlanError(f"rules file {str(file)!r} must hold a non-empty list of [regex, layout] pairs, "
                        f"e.g. {example}; got {type(data).__name__}")
    try:
        return LayoutMap.from_list(data)
    except PlanError as exc:
        raise PlanError(f"rules file {str(file)!r}: {exc}") from None


def with_rules_hint(exc: PlanError, flags: PlanFlags | None, name: str) -> PlanError:
    """A model given by its builder path has no built-in rules: when a model axis is then used by no
    rule, the error says where rules come from."""
    if flags is None or flags.plan is not None or flags.rules is not None or not is_builder_path(name):
        return exc
    hint = f"; model {name!r} has no built-in layout rules: {RULES_HINT}"
    return PlanError([p + hint if _NO_RULE in p else p for p in exc.problems])


def job_plan(config: TrainConfig) -> tuple[Plan, int]:
    """The plan and world size of a training job (not yet checked against the model): its plan flags, plan
    file or Plan (a Plan without rules on a mesh with model axes gets the model's rules, as ``--mesh`` does),
    with the job's ``precision`` section as the plan's mixed-precision policy."""
    plan = config.plan
    if plan == AUTO_PLAN or (isinstance(plan, PlanFlags) and plan.plan == AUTO_PLAN):
        raise PlanError(f"plan '{AUTO_PLAN}' is chosen by 'shardkit train --plan auto' on the calibrated local "
                        f"world; in Python give the plan, e.g. sk.autoshard(model, ...)[0].plan")
    entry = model_from_flag(config.model)
    if isinstance(plan, PlanFlags) or plan is None:
        plan, world_size = plan_from_flags(plan or PlanFlags(), config.model, entry, config.world_size)
    else:
        if not isinstance(plan, Plan):
            plan = Plan.load(plan)  # a plan file is the whole plan, as --plan FILE
        elif plan.rules is None and plan.mesh.model_axes:
            rules = model_rules(config.model, entry, plan.mesh)
            plan = plan if rules is None else replace(plan, rules=rules)
        plan, world_size = resolved(plan, config.world_size)
    plan = _with_precision(plan, config)
    if config.profile is not None and plan.pipeline is None:
        raise PlanError(f"--profile records the pipeline timeline (forward/backward per micro-batch and stage), but "
                        f"{plan.mesh!r} has no pipeline; add a 'pp' axis of size >= 2, e.g. --mesh pp=2")
    return plan, world_size


def _with_precision(plan: Plan, config: TrainConfig) -> Plan:
    """The job's ``precision`` section as the plan's mixed-precision policy (``FSDPOptions``) and loss scale
    (``Plan.loss_scale``); a plan that already sets another value is refused, naming both."""
    given = {name: getattr(config, name) for name in ("param_dtype", "reduce_dtype") if getattr(config, name)}
    clashes = [f"precision.{name} is {value!r} but the plan's fsdp.{name} is {getattr(plan.fsdp, name)!r}"
               for name, value in given.items() if getattr(plan.fsdp, name) not in (None, value)]
    scale = config.loss_scale
    if scale is not None and plan.loss_scale not in (None, scale):
        clashes.append(f"{config.name('loss_scale')} is {scale!r} but the plan's loss_scale is {plan.loss_scale!r}")
    if clashes:
        raise PlanError([f"{clash}: give it in one place" for clash in clashes])
    if given:
        plan = replace(plan, fsdp=replace(plan.fsdp, **given))
    plan = plan if scale is None else replace(plan, loss_scale=scale)
    problems = loss_scale_problems(plan.loss_scale, plan.fsdp.param_dtype, plan.fsdp.reduce_dtype)
    if problems:  # at once, before the model is built (sk.validate would say it too, later)
        where = f"{config.named('loss_scale')}: " if scale is not None else ""
        raise PlanError([where + problem for problem in problems])
    return plan


__all__ = ["AUTO_PLAN", "DEFAULT_MESH", "PLAN_OPTIONS", "WHOLE_PLAN", "PlanFlags", "inferred_rules", "job_plan",
           "load_rules", "model_rules", "parse_mesh_flag", "plan_from_flags", "with_rules_hint"]
