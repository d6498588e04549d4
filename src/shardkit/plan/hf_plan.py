"""Layout rules from a transformers model's own tensor-parallel plan (``LayoutMap.from_hf``).

transformers ships, per architecture, a plan of ``{module pattern: style}`` (the config's
``base_model_tp_plan`` and the head's ``_tp_plan``, merged with prefixes on the model as
``model.tp_plan``), e.g. ``"model.layers.*.self_attn.q_proj": "colwise"``. This module reads
that plan as data (no transformers import) and writes the equivalent shardkit rules over
parameter names. What a style means for the forward (an output gathered, a packed weight)
shardkit finds by itself on the meta device, so styles that differ only there map to one layout:

======================================================  =============================  ===========
transformers style                                      weight                          bias
======================================================  =============================  ===========
colwise, colwise_rep, colwise_gather_output, packed_colwise   ``(axis, None)``         ``(axis,)``
rowwise, rowwise_rep, rowwise_split_input, packed_rowwise     ``(None, axis)``         ``None``
embedding_rowwise                                       ``(axis, None)`` (vocabulary)
embedding_colwise                                       ``(None, axis)``
sequence_parallel, replicate, replicated_with_grad_allreduce, local  ``None``
======================================================  =============================  ===========

(GPT-2's ``Conv1D`` stores weights ``[in, out]``: its dims are swapped.) An entry naming a
parameter itself (a mixture of experts' ``mlp.experts.gate_up_proj``, stacked ``[experts, out,
in]``) splits its ``out`` dim (column styles) or its ``in`` dim (row styles). A parameter takes
the entry naming it, else its module's: a module style with no equivalent whose parameters all
have entries of their own (``moe_tp_experts`` on ``mlp.experts``, in Llama-4's plan and in
Qwen3-MoE's up to transformers 5.24: how the experts' outputs are combined, which
:func:`shardkit.validate` decides from the layouts) adds no rule. A
parameter whose entry has a style with no equivalent is refused, naming the parameter, the entry
and the axis. A mesh whose ``tp`` axis has size 1 splits nothing and needs no rules: the command
line reads the plan only when ``tp`` > 1.

**Mixtures of experts under ``ep``** (``from_hf(model, ep=True)``): transformers' MoE configs
carry a second plan, ``base_model_ep_plan``, which its expert-parallel mode uses in place of the
tensor-parallel one. Its styles mean, for shardkit:

- ``grouped_gemm`` on a stacked expert weight (``experts.gate_up_proj``, ``experts.down_proj``):
  split on its expert dim 0 by the ``ep`` axis, which finds the experts modules by itself
  (``sk.validate``; no layout rule names ``ep``), so the rule is ``None`` over ``axis`` (whole on
  ``tp``, each rank's experts whole);
- ``ep_dispatch_experts`` on the experts module: its tokens are sent to their experts' ranks by
  all-to-all, which shardkit's ``ep`` does for every experts module: no rule;
- any tensor-parallel style (Gemma-4's plan splits its dense MLP ``colwise`` / ``rowwise``): the
  layout of the table above over ``axis``, in place of the tensor-parallel plan's entry.

The tensor-parallel plan's other entries (attention) are kept. A model without an ep plan, or an
ep-plan style with no meaning here, is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .errors import PlanError, UsageError

COLWISE_STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise", "local_colwise")
ROWWISE_STYLES = ("rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise", "local_rowwise")
REPLICATED_STYLES = ("sequence_parallel", "replicate", "replicated_with_grad_allreduce", "local", "gather",
                     "isolated")
EMBEDDING_STYLES = {"embedding_rowwise": 0, "embedding_colwise": 1}


#: ``base_model_ep_plan`` styles of the experts themselves: what shardkit's ``ep`` does by itself.
EXPERT_STYLES = ("grouped_gemm", "ep_dispatch_experts")


def hf_tp_plan(model: Any, kind: str = "tp") -> dict[str, str]:
    """The model's merged transformers tensor-parallel plan (``kind="ep"``: its expert-parallel
    plan, ``base_model_ep_plan``), ``{}`` when it has none."""
    plan = getattr(model, f"{kind}_plan", None)
    if isinstance(plan, Mapping):
        return dict(plan)
    config = getattr(model, "config", None)
    base = dict(getattr(config, f"base_model_{kind}_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    merged = {f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k: v for k, v in base.items()}
    merged.update(getattr(type(model), f"_{kind}_plan", None) or {})
    return merged


def _with_ep_plan(model: Any, plan: dict[str, str], axis: str) -> dict[str, str]:
    """``plan`` with the model's ``base_model_ep_plan`` entries in place of its own (see the module
    docstring): expert entries become ``replicate`` over ``axis`` (``ep`` splits them)."""
    ep_plan = hf_tp_plan(model, "ep")
    if not ep_plan:
        raise PlanError(f"{type(model).__name__} has no expert-parallel plan in transformers (config."
                        f"base_model_ep_plan is empty): call LayoutMap.from_hf(model) for its tensor-parallel rules; "
                        f"an 'ep' axis finds experts modules by their stacked gate_up_proj / down_proj by itself")
    unknown = {key: style for key, style in ep_plan.items() if style not in EXPERT_STYLES and not _known(style)}
    if unknown:
        raise PlanError([f"transformers' expert-parallel plan entry {key!r} of {type(model).__name__} has style "
                         f"{style!r}, which has no shardkit equivalent over axis {axis!r} or 'ep'; write layout "
                         f"rules for it yourself" for key, style in unknown.items()])
    experts = [key for key, style in ep_plan.items() if style == "ep_dispatch_experts"]
    out = {key: style for key, style in plan.items() if not any(key == e or key.startswith(e + ".") for e in experts)}
    out.update({key: "replicate" if style in EXPERT_STYLES else style for key, style in ep_plan.items()})
    return out


def plan_pattern(key: str) -> str:
    """A transformers plan key (``*`` = one layer index) as a regex over dotted names."""
    return r"\d+".join(re.escape(part) for part in key.split("*"))


def _stored_transposed(model: Any, module_name: str) -> bool:
    """transformers' ``Conv1D`` (GPT-2) stores ``[in, out]``: its layouts swap dims."""
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    return type(module).__name__ == "Conv1D"


