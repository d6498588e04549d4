"""Explain a plan before launch: per parameter, what each device holds and how many bytes.

Works on a model built on the meta device (no memory, no processes). Per parameter: the
rule that matched, its layout, the torch mechanism it becomes (inferred from the module
type), the local shape after the layout's model axes (``tp`` ...) and after FSDP, and the
bytes one device holds. FSDP2 (``fully_shard``) shards dim 0 of the tensor-parallel-local
tensor (or the dim a layout gives to ``fsdp``) over the ``fsdp`` axis (times ``sp`` when
both are used, as ``runtime.parallelize`` does), padding an uneven dim: a device holds
``ceil(dim0 / fsdp)`` rows.

>>> from shardkit.models.gpt import GPT_RULES, build_tiny_gpt
>>> from shardkit.planner.meta import meta_model
>>> from shardkit.plan import Mesh, Plan
>>> text = explain_plan(Plan(Mesh(fsdp=2, tp=2), GPT_RULES), meta_model(build_tiny_gpt))
>>> "layers.{0..1}.attn.q_proj.weight" in text
True
"""

from __future__ import annotations

import io
import math
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.table import Table
from torch import nn

from ..plan import Mesh, Plan, PlanWarning
from ..plan.layout import ParamLayout, axes_of
from ..plan.mesh import axis_role
from ..plan.text import format_bytes
from .batch_stats import BatchStats, batch_stats_lines
from .expert_costs import expert_shard_dim
from .experts import ExpertsLayer
from .hardware import Hardware
from .model_checks import ModelFacts
from .tensor_parallel import COLWISE, ROWWISE, aliases
from .validate import validate

FSDP_AXIS = "fsdp"
_TABLE_STYLE: dict[str, Any] = dict(box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, show_edge=False)


@dataclass(frozen=True)
class ParamRow:
    """What one device holds of one parameter."""

    layout: ParamLayout
    mechanism: str
    local: tuple[int, ...]  # after the layout axes (tp, ...)
    sharded: tuple[int, ...]  # after FSDP as well: what a device stores
    itemsize: int
    #: what validate found that the layout does not show: "packed xN" (its parts permuted rank-major),
    #: "gathered" (a column-parallel output all-gathered), "splits input" (a row-parallel layer taking
    #: the whole input), "tied to NAME"
    note: str = ""

    @property
    def bytes(self) -> int:
        return math.prod(self.sharded) * self.itemsize


def explain_plan(plan: Plan, model: Any, world_size: int | None = None, *, width: int = 180,
                 batch_size: int | None = None, seq_len: int | None = None) -> str:
    """Validate ``plan`` against ``model`` and describe, as plain text, what every device holds.

    Raises :class:`~shardkit.plan.PlanError` for a bad plan: every problem
    :func:`~shardkit.planner.validate.validate` finds.
    Identical rows of repeated layers are shown once, e.g. ``layers.{0..79}.mlp.up_proj.weight x80``.
    With ``ep``, which experts each rank holds and every MoE layer's all-to-all for ``batch_size``
    sequences of ``seq_len`` tokens (:mod:`shardkit.planner.explain_experts`).
    """
    mesh, rows, unused, experts, stats = _analyse(plan, model, world_size)
    console = Console(record=True, width=width, file=io.StringIO(), color_system=None, markup=False, highlight=False)
    total = sum(math.prod(r.layout.shape) for r in rows)
    what = type(model).__name__ if isinstance(model, nn.Module) else "parameter shapes"
    console.print(f"Plan for {what}: {len(rows)} parameter tensors, {total:,} parameters "
                  f"({format_bytes(sum(math.prod(r.layout.shape) * r.itemsize for r in rows), digits=2)}) on {mesh.size} devices\n")
    console.print(_mesh_table(mesh))
    console.print(_options_line(plan, mesh) + "\n")
    if plan.rules is not None:
        console.print(_rules_table(plan, rows), "")
    console.print(_param_table(rows), "")
    for line in _totals(mesh, rows):
        console.print(line)
    if isinstance(model, nn.Module):
        for line in batch_stats_lines(plan.resolved(mesh.size), model, stats=stats):
            console.print(line)
    for index, pattern in unused:
        console.print(f"unused rule #{index} {pattern!r} matches no parameter (a typo or a renamed module?)")
    if experts and mesh.size_of("ep") > 1:
        from .explain_experts import explain_experts

        console.print("\n" + explain_experts(plan.resolved(mesh.size), model, experts, batch_size=batch_size,
                                               seq_len=seq_len))
    if plan.pipeline is not None and isinstance(model, nn.Module):
        from .explain_stages import explain_stages

        console.print("\n" + explain_stages(plan, model, world_size=mesh.size))
    if plan.replicas is not None:
        from ..plan.replicas import grouping_table

        console.print("\nReplica groups (dp axis):\n" + grouping_table(plan.replicas))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def estimate_memory(plan: Plan, model: Any, world_size: int | None = None, *, batch_size: int | None = None,
                    seq_len: int | None = None, hardware: str | Hardware = "h100-80g",
                    optimizer: str = "adamw") -> dict[str, int]:
    """Bytes per device of training ``model`` under ``plan``, by component and ``total``: the memory
    of :func:`~shardkit.planner.estimate.estimate` (shardkit's one model of memory,
    :mod:`shardkit.planner.memory`, which states every term), for ``batch_size`` sequences of
    ``seq_len`` tokens (default: the smallest batch the plan takes, one sequence per data replica
    and micro-batch, of the model's positions) on ``hardware``.

    >>> from shardkit.models.gpt import GPT_RULES, build_tiny_gpt
    >>> from shardkit.plan import Mesh, Plan
    >>> memory = estimate_memory(Plan(Mesh(tp=2), GPT_RULES), build_tiny_gpt())
    >>> memory["optimizer"] == 2 * memory["parameters"], memory["total"] <= sum(v for k, v in memory.items() if k != "total")
    (True, True)
    """
    from .analysis import analyse
    from .estimate import estimate, priced_plan

    plan = priced_plan(plan, world_size, "estimate_memory")
    if batch_size is None:
        batch_size = plan.mesh.data_size * (plan.pipeline.microbatches if plan.pipeline is not None else 1)
    if seq_len is None:
        seq_len = analyse(model).seq_len
    return dict(estimate(model, plan, batch_size=batch_size, seq_len=seq_len, hardware=hardware,
                         optimizer=optimizer).memory)


