"""Tensor-parallel layout rules inferred from a model's dataflow (``sk.infer_tp_rules``).

For models whose library ships no tensor-parallel plan (GPT-2, BERT, a hand-written
``nn.Module``), one forward on the meta device (no memory, no compute) shows which layers can
be split Megatron-style. Every tensor carries what it is computed from: the linear layers
(``nn.Linear`` or transformers' ``Conv1D``) whose output it derives from without passing
through another linear layer and which of its dims holds those layers' split features, the
parameters of other modules (norms) it met, and whether it comes from the model's input ids.
Then:

- a linear layer ``A`` is *column-parallel* and ``B`` *row-parallel* when everything computed
  from ``A``'s output goes only through ops known to keep the features ``A``'s split would
  cut apart (:func:`~shardkit.planner.split_ops.follow_split`: elementwise ops, reshapes,
  chunks and slices, reductions and norms over other dims, attention between whole heads;
  not a norm, softmax or sum over those features, nor a matmul contracting over them), meets
  no other module's parameter (a norm's weight), is never combined with a whole tensor of its
  own shape (a residual), never reaches the model's output, and
  enters exactly one linear layer, ``B`` (in the same block, if the model has repeated
  blocks), and every linear layer feeding ``B`` is such an ``A``: attention's q/k/v then o,
  an MLP's up/gate then down, a packed projection (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``
  and ``gate_up_proj``) cut into parts that all flow to one layer. Pairs are taken in the order
  the forward runs, so a chain of linear layers pairs up as (1, 2), (3, 4), ...;
- the embedding that looks up the model's input ids, and a linear layer as wide as the
  vocabulary whose output is the model's output (the LM head), are split over the vocabulary,
  as transformers' own plans split ``embed_tokens`` and ``lm_head``;
- everything else (norms, position embeddings, row layers' biases) is replicated; so are stacked
  experts (grouped GEMM, no linear layers), left whole for ``ep`` to split on their expert dim:
  the layouts of ``LayoutMap.from_hf(model, ep=True)`` (Mixtral: attention split, experts whole).

A column layer's bias is split with its output. Layouts are those of
:meth:`~shardkit.plan.LayoutMap.from_hf` (``Conv1D`` stores ``[in, out]``: dims swapped), so
where transformers has a plan the inferred rules resolve to the same layout on every
parameter. Which packed projections are permuted or gathered, and which partners sit in
different modules, :func:`shardkit.validate` decides from the layouts, as for rules written
by hand. torch has no such analysis for eager modules (``torch.export`` needs a traceable
model, and DTensor's sharding propagation needs a placement to start from), so this is a
``TorchFunctionMode`` over the eager run on meta tensors.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..families import CHAIN, Family, family_of
from ..families.modules import guess_input, is_linear, linear_dims
from ..families.on_meta import meta_tensors, run_on_meta
from ..plan import LayoutMap, PlanError, UsageError
from ..plan.layout import Layout
from .split_ops import Mixes, Split, follow_split
from .tensor_parallel import aliases


@dataclass(frozen=True)
class _Origin:
    """What a tensor is computed from: linear layers' outputs (``sources``), other modules'
    parameters with more than one element (``params``), the model's input (``ids``), the
    weights of linear layers and embeddings (``weights``: what they compute with, not data)."""

    sources: frozenset[str] = frozenset()
    params: frozenset[str] = frozenset()
    ids: bool = False
    weights: bool = False

    def __or__(self, other: _Origin) -> _Origin:
        return _Origin(self.sources | other.sources, self.params | other.params, self.ids or other.ids,
                       self.weights or other.weights)

    @property
    def plain(self) -> bool:
        return self == _NOTHING


_NOTHING = _Origin()
#: The sequence length of guessed inputs: a prime unlike any width, so a tensor of a layer
#: output's shape is a residual, not a coincidence of sizes (sequence 64 = hidden 64).
SEQ_LEN = 7


@dataclass
class Feeds:
    """What :func:`trace_feeds` saw: linear layers in the order they first ran, which linear
    layers each one's output enters (``consumers``) and is fed by (``feeders``), the first
    reason its output goes anywhere else (``escapes``), and the embeddings looking up the
    model's input (``lookups``)."""

    order: list[str] = field(default_factory=list)
    consumers: dict[str, set[str]] = field(default_factory=dict)
    feeders: dict[str, set[str]] = field(default_factory=dict)
    escapes: dict[str, str] = field(default_factory=dict)
    outputs: set[str] = field(default_factory=set)
    lookups: list[str] = field(default_factory=list)

    def escape(self, sources: frozenset[str], reason: str) -> None:
        for source in sources:
            self.escapes.setdefault(source, reason)


