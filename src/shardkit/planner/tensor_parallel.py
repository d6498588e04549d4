"""Tensor parallelism planned on the meta device: which torch mechanism each module gets, checked.

For each model axis (``tp`` or a user axis) :func:`plan_axis` reads the layouts and decides,
per module, what :mod:`shardkit.runtime.tensor_parallel` will apply, and refuses before launch
whatever would fail in the workers or compute wrong numbers:

=============================  =====================================================
module and layout               mechanism
=============================  =====================================================
Linear / Conv1D, output dim    ``colwise``: output stays split for a row-parallel partner
                                in the same parent, else all-gathered
Linear / Conv1D, input dim     ``rowwise``: partial outputs all-reduced; the input is taken
                                split from a column-parallel partner, else split locally
Embedding, vocabulary dim       ``vocab``: masked lookup, partial embeddings all-reduced
Embedding, embedding dim        ``embed-colwise``: output all-gathered
anything else                   ``dtensor``: parameters as DTensors, inputs replicated
=============================  =====================================================

What the layouts alone do not say comes from the model: a *packed* projection (several
outputs side by side, cut by ``chunk``/``split``/slicing in the forward, seen by
:mod:`shardkit.planner.dataflow`) is permuted so each rank holds whole parts when the
forward cuts it into equal parts it does not size itself (``chunk``, or a size its family
makes local, GPT-2's ``split_size``), else its output is all-gathered (transformers' own
plans do the same: ``colwise_gather_output``); attention head counts must divide; module
attributes holding head counts become local (the family says which); tied parameters keep
one layout and stay tied.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..families import AttributeChange, Family
from ..families.modules import is_conv1d, is_linear, is_norm, linear_dims
from ..plan import PlanError
from ..plan.layout import ParamLayout, axes_of
from ..plan.mesh import is_model_axis
from .dataflow import Dataflow

COLWISE, ROWWISE, VOCAB, EMBED_COLWISE, DTENSOR = "colwise", "rowwise", "vocab", "embed-colwise", "dtensor"


@dataclass(frozen=True)
class ModuleSplit:
    """How one module is split over an axis.

    ``gather_output``: a column-parallel output is all-gathered (no row-parallel partner, or a
    packed output the forward cuts by offsets). ``replicated_input``: a row-parallel layer takes
    the whole input and splits it locally. ``packed``: a column-parallel weight holds that many
    equal parts side by side, permuted so each rank's contiguous shard holds its slice of each.
    ``placements``: per direct parameter, the dim split over the axis (``None``: replicated).
    ``copy_output``: the forward changes the output in place, so it is handed out as a copy (the
    styles return a view of a DTensor's local tensor, which autograd forbids changing in place).
    """

    name: str
    kind: str
    placements: dict[str, int | None]
    gather_output: bool = False
    replicated_input: bool = False
    packed: int = 1
    copy_output: bool = False


@dataclass(frozen=True)
class AxisPlan:
    """Everything the runtime applies for one model axis, decided and checked before launch.

    ``ties``: every name of each tied parameter split over the axis (the runtime re-ties them
    after torch's styles replaced each module's parameter). With ``sequence_parallel``: norms
    and replicated embeddings run on sequence shards, ``gathers`` are replicated modules
    outside the blocks (output heads) whose input sequence is all-gathered first. Parameters no
    style splits that act on split activations (:mod:`shardkit.planner.split_params`):
    ``summed``, replicated with their gradient summed over the axis; ``sliced``, ``(name, dim)``:
    split with the activation along ``dim``, each rank using its slice. ``routed``: with
    ``sequence_parallel`` and ``ep``, the MoE blocks (parents of the experts modules) that route
    the rank's own part of the sequence (the experts act per token); their other parameters (the
    router) are in ``summed``, each rank's gradient covering its tokens.
    """

    axis: str
    size: int
    splits: dict[str, ModuleSplit]
    changes: tuple[AttributeChange, ...] = ()
    ties: tuple[tuple[str, ...], ...] = ()
    sequence_parallel: bool = False
    norms: tuple[str, ...] = ()
    embeddings: tuple[str, ...] = ()
    gathers: tuple[str, ...] = ()
    summed: tuple[str, ...] = ()
    sliced: tuple[tuple[str, int], ...] = ()
    routed: tuple[str, ...] = ()

    def local_outputs(self) -> set[str]:
        """Column-parallel modules whose output stays split (each rank computes its own part)."""
        return {n for n, s in self.splits.items() if s.kind == COLWISE and not s.gather_output}


def aliases(model: nn.Module) -> dict[str, str]:
    """``{every parameter name: its canonical name}`` (the first, as ``named_parameters()`` lists it)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _direct(module: nn.Module, prefix: str, layouts: dict[str, ParamLayout], canonical: dict[str, str]
            ) -> dict[str, ParamLayout]:
    found = {}
    for pname, _ in module.named_parameters(recurse=False):
        layout = layouts.get(canonical.get(prefix + pname, prefix + pname))
        if layout is not None:
            found[pname] = layout
    return found


