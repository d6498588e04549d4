"""The experts of a model, found on the meta device, and what an ``ep`` axis asks of them.

An *experts module* holds a MoE layer's experts stacked on dim 0 of its own parameters: the
``gate_up_proj`` and ``down_proj`` that transformers' ``base_model_ep_plan`` marks for grouped
GEMM (and their biases), with the forward transformers 5 gives every experts class,
``forward(hidden_states, top_k_index, top_k_weights)`` (:mod:`shardkit.models.experts`). It is
recognised by those parameters and that forward, on any model: transformers' Mixtral,
Qwen2-MoE and their kin, and the reference GPT built with ``experts=``.

:func:`expert_problems` is what :func:`sk.validate <shardkit.planner.validate.validate>` checks
for ``ep``: a model with experts, ``E`` divisible by ``ep`` in every layer, and the parts of a
plan expert parallelism does not compose with yet, each refused by name.

>>> from shardkit.models.gpt import build_tiny_gpt_moe
>>> [(layer.name, layer.num_experts) for layer in find_experts(build_tiny_gpt_moe())]
[('layers.0.mlp.experts', 4), ('layers.1.mlp.experts', 4)]
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from ..plan import Plan
from ..plan.layout import axes_of
from ..plan.mesh import is_model_axis

#: The stacked weights an experts module must hold (transformers' ``base_model_ep_plan`` names).
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
#: The arguments of an experts module's forward, in order (by position: GPT-OSS names the last two
#: ``router_indices, routing_weights``).
EXPERTS_FORWARD = ("hidden_states", "top_k_index", "top_k_weights")


@dataclass(frozen=True)
class ExpertsLayer:
    """One experts module: its dotted ``name``, ``num_experts`` (E) and ``params``, the names of
    its own parameters, each split on dim 0 (the expert dim) by ``ep``."""

    name: str
    num_experts: int
    params: tuple[str, ...]


def _forward_arguments(module: nn.Module) -> tuple[str, ...]:
    """The names of ``module.forward``'s positional arguments (through transformers' dispatching wrapper)."""
    try:
        signature = inspect.signature(inspect.unwrap(type(module).forward))
    except (TypeError, ValueError):
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in signature.parameters.values() if p.kind in positional)[1:]


def _takes_routing(module: nn.Module) -> bool:
    """Whether the forward takes (hidden states, top-k expert ids, top-k weights) by position."""
    return len(_forward_arguments(module)) >= len(EXPERTS_FORWARD)


def _stacks_experts(module: nn.Module) -> bool:
    own = dict(module.named_parameters(recurse=False))
    return all(name in own and own[name].dim() == 3 for name in EXPERT_WEIGHTS)


def find_experts(model: nn.Module) -> list[ExpertsLayer]:
    """Every experts module of ``model`` (stacked ``gate_up_proj`` / ``down_proj`` and the
    experts' forward), in module order. See :func:`experts_structure_problems` for modules that
    stack expert weights but cannot be split."""
    found = []
    for name, module in model.named_modules():
        if _stacks_experts(module) and _takes_routing(module):
            own = dict(module.named_parameters(recurse=False))
            found.append(ExpertsLayer(name, own["gate_up_proj"].shape[0], tuple(own)))
    return found


def experts_structure_problems(model: nn.Module) -> list[str]:
    """Modules that stack expert weights in a way expert parallelism cannot split: a forward of
    another form, a parameter whose dim 0 is not the expert dim, a norm after each expert."""
    problems = []
    for name, module in model.named_modules():
        if not _stacks_experts(module):
            continue
        own = dict(module.named_parameters(recurse=False))
        experts = own["gate_up_proj"].shape[0]
        if not _takes_routing(module):
            problems.append(f"module {name!r} ({type(module).__name__}) stacks expert weights {list(EXPERT_WEIGHTS)} "
                            f"but its forward takes {list(_forward_arguments(module))}, not {list(EXPERTS_FORWARD)} "
                            f"(transformers' experts interface), so 'ep' cannot send it tokens; remove the 'ep' axis")
            continue
        for param, tensor in own.items():
            if tensor.dim() == 0 or tensor.shape[0] != experts:
                problems.append(f"parameter '{name}.{param}' (shape {list(tensor.shape)}) of experts module {name!r} "
                                f"has no expert dim 0 of size {experts}, so 'ep' cannot split it with the experts; "
                                f"remove the 'ep' axis")
        if getattr(module, "has_post_expert_norm", False):
            problems.append(f"experts module {name!r} applies a norm after each expert (has_post_expert_norm), "
                            f"which shardkit's expert-parallel forward does not compute; remove the 'ep' axis")
    return problems


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def composition_problems(plan: Plan) -> list[str]:
    """What an ``ep`` axis does not compose with yet (known from the plan alone), each by name.

    ``tp`` and user model axes, ``pp``, ``sp`` (context parallel), ``dp`` and ``fsdp`` (HSDP too),
    activation recompute and mixed-precision policies compose (:mod:`shardkit.runtime.expert_parallel`)."""
    ep = plan.mesh.size_of("ep")
    problems = []
    if plan.replicas is not None:
        problems.append(f"replica groups with ep={ep}: gradients of experts are not averaged within groups; "
                        f"use replicas=None with 'ep'")
    return problems


def sequence_routing_problems(plan: Plan, model: nn.Module) -> list[str]:
    """Router losses and bias balancing under Megatron sequence parallel with ``ep``: each ``tp`` rank
    routes its own part of the sequence, and shardkit sums their batch totals over the data ranks
    only (not verified over ``tp``), so they are refused by name."""
    from ..models.routing import bias_balanced
    from .routing import router_losses

    if not plan.sequence_parallel or plan.mesh.size_of("tp") == 1:
        return []
    ep, tp = plan.mesh.size_of("ep"), plan.mesh.size_of("tp")
    problems = [f"{type(model).__name__}'s forward computes a router auxiliary loss ({loss.where}) over the whole "
                f"batch; with sequence_parallel=True and ep={ep} each of the tp={tp} ranks routes its own part of "
                f"the sequence, which shardkit's batch totals do not sum yet; turn it off "
                f"(output_router_logits=False, router_aux_loss_coef=0) or use sequence_parallel=False"
                for loss in router_losses(model, run=any(loss.called for loss in router_losses(model, run=False)))
                if loss.called]  # named by a forward: run on meta to see whether it is called
    biased = [n for n, _ in bias_balanced(model)]
    if biased:
        problems.append(f"routers {biased[:4]} balance their experts with a bias from the whole batch's load; with "
                        f"sequence_parallel=True and ep={ep} each of the tp={tp} ranks counts its own part of the "
                        f"sequence, which shardkit does not sum yet; use sequence_parallel=False or no bias")
    return problems


def expert_layout_problems(plan: Plan, layers: list[ExpertsLayer]) -> list[str]:
    """Expert weights a layout rule splits over another axis: ``ep`` holds each expert whole and
    replicates it over ``tp`` (parallel folding: attention over ``tp``, experts over ``ep``)."""
    if plan.rules is None:
        return []
    problems = []
    for layer in layers:
        for param in layer.params:
            found = plan.rules.lookup(f"{layer.name}.{param}")
            layout = found[1] if found else None
            axes = [a for e in (layout or ()) for a in axes_of(e) if is_model_axis(a) and plan.mesh.size_of(a) > 1]
            if axes:
                problems.append(f"parameter '{layer.name}.{param}' of MoE layer {layer.name!r} is split over {axes} by "
                                f"layout {layout!r}, but with ep={plan.mesh.size_of('ep')} each "
                                f"expert is held whole on its 'ep' rank and replicated over the other axes; give the "
                                f"experts' weights layout None (a rule (r'.*experts.*', None) before the others)")
    return problems


@dataclass(frozen=True)
class ModelExperts:
    """What the ``ep`` checks read of a model, whatever the plan: its class name (``model``), its
    experts modules (:func:`find_experts`) and the modules stacking expert weights that ``ep``
    cannot split (:func:`experts_structure_problems`). Plain data, so the planner can keep it
    between processes without the model (:mod:`shardkit.planner.stored`)."""

    model: str
    layers: tuple[ExpertsLayer, ...]
    structure: tuple[str, ...]


def model_experts(model: nn.Module) -> ModelExperts:
    """:class:`ModelExperts` of ``model``.

    >>> from shardkit.models.gpt import build_tiny_gpt
    >>> model_experts(build_tiny_gpt())
    ModelExperts(model='GPT', layers=(), structure=())
    """
    return ModelExperts(type(model).__name__, tuple(find_experts(model)), tuple(experts_structure_problems(model)))


def expert_problems(plan: Plan, model: nn.Module) -> tuple[list[ExpertsLayer], list[str]]:
    """``(experts layers, problems)`` of ``plan``'s ``ep`` axis on ``model``; nothing to check
    (and no layers returned) when the mesh has no ``ep`` of size > 1.

    >>> from shardkit.plan import Mesh
    >>> from shardkit.models.gpt import build_tiny_gpt, build_tiny_gpt_moe
    >>> expert_problems(Plan(mesh=Mesh(ep=3)), build_tiny_gpt_moe())[1][0]
    "MoE layer 'layers.0.mlp.experts' has 4 experts, not divisible by ep=3; valid ep sizes: [1, 2, 4]"
    >>> expert_problems(Plan(mesh=Mesh(ep=2)), build_tiny_gpt())[1][0][:60]
    "mesh axis 'ep' (size 2) splits the experts of MoE layers, bu"
    """
    if plan.mesh.size_of("ep") == 1:
        return [], []
    experts = model_experts(model)
    return list(experts.layers), ep_problems(plan, experts, sequence_routing_problems(plan, model))


def ep_problems(plan: Plan, experts: ModelExperts, routing: list[str] | None = None) -> list[str]:
    """:func:`expert_problems` of a model known by its :class:`ModelExperts`; ``routing``: its
    :func:`sequence_routing_problems` under ``plan`` (which need the model; none without
    ``sequence_parallel``)."""
    ep = plan.mesh.size_of("ep")
    if ep == 1:
        return []
    layers = list(experts.layers)
    problems = composition_problems(plan) + list(experts.structure) + expert_layout_problems(plan, layers) \
        + list(routing or [])
    if not layers and not problems:
        problems.append(f"mesh axis 'ep' (size {ep}) splits the experts of MoE layers, but {experts.model} "
                        f"has none (no module with stacked {list(EXPERT_WEIGHTS)} and a forward taking "
                        f"{list(EXPERTS_FORWARD)}); remove the 'ep' axis, or use 'dp' / 'fsdp' to split the batch")
    for layer in layers:
        if layer.num_experts % ep:
            problems.append(f"MoE layer {layer.name!r} has {layer.num_experts} experts, not divisible by ep={ep}; "
                            f"valid ep sizes: {_divisors(layer.num_experts)}")
    return problems


__all__ = ["EXPERTS_FORWARD", "EXPERT_WEIGHTS", "ExpertsLayer", "ModelExperts", "composition_problems",
           "ep_problems", "expert_layout_problems", "expert_problems", "experts_structure_problems", "find_experts",
           "model_experts", "sequence_routing_problems"]