class _Tracker(TorchFunctionMode):
    """Propagates each tensor's :class:`_Origin` through every torch function the forward calls."""

    def __init__(self, feeds: Feeds):
        super().__init__()
        self.feeds = feeds
        self.origins: dict[int, tuple[torch.Tensor, _Origin]] = {}  # the tensor is kept so no other reuses its id
        self.splits: dict[int, Split] = {}  # where a marked tensor computed from a linear output holds its features
        self.inside = 0  # how many linear layers' forwards are running (their inner ops are theirs)

    def origin(self, tensor: Any) -> _Origin:
        found = self.origins.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return _NOTHING if found is None else found[1]

    def mark(self, value: Any, origin: _Origin, merge: bool = False) -> None:
        for tensor in tree_flatten(value)[0]:
            if isinstance(tensor, torch.Tensor):
                self.origins[id(tensor)] = (tensor, self.origin(tensor) | origin if merge else origin)
                self.splits.pop(id(tensor), None)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        origins = [self.origin(t) for t in tensors]
        merged = _NOTHING
        for origin in origins:
            merged = merged | origin
        splits: dict[int, Split] = {}
        if merged.sources:
            self._check_mixing(func, tensors, origins, merged.sources)
            if not self.inside:
                splits = self._follow(func, args, kwargs, out, tensors, origins, merged.sources)
        if not merged.plain:
            self.mark(out, merged, merge=True)
            self.splits.update(splits)
        return out

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any, tensors: list[torch.Tensor],
                origins: list[_Origin], sources: frozenset[str]) -> dict[int, Split]:
        """Where the split features lie in ``out`` (:func:`~shardkit.planner.split_ops.follow_split`);
        ``sources`` escape, naming the op, where it computes across them or is not known not to."""
        known = {id(t): self.splits[id(t)] for t, o in zip(tensors, origins) if o.sources and id(t) in self.splits}
        lost = [o for t, o in zip(tensors, origins) if o.sources and id(t) not in known]
        if lost:  # computed from a split output by an op that mixes it, whose sources escaped there
            self.feeds.escape(sources, f"is combined in {getattr(func, '__name__', func)} with a tensor computed "
                                       f"from {sorted(lost[0].sources)[0]!r} that is not split as it is")
            return {}
        try:
            return follow_split(func, args, kwargs, out, known)
        except Mixes as exc:
            self.feeds.escape(sources, str(exc))
        except Exception as exc:  # arguments follow_split does not read: not followed
            self.feeds.escape(sources, f"passes through {getattr(func, '__name__', func)}, which shardkit cannot "
                                       f"follow ({type(exc).__name__}: {exc})")
        return {}

    def _check_mixing(self, func: Any, tensors: list[torch.Tensor], origins: list[_Origin],
                      sources: frozenset[str]) -> None:
        name = getattr(func, "__name__", str(func))
        for tensor, origin in zip(tensors, origins):
            if origin.params and tensor.numel() > 1:
                self.feeds.escape(sources, f"meets parameter {sorted(origin.params)[0]!r} in {name}")
        shapes = {tuple(t.shape) for t, o in zip(tensors, origins) if o.sources}
        for tensor, origin in zip(tensors, origins):
            if origin.plain and tensor.is_floating_point() and tuple(tensor.shape) in shapes and tensor.numel() > 1:
                self.feeds.escape(sources, f"is combined in {name} with a whole tensor of its shape "
                                           f"{list(tensor.shape)} (a residual?)")