def _blocks(model: nn.Module) -> list[str]:
    """Names of the repeated blocks: children of every ModuleList."""
    return [f"{n}.{c}" if n else c for n, m in model.named_modules() if isinstance(m, nn.ModuleList)
            for c, _ in m.named_children()]


def axis_problems(layouts: dict[str, ParamLayout], model: nn.Module) -> list[str]:
    """Layouts that split one parameter (or one module) over two model axes: torch's tensor-parallel
    styles take one 1-D mesh per module, so nested splits are refused (merge the axes into one)."""
    problems = []
    by_module: dict[str, dict[str, str]] = {}
    for name, lay in layouts.items():
        axes = [a for e in (lay.layout or ()) for a in axes_of(e) if is_model_axis(a)]
        if len(axes) > 1:
            problems.append(f"parameter {name!r} is split over model axes {axes} (layout {lay.layout!r}); a tensor "
                            f"is split over one model axis at most: merge them into one axis of size "
                            f"{' x '.join(axes)} or replicate one dim")
        elif axes:
            by_module.setdefault(name.rpartition(".")[0], {})[name] = axes[0]
    for module, params in by_module.items():
        if len(set(params.values())) > 1:
            problems.append(f"module {module or type(model).__name__!r} has parameters split over different model "
                            f"axes ({params}); a module is split over one model axis")
    return problems


def _classify(name: str, module: nn.Module, params: dict[str, ParamLayout], axis: str, sequence_parallel: bool
              ) -> tuple[str | None, list[str]]:
    """(mechanism or None, problems) for one module's direct parameters on ``axis``."""
    using = {p: lay for p, lay in params.items() if lay.axis_dim(axis) is not None}
    if not using:
        return None, []
    weight, bias = params.get("weight"), params.get("bias")
    if is_norm(module):
        return None, [f"norm {name!r} ({type(module).__name__}) has parameters split over {axis!r} "
                      f"({sorted(using)}); a norm normalises over the whole hidden dim, so replicate its "
                      f"parameters (layout None)" + (" (with sequence_parallel=True it runs on sequence shards)"
                                                     if sequence_parallel else "")]
    if is_linear(module) and weight is not None:
        out_dim, _ = linear_dims(module)
        wdim = weight.axis_dim(axis)
        if wdim is None:
            return None, [f"parameter {name}.bias is split over {axis!r} but {name}.weight is not; split the weight "
                          f"too (column-parallel: the output dim) or replicate the bias"]
        kind = COLWISE if wdim == out_dim else ROWWISE
        bdim = None if bias is None else bias.axis_dim(axis)
        if bias is not None and kind == COLWISE and bdim != 0:
            return None, [f"parameter {name}.bias has layout {bias.layout!r} but {name}.weight is column-parallel over "
                          f"{axis!r}; a column-parallel layer's bias is split with its output: use ('{axis}',)"]
        if bias is not None and kind == ROWWISE and bdim is not None:
            return None, [f"parameter {name}.bias has layout {bias.layout!r} but {name}.weight is row-parallel over "
                          f"{axis!r}; a row-parallel layer's bias is added after the all-reduce: use None"]
        return kind, []
    if isinstance(module, nn.Embedding) and weight is not None and weight.axis_dim(axis) is not None:
        return (VOCAB if weight.axis_dim(axis) == 0 else EMBED_COLWISE), []
    if sequence_parallel:
        return None, [f"module {name!r} ({type(module).__name__}) has parameters split over {axis!r} that no "
                      f"tensor-parallel style covers; with sequence_parallel=True only Linear, Embedding and "
                      f"Conv1D are split (norms run on sequence shards)"]
    return DTENSOR, []


