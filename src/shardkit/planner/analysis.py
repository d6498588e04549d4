"""``sk.analyse``: what a model costs per token, measured on fake tensors, without memory.

A language model is three parts: the **embedding** (everything before the first block), one
repeated **block**, and the **head** (everything after the last block: final norm, output
layer, loss). For each part, and for what one tensor-parallel rank holds of it: parameters,
forward FLOPs per token and bytes saved for backward per token, by component
(:data:`~shardkit.planner.measure.COMPONENTS`), the operator calls of one forward and the bytes
the operators other than matrix products and attention kernels read and write per token. The numbers are measured by torch on one forward
(:mod:`shardkit.planner.measure`), not computed from a formula, so they follow the model's code:
grouped-query attention, gated MLPs, tied heads, dropout masks, the attention kernel.

A config (transformers, or shardkit's :class:`~shardkit.models.gpt.GPTConfig`) or a catalogue
name is built on the meta device with two blocks; a module is run as it is. Tensors saved by
every block alike (rotary ``cos``/``sin``, made once before the blocks) are held once: they are
counted in the embedding part. Results are cached, so asking again (another ``tp``) is cheap.
"""

from __future__ import annotations

import copy
import functools
import json
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..families import Family, family_of
from ..families.modules import is_linear, linear_dims
from ..models.gpt import GPT, GPTConfig
from ..plan import LayoutMap, PlanError, UsageError
from .catalogue import catalogue_config, catalogue_name
from .expert_costs import ExpertCosts, block_experts, routing_watch
from .measure import COMPONENTS, Measurement, Piece, Tally, block_names, first_blocks, measure
from .model_rules import axis_plan, default_rules, fsdp_dims
from .one_rank import sliced_parameters
from .stored import stored

#: Blocks built from a config: two, so tensors every block saves alike can be told apart.
BLOCKS_BUILT = 2


class Components(Mapping[str, float]):
    """Values per component, read-only (analyses are cached and shared between callers).

    >>> Components({"mlp": 2.0})["mlp"]
    2.0
    """

    def __init__(self, values: Mapping[str, float]):
        self._values = dict(values)

    def __getitem__(self, key: str) -> float:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return repr(self._values)


@dataclass(frozen=True)
class PartCost:
    """One part of the model, as one tensor-parallel rank of degree ``tp`` computes it, for
    sequences of ``seq_len`` tokens. ``params`` are the elements this rank holds (local shapes);
    ``flops_per_token`` and ``activations_per_token`` (bytes saved for backward) have one entry
    per component, zeros included. ``ops``: the ATen operators one forward of the part calls
    (one block, for the block; views and other operators launching no kernel left out), per
    call, not per token. ``traffic_per_token``: the bytes the operators that are not matrix
    products or attention kernels (whose time the FLOPs price) read and write, per token.
    ``pieces``: this rank's parameters as FSDP shards them, ``(size of the sharded dim, elements
    of the rest)`` each; ``borrowed``: those the part uses that an earlier part holds (the LM head
    of a tied embedding: a pipeline's last stage holds its own copy). ``products``: matrix products
    and attention kernels of one forward; ``dtensor_ops``, ``dtensor_params``: operators one forward
    runs on DTensors and parameters that are DTensors, without and with Megatron SP (zeros at
    ``tp=1``); ``tp_boundaries``: column-parallel inputs, row-parallel outputs (tp's collectives).
    ``half_activations_per_token``: the bytes saved with the parameters in a 2-byte float dtype
    (bfloat16, float16: measured in bfloat16), of which ``fixed_activations_per_token`` in other
    dtypes (a norm's float32 upcast, integer indices): what does not follow the compute dtype
    (``None``: not measured, a part made by hand).
    ``rebuilt_per_token``: what full recompute holds while it runs the part again (its saved tensors
    and the values alive beside them, its input aside); ``half_rebuilt_per_token``: the same in a
    2-byte dtype, and of which in other dtypes. ``ahead_per_token``: :meth:`~shardkit.planner.measure.Measurement.ahead`'s, per token.

    >>> part = PartCost("block", 10, 40, {"mlp": 20.0, "norm": 0.0}, {"mlp": 8.0, "norm": 4.0}, 3, 16.0)
    >>> part.flops, part.activations, part.ops, part.traffic_per_token
    (20.0, 12.0, 3, 16.0)
    """

    name: str
    params: int
    param_bytes: int
    flops_per_token: Mapping[str, float]
    activations_per_token: Mapping[str, float]
    ops: int = 0
    traffic_per_token: float = 0.0
    pieces: tuple[Piece, ...] = ()
    borrowed: tuple[Piece, ...] = ()
    products: int = 0
    dtensor_ops: tuple[int, int] = (0, 0)
    dtensor_params: tuple[int, int] = (0, 0)
    tp_boundaries: tuple[int, int] = (0, 0)
    half_activations_per_token: Mapping[str, float] | None = None
    fixed_activations_per_token: Mapping[str, float] | None = None
    rebuilt_per_token: float = 0.0
    half_rebuilt_per_token: tuple[float, float] = (0.0, 0.0)
    ahead_per_token: tuple[float, ...] = (0.0,) * 12

    @property
    def flops(self) -> float:
        """Forward FLOPs per token, all components."""
        return float(sum(self.flops_per_token.values()))

    @property
    def activations(self) -> float:
        """Bytes saved for backward per token, all components."""
        return float(sum(self.activations_per_token.values()))