@contextmanager
def _hooks(model: nn.Module, tracker: _Tracker, vocab: int | None) -> Iterator[None]:
    feeds = tracker.feeds
    handles = []

    def mark_input(_m: nn.Module, args: tuple) -> None:
        tracker.mark(args, _Origin(ids=True))

    handles.append(model.register_forward_pre_hook(mark_input))
    for name, module in model.named_modules():
        if is_linear(module):
            def enter(_m: nn.Module, args: tuple, name: str = name) -> None:
                tracker.inside += 1
                sources = tracker.origin(args[0]).sources if args else frozenset()
                if name not in feeds.consumers:
                    feeds.order.append(name)
                    feeds.consumers[name] = set()
                feeds.feeders.setdefault(name, set()).update(sources)
                for source in sources:
                    feeds.consumers.setdefault(source, set()).add(name)

            def leave(_m: nn.Module, _a: tuple, out: Any, name: str = name) -> None:
                split = Split.of_output(out) if isinstance(out, torch.Tensor) and out.dim() else None
                tracker.inside -= 1  # after reading the output's shape: an op the tracker sees
                tracker.mark(out, _Origin(sources=frozenset({name})))
                if split is not None:
                    tracker.splits[id(out)] = split

            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
        elif isinstance(module, nn.Embedding):
            def lookup(m: nn.Module, args: tuple, out: Any, name: str = name) -> None:
                if args and tracker.origin(args[0]).ids and m.num_embeddings == vocab and name not in feeds.lookups:
                    feeds.lookups.append(name)
                tracker.mark(out, _NOTHING)  # a vocabulary-split lookup is all-reduced: whole again

            handles.append(module.register_forward_hook(lookup))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def trace_feeds(model: nn.Module, example_inputs: tuple, vocab: int | None = None) -> Feeds:
    """Run ``model(*example_inputs)`` on meta tensors and record which linear layer feeds which
    (see the module docstring); ``vocab``: the vocabulary size, to find the input embedding.

    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> feeds = trace_feeds(net, (torch.zeros(1, 4),))
    >>> feeds.consumers["0"], feeds.escapes["2"]
    ({'2'}, "reaches the model's output")
    """
    feeds = Feeds()
    tracker = _Tracker(feeds)
    tensors = meta_tensors(model)
    modules = dict(model.named_modules())
    for pname, _ in model.named_parameters():
        owner = modules[pname.rpartition(".")[0]]
        if is_linear(owner) or isinstance(owner, nn.Embedding):
            tracker.mark(tensors[pname], _Origin(weights=True))
        elif tensors[pname].numel() > 1:
            tracker.mark(tensors[pname], _Origin(params=frozenset({pname})))
    with _hooks(model, tracker, vocab), tracker:
        output = run_on_meta(model, tensors, example_inputs)
    for tensor in tree_flatten(output.to_tuple() if hasattr(output, "to_tuple") else output)[0]:
        sources = tracker.origin(tensor).sources
        feeds.outputs |= sources
        feeds.escape(sources, "reaches the model's output")
    return feeds


def _block_of(name: str, blocks: list[str]) -> str | None:
    return next((b for b in blocks if name.startswith(b + ".")), None)


def pair_layers(model: nn.Module, feeds: Feeds) -> tuple[dict[str, str], dict[str, str]]:
    """``({column layer: its row partner}, {layer: why it is not split})``, in execution order."""
    blocks = [f"{n}.{c}" if n else c for n, m in model.named_modules() if isinstance(m, nn.ModuleList)
              for c, _ in m.named_children()]
    columns: dict[str, str] = {}
    rows: set[str] = set()
    why: dict[str, str] = {}

    def column_problem(name: str, row: str) -> str | None:
        """Why ``name`` cannot be column-parallel with ``row`` as its partner (``None``: it can)."""
        consumers = feeds.consumers.get(name, set())
        if name in feeds.escapes:
            return f"its output {feeds.escapes[name]}"
        if consumers != {row}:
            return f"its output enters {len(consumers)} linear layers ({sorted(consumers)})"
        if name in rows or name in columns:
            return "it is split already"
        if row == name or row in rows or row in columns:
            return f"its only consumer {row!r} is split already (or is itself)"
        if _block_of(name, blocks) != _block_of(row, blocks):
            return f"its only consumer {row!r} is in another block"
        return None

    for name in feeds.order:
        if name in columns or name in rows:
            continue
        consumers = feeds.consumers.get(name, set())
        row = next(iter(consumers)) if len(consumers) == 1 else ""
        problem = column_problem(name, row)
        if problem is None:
            others = {f: column_problem(f, row) for f in sorted(feeds.feeders[row] - {name})}
            other = next(((f, p) for f, p in others.items() if p), None)
            if other is not None:
                problem = f"{row!r}, its only consumer, is also fed by {other[0]!r}, which cannot be split: {other[1]}"
        if problem is not None:
            why[name] = problem
            continue
        for feeder in feeds.feeders[row]:
            columns[feeder] = row
        rows.add(row)
    return columns, {n: w for n, w in why.items() if n not in columns and n not in rows}


