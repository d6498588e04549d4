"""Stage assignment: which modules of a model form each pipeline stage, checked on the meta device.

A model is first cut into *units*, the pieces a stage boundary may fall between, in
execution order, by its family (:func:`shardkit.families.model_layout`: the reference GPT,
HuggingFace decoder-only causal LMs split by module lists as torchtitan does, since torch's
``pipeline()`` tracer breaks on HF models, and chain models).

:func:`assign_stages` then places units in stages by split points, explicit module lists,
``sk.stage`` scopes, an even split of the blocks, or the automatic split, and checks that
every parameter is in exactly one stage and stages are contiguous. Where a family re-runs a
library's forward piece by piece (transformers causal LMs), the stages are first proven to
compute that forward on a miniature of the model (:mod:`shardkit.planner.pipeline_proof`). A tied parameter whose
names fall in different stages (an embedding tied to the LM head) is recorded as a
:class:`StageTie`: each of those stages holds a copy, which the pipeline runtime keeps equal
(:mod:`shardkit.runtime.pipeline`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from ..families import ModelLayout, model_layout
from ..plan import Mesh, PlanError
from ..plan.pipeline import Pipeline
from ..plan.scopes import stage_of
from .autosplit import DeviceModel, SplitResult, UnitCost, auto_split, unit_costs
from .pipeline_proof import stage_problems


# -- assignment -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageTie:
    """One tied parameter whose ``names`` (the model's first name first) lie in different
    ``stages`` (the stage of each name, in the same order)."""

    names: tuple[str, ...]
    stages: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class StageAssignment:
    """Units per stage (indices into ``layout.units``), how they were chosen, the costs if measured,
    and the tied parameters shared by several stages."""

    layout: ModelLayout
    stages: tuple[tuple[int, ...], ...]
    method: str
    costs: tuple[UnitCost, ...] | None = None
    split: SplitResult | None = None
    ranks: tuple[int, ...] = field(default=())
    ties: tuple[StageTie, ...] = field(default=())

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def unit_names(self, stage: int) -> list[str]:
        return [self.layout.units[i].name for i in self.stages[stage]]

    def modules(self, stage: int) -> list[str]:
        return [m for i in self.stages[stage] for m in self.layout.units[i].modules]

    def local_stages(self, pp_rank: int) -> list[int]:
        """The stages pipeline device ``pp_rank`` runs, in increasing order."""
        return [s for s, r in enumerate(self.ranks) if r == pp_rank]


def stage_ranks(stages: int, devices: int, schedule: str) -> tuple[int, ...]:
    """Pipeline device of every stage: looped (``s % p``), or a V for ``zbv`` (p-1, p-1, ... back to 0).

    >>> stage_ranks(4, 2, "interleaved-1f1b"), stage_ranks(4, 2, "zbv")
    ((0, 1, 0, 1), (0, 1, 1, 0))
    """
    if schedule == "zbv":
        return tuple(s if s < devices else 2 * devices - 1 - s for s in range(stages))
    return tuple(s % devices for s in range(stages))


def inflight_microbatches(schedule: str, microbatches: int, ranks: Sequence[int], devices: int) -> list[int]:
    """Micro-batches whose activations each stage holds at its peak (sequential: the whole batch once).

    1F1B: stage on device ``d`` holds ``min(m, p - d)``; GPipe and the multi-stage schedules are
    bounded by ``m``.
    """
    if schedule == "1f1b":
        return [min(microbatches, devices - d) for d in ranks]
    return [microbatches] * len(ranks)


def _total_stages(pipeline: Pipeline, mesh: Mesh | None) -> int:
    if mesh is not None:
        return pipeline.num_stages(mesh)
    if pipeline.stages is not None:
        return pipeline.stages
    if pipeline.split_points is not None:
        return len(pipeline.split_points) + 1
    if pipeline.stage_modules is not None:
        return len(pipeline.stage_modules)
    raise PlanError("the number of stages is unknown: pass the mesh (its 'pp' axis) or Pipeline(stages=...)")


def _listing(names: Sequence[str], limit: int = 12) -> str:
    names = list(names)
    return str(names) if len(names) <= limit else str(names[:limit - 2] + ["...", names[-1]])


def _by_split_points(layout: ModelLayout, points: Sequence[str]) -> list[int]:
    problems, starts = [], []
    valid = [u.name for u in layout.units[1:]]
    for name in points:
        index = layout.index(name)
        if index is None:
            inside = [u.name for u in layout.units for m in u.modules if name.startswith(m + ".") or name in u.modules]
            if inside:
                problems.append(f"split point {name!r} is inside pipeline unit {inside[0]!r}; a stage can only begin "
                                f"at a unit; valid split points: {_listing(valid)}")
            else:
                problems.append(f"split point {name!r} is not a module of this {layout.kind} model; valid split "
                                f"points: {_listing(valid)}")
        elif index == 0:
            problems.append(f"split point {name!r} is the first unit, so stage 0 would be empty; valid split points: "
                            f"{_listing(valid)}")
        else:
            starts.append(index)
    if not problems and starts != sorted(set(starts)):
        ordered = [layout.units[i].name for i in sorted(set(starts))]
        problems.append(f"split points {list(points)} must be distinct and in execution order; e.g. {ordered}")
    if problems:
        raise PlanError(problems)
    stage_of_unit, stage = [], 0
    for i in range(len(layout.units)):
        if stage < len(starts) and i == starts[stage]:
            stage += 1
        stage_of_unit.append(stage)
    return stage_of_unit


def _by_module_lists(layout: ModelLayout, lists: Sequence[Sequence[str]]) -> list[int]:
    problems: list[str] = []
    module_stage: dict[str, int] = {}
    all_modules = [m for u in layout.units for m in u.modules]
    for stage, names in enumerate(lists):
        for name in names:
            covered = [m for m in all_modules if m == name or m.startswith(name + ".")]
            if not covered:
                inside = [m for m in all_modules if name.startswith(m + ".")]
                problems.append(f"stage_modules[{stage}] names {name!r}, " + (
                    f"which is inside pipeline unit {inside[0]!r}; list whole units" if inside else
                    f"which is not a module of this {layout.kind} model; valid names: "
                    f"{_listing([u.name for u in layout.units])}"))
            for m in covered:
                if m in module_stage and module_stage[m] != stage:
                    problems.append(f"module {m!r} is listed in stages {module_stage[m]} and {stage}; "
                                    f"every module belongs to exactly one stage")
                module_stage[m] = stage
    stage_of_unit = []
    for unit in layout.units:
        stages = {module_stage.get(m) for m in unit.modules}
        if None in stages:
            missing = [m for m in unit.modules if m not in module_stage]
            problems.append(f"module(s) {missing} are in no stage; add them to one of stage_modules")
        elif len(stages) > 1:
            problems.append(f"modules {list(unit.modules)} run together (unit {unit.name!r}) but are listed in stages "
                            f"{sorted(stages)}; put them in one stage")
        stage_of_unit.append(min((s for s in stages if s is not None), default=0))
    if problems:
        raise PlanError(problems)
    return stage_of_unit


def _by_scopes(model: nn.Module, layout: ModelLayout) -> list[int]:
    problems, stage_of_unit, previous = [], [], 0
    for unit in layout.units:
        tags = set()
        for path in unit.modules:
            module = model.get_submodule(path)
            tags |= {stage_of(m) for m in module.modules()} | {stage_of(p) for p in module.parameters()}
        tags.discard(None)
        if len(tags) > 1:
            problems.append(f"module {unit.name!r} holds parts tagged with stages {sorted(tags)}; a stage boundary "
                            f"must fall between pipeline units, so build the whole module in one sk.stage scope")
        elif not tags and any(True for path in unit.modules for _ in model.get_submodule(path).parameters()):
            problems.append(f"module {unit.name!r} has parameters but was built outside any sk.stage(i) scope; "
                            f"wrap its construction in `with sk.stage(i):`")
        previous = min(tags) if tags else previous
        stage_of_unit.append(previous)
    if problems:
        raise PlanError(problems)
    return stage_of_unit


def _even(layout: ModelLayout, stages: int) -> list[int]:
    blocks = [i for i, u in enumerate(layout.units) if u.block]
    if stages > len(blocks):
        raise PlanError(f"pipeline has {stages} stages but the model has only {len(blocks)} blocks "
                        f"({_listing([layout.units[i].name for i in blocks])}); use at most {len(blocks)} stages "
                        f"(pp x virtual_stages) or a model with more layers")
    sizes = [len(blocks) // stages + (1 if s < len(blocks) % stages else 0) for s in range(stages)]
    block_stage = [s for s, n in enumerate(sizes) for _ in range(n)]
    stage_of_unit, seen = [], 0
    for i, unit in enumerate(layout.units):
        if unit.block:
            seen += 1
        stage_of_unit.append(block_stage[max(0, seen - 1)] if seen else 0)
        if not unit.block and i > blocks[-1]:
            stage_of_unit[-1] = stages - 1
    return stage_of_unit


def _check_contiguous(layout: ModelLayout, stage_of_unit: list[int], stages: int, method: str) -> None:
    problems = []
    for i in range(1, len(stage_of_unit)):
        if stage_of_unit[i] < stage_of_unit[i - 1]:
            problems.append(f"stages are not contiguous in execution order: {layout.units[i].name!r} is in stage "
                            f"{stage_of_unit[i]} but runs after {layout.units[i - 1].name!r} in stage "
                            f"{stage_of_unit[i - 1]}; each stage must be a run of consecutive modules")
            break
    used = sorted(set(stage_of_unit))
    if used != list(range(stages)):
        missing = sorted(set(range(stages)) - set(used))
        extra = sorted(set(used) - set(range(stages)))
        problems.append(f"{method} give stages {used} but the pipeline has {stages} (0..{stages - 1})"
                        + (f"; stages {missing} would be empty" if missing else "")
                        + (f"; stages {extra} do not exist" if extra else ""))
    if problems:
        raise PlanError(problems)


def _check_parameters(model: nn.Module, layout: ModelLayout, stage_of_unit: list[int]) -> tuple[StageTie, ...]:
    """Every parameter in a unit, shared modules without parameters; the tied parameters whose
    names lie in different stages."""
    unit_of_module = {path: index for index, unit in enumerate(layout.units) for path in unit.modules}
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    problems, ties = [], []
    for pnames in names.values():
        units = [_unit_of(name, unit_of_module) for name in pnames]
        if any(u is None for u in units):
            problems.append(f"parameter {pnames[units.index(None)]!r} is in no pipeline unit ({layout.kind} units: "
                            f"{_listing([u.name for u in layout.units])}); move it into one of those modules")
            continue
        stages = tuple(stage_of_unit[u] for u in units)
        if len(set(stages)) > 1:
            ties.append(StageTie(tuple(pnames), stages))
    for path in layout.shared:
        if any(True for _ in model.get_submodule(path).parameters()):
            problems.append(f"module {path!r} is recomputed on every stage, so it must hold no parameters")
    if problems:
        raise PlanError(problems)
    return tuple(ties)


def _unit_of(name: str, unit_of_module: dict[str, int]) -> int | None:
    """The unit holding parameter ``name``: that of its longest enclosing unit module."""
    path = name
    while path:
        path = path.rpartition(".")[0]
        if path in unit_of_module:
            return unit_of_module[path]
    return None


def assign_stages(model: nn.Module, pipeline: Pipeline, mesh: Mesh | None = None,
                  example_inputs: tuple | None = None, device: DeviceModel | None = None) -> StageAssignment:
    """Place the units of ``model`` (meta device is fine) in the pipeline's stages, checked.

    Raises :class:`PlanError` naming the module, stage and what would be valid.

    >>> seq = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    >>> a = assign_stages(seq, Pipeline(split_points=["2"], schedule="gpipe"), Mesh(pp=2))
    >>> a.unit_names(0), a.unit_names(1)
    (['0', '1'], ['2', '3'])
    """
    stages = _total_stages(pipeline, mesh)
    layout = model_layout(model, example_inputs)
    problems = stage_problems(model, layout)  # the family's stages compute the model's forward, proven on a miniature
    if problems:
        raise PlanError(problems)
    devices = mesh.size_of("pp") if mesh is not None else max(1, stages // pipeline.virtual_stages)
    ranks = stage_ranks(stages, devices, pipeline.schedule)
    if stages > len(layout.units):
        raise PlanError(f"pipeline has {stages} stages but the model has only {len(layout.units)} pipeline units "
                        f"({_listing([u.name for u in layout.units])}); use at most {len(layout.units)} stages")
    costs, split = None, None
    method = pipeline.method
    if method == "split_points":
        stage_of_unit = _by_split_points(layout, pipeline.split_points or ())
    elif method == "stage_modules":
        stage_of_unit = _by_module_lists(layout, pipeline.stage_modules or ())
    elif method == "scopes":
        stage_of_unit = _by_scopes(model, layout)
    elif method == "even":
        stage_of_unit = _even(layout, stages)
    else:
        costs = tuple(layout_costs(model, layout))
        inflight = inflight_microbatches(pipeline.schedule, pipeline.microbatches, ranks, devices)
        limit = None if pipeline.memory_limit is None else pipeline.memory_limit // pipeline.virtual_stages
        split = auto_split(costs, stages, objective=pipeline.objective, memory_limit=limit, inflight=inflight,
                           device=device)
        stage_of_unit = [s for s, r in enumerate(split.ranges(len(costs))) for _ in r]
    _check_contiguous(layout, stage_of_unit, stages, method.replace("_", " "))
    ties = _check_parameters(model, layout, stage_of_unit)
    grouped = tuple(tuple(i for i, s in enumerate(stage_of_unit) if s == k) for k in range(stages))
    return StageAssignment(layout, grouped, method, costs, split, ranks, ties)


def layout_costs(model: nn.Module, layout: ModelLayout) -> list[UnitCost]:
    """Measured costs of every unit for the layout's example input (one sample)."""
    if layout.example_inputs is None:
        raise PlanError(f"cannot estimate costs of {type(model).__name__}: its input shape is unknown; pass "
                        f"example_inputs= (a tuple of tensors for one micro-batch)")
    return unit_costs(model, [(u.name, u.modules) for u in layout.units], layout.example_inputs)


__all__ = ["StageAssignment", "StageTie", "assign_stages", "inflight_microbatches", "layout_costs", "stage_ranks"]