# -- analysis ---------------------------------------------------------------------------------

def _analyse(plan: Plan, model: Any, world_size: int | None) -> tuple[
        Mesh, list[ParamRow], list[tuple[int, str]], list[ExpertsLayer], BatchStats | None]:
    with warnings.catch_warnings():  # unused rules are reported in the text instead
        warnings.simplefilter("ignore", PlanWarning)
        report = validate(plan, model, world_size=world_size)
    mesh = report.mesh
    layouts = report.layouts.params
    dtypes = _dtypes(model)
    mechanisms = _mechanisms(model, layouts)
    notes = _notes(model, report.facts)
    shards = _fsdp_shards(mesh)
    sliced = {name: (plan_axis, dim) for plan_axis in (report.facts.tensor_parallel.values() if report.facts else ())
              for name, dim in plan_axis.sliced}
    layers = list(report.facts.experts) if report.facts else []
    experts = {f"{layer.name}.{p}" for layer in layers for p in layer.params}
    rows = []
    for name, layout in layouts.items():
        if name in sliced:  # split with the activations it acts on, whatever its layout says
            axis, dim = sliced[name]
            layout = replace(layout, layout=tuple(axis.axis if d == dim else None for d in range(len(layout.shape))))
            mechanisms[name] = "sliced"
        if name in experts:  # ep splits dim 0 (runtime/expert_parallel.py); FSDP then shards over the rest
            expert_shards = shards // mesh.size_of("ep") if shards > 1 else 1
            local, sharded = _local_shapes(layout, mesh, expert_shards, mesh.size_of("ep"))
            mechanisms[name] = f"experts over ep ({mesh.size_of('ep')})"
        else:
            local, sharded = _local_shapes(layout, mesh, shards)
        rows.append(ParamRow(layout, mechanisms.get(name, _split_name(layout)), local, sharded,
                             dtypes.get(name, torch.float32).itemsize, notes.get(name, "")))
    patterns = list(plan.rules) if plan.rules is not None else []
    unused = [(patterns.index(p), p) for p in report.layouts.unused_rules]
    return mesh, rows, unused, layers, report.batch_stats


def _notes(model: Any, facts: ModelFacts | None) -> dict[str, str]:
    """Per parameter, what validate found that the layout does not show."""
    found: dict[str, list[str]] = {}
    for plan in (facts.tensor_parallel.values() if facts is not None else ()):
        for name, split in plan.splits.items():
            text = []
            if split.packed > 1:
                text.append(f"packed x{split.packed}")
            if split.kind == COLWISE and split.gather_output:
                text.append("gathered")
            if split.kind == ROWWISE and split.replicated_input:
                text.append("splits input")
            for pname in split.placements:
                found.setdefault(f"{name}.{pname}" if name else pname, []).extend(text)
        for name in plan.summed:  # on split activations: planner/split_params.py
            found.setdefault(name, []).append(f"gradient summed over {plan.axis} (used whole on split activations)")
        for name, dim in plan.sliced:
            found.setdefault(name, []).append(f"sliced over {plan.axis} on dim {dim} with the split activations")
    for conv in (facts.causal_convs if facts is not None else ()):  # context parallel: runtime/halo.py
        found.setdefault(conv.weight, []).append(f"causal conv: {conv.padding} positions from the previous sp chunk")
    if isinstance(model, nn.Module):
        for alias, first in aliases(model).items():
            if alias != first:
                found.setdefault(first, []).append(f"tied to {alias}")
    return {name: "; ".join(text) for name, text in found.items() if text}