def _vocab_splits(model: nn.Module, feeds: Feeds, paired: set[str], vocab: int | None
                  ) -> tuple[list[str], list[str]]:
    """``(LM heads, input embeddings)`` split over the vocabulary. A head is one when its output is
    the model's and it is as wide as the vocabulary, and its parameters are its own or tied to
    the input embedding: a bias held by another module (BERT's ``cls.predictions.bias``) would be
    split outside torch's style for the head, so that head stays whole, and so does the
    embedding tied to it (one tensor has one layout)."""
    if vocab is None or not feeds.lookups:
        return [], []
    canonical = aliases(model)
    modules = dict(model.named_modules())
    lookups = {f"{name}.weight": name for name in feeds.lookups}
    heads, whole = [], set()
    for name in sorted(feeds.outputs - paired):
        module = modules[name]
        if module.weight.shape[linear_dims(module)[0]] != vocab:
            continue
        firsts = [canonical[f"{name}.{p}"] for p, _ in module.named_parameters(recurse=False)]
        if all(first.rpartition(".")[0] == name or first in lookups for first in firsts):
            heads.append(name)
        else:
            whole.update(firsts)
    return heads, [name for weight, name in lookups.items() if weight not in whole]


def _layouts(model: nn.Module, columns: dict[str, str], heads: list[str], lookups: list[str], axis: str
             ) -> dict[str, Layout]:
    """``{canonical parameter name: layout}`` of every split parameter."""
    canonical = aliases(model)
    modules = dict(model.named_modules())
    found: dict[str, Layout] = {}

    def put(module: str, param: str, layout: Layout) -> None:
        name = canonical.get(f"{module}.{param}" if module else param)
        if name is None:
            return
        if found.get(name, layout) != layout:
            raise PlanError(f"parameter {name!r} is shared by modules split two ways ({found[name]!r} and "
                            f"{layout!r}); write layout rules for this model by hand")
        found[name] = layout

    for name in [*columns, *heads]:
        module = modules[name]
        out_dim, _ = linear_dims(module)
        put(name, "weight", (axis, None) if out_dim == 0 else (None, axis))
        if getattr(module, "bias", None) is not None:
            put(name, "bias", (axis,))
    for name in set(columns.values()):
        _, in_dim = linear_dims(modules[name])
        put(name, "weight", (axis, None) if in_dim == 0 else (None, axis))
    for name in lookups:
        put(name, "weight", (axis, None))
    return found


def _pattern(name: str) -> str:
    """A parameter name as a regex with layer indices generalised: ``layers\\.\\d+\\.mlp\\.w``."""
    return r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))


def _rules(names: list[str], layouts: dict[str, Layout]) -> list[tuple[str, Layout]]:
    """One rule per parameter kind (layer indices as ``\\d+``) where every parameter it matches
    has its layout, else one rule per parameter; sorted by pattern, then ``(".*", None)``."""
    kinds: dict[str, set[Layout]] = {}
    for name in names:
        kinds.setdefault(_pattern(name), set()).add(layouts.get(name))
    rules = {_pattern(name) if len(kinds[_pattern(name)]) == 1 else re.escape(name): layout
             for name, layout in layouts.items()}
    return [*sorted(rules.items()), (".*", None)]


