"""Layers that mix positions under context parallel and Megatron sequence parallel, refused or made whole.

:func:`context_parallel_mixing` runs a copy of the model on meta tensors with the attention
shardkit replaces (ring attention) stood in by an op that keeps positions apart, and follows
the sequence (:mod:`shardkit.planner.sequence_mixing`): every other op that reads other
positions is refused by name, except causal 1-D convolutions, which the runtime makes whole by
passing each chunk the positions before it (:mod:`shardkit.runtime.halo`).

:func:`sequence_parallel_mixing` follows the residual stream that Megatron sequence parallel
splits along the sequence between tensor-parallel regions (from embeddings, norms and
row-parallel layers to the column-parallel layers and output heads that gather it). There it
is a DTensor sharded on the sequence, so an op torch's DTensor has a sharding rule for gets the
sequence it needs; one it has none for would fail in the workers, and is refused here.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..families import Family
from ..families.on_meta import module_stack
from ..plan import PlanError
from .experts import find_experts
from .sequence_mixing import CausalConv, Mixer, SequenceTrace, SequenceWatch
from .tensor_parallel import COLWISE, AxisPlan

#: The most positions a traced sequence has (meta tensors cost nothing; the length only has to be distinctive).
_LONGEST = 127


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def distinctive_length(model: nn.Module, limit: int | None) -> int | None:
    """The longest prime ``<= limit`` (at most 127, at least 5) that no parameter, buffer or config size
    of ``model`` is a multiple of, so a dim of that size can only be the sequence; ``None`` if none.

    >>> distinctive_length(nn.Linear(61, 122), 64)  # 61 divides 122: the next prime down
    59
    """
    sizes = {s for t in [*model.parameters(), *model.buffers()] for s in t.shape}
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        sizes |= {v for v in config.to_dict().values() if isinstance(v, int) and not isinstance(v, bool)}
    for n in range(min(limit or _LONGEST, _LONGEST), 4, -1):
        if _is_prime(n) and not any(s >= n and s % n == 0 for s in sizes):
            return n
    return None


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta stand-ins (no data is copied),
    free to be changed (attention installed, settings switched) without touching ``model``."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    for module in model.modules():  # tensors a forward kept (a MoE block's last router logits): stand-ins too
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = torch.empty(value.shape, dtype=value.dtype, device="meta")
    return copy.deepcopy(model, memo)




def _meta_friendly(model: nn.Module) -> ExitStack:
    """Settings under which data-dependent forwards run on meta tensors: ``nonzero`` assumed to find
    every element (a mixture of experts' loop then visits every expert), and transformers' experts
    run as their eager loop (its grouped matrix product has no meta kernel for float32)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"
    stack = ExitStack()
    stack.enter_context(torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True))
    return stack


def _sequence_inputs(family: Family, model: nn.Module, example_inputs: tuple | None, length: int) -> tuple | None:
    """The model's inputs with the sequence (dim 1 of each input with two dims or more) ``length`` long."""
    if example_inputs is None:
        return family.example_inputs(model, seq_len=length)
    return tuple(torch.zeros((x.shape[0], length, *x.shape[2:]), dtype=x.dtype, device="meta")
                 if isinstance(x, torch.Tensor) and x.dim() >= 2 else x for x in example_inputs)


class _StandIn:
    """Stands in for ring attention while tracing: an output of the right shape that keeps positions apart."""

    def __init__(self, watch: SequenceWatch):
        self.watch = watch

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        self.watch.paused += 1
        try:
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        finally:
            self.watch.paused -= 1
        self.watch.mark(out)
        return out