def plan_axis(model: nn.Module, layouts: dict[str, ParamLayout], axis: str, size: int, family: Family,
              flow: Dataflow, sequence_parallel: bool = False, experts: tuple[str, ...] = ()) -> AxisPlan:
    """Decide and check every module's mechanism on ``axis``; :class:`PlanError` lists every problem.
    ``experts``: the experts modules ``ep`` splits (their MoE blocks route their own sequence part)."""
    canonical = aliases(model)
    modules = dict(model.named_modules())
    problems: list[str] = []
    kinds: dict[str, str] = {}
    for name, module in modules.items():
        kind, found = _classify(name, module, _direct(module, f"{name}." if name else "", layouts, canonical), axis,
                                sequence_parallel)
        problems += found
        if kind is not None:
            kinds[name] = kind
    fused = family.fused_projections(model)
    packed: dict[str, int] = {}
    gathered: set[str] = set()
    for name, kind in kinds.items():
        if kind != COLWISE:
            continue
        cut = flow.cuts.get(name)
        parts = cut.parts if cut is not None and (cut.kind == "chunk" or (cut.kind == "split" and name in fused)) \
            else fused.get(name)
        if parts:
            width = modules[name].weight.shape[linear_dims(modules[name])[0]]
            if (width // parts) % size:
                problems.append(f"module {name!r} computes {parts} outputs side by side ({width // parts} features "
                                f"each), which do not split over {axis}={size}; valid {axis} sizes divide "
                                f"{width // parts}")
            packed[name] = parts
        elif cut is not None:
            gathered.add(name)  # cut by offsets the code computes from global sizes: compute on the whole output
    parents: dict[str, dict[str, str]] = {}
    for name, kind in kinds.items():
        parents.setdefault(name.rpartition(".")[0], {})[name] = kind
    splits: dict[str, ModuleSplit] = {}
    for name, kind in kinds.items():
        siblings = parents[name.rpartition(".")[0]]
        split_partners = [s for s, k in siblings.items() if k == COLWISE and s not in gathered]
        gather_partners = [s for s, k in siblings.items() if k == COLWISE and s in gathered]
        if kind == ROWWISE and split_partners and gather_partners:
            problems.append(f"row-parallel {name!r} sits beside column-parallel layers whose outputs stay split "
                            f"({split_partners}) and ones gathered because the forward cuts them ({gather_partners}); "
                            f"shardkit cannot tell which one feeds it: replicate one group (layout None)")
        placements = {p: lay.axis_dim(axis) for p, lay in
                      _direct(modules[name], f"{name}." if name else "", layouts, canonical).items()}
        splits[name] = ModuleSplit(
            name, kind, placements,
            gather_output=kind == COLWISE and (name in gathered or ROWWISE not in siblings.values()),
            replicated_input=kind == ROWWISE and not split_partners,
            packed=packed.get(name, 1),
            copy_output=name in flow.modified)
    local = AxisPlan(axis, size, splits).local_outputs()
    attentions = family.attentions(model)
    split_attentions = [a for a in attentions if any(m.startswith(f"{a.name}." if a.name else "") for m in local)]
    problems += head_count_problems(split_attentions, size, axis)
    ties = _ties(model, layouts, canonical, axis)
    problems += _tie_problems(ties, kinds, axis)
    changes = tuple(family.tensor_parallel_changes(model, local, size))
    extras: dict[str, tuple[str, ...]] = {}
    if sequence_parallel:
        found_extras, found = _sequence_parallel(model, splits, [a.name for a in attentions], experts)
        extras.update(found_extras)
        problems += found
    if problems:
        raise PlanError(problems)
    return AxisPlan(axis, size, splits, changes, ties, sequence_parallel, **extras)


def head_count_problems(attentions: Iterable, size: int, axis: str = "tp") -> list[str]:
    """One line per distinct attention shape whose head counts ``size`` does not divide."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for attention in attentions:
        shapes.setdefault((attention.heads, attention.kv_heads), []).append(attention.name)
    problems = []
    for (heads, kv_heads), names in shapes.items():
        if heads % size or kv_heads % size:
            common = math.gcd(heads, kv_heads)
            valid = [d for d in range(1, common + 1) if common % d == 0]
            what = f"{heads} heads" if heads == kv_heads else f"{heads} query heads and {kv_heads} key/value heads"
            more = f" (and {len(names) - 1} more like it)" if len(names) > 1 else ""
            problems.append(f"tensor parallel {axis}={size}: attention {names[0]!r}{more} has {what}, but each "
                            f"rank must hold whole heads; valid {axis} sizes: {valid}")
    return problems


def tensor_parallel_problems(model: nn.Module, tp_size: int) -> list[str]:
    """Head counts ``tp_size`` breaks in any attention of ``model`` (its family says where they are).

    >>> from shardkit.models.gpt import GPT, GPTConfig
    >>> print(tensor_parallel_problems(GPT(GPTConfig(layers=1, heads=4)), 3)[0])
    tensor parallel tp=3: attention 'layers.0.attn' has 4 heads, but each rank must hold whole heads; valid tp sizes: [1, 2, 4]
    """
    from ..families import family_of

    if tp_size < 1:
        raise PlanError(f"tensor parallel size {tp_size} must be >= 1")
    return head_count_problems(family_of(model).attentions(model), tp_size)


def _ties(model: nn.Module, layouts: dict[str, ParamLayout], canonical: dict[str, str], axis: str
          ) -> tuple[tuple[str, ...], ...]:
    groups: dict[str, list[str]] = {}
    for name, first in canonical.items():
        groups.setdefault(first, []).append(name)
    return tuple(tuple(names) for first, names in groups.items()
                 if len(names) > 1 and first in layouts and layouts[first].axis_dim(axis) is not None)


def _tie_problems(ties: tuple[tuple[str, ...], ...], kinds: dict[str, str], axis: str) -> list[str]:
    """A split parameter held by two modules is re-tied after torch's styles only when each holder is
    split by a style of its own (an embedding and a head): a holder whose parameters become plain
    DTensors would distribute it first, and the style of the other then fails in the workers."""
    problems = []
    for names in ties:
        holders = {n.rpartition(".")[0]: kinds.get(n.rpartition(".")[0]) for n in names}
        odd = [h for h, kind in holders.items() if kind not in (COLWISE, ROWWISE, VOCAB, EMBED_COLWISE)]
        if odd:
            problems.append(f"parameter {names[0]!r} is also {', '.join(map(repr, names[1:]))}: split over {axis!r} it "
                            f"would be distributed once per module holding it, and {', '.join(map(repr, odd))} "
                            f"is not split by a tensor-parallel style of its own; keep it replicated (layout None)")
    return problems


def _routed(model: nn.Module, splits: dict[str, ModuleSplit], experts: tuple[str, ...]
            ) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """The MoE blocks holding ``experts``, which route the rank's own part of the sequence, and their
    parameters outside the experts (summed over the axis); a block with a split layer is refused."""
    blocks = tuple(dict.fromkeys(e.rpartition(".")[0] for e in experts))
    summed, problems = [], []
    for block in blocks:
        prefix = f"{block}." if block else ""
        split = [n for n in splits if n == block or n.startswith(prefix)]
        if split:
            problems.append(f"MoE block {block!r} routes each rank's own part of the sequence under "
                            f"sequence_parallel=True with 'ep', but its {split} are split over the tensor-parallel "
                            f"axis (a shared expert?); give them layout None, or use sequence_parallel=False")
        summed += [prefix + p for p, _ in model.get_submodule(block).named_parameters()
                   if not any((prefix + p).startswith(e + ".") for e in experts)]
    return {"routed": blocks, "summed": tuple(summed)}, problems


def _sequence_parallel(model: nn.Module, splits: dict[str, ModuleSplit], attentions: list[str],
                       experts: tuple[str, ...] = ()) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """Norms and embeddings on sequence shards; replicated heads gathered; replicated layers in blocks refused;
    the MoE blocks of ``experts`` on each rank's own part of the sequence (:func:`_routed`).

    A norm inside an attention (Qwen 3's ``q_norm``/``k_norm``, over each head) runs on the rank's own
    heads after the column-parallel projections, not on the residual stream: it is left as it is (its
    gradient is summed: :mod:`shardkit.planner.split_params`)."""
    blocks = _blocks(model)
    extras, problems = _routed(model, splits, experts)
    moe = tuple(f"{b}." if b else "" for b in extras["routed"])
    norms, embeddings, gathers = [], [], []
    for name, module in model.named_modules():
        if name in splits or not name or name in extras["routed"] or name.startswith(moe):
            continue
        inside = next((b for b in blocks if name == b or name.startswith(b + ".")), None)
        if is_norm(module):
            if not any(name.startswith(a + ".") for a in attentions):
                norms.append(name)
        elif isinstance(module, nn.Embedding):
            embeddings.append(name)
        elif is_linear(module) or is_conv1d(module):
            if inside is not None:
                problems.append(f"module {name!r} ({type(module).__name__}) inside block {inside!r} is replicated, but "
                                f"sequence_parallel=True keeps the residual stream split along the sequence between "
                                f"tensor-parallel layers; split it (column- or row-parallel) like the block's other "
                                f"projections, or drop sequence_parallel")
            else:
                gathers.append(name)
    return {"norms": tuple(norms), "embeddings": tuple(embeddings), "gathers": tuple(gathers), **extras}, problems


def shared_input_scopes(plan: AxisPlan) -> dict[str, tuple[str, ...]]:
    """The column-parallel modules that share the conversion of a tensor they read, by the module they run
    in (their parent: q, k and v in their attention, gate and up in their MLP). In one call of the parent,
    a tensor its column-parallel modules read is converted once, by the first (under Megatron SP one
    all-gather, without SP one DTensor whose summed gradient is reduced once): torch's ``ColwiseParallel``
    converts per module. Modules under different parents convert their input each.

    >>> splits = {n: ModuleSplit(n, COLWISE, {"weight": 0}) for n in ("attn.q_proj", "attn.k_proj", "head")}
    >>> shared_input_scopes(AxisPlan("tp", 2, splits))
    {'attn': ('attn.q_proj', 'attn.k_proj'), '': ('head',)}
    """
    scopes: dict[str, list[str]] = {}
    for name, split in plan.splits.items():
        if split.kind == COLWISE:
            scopes.setdefault(name.rpartition(".")[0], []).append(name)
    return {parent: tuple(names) for parent, names in scopes.items()}


class InputScope:
    """The last tensor the column-parallel modules of one parent call converted, and what it became
    (:func:`shared_input_scopes`): :meth:`get` hands it to a later module given the same tensor,
    unchanged (its version), else ``None``. Emptied when the parent's forward ends: the conversion of a
    replicated input is a view of it, so keeping it on the tensor itself would make a cycle only the
    garbage collector frees.

    >>> import torch
    >>> scope, x = InputScope(), torch.zeros(2)
    >>> scope.keep(x, "converted"); scope.get(x), scope.get(torch.zeros(2))
    ('converted', None)
    >>> _ = x.add_(1)  # changed in place: its version moves on
    >>> scope.get(x) is None
    True
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self, *_hook_args: object) -> None:
        self._source: object = None
        self._version = -1
        self._value: object = None

    def get(self, tensor: Any) -> Any:
        return self._value if tensor is self._source and tensor._version == self._version else None

    def keep(self, tensor: Any, value: Any) -> None:
        self._source, self._version, self._value = tensor, tensor._version, value


def input_scopes(modules: Mapping[str, nn.Module], plan: AxisPlan) -> tuple[dict[str, InputScope], list[Any]]:
    """Per column-parallel module of ``plan`` among ``modules``, its parent's :class:`InputScope`, emptied by
    a forward hook on the parent (returned, with ``always_call``); a parent missing from ``modules`` (a
    pipeline stage without it) gives its modules none: each converts its own input."""
    scopes: dict[str, InputScope] = {}
    handles = []
    for parent, names in shared_input_scopes(plan).items():
        if parent in modules and all(name in modules for name in names):
            scope = InputScope()
            scopes.update(dict.fromkeys(names, scope))
            handles.append(modules[parent].register_forward_hook(scope.clear, always_call=True))
    return scopes, handles


__all__ = ["AxisPlan", "InputScope", "ModuleSplit", "aliases", "axis_problems", "head_count_problems",
           "input_scopes", "plan_axis", "shared_input_scopes", "tensor_parallel_problems"]
