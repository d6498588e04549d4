"""Which ``ep`` degrees ``sk.autoshard`` tries, and why it refuses the others: by the validator's
own checks (:mod:`shardkit.planner.experts`), so the search follows what ``sk.validate`` allows.

>>> from shardkit.models.gpt import build_tiny_gpt_moe
>>> from shardkit.planner.experts import model_experts
>>> refused = {}
>>> expert_degrees(model_experts(build_tiny_gpt_moe()), ("dp", "ep"), 8, Setting(), refused.setdefault)
[1, 2, 4]
>>> refused["ep=8"]
"MoE layer 'layers.0.mlp.experts' has 4 experts, not divisible by ep=8; valid ep sizes: [1, 2, 4]"
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..plan import Mesh, Plan
from ..plan.pipeline import Pipeline
from .costs import Setting, mesh_of
from .experts import ModelExperts, composition_problems, ep_problems


def expert_degrees(experts: ModelExperts, axes: Sequence[str], data: int, base: Setting,
                   reject: Callable[[str, str], Any]) -> list[int]:
    """``ep`` degrees of ``data`` data ranks that ``sk.validate`` allows on the model of ``experts``
    (:func:`~shardkit.planner.experts.model_experts`: no model needed) with ``base``'s
    ``tp``, ``pp`` and ``sp`` (1 always): the model has experts, ``E`` is divisible, the axes
    compose with ``ep``. Each other degree is refused, ``reject(family, reason)``, with the
    validator's reason (``"ep > 1"`` for a model without experts, ``"ep=3"`` for a degree ``E``
    does not split, ``"ep with tp"`` for axes ``ep`` does not compose with)."""
    if "ep" not in axes:
        return [1]
    degrees = [1]
    for ep in (d for d in range(2, data + 1) if data % d == 0):
        problems = ep_problems(Plan(Mesh(ep=ep)), experts)
        if problems:
            reject("ep > 1" if not experts.layers else f"ep={ep}", problems[0])
            continue
        setting = replace(base, ep=ep)
        refusal = ep_refusal(setting)
        if refusal is not None:
            reject("ep with " + ", ".join(a for a in ("tp", "pp", "sp") if setting.size(a) > 1), refusal)
            continue
        degrees.append(ep)
    return degrees


def ep_refusal(base: Setting, **options: Any) -> str | None:
    """What ``ep`` does not compose with in the plan of ``base``'s degrees with ``options`` (Plan
    fields: ``recompute=``, ``fsdp=``): :func:`~shardkit.planner.experts.composition_problems`;
    ``None`` when it composes. With ``options``, only the problems they add."""
    def problems(**extra: Any) -> list[str]:
        pipeline = Pipeline(microbatches=base.pp) if base.pp > 1 else None
        return composition_problems(Plan(mesh_of(base), pipeline=pipeline, **extra))

    mesh = problems()
    added = [p for p in problems(**options) if p not in mesh] if options else mesh
    return added[0] if added else None


__all__ = ["ep_refusal", "expert_degrees"]