@dataclass(frozen=True)
class ModelAnalysis:
    """What :func:`analyse` measured: the parts (at ``tp``), ``layers`` blocks, the model's sizes.

    ``total_params``: the whole model at ``tp=1``, a tied output layer counted once. ``dtype``: the parameters'.
    ``notes``: what the numbers rest on that a reader should know (blocks that differ, an attention kernel that
    saves ``[seq, seq]`` probabilities). ``experts``: a mixture of experts' experts in the block shown (``None``
    without), whose FLOPs the block's count for ``top_k`` experts per token, as the model computes them.
    ``fused_attention``: the core ran as a fused kernel, priced at ``Hardware.attention_efficiency``."""

    name: str
    seq_len: int
    tp: int
    embedding: PartCost
    block: PartCost
    layers: int
    head: PartCost
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int
    dtype: torch.dtype
    tied: bool
    total_params: int
    family: str
    head_dim: int = 0
    notes: tuple[str, ...] = ()
    experts: ExpertCosts | None = None
    fused_attention: bool = False
    _rules: LayoutMap | None = field(default=None, repr=False, compare=False)
    _rules_problem: PlanError | None = field(default=None, repr=False, compare=False)

    def tp_rules(self) -> LayoutMap | None:
        """The layout rules that split this model over ``tp`` (the reference GPT's ``GPT_RULES``,
        transformers' own plan, GPT-2's rules, those inferred from the dataflow, or those given to
        :func:`analyse`). An analysis at ``tp=1`` needs none: when the model's own cannot be read
        (a transformers plan style shardkit has no equivalent of), asking raises that
        :class:`PlanError`."""
        if self._rules_problem is not None:
            raise self._rules_problem
        return self._rules

    @property
    def active_params(self) -> int:
        """Parameters one token uses: ``total_params`` less ``1 - top_k / E`` of every block's experts."""
        e = self.experts
        return self.total_params - (self.layers * (e.global_params - e.active_params) if e else 0)

    def flops_per_token(self) -> float:
        """Forward FLOPs per token of the whole model on one rank: embedding, every block, head."""
        return self.embedding.flops + self.layers * self.block.flops + self.head.flops

    def activations_per_token(self) -> float:
        """Bytes saved for backward per token on one rank: embedding, every block, head."""
        return self.embedding.activations + self.layers * self.block.activations + self.head.activations


#: The classes an analysis is made of, as the planner's stores read it back (:func:`~shardkit.planner.shipped.decode`).
STORED_TYPES = (ModelAnalysis, PartCost, Components, ExpertCosts)


def analyse(model: nn.Module | GPTConfig | str | Any, *, seq_len: int | None = None, tp: int = 1,
            dtype: torch.dtype | None = None, rules: LayoutMap | None = None) -> ModelAnalysis:
    """Parameters, FLOPs and saved activations per token of ``model``'s parts, for one rank of
    tensor-parallel degree ``tp``, measured on fake tensors (no memory).

    ``model``: an ``nn.Module`` (on the meta device is fine), a transformers config, a
    :class:`~shardkit.models.gpt.GPTConfig` or a catalogue name (:data:`~shardkit.planner.catalogue.CATALOGUE`).
    ``seq_len``: tokens per sequence (default: the model's positions). ``dtype``: of the parameters
    (default: as built; float32 for configs). ``rules``: the layouts splitting it over ``tp``
    (default: the model's own, :meth:`ModelAnalysis.tp_rules`). A ``tp`` the model's sizes do
    not split is a :class:`PlanError` naming the sizes and the valid degrees.

    >>> a = analyse("gpt-tiny", seq_len=16)
    >>> a.layers, a.block.params, a.block.flops_per_token["mlp"] == 2 * 2 * 64 * 256
    (2, 49984, True)
    >>> analyse("gpt-tiny", seq_len=16, tp=2).block.params
    25184
    """
    _check(seq_len, tp, dtype, rules)
    if isinstance(model, nn.Module):
        return _from_module(model, seq_len, tp, dtype, rules)
    return _from_config(_source(model), seq_len, tp, dtype, _Keyed(_rules_key(rules), rules))