def _fsdp_shards(mesh: Mesh) -> int:
    """Ways FSDP2 shards a parameter: ``fsdp``, times ``sp`` and ``ep`` when used (runtime.meshes joins them)."""
    fsdp = mesh.size_of(FSDP_AXIS)
    return fsdp * mesh.size_of("sp") * mesh.size_of("ep") if fsdp > 1 else 1


def _local_shapes(layout: ParamLayout, mesh: Mesh, shards: int,
                  experts_split: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape after the model axes of the layout (and ``ep``'s split of dim 0 for an expert
    parameter: ``experts_split``), shape after FSDP as well).

    FSDP shards the dim the layout gives to ``fsdp`` (dim 0 by default; an expert's:
    :func:`~shardkit.planner.expert_costs.expert_shard_dim`), padded: ceil.
    """
    entries = layout.layout or (None,) * len(layout.shape)
    local = tuple(size // math.prod(mesh.size_of(a) for a in axes_of(entry) if a != FSDP_AXIS)
                  for size, entry in zip(layout.shape, entries))
    if local:
        local = (local[0] // experts_split, *local[1:])
    if shards == 1 or not local:
        return local, local
    # an expert parameter: the dim the runtime's fully_shard of its experts module shards
    dim = expert_shard_dim(local, shards) if experts_split > 1 else layout.axis_dim(FSDP_AXIS) or 0
    sharded = list(local)
    sharded[dim] = -(-local[dim] // shards)
    return local, tuple(sharded)


def _dtypes(model: Any) -> dict[str, torch.dtype]:
    if isinstance(model, nn.Module):
        return {n: p.dtype for n, p in model.named_parameters()}
    return {}


def _split_dims(layout: ParamLayout) -> set[int]:
    """Dims split over a model axis (tp or a user axis; fsdp is data parallelism, shown apart)."""
    return {dim for dim, entry in enumerate(layout.layout or ()) if set(axes_of(entry)) - {FSDP_AXIS}}


def _split_name(layout: ParamLayout) -> str:
    return "sharded" if _split_dims(layout) else "replicated"


def _mechanisms(model: Any, layouts: Mapping[str, ParamLayout]) -> dict[str, str]:
    """Per parameter, the torch mechanism its layout becomes, judged from the owning module's weight."""
    if not isinstance(model, nn.Module):
        return {}
    found = {}
    for name, layout in layouts.items():
        if not _split_dims(layout):
            found[name] = "replicated"
            continue
        owner, _, _ = name.rpartition(".")
        module = model.get_submodule(owner)
        weight = layouts.get(f"{owner}.weight" if owner else "weight", layout)
        found[name] = _module_mechanism(module, _split_dims(weight))
    return found


def _module_mechanism(module: nn.Module, weight_dims: set[int]) -> str:
    if isinstance(module, nn.Linear):  # weight [out, in]
        return {frozenset({0}): "colwise", frozenset({1}): "rowwise"}.get(frozenset(weight_dims), "sharded")
    if isinstance(module, nn.Embedding):  # weight [vocab, dim]
        return {frozenset({0}): "vocab-parallel", frozenset({1}): "colwise (embedding dim)"}.get(
            frozenset(weight_dims), "sharded")
    if type(module).__name__ == "Conv1D":  # transformers' Conv1D, weight [in, out]
        return {frozenset({1}): "colwise (Conv1D)", frozenset({0}): "rowwise (Conv1D)"}.get(
            frozenset(weight_dims), "sharded")
    return "sharded"


# -- rendering --------------------------------------------------------------------------------

def _mesh_table(mesh: Mesh) -> Table:
    table = Table("axis", "size", "role", title="mesh", **_TABLE_STYLE)
    for axis, size in mesh.items():
        table.add_row(axis, str(size), axis_role(axis))
    return table


def _options_line(plan: Plan, mesh: Mesh) -> str:
    fsdp = plan.fsdp
    stage = f" (zero={plan.zero}'s)" if plan.zero is not None and not fsdp.written else ""
    parts = [f"fsdp options: reshard_after_forward={fsdp.reshard_after_forward}{stage}, param_dtype={fsdp.param_dtype}, "
             f"reduce_dtype={fsdp.reduce_dtype}", f"sequence_parallel={plan.sequence_parallel}",
             f"recompute={plan.recompute}"] + ([f"zero={plan.zero}"] if plan.zero is not None else [])
    if plan.pipeline is not None:
        parts.append(f"pipeline: {plan.pipeline.to_dict()}")
    if plan.replicas is not None:
        parts.append(f"replicas: {plan.replicas.to_dict()}")
    if mesh.size_of("dp") > 1:
        parts.append(f"parameters are replicated over dp={mesh['dp']}")
    return "; ".join(parts)


