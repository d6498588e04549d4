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
    """What an ``ep`` axis does not compose with yet (known from the plan alone), each by name."""
    mesh, ep = plan.mesh, plan.mesh.size_of("ep")
    problems = []
    others = [a for a in mesh.names if mesh[a] > 1 and a not in ("dp", "fsdp", "ep")]
    if others:
        problems.append(f"mesh axes {others} with ep={ep}: expert parallelism composes with the data axes 'dp' "
                        f"and 'fsdp' only so far; use a mesh of dp, fsdp and ep")
    if plan.replicas is not None:
        problems.append(f"replica groups with ep={ep}: gradients of experts are not averaged within groups; "
                        f"use replicas=None with 'ep'")
    if plan.fsdp.mixed_precision:
        problems.append(f"mixed precision (param_dtype={plan.fsdp.param_dtype!r}, reduce_dtype="
                        f"{plan.fsdp.reduce_dtype!r}) with ep={ep}: the experts' own precision policy is not "
                        f"applied yet; build the model in the dtype to train in, without a policy")
    if plan.recompute != "none":
        problems.append(f"recompute={plan.recompute!r} with ep={ep}: recomputing a block would repeat its "
                        f"all-to-all exchanges, which is not verified yet; use recompute='none' with 'ep'")
    return problems


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
    ep = plan.mesh.size_of("ep")
    if ep == 1:
        return [], []
    layers = find_experts(model)
    problems = composition_problems(plan) + experts_structure_problems(model)
    if not layers and not problems:
        problems.append(f"mesh axis 'ep' (size {ep}) splits the experts of MoE layers, but {type(model).__name__} "
                        f"has none (no module with stacked {list(EXPERT_WEIGHTS)} and a forward taking "
                        f"{list(EXPERTS_FORWARD)}); remove the 'ep' axis, or use 'dp' / 'fsdp' to split the batch")
    for layer in layers:
        if layer.num_experts % ep:
            problems.append(f"MoE layer {layer.name!r} has {layer.num_experts} experts, not divisible by ep={ep}; "
                            f"valid ep sizes: {_divisors(layer.num_experts)}")
    return layers, problems


__all__ = ["EXPERTS_FORWARD", "EXPERT_WEIGHTS", "ExpertsLayer", "composition_problems", "expert_problems",
           "experts_structure_problems", "find_experts"]