def probe_model(model: nn.Module | GPTConfig | str | Any) -> nn.Module:
    """A model to check plans of ``model`` against on meta: the module itself, or the one
    :func:`analyse` builds from a config or catalogue name (with :data:`BLOCKS_BUILT` blocks:
    which kinds of plan a model allows does not depend on its depth)."""
    return model if isinstance(model, nn.Module) else _built(_source(model))[0]


# -- arguments and caching ------------------------------------------------------------------------
def _check(seq_len: Any, tp: Any, dtype: Any, rules: Any) -> None:
    problems = []
    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
        problems.append(f"seq_len must be a positive integer (or None: the model's positions), got {seq_len!r}")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        problems.append(f"tp must be a positive integer, got {tp!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        problems.append(f"dtype must be a floating torch.dtype such as torch.bfloat16 (or None: as built), "
                        f"got {dtype!r}")
    if rules is not None and not isinstance(rules, LayoutMap):
        problems.append(f"rules must be a shardkit LayoutMap (or None: the model's own), got {type(rules).__name__}")
    if problems:
        raise UsageError("analyse(): " + "; ".join(problems))


@dataclass(frozen=True)
class _Keyed:
    """A value cached by a key that stands for it (configs and layout maps are not hashable)."""

    key: str
    value: Any = field(compare=False, hash=False)


def _rules_key(rules: LayoutMap | None) -> str:
    return "" if rules is None else f"{rules!r} strict={rules.strict}"


def _source(model: GPTConfig | str | Any) -> _Keyed:
    """A config or catalogue name keyed for the caches, ``(config's maker, name)``: a name by itself, its config
    (fixed by ``catalogue.py`` and transformers' version, in the stores' keys) made only to build a model."""
    if isinstance(model, str):
        return _Keyed(f"catalogue={catalogue_name(model)}", (functools.partial(catalogue_config, model), model))
    if not isinstance(model, GPTConfig) and not hasattr(model, "to_json_string"):
        raise UsageError(f"analyse(model): expected an nn.Module, a transformers config, a GPTConfig or a "
                         f"catalogue name, got {type(model).__name__}")
    return _Keyed(_config_key(model), (lambda: model, None))


def _config_key(config: Any) -> str:
    if isinstance(config, GPTConfig):
        return repr(config)
    attention = getattr(config, "_attn_implementation", None)  # not in to_dict()
    return f"{type(config).__name__}:{attention}:{json.dumps(config.to_dict(), sort_keys=True, default=str)}"


_MODULE_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[tuple, ModelAnalysis]] = weakref.WeakKeyDictionary()


def _from_module(model: nn.Module, seq_len: int | None, tp: int, dtype: torch.dtype | None,
                 rules: LayoutMap | None) -> ModelAnalysis:
    """Cached per module while it lives, keyed also by its parameters' names, shapes and dtypes and
    its transformers attention implementation."""
    signature = tuple((n, tuple(p.shape), p.dtype) for n, p in model.named_parameters())
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    key = (signature, attention, seq_len, tp, dtype, _rules_key(rules))
    cached = _MODULE_CACHE.setdefault(model, {})
    if key not in cached:
        cached[key] = _analyse_module(model, type(model).__name__, len(block_names(model)), seq_len, tp, dtype,
                                      rules)
    return cached[key]


@functools.lru_cache(maxsize=512)
def _from_config(source: _Keyed, seq_len: int | None, tp: int, dtype: torch.dtype | None,
                 rules: _Keyed) -> ModelAnalysis:
    """Cached in the process, and on disk between processes (:mod:`shardkit.planner.stored`)."""
    key = f"{source.key}|seq_len={seq_len}|tp={tp}|dtype={dtype}|rules={rules.key}"
    return stored("analysis", key, lambda: _measured_config(source, seq_len, tp, dtype, rules), source.value[1],
                  STORED_TYPES)