def trace_sequence(model: nn.Module, inputs: tuple, length: int, *, positions: str | None = None,
                   attention: Family | None = None, sources: set[str] | None = None,
                   inside: set[str] | None = None, per_token: set[str] | None = None) -> SequenceTrace:
    """Run a meta copy of ``model`` on ``inputs`` and record the ops that mix positions.

    ``positions``: the forward argument given the tokens' positions (as context parallel does);
    ``attention``: the family whose attention is stood in for (as ring attention replaces it);
    ``sources``: modules whose outputs are the split sequence (instead of the inputs: Megatron
    sequence parallel's residual stream); ``inside``: modules whose internals are not followed
    (their input is gathered, or they compute per position); ``per_token``: experts modules, whose
    output row ``t`` is computed from input row ``t`` alone (transformers' experts interface: the
    dispatch sorts and exchanges rows but brings each back to its token), followed as one per-position
    op from their hidden states to their output."""
    twin = meta_copy(model)
    stack: list[str] = []
    watch = SequenceWatch(length, stack, {n: type(m).__name__ for n, m in twin.named_modules()},
                          split_only=bool(sources), params={id(p): n for n, p in twin.named_parameters()})
    if attention is not None:
        attention.install_attention(twin, _StandIn(watch))
    kwargs: dict[str, torch.Tensor] = {}
    if positions is not None:
        kwargs[positions] = torch.arange(length, device="meta").unsqueeze(0) if positions == "position_ids" \
            else torch.arange(length, device="meta")
    if attention is not None:
        attention.check_context_parallel_inputs(twin, kwargs)
    meta_inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    if sources is None:
        for x in [*meta_inputs, *kwargs.values()]:
            if isinstance(x, torch.Tensor):
                watch.mark(x)
    handles = _region_hooks(twin, watch, sources or set(), inside or set()) + _per_token_hooks(twin, watch, per_token)
    try:
        with module_stack(twin, stack), _meta_friendly(twin), watch:
            twin(*meta_inputs, **kwargs)
    except PlanError:  # the family refuses an argument of the forward under context parallel: as it would at run time
        raise
    except Exception as exc:  # the model's own error on meta tensors: reported by the caller
        return SequenceTrace(length, watch.mixers, watch.convs, f"{type(exc).__name__}: {str(exc).strip()[:300]}")
    finally:
        for handle in handles:
            handle.remove()
    return SequenceTrace(length, watch.mixers, watch.convs)


def _region_hooks(model: nn.Module, watch: SequenceWatch, sources: set[str], inside: set[str]) -> list:
    """Hooks marking ``sources``' outputs as the split sequence and pausing the watch inside ``inside``."""
    handles = []
    for name, module in model.named_modules():
        if name in inside:
            handles.append(module.register_forward_pre_hook(lambda _m, _a: setattr(watch, "paused", watch.paused + 1)))
            handles.append(module.register_forward_hook(
                lambda _m, _a, _o: setattr(watch, "paused", watch.paused - 1), always_call=True))
        if name in sources:
            handles.append(module.register_forward_hook(
                lambda _m, _a, out: watch.mark(out) if isinstance(out, torch.Tensor) else None))
    return handles