def _rules_table(plan: Plan, rows: list[ParamRow]) -> Table:
    table = Table("rule", "pattern", "layout", "matches", title="layout rules (first match wins)",
                  **_TABLE_STYLE)
    matches: dict[int, int] = {}
    for row in rows:
        if row.layout.rule is not None:
            matches[row.layout.rule] = matches.get(row.layout.rule, 0) + 1
    for index, (pattern, layout) in enumerate((plan.rules or {}).items()):
        table.add_row(f"#{index}", pattern, _layout(layout), str(matches.get(index, 0)))
    return table


def _param_table(rows: list[ParamRow]) -> Table:
    table = Table(title="parameters (what one device holds)", **_TABLE_STYLE)
    groups = list(_group(rows))
    # names stay whole; the notes (the last column) fold when the table is too wide
    table.add_column("parameter", overflow="fold", min_width=max((len(label) for label, _ in groups), default=9))
    for header in ("count", "shape", "rule", "layout", "mechanism", "after layout", "after fsdp", "bytes/device"):
        table.add_column(header, justify="right" if header == "bytes/device" else "left", no_wrap=True)
    table.add_column("notes", overflow="fold")
    for label, members in groups:
        row = members[0]
        p = row.layout
        table.add_row(label, f"x{len(members)}", _shape(p.shape), "-" if p.rule is None else f"#{p.rule}",
                      _layout(p.layout), row.mechanism, _shape(row.local), _shape(row.sharded), f"{row.bytes:,}",
                      _numbered(row.note, members))
    return table


def _totals(mesh: Mesh, rows: list[ParamRow]) -> list[str]:
    """The parameter bytes the table shows, summed; memory per device in training is the estimate's
    (``sk.estimate``, printed after this by ``shardkit explain``), one model of it for every command."""
    total = sum(math.prod(r.layout.shape) * r.itemsize for r in rows)
    per_device = sum(r.bytes for r in rows)
    ideal = total / mesh.size
    ratio = per_device / ideal if ideal else 1.0
    lines = [f"parameter bytes per device: {per_device:,} B ({format_bytes(per_device, digits=2)}); "
             f"total / {mesh.size} devices = {ideal:,.0f} B ({format_bytes(ideal, digits=2)}); ratio {ratio:.2f}x"]
    if mesh.size_of("pp") > 1:
        lines.append(f"pp={mesh['pp']}: a device holds only its pipeline stage, so this is an upper bound")
    return lines


def _group(rows: list[ParamRow]) -> Iterable[tuple[str, list[ParamRow]]]:
    """Rows that differ only in layer numbers, as ``(label with {a..b}, members)`` in first-seen order."""
    groups: dict[tuple[Any, ...], list[tuple[tuple[int, ...], ParamRow]]] = {}
    for row in rows:
        parts = row.layout.name.split(".")
        template = tuple("{}" if part.isdigit() else part for part in parts)
        numbers = tuple(int(part) for part in parts if part.isdigit())
        key = (template, row.layout.shape, row.layout.rule, row.layout.layout, row.mechanism, row.local,
               row.sharded, row.itemsize, re.sub(r"\.\d+\.", ".{}.", row.note))
        groups.setdefault(key, []).append((numbers, row))
    for key, members in groups.items():
        if len(members) == 1:
            yield members[0][1].layout.name, [members[0][1]]
            continue
        template = ".".join(key[0])
        slots = [_numbers_text(sorted({numbers[i] for numbers, _ in members})) for i in range(len(members[0][0]))]
        yield template.format(*slots), [row for _, row in members]


def _numbered(note: str, members: list[ParamRow]) -> str:
    """A grouped row's note, with its layer numbers as ``{}`` when the members' notes differ only there."""
    return note if len(members) == 1 else re.sub(r"\.\d+\.", ".{}.", note)


def _numbers_text(values: list[int]) -> str:
    if len(values) == 1:
        return str(values[0])
    if values == list(range(values[0], values[-1] + 1)):
        return f"{{{values[0]}..{values[-1]}}}"
    return "{" + ",".join(map(str, values)) + "}"


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _layout(layout: Any) -> str:
    if layout is None:
        return "None"
    entries = ["None" if e is None else e if isinstance(e, str) else "(" + ", ".join(e) + ")" for e in layout]
    return "(" + ", ".join(entries) + ("," if len(entries) == 1 else "") + ")"