def model_key(model: Any) -> str | None:
    """A config's or catalogue name's key in the planner's stores (``None`` for an ``nn.Module``: it has none)."""
    return None if isinstance(model, nn.Module) else _source(model).key


def _measured_config(source: _Keyed, seq_len: int | None, tp: int, dtype: torch.dtype | None,
                     rules: _Keyed) -> ModelAnalysis:
    config, name = source.value[0](), source.value[1]
    model, layers = _built(source)
    label = name or (f"gpt(dim={config.dim}, layers={config.layers})" if isinstance(config, GPTConfig)
                     else getattr(config, "model_type", type(config).__name__))
    return _analyse_module(model, label, layers, seq_len, tp, dtype, rules.value)


@functools.lru_cache(maxsize=32)
def _built(source: _Keyed) -> tuple[nn.Module, int]:
    """The model of a config with :data:`BLOCKS_BUILT` blocks, on the meta device, and its real block count."""
    config = source.value[0]()
    if isinstance(config, GPTConfig):
        with torch.device("meta"):
            return GPT(replace(config, layers=min(config.layers, BLOCKS_BUILT))), config.layers
    from transformers import AutoModelForCausalLM

    layers = config.num_hidden_layers
    small = copy.deepcopy(config)
    small.num_hidden_layers = min(layers, BLOCKS_BUILT)
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:small.num_hidden_layers]
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(small, attn_implementation=implementation), layers


# -- the analysis -----------------------------------------------------------------------------------
def _analyse_module(model: nn.Module, name: str, layers: int, seq_len: int | None, tp: int,
                    dtype: torch.dtype | None, rules: LayoutMap | None) -> ModelAnalysis:
    """``layers``: the model's blocks; ``model`` may hold fewer (built from a config), each like the first."""
    family = family_of(model)
    with first_blocks(model, BLOCKS_BUILT) as blocks:
        return _analyse_blocks(model, family, blocks, name, layers, seq_len, tp, dtype, rules)


def _analyse_blocks(model: nn.Module, family: Family, blocks: list[str], name: str, layers: int, seq_len: int | None,
                    tp: int, dtype: torch.dtype | None, rules: LayoutMap | None) -> ModelAnalysis:
    if not family.takes_token_ids(model) or not blocks:
        raise UsageError(f"analyse(): {type(model).__name__} is not a language model shardkit can analyse: it needs "
                         f"token ids in and repeated blocks (the children of an nn.ModuleList); "
                         f"{'it has no ModuleList' if not blocks else 'its first layer is not an nn.Embedding'}")
    positions = family.max_positions(model)
    if seq_len is None and positions is None:
        raise UsageError(f"analyse(): {type(model).__name__} does not say how many positions it takes; pass seq_len")
    seq_len = seq_len or positions
    if positions is not None and seq_len > positions:
        raise UsageError(f"analyse(seq_len={seq_len}): {type(model).__name__} takes at most {positions} positions; "
                         f"pass seq_len <= {positions} or a config with more positions")
    dtype = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    rules_problem = None
    if rules is None:
        try:
            rules = default_rules(model, family)
        except PlanError as exc:  # one rank of tp=1 splits nothing: the rules are needed only when asked for
            if tp > 1:
                raise PlanError([f"analyse(tp={tp}): {p}" for p in exc.problems]) from None
            rules_problem = exc
    plan = None if tp == 1 else axis_plan(model, family, rules, tp)
    sharded_dims = fsdp_dims(model, rules)
    with routing_watch(model) as top_k:
        measured = measure(model, family, blocks, seq_len, dtype, plan, sharded_dims)
    measured.share()
    notes = []
    index, block, differ = _largest_block(measured)
    experts = block_experts(model, blocks[index], top_k, sliced_parameters(model, plan), tp, sharded_dims)
    if differ:
        notes.append(f"blocks differ ({differ}); the block shown is the largest")
    if measured.quadratic:
        notes.append(f"the attention saves [heads, {seq_len}, {seq_len}] probabilities (a math kernel: eager "
                     f"attention, or attention dropout, which torch's CPU flash kernel does not take); a GPU flash "
                     f"kernel would save only its output and log-sum-exp")
    parts, half = measured.parts, (measured.half or measured)
    total = parts["embedding"].global_params + parts["head"].global_params + \
        sum(parts[f"block.{i}"].global_params for i in range(measured.blocks)) + \
        (layers - measured.blocks) * parts["block.0"].global_params  # the blocks that did not run are like the first
    attention = next(iter(family.attentions(model)), None)
    return ModelAnalysis(
        name=name, seq_len=seq_len, tp=tp,
        embedding=_part("embedding", parts["embedding"], half, seq_len),
        block=_part("block", block, half, seq_len, index, measured.ahead(seq_len)), layers=layers, head=_part("head", parts["head"], half, seq_len),
        hidden=_hidden(model, family), heads=attention.heads if attention else 0,
        kv_heads=attention.kv_heads if attention else 0, vocab=family.vocab_size(model) or 0,
        intermediate=_intermediate(model, family, blocks[0]), dtype=dtype, tied=_tied(model, family), total_params=total,
        family=_family_label(model, family), head_dim=attention.head_dim if attention else 0,
        notes=tuple(notes), experts=experts, fused_attention=measured.fused, _rules=rules, _rules_problem=rules_problem)