def _per_token_hooks(model: nn.Module, watch: SequenceWatch, per_token: set[str] | None) -> list:
    """Hooks pausing the watch inside each ``per_token`` module and carrying the sequence from its
    hidden states (first argument) to its output, as a per-position op does."""
    handles, entered = [], []

    def enter(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else next(iter(kwargs.values()), None)
        entered.append(bool(watch.seq_dims(hidden)) and not watch.paused)
        watch.paused += 1

    def leave(_module: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> None:
        watch.paused -= 1
        if entered.pop() and isinstance(out, torch.Tensor):
            watch.mark(out)

    for name, module in model.named_modules():
        if name in (per_token or ()):
            handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
            # first of the forward hooks: any other hook (which may mix positions) runs followed
            handles.append(module.register_forward_hook(leave, with_kwargs=True, always_call=True, prepend=True))
    return handles


# -- context parallel ----------------------------------------------------------------------------------
def _grouped(mixers: list[Mixer]) -> list[tuple[Mixer, list[str]]]:
    """The first mixer of each module, grouped by (module class, op, reason) with every module it was seen in."""
    groups: dict[tuple[str, str, str], tuple[Mixer, list[str]]] = {}
    firsts: dict[str, Mixer] = {}
    for mixer in mixers:
        firsts.setdefault(mixer.module, mixer)
    for mixer in firsts.values():
        first, modules = groups.setdefault((mixer.kind, mixer.op, mixer.why), (mixer, []))
        if mixer.module not in modules:
            modules.append(mixer.module)
    return list(groups.values())


def _where(mixer: Mixer, modules: list[str], model: nn.Module) -> str:
    name = f"module {mixer.module!r} ({mixer.kind})" if mixer.module else f"{type(model).__name__}.forward"
    more = modules[1:]
    if more:
        shown = ", ".join(repr(m) for m in more[:3]) + (", ..." if len(more) > 3 else "")
        name += f" (and {len(more)} more module{'s' * (len(more) > 1)} like it: {shown})"
    return name


def context_parallel_checks(model: nn.Module, family: Family, sp: int, example_inputs: tuple | None = None
                            ) -> tuple[tuple[CausalConv, ...], list[str]]:
    """``(causal convolutions the runtime makes whole, problems)`` of ``model`` under context parallel
    over ``sp`` ranks: the family's problems with ring attention, else every other op mixing positions.

    >>> from shardkit.families import family_of
    >>> from shardkit.models.gpt import build_tiny_gpt
    >>> gpt = build_tiny_gpt()
    >>> context_parallel_checks(gpt, family_of(gpt), sp=2)
    ((), [])
    """
    if sp <= 1:
        return (), []
    problems = family.context_parallel_problems(model)
    if problems:
        return (), problems
    length = distinctive_length(model, family.max_positions(model))
    inputs = None if length is None else _sequence_inputs(family, model, example_inputs, length)
    if length is None or inputs is None:
        return (), [f"context parallel (sp={sp}) needs every op of {type(model).__name__} checked for mixing positions "
                    f"on meta tensors, but shardkit cannot make its inputs (no example input known, or too few "
                    f"positions); pass example_inputs= to sk.validate, or remove the 'sp' axis"]
    try:
        found = trace_sequence(model, inputs, length, positions=family.position_argument(model), attention=family,
                               per_token={layer.name for layer in find_experts(model)})
    except PlanError as exc:
        return (), [f"context parallel (sp={sp}): {problem}" for problem in exc.problems]
    if found.error is not None:
        return (), [f"context parallel (sp={sp}) needs every op of {type(model).__name__} checked for mixing positions, "
                    f"but its forward fails on meta tensors ({found.error}); pass example_inputs= it accepts, or "
                    f"remove the 'sp' axis"]
    problems = [f"context parallel (sp={sp}) gives each rank chunks of the sequence, but {_where(m, mods, model)} "
                f"{m.why} (aten.{m.op}), so each rank would compute it from its own chunks without the positions "
                f"before them (no error, wrong numbers from each chunk's start). Across sp ranks shardkit runs causal "
                f"attention (ring attention) and causal 1-D convolutions (each chunk given the positions before it); "
                f"valid: sp=1 for this model, split it with tp, fsdp or pp instead"
                for m, mods in _grouped(found.mixers)]
    return tuple(found.convs), problems


# -- Megatron sequence parallel ----------------------------------------------------------------------
def _dtensor_has_rule(op: str) -> bool:
    """Whether torch's DTensor has a sharding rule for ``aten.<op>`` (any overload), so a DTensor sharded on
    the sequence gets what the op needs (DTensor redistributes its input first)."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    tables = (propagator.op_strategy_funcs, propagator.op_to_rules,
              getattr(propagator, "op_single_dim_strategy_funcs", {}))
    return any(getattr(key, "overloadpacket", None) is getattr(torch.ops.aten, op, None)
               for table in tables for key in table)


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _backward_ops(call: tuple | None) -> list[str]:
    """The aten ops autograd runs for the backward of one recorded ``(op, args, kwargs)`` call, replayed on
    fresh meta leaves (the forward trace runs no backward)."""
    if call is None:
        return []
    func, args, kwargs = call
    leaves = []

    def leaf(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            leaves.append(torch.empty(t.shape, dtype=t.dtype, device="meta", requires_grad=True))
            return leaves[-1]
        return t

    args, kwargs = tree_map(leaf, args), tree_map(leaf, kwargs)
    try:
        outs = [o for o in tree_flatten(func(*args, **kwargs))[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        recorder = _Record()
        with recorder:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    except Exception:  # not differentiable on meta: nothing to check
        return []
    return sorted(set(recorder.ops) - {"ones_like", "empty_like", "zeros_like", "detach", "new_empty_strided"})


def sequence_parallel_checks(model: nn.Module, family: Family, plans: list[AxisPlan],
                             example_inputs: tuple | None = None) -> list[str]:
    """Ops on the residual stream that Megatron sequence parallel splits along the sequence (from
    embeddings, norms and row-parallel layers to the column-parallel layers and heads that gather it)
    that read other positions and that torch's DTensor cannot run on a sequence-sharded DTensor (no
    sharding rule: they would fail in the workers), or convolutions over the sequence (DTensor's exchange
    of neighbours' positions assumes centred padding). One line per problem."""
    plans = [p for p in plans if p.sequence_parallel and p.size > 1]
    length = distinctive_length(model, family.max_positions(model))
    inputs = None if length is None or not plans else _sequence_inputs(family, model, example_inputs, length)
    if inputs is None:
        return []
    sources, inside = set(), set()
    for plan in plans:
        sources |= {*plan.norms, *plan.embeddings, *(n for n, s in plan.splits.items() if s.kind != COLWISE)}
        inside |= {*plan.splits, *plan.norms, *plan.embeddings, *plan.gathers, *plan.routed}
        sources |= set(plan.routed)
    found = trace_sequence(model, inputs, length, sources=sources, inside=inside)
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    mixers = found.mixers + [Mixer(c.module, kinds.get(c.module, ""), "convolution", "runs a causal convolution over "
                                   "the sequence") for c in found.convs]
    axes = ", ".join(f"{p.axis!r} (size {p.size})" for p in plans)
    problems = _routed_problems(model, inputs, length, {b for p in plans for b in p.routed}, axes)
    blocking = []
    for m in mixers:
        if m.why.startswith("combines the split"):
            reason = "torch's DTensor refuses to combine a sequence-split tensor with a plain one: it fails in the workers"
        elif m.op == "convolution":
            reason = "torch's DTensor splits a convolution over the sequence only with centred padding"
        elif not _dtensor_has_rule(m.op):
            reason = "torch's DTensor has no sharding rule for it: it fails in the workers"
        elif missing := [op for op in _backward_ops(m.call) if not _dtensor_has_rule(op)]:
            reason = f"torch's DTensor has no sharding rule for its backward ({', '.join(missing)}): it fails there"
        else:
            continue  # DTensor gathers the sequence the op needs
        blocking.append(Mixer(m.module, m.kind, m.op, f"{m.why} (aten.{m.op}): {reason}"))
    return problems + [f"sequence_parallel=True splits the residual stream along the sequence over {axes} between "
                       f"tensor-parallel layers, but where it is split {_where(m, mods, model)} {m.why}; valid: "
                       f"sequence_parallel=False for this model, or the op inside a tensor-parallel layer's region"
                       for m, mods in _grouped(blocking)]


def _routed_problems(model: nn.Module, inputs: tuple, length: int, routed: set[str], axes: str) -> list[str]:
    """Ops of the MoE blocks that route each rank's own part of the sequence (plain tensors, no
    DTensor to gather what they need) that mix positions, the experts followed as per-token."""
    if not routed:
        return []
    prefixes = tuple(f"{b}." for b in routed)
    found = trace_sequence(model, inputs, length, per_token={e.name for e in find_experts(model)})
    mixers = [m for m in found.mixers if m.module in routed or m.module.startswith(prefixes)]
    return [f"sequence_parallel=True with 'ep' gives each MoE block the rank's own part of the sequence over "
            f"{axes}, but {_where(m, mods, model)} {m.why} (aten.{m.op}), so each rank would compute it from its "
            f"own part alone; valid: sequence_parallel=False for this model" for m, mods in _grouped(mixers)]


__all__ = ["CausalConv", "context_parallel_checks", "distinctive_length", "meta_copy", "sequence_parallel_checks",
           "trace_sequence"]