def _inputs_guessed(model: nn.Module, family: Family, seq_len: int) -> tuple:
    """The input ``model``'s family gives; for a model no family knows (a plain ``nn.Module``), the
    guess of :func:`~shardkit.families.modules.guess_input`, taken only when its forward takes one
    argument and its first layer with parameters is the one the guess is made for (an Embedding:
    token ids; a Linear: features). Else :class:`UsageError` asking for ``example_inputs``."""
    what = type(model).__name__
    ask = "pass example_inputs=(one input batch,)"
    if family is not CHAIN:
        inputs = family.example_inputs(model, seq_len=seq_len)
        if inputs is None:
            raise UsageError(f"infer_tp_rules: shardkit does not know what {what} takes as input (family "
                             f"{family.name!r}); {ask}")
        return inputs
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward torch cannot describe: the guess is not checked against it
        signature = None
    required = [] if signature is None else [
        n for n, p in signature.parameters.items() if p.default is p.empty and p.kind in
        (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if signature is not None and len(required) != 1:
        raise UsageError(f"infer_tp_rules: {what}.forward takes {len(required)} required arguments "
                         f"({', '.join(required) or 'none'}), so shardkit cannot tell what to pass it; {ask}")
    if not isinstance(first, (nn.Embedding, nn.Linear)):
        found = "no parameters" if first is None else f"a {type(first).__name__}"
        raise UsageError(f"infer_tp_rules: {what} is not a language model over token ids, and its first layer with "
                         f"parameters is {found}: shardkit guesses an input only for a model starting with an "
                         f"nn.Embedding (token ids) or an nn.Linear (features); {ask}")
    return guess_input(model, seq_len)


def infer_tp_rules(model: nn.Module, axis: str = "tp", example_inputs: tuple | None = None) -> LayoutMap:
    """Tensor-parallel layout rules over ``axis`` inferred from ``model``'s dataflow on the meta
    device: column/row pairs, packed projections, the vocabulary split of the input embedding
    and LM head; see :mod:`shardkit.planner.tp_infer`. ``example_inputs``: one input the model
    takes, when its family does not say: token ids, or a feature vector for a model whose forward
    takes one argument and starts with a Linear, are guessed; any other model is refused with
    :class:`~shardkit.plan.UsageError` asking for them. Raises :class:`~shardkit.plan.PlanError`
    naming why when no column/row pair is found.

    >>> import shardkit as sk
    >>> net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    >>> infer_tp_rules(net)
    LayoutMap([('0\\\\.bias', ('tp',)), ('0\\\\.weight', ('tp', None)), ('2\\\\.weight', (None, 'tp')), ('.*', None)])
    >>> sk.validate(sk.Plan(sk.Mesh(tp=2), infer_tp_rules(net)), net).layouts.params["2.weight"].layout
    (None, 'tp')
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"infer_tp_rules(model): model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(axis, str) or not axis:
        raise UsageError(f"infer_tp_rules(axis=...): axis must be a mesh axis name such as 'tp', got {axis!r}")
    family = family_of(model)
    what = type(model).__name__
    guessed = example_inputs is None
    inputs = _inputs_guessed(model, family, min(SEQ_LEN, family.max_positions(model) or SEQ_LEN)) if guessed \
        else example_inputs
    if not isinstance(inputs, tuple):
        raise UsageError(f"infer_tp_rules(example_inputs=...): must be a tuple of the forward's positional "
                         f"arguments, got {type(inputs).__name__}")
    try:
        feeds = trace_feeds(model, inputs, family.vocab_size(model) if family.takes_token_ids(model) else None)
    except Exception as exc:  # the model's own error, named with what was run
        shapes = [list(x.shape) for x in inputs if isinstance(x, torch.Tensor)]
        raise PlanError(f"infer_tp_rules: the forward of {what} fails on meta tensors with "
                        f"{'inputs shardkit guessed' if guessed else 'example inputs'} of shapes {shapes}: "
                        f"{type(exc).__name__}: {exc}" + ("; pass example_inputs=(one input batch,)" if guessed
                                                          else "")) from None
    columns, why = pair_layers(model, feeds)
    if not columns:
        seen = "; ".join(f"{n!r}: {w}" for n, w in list(why.items())[:6]) or "the forward runs no nn.Linear or Conv1D"
        raise PlanError(f"infer_tp_rules: no column/row pair found in {what}: tensor parallelism splits a linear "
                        f"layer's output and the one linear layer that consumes it (through ops that keep its "
                        f"features apart: elementwise ops, reshapes, attention between whole heads; meeting no "
                        f"norm, reduction over the features or residual); {seen}. Write layout rules by "
                        f"hand (docs/your-model.md) or use data-parallel axes only")
    heads, lookups = _vocab_splits(model, feeds, {*columns, *columns.values()}, family.vocab_size(model))
    layouts = _layouts(model, columns, heads, lookups, axis)
    return LayoutMap(_rules([n for n, _ in model.named_parameters()], layouts))


__all__ = ["Feeds", "infer_tp_rules", "pair_layers", "trace_feeds"]