def _largest_block(measured: Measurement) -> tuple[int, Tally, str]:
    blocks = [measured.parts[f"block.{i}"] for i in range(measured.blocks)]
    sizes = [(sum(b.saved_by_component().values()), sum(b.flops.values()), b.params, b.ops, b.traffic)
             for b in blocks]
    largest = max(range(len(blocks)), key=lambda i: sizes[i])
    differ = "" if len(set(sizes)) == 1 else \
        f"saved bytes, FLOPs, parameters, operator calls and traffic per block range over {sorted(set(sizes))[0]} " \
        f".. {sorted(set(sizes))[-1]}"
    return largest, blocks[largest], differ


def _part(name: str, tally: Tally, half: Measurement, seq_len: int, block: int = 0,
          ahead: tuple[float, ...] = (0.0,) * 12) -> PartCost:
    """``half``: the measurement in a 2-byte dtype, whose part of that name (``block``: the block's
    index) gives the saved bytes in it and those of its tensors in other dtypes."""
    halved = half.parts[f"block.{block}" if name == "block" else name]
    saved, in_half, fixed = (t.saved_by_component(other) for t, other in
                             ((tally, None), (halved, None), (halved, half.dtype)))
    per_token = [Components({c: values.get(c, 0.0) / seq_len for c in COMPONENTS})
                 for values in (tally.flops, saved, in_half, fixed)]
    return PartCost(name, tally.params, tally.param_bytes, *per_token[:2], tally.ops,
                    tally.traffic / seq_len, tuple(tally.pieces), tuple(tally.borrowed), tally.products,
                    *tally.tensor_parallel_counts(), *per_token[2:], tally.rebuilt[0] / seq_len,
                    (halved.rebuilt[0] / seq_len, halved.rebuilt[1] / seq_len), ahead)


def _token_embedding(model: nn.Module, family: Family) -> nn.Embedding | None:
    vocab = family.vocab_size(model)
    return next((m for m in model.modules() if isinstance(m, nn.Embedding) and m.num_embeddings == vocab), None)


def _hidden(model: nn.Module, family: Family) -> int:
    embedding = _token_embedding(model, family)
    return embedding.embedding_dim if embedding is not None else 0


def _intermediate(model: nn.Module, family: Family, block: str) -> int:
    """The MLP's inner width: the config's, else the widest output of a linear layer of the block
    outside its attention."""
    config = getattr(model, "config", None)
    width = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    if isinstance(width, int):
        return width
    attentions = tuple(f"{a.name}." for a in family.attentions(model))
    widths = [m.weight.shape[linear_dims(m)[0]] for n, m in model.named_modules()
              if n.startswith(f"{block}.") and is_linear(m) and not n.startswith(attentions)]
    return max(widths, default=0)


def _tied(model: nn.Module, family: Family) -> bool:
    embedding = _token_embedding(model, family)
    if embedding is None:
        return False
    users = [m for m in model.modules() if m is not embedding and any(p is embedding.weight for p in m.parameters(
        recurse=False))]
    return bool(users)


def _family_label(model: nn.Module, family: Family) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if isinstance(model_type, str) and model_type else family.name


__all__ = ["model_key", "probe_model", "BLOCKS_BUILT", "STORED_TYPES", "Components", "ModelAnalysis", "PartCost",
           "analyse"]