def rules_from_hf(model: Any, axis: str = "tp", ep: bool = False) -> list[tuple[str, Any]]:
    """``[(regex, layout), ...]`` for ``model``'s transformers plan, one rule per parameter kind,
    sorted by pattern, then the catch-all ``(".*", None)``; ``ep``: with its expert-parallel plan
    (experts whole over ``axis``, split by ``ep``); see the module docstring.

    >>> class Config:                      # what transformers' configs hold, as plain data
    ...     _attn_implementation = "sdpa"
    ...     base_model_tp_plan = {"layers.*.proj": "colwise"}
    >>> class Shaped:                      # a parameter, as far as its shape goes
    ...     def __init__(self, shape):
    ...         self.shape = shape
    >>> class Tiny:
    ...     config, base_model_prefix = Config(), ""
    ...     def named_parameters(self):
    ...         return [("layers.0.proj.weight", Shaped((4, 2))), ("layers.0.proj.bias", Shaped((4,)))]
    >>> rules_from_hf(Tiny())
    [('layers\\\\.\\\\d+\\\\.proj\\\\.bias', ('tp',)), ('layers\\\\.\\\\d+\\\\.proj\\\\.weight', ('tp', None)), ('.*', None)]
    """
    if not hasattr(model, "named_parameters"):
        raise UsageError(f"LayoutMap.from_hf(model): model must be a transformers model (an nn.Module with a "
                         f"config), got {type(model).__name__}")
    if not hasattr(getattr(model, "config", None), "_attn_implementation"):
        raise UsageError(f"LayoutMap.from_hf(model): {type(model).__name__} is not a transformers model (it has no "
                         f"transformers config), so it has no transformers tensor-parallel plan; write layout rules "
                         f"for it, see docs/your-model.md")
    plan = hf_tp_plan(model)
    if ep:
        plan = _with_ep_plan(model, plan, axis)
    if not plan:
        raise PlanError(f"{type(model).__name__} has no tensor-parallel plan in transformers (config."
                        f"base_model_tp_plan / _tp_plan are empty): write layout rules for it, see "
                        f"docs/your-model.md")
    shapes = {n: tuple(getattr(p, "shape", ())) for n, p in model.named_parameters()}
    patterns = {key: plan_pattern(key) for key in plan}
    # which entry gives each parameter its layout: an entry naming the parameter itself, else its module's
    owner: dict[str, str] = {}
    for key in plan:
        for name in shapes:
            if re.fullmatch(patterns[key], name):
                owner[name] = key
    for key in plan:
        for name in shapes:
            if name not in owner and re.fullmatch(patterns[key] + r"\.[^.]+", name):
                owner[name] = key
    rules: dict[str, Any] = {}
    problems = []
    for name, key in owner.items():
        style = plan[key]
        itself = re.fullmatch(patterns[key], name) is not None
        kind = "weight" if itself else name.rpartition(".")[2]
        if not _known(style):
            problems.append(f"parameter {name!r}: transformers plan entry {key!r} has style {style!r}, which has no "
                            f"shardkit equivalent over axis {axis!r}; write a rule for it yourself (or replicate "
                            f"it: layout None), or use a mesh with {axis}=1, which needs no rules")
            continue
        layout = _layout(style, kind, len(shapes[name]), axis)
        if layout is not None and len(layout) == 2 and _stored_transposed(model, name.rpartition(".")[0]):
            layout = layout[::-1]
        rules[patterns[key] if itself else f"{patterns[key]}\\.{re.escape(kind)}"] = layout
    if problems:
        raise PlanError(problems)
    return [*sorted(rules.items()), (".*", None)]


def _known(style: str) -> bool:
    return style in (*COLWISE_STYLES, *ROWWISE_STYLES, *REPLICATED_STYLES, *EMBEDDING_STYLES)


def _layout(style: str, kind: str, ndim: int, axis: str) -> Any:
    """The layout ``style`` gives a parameter of ``ndim`` dims (``kind``: ``weight``, ``bias`` or
    another name). Weights store ``[..., out, in]`` (a Linear's ``[out, in]``; experts stacked as
    ``[experts, out, in]``): column-parallel splits ``out``, row-parallel ``in``; a column-parallel
    bias ``[..., out]`` is split with its output, a row-parallel one is added whole."""
    def split(dim: int) -> tuple[str | None, ...]:
        return tuple(axis if d == dim % ndim else None for d in range(ndim))

    if style in REPLICATED_STYLES or ndim == 0 or kind not in ("weight", "bias"):
        return None
    if style in EMBEDDING_STYLES:
        return split(EMBEDDING_STYLES[style]) if kind == "weight" else None
    if style in COLWISE_STYLES:
        return split(-1) if kind == "bias" or ndim == 1 else split(-2)
    return None if kind == "bias" else split(-1)  # row-parallel


__all__ = ["EXPERT_STYLES", "hf_tp_plan", "plan_pattern", "rules_from_hf"]
