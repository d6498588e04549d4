"""Stage assignment: which modules of a model form each pipeline stage, checked on the meta device.

A model is first cut into *units*, the pieces a stage boundary may fall between, in
execution order (:func:`model_layout`):

- the reference GPT (``embed`` + ``pos_embed``, ``layers.{i}``, ``norm_f``, ``lm_head``);
- a HuggingFace decoder-only causal LM (``model.embed_tokens``, ``model.layers.{i}``,
  ``model.norm``, ``lm_head``; ``model.rotary_emb`` is recomputed on every stage). Split by
  module lists as torchtitan does: torch's ``pipeline()`` tracer breaks on HF models;
- any other model whose forward is a *chain* of its top-level modules (``nn.Sequential``,
  or ``forward`` passing each child's output straight to the next; ModuleList/Sequential
  children are expanded). The chain and the execution order are checked with forward hooks
  on meta tensors.

:func:`assign_stages` then places units in stages by split points, explicit module lists,
``sk.stage`` scopes, an even split of the blocks, or the automatic split, and checks that
every parameter is in exactly one stage, stages are contiguous, and tied parameters do not
cross stages (they are rejected: nothing would keep the copies equal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..plan import Mesh, PlanError
from ..plan.pipeline import Pipeline
from ..plan.scopes import stage_of
from .autosplit import DeviceModel, SplitResult, UnitCost, auto_split, unit_costs

#: Sequence length used for the example input when the model does not state one.
EXAMPLE_SEQ = 16


@dataclass(frozen=True)
class Unit:
    """A run of modules that always stay together in one stage; ``block`` marks repeated layers."""

    name: str
    modules: tuple[str, ...]
    block: bool = True


@dataclass(frozen=True, eq=False)
class ModelLayout:
    """A model cut into units in execution order; ``kind`` selects the per-stage forward."""

    kind: str
    units: tuple[Unit, ...]
    shared: tuple[str, ...] = ()
    example_inputs: tuple | None = None

    def index(self, name: str) -> int | None:
        for i, unit in enumerate(self.units):
            if unit.name == name or unit.modules[0] == name:
                return i
        return None


def _is_gpt(model: nn.Module) -> bool:
    return all(isinstance(getattr(model, a, None), nn.Module) for a in ("embed", "pos_embed", "norm_f", "lm_head")) \
        and isinstance(getattr(model, "layers", None), nn.ModuleList)


def _is_hf_causal_lm(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return isinstance(getattr(model, "lm_head", None), nn.Module) and isinstance(inner, nn.Module) and all(
        hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) and hasattr(model, "config")


def _chain_units(model: nn.Module) -> list[Unit]:
    units = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            units += [Unit(f"{name}.{i}", (f"{name}.{i}",)) for i, _ in child.named_children()]
        else:
            units.append(Unit(name, (name,)))
    return units


def _guess_input(module: nn.Module) -> tuple | None:
    for leaf in module.modules():
        if isinstance(leaf, nn.Embedding):
            return (torch.zeros(1, EXAMPLE_SEQ, dtype=torch.long),)
        if isinstance(leaf, nn.Linear):
            return (torch.zeros(1, leaf.in_features, dtype=leaf.weight.dtype),)
    return None


def model_layout(model: nn.Module, example_inputs: tuple | None = None) -> ModelLayout:
    """Cut ``model`` into pipeline units (see the module docstring for the families known).

    >>> layout = model_layout(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    >>> layout.kind, [u.name for u in layout.units]
    ('chain', ['0', '1', '2'])
    """
    if _is_gpt(model):
        units = [Unit("embed", ("embed", "pos_embed"), block=False)]
        units += [Unit(f"layers.{i}", (f"layers.{i}",)) for i in range(len(model.layers))]
        units += [Unit("norm_f", ("norm_f",), block=False), Unit("lm_head", ("lm_head",), block=False)]
        seq = getattr(getattr(model, "config", None), "seq_len", None) or model.pos_embed.num_embeddings
        inputs = example_inputs or (torch.zeros(1, seq, dtype=torch.long),)
        return ModelLayout("gpt", tuple(units), (), inputs)
    if _is_hf_causal_lm(model):
        units = [Unit("model.embed_tokens", ("model.embed_tokens",), block=False)]
        units += [Unit(f"model.layers.{i}", (f"model.layers.{i}",)) for i in range(len(model.model.layers))]
        units += [Unit("model.norm", ("model.norm",), block=False), Unit("lm_head", ("lm_head",), block=False)]
        seq = min(128, getattr(model.config, "max_position_embeddings", 128) or 128)
        inputs = example_inputs or (torch.zeros(1, seq, dtype=torch.long),)
        return ModelLayout("hf-causal-lm", tuple(units), ("model.rotary_emb",), inputs)
    units = _chain_units(model)
    if not units:
        raise PlanError(f"{type(model).__name__} has no child modules to place in pipeline stages")
    inputs = example_inputs or _guess_input(model.get_submodule(units[0].modules[0]))
    if inputs is None:
        return ModelLayout("chain", tuple(units), (), None)
    return ModelLayout("chain", _chain_order(model, units, inputs), (), inputs)


def _chain_order(model: nn.Module, units: list[Unit], inputs: tuple) -> tuple[Unit, ...]:
    """Run the forward on meta tensors; return the units in call order after checking it is a chain."""
    from torch.func import functional_call

    calls: list[tuple[int, tuple, dict, Any]] = []
    handles = []
    for index, unit in enumerate(units):
        module = model.get_submodule(unit.modules[0])

        def post(_m: nn.Module, args: tuple, kwargs: dict, out: Any, index: int = index) -> None:
            calls.append((index, args, kwargs, out))

        handles.append(module.register_forward_hook(post, with_kwargs=True))
    tensors = {n: torch.empty_like(t, device="meta") for n, t in
               [*model.named_parameters(), *model.named_buffers()]}
    meta_inputs = tuple(torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    try:
        output = functional_call(model, tensors, meta_inputs)
    except Exception as exc:
        raise PlanError(f"could not run {type(model).__name__}.forward on meta tensors of shapes "
                        f"{[tuple(x.shape) for x in meta_inputs]} to find its execution order ({exc}); pass "
                        f"example_inputs= to assign_stages/model_layout") from None
    finally:
        for handle in handles:
            handle.remove()
    problems = []
    counts = [sum(1 for c in calls if c[0] == i) for i in range(len(units))]
    for unit, count in zip(units, counts):
        if count > 1:
            problems.append(f"module {unit.name!r} runs {count} times in one forward; a pipeline unit must run once "
                            f"(a module reused in two places cannot live in one stage only)")
        if count == 0 and any(True for _ in model.get_submodule(unit.modules[0]).parameters()):
            problems.append(f"module {unit.name!r} has parameters but never runs in forward; remove it from the model")
    expected: Any = meta_inputs
    for position, (index, args, kwargs, out) in enumerate(calls):
        takes_previous = (len(args) == len(expected) and all(a is b for a, b in zip(args, expected)) and not kwargs)
        if not takes_previous:
            source = "the model's inputs" if position == 0 else f"the output of {units[calls[position - 1][0]].name!r}"
            problems.append(f"{type(model).__name__} is not a chain of its modules: {units[index].name!r} does not take "
                            f"{source} as its only input, so the model cannot be cut between them. Pipelines support "
                            f"the shardkit GPT, HF causal LMs and chain models (nn.Sequential-like)")
            break
        expected = (out,)
    if not problems and calls and output is not calls[-1][3]:
        problems.append(f"{type(model).__name__}.forward does more after its last module {units[calls[-1][0]].name!r}; "
                        f"a chain model must return the last module's output")
    if problems:
        raise PlanError(problems)
    order = [c[0] for c in calls] + [i for i, n in enumerate(counts) if n == 0]
    return tuple(units[i] for i in order)


# -- assignment -------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class StageAssignment:
    """Units per stage (indices into ``layout.units``), how they were chosen, and the costs if measured."""

    layout: ModelLayout
    stages: tuple[tuple[int, ...], ...]
    method: str
    costs: tuple[UnitCost, ...] | None = None
    split: SplitResult | None = None
    ranks: tuple[int, ...] = field(default=())

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


def _check_parameters(model: nn.Module, layout: ModelLayout, stage_of_unit: list[int]) -> None:
    owners: dict[int, set[int]] = {}
    for index, unit in enumerate(layout.units):
        for path in unit.modules:
            for p in model.get_submodule(path).parameters():
                owners.setdefault(id(p), set()).add(index)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    problems = []
    for pid, pnames in names.items():
        units = owners.get(pid, set())
        if not units:
            problems.append(f"parameter {pnames[0]!r} is in no pipeline unit ({layout.kind} units: "
                            f"{_listing([u.name for u in layout.units])}); move it into one of those modules")
        stages = sorted({stage_of_unit[u] for u in units})
        if len(stages) > 1:
            problems.append(f"parameter {pnames} is shared by modules in stages {stages} (tied weights); shardkit "
                            f"rejects ties across stages because nothing would keep the copies equal: untie them "
                            f"(e.g. tie_word_embeddings=False) or put the modules in one stage")
    for path in layout.shared:
        if any(True for _ in model.get_submodule(path).parameters()):
            problems.append(f"module {path!r} is recomputed on every stage, so it must hold no parameters")
    if problems:
        raise PlanError(problems)


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
    _check_parameters(model, layout, stage_of_unit)
    grouped = tuple(tuple(i for i, s in enumerate(stage_of_unit) if s == k) for k in range(stages))
    return StageAssignment(layout, grouped, method, costs, split, ranks)


def layout_costs(model: nn.Module, layout: ModelLayout) -> list[UnitCost]:
    """Measured costs of every unit for the layout's example input (one sample)."""
    if layout.example_inputs is None:
        raise PlanError(f"cannot estimate costs of {type(model).__name__}: its input shape is unknown; pass "
                        f"example_inputs= (a tuple of tensors for one micro-batch)")
    return unit_costs(model, [(u.name, u.modules) for u in layout.units], layout.example_inputs)


# -- explain ---------------------------------------------------------------------------------------
def _compress(names: Sequence[str]) -> str:
    """``['layers.0', 'layers.1', 'layers.2', 'norm_f']`` -> ``'layers.0-2, norm_f'``."""
    out: list[str] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if run:
            prefix, first, last = run[0][0] and run[0][0] + ".", run[0][1], run[-1][1]
            out.append(f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}")
            run.clear()

    for name in names:
        prefix, _, tail = name.rpartition(".")
        if tail.isdigit() and run and run[-1][0] == prefix and run[-1][1] + 1 == int(tail):
            run.append((prefix, int(tail)))
            continue
        flush()
        if tail.isdigit():
            run.append((prefix, int(tail)))
        else:
            out.append(name)
    flush()
    return ", ".join(out)


def explain_stages(plan: Any, model: nn.Module, example_inputs: tuple | None = None,
                   device: DeviceModel | None = None, world_size: int | None = None) -> str:
    """A table of the plan's stages: device, modules, parameter bytes, estimated cost; plus the balance.

    Costs are for one sample of the model's example input on :class:`DeviceModel` (a nominal
    device); memory counts 4x parameter bytes plus the activations of the micro-batches held.

    >>> from shardkit.plan import Plan
    >>> seq = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    >>> print(explain_stages(Plan(mesh=Mesh(pp=2), pipeline=Pipeline(schedule="gpipe")), seq))  # doctest: +ELLIPSIS
    pipeline: 2 stages on pp=2, schedule gpipe, 1 micro-batches, stages by even split
    stage  device  modules  params  param bytes  FLOP/sample  est. time  memory
        0       0  0-1         144        576 B  768          19.3 ns    2.3 KiB
        1       1  2-3         144        576 B  768          19.3 ns    2.3 KiB
    balance (slowest / mean stage time): 1.000; ...
    """
    pipeline: Pipeline = plan.pipeline
    if pipeline is None:
        return "no pipeline: every device holds all layers"
    if world_size is not None:
        plan = plan.resolved(world_size)
    elif not plan.mesh.is_resolved:
        raise PlanError(f"{plan.mesh!r} has an inferred (-1) axis; pass world_size= to explain its stages")
    problems = pipeline.check_mesh(plan.mesh)
    if problems:
        raise PlanError(problems)
    device = device or DeviceModel()
    assignment = assign_stages(model, pipeline, plan.mesh, example_inputs, device)
    layout = assignment.layout
    costs = assignment.costs
    if costs is None and layout.example_inputs is not None:
        costs = tuple(layout_costs(model, layout))
    devices = plan.mesh.size_of("pp")
    inflight = inflight_microbatches(pipeline.schedule, pipeline.microbatches, assignment.ranks, devices)
    header = (f"pipeline: {assignment.num_stages} stages on pp={devices}, schedule {pipeline.schedule}, "
              f"{pipeline.microbatches} micro-batches, stages by {_METHOD_TEXT[assignment.method]}")
    rows = [("stage", "device", "modules", "params", "param bytes", "FLOP/sample", "est. time", "memory")]
    times = []
    for s in range(assignment.num_stages):
        params = {id(p): p for path in assignment.modules(s) for p in model.get_submodule(path).parameters()}
        numel = sum(p.numel() for p in params.values())
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
        if costs is not None:
            stage_costs = [costs[i] for i in assignment.stages[s]]
            t = sum(device.time(c) for c in stage_costs)
            mem = sum(4 * c.param_bytes + inflight[s] * c.act_bytes for c in stage_costs)
            times.append(t)
            extra = (_si(3 * sum(c.flops for c in stage_costs)), _seconds(t), _bytes(mem))
        else:
            extra = ("?", "?", "?")
        rows.append((str(s), str(assignment.ranks[s]), _compress(assignment.unit_names(s)), str(numel),
                     _bytes(nbytes), *extra))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [header] + ["  ".join(cell.rjust(w) if c in (0, 1, 3, 4) else cell.ljust(w)
                                  for c, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    if times:
        mean = sum(times) / len(times)
        lines.append(f"balance (slowest / mean stage time): {max(times) / mean if mean else 1.0:.3f}; "
                     f"memory = 4 x param bytes (param, grad, Adam) + activations of the micro-batches held")
    return "\n".join(lines)


def _si(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}" if unit == "" else f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"


def _seconds(t: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"


_METHOD_TEXT = {"split_points": "split points", "stage_modules": "module lists", "even": "even split",
                "auto": "auto split", "scopes": "sk.stage scopes"}


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


__all__ = ["ModelLayout", "StageAssignment", "Unit", "assign_stages", "explain_stages", "inflight_microbatches",
           "layout_costs", "model_layout", "stage_ranks"]
