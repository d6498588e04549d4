"""``shardkit explain``'s experts: which experts each ``ep`` rank holds, and the all-to-all of
every MoE layer (:mod:`shardkit.planner.expert_costs`) for a batch, at balanced routing.

>>> import shardkit as sk
>>> from shardkit.models.gpt import build_tiny_gpt_moe
>>> from shardkit.planner.meta import meta_model
>>> plan = sk.Plan(sk.Mesh(fsdp=2, ep=2))
>>> model = meta_model(build_tiny_gpt_moe)
>>> print(explain_experts(plan, model, sk.validate(plan, model).facts.experts, batch_size=8, seq_len=16))
experts: 2 MoE layers (layers.{0..1}.mlp.experts), 4 experts each, split over ep=2: 2 whole experts per rank
  ep rank 0 (ranks 0, 2): experts 0-1 of every MoE layer
  ep rank 1 (ranks 1, 3): experts 2-3 of every MoE layer
all-to-all per MoE layer and micro-batch, per rank: 32 tokens x top 2 = 64 rows of 64 float32 (balanced routing: 1/2 of them stay on the rank)
  exchange              pass      bytes sent to the other ep ranks
  counts                forward             16
  rows out              forward          8,192
  rows back             forward          8,192
  rows back's gradient  backward         8,192
  rows out's gradient   backward         8,192
  per step: 65,568 B per rank (2 MoE layers x 1 micro-batch); its time is sk.estimate's 'ep' part
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..plan import Plan, PlanError, UsageError
from ..plan.dtypes import torch_dtype
from .expert_costs import exchanges
from .experts import ExpertsLayer


def _numbered(names: Sequence[str]) -> str:
    """``['layers.0.mlp.experts', 'layers.1.mlp.experts']`` -> ``'layers.{0..1}.mlp.experts'``."""
    templates = {re.sub(r"\.\d+\.", ".{}.", name) for name in names}
    if len(templates) != 1 or len(names) == 1:
        return ", ".join(names)
    numbers = sorted(int(re.search(r"\.(\d+)\.", name).group(1)) for name in names)
    span = f"{{{numbers[0]}..{numbers[-1]}}}" if numbers == list(range(numbers[0], numbers[-1] + 1)) \
        else "{" + ",".join(map(str, numbers)) + "}"
    return next(iter(templates)).replace("{}", span)


def holdings(plan: Plan, layers: Sequence[ExpertsLayer]) -> list[str]:
    """One line per ``ep`` rank: the ranks at that ``ep`` coordinate and the experts they hold."""
    mesh, ep = plan.mesh, plan.mesh.size_of("ep")
    sizes = sorted({layer.num_experts for layer in layers})
    if len(sizes) != 1:
        return [f"  ep rank j holds experts j*E/ep .. (j+1)*E/ep-1 of each layer (E: {sizes})"]
    local = sizes[0] // ep
    lines = []
    for j in range(ep):
        ranks = [r for r in range(mesh.size) if mesh.coordinates(r).get("ep", 0) == j]
        first, last = j * local, (j + 1) * local - 1
        held = f"expert {first}" if first == last else f"experts {first}-{last}"
        lines.append(f"  ep rank {j} (ranks {', '.join(map(str, ranks))}): {held} of every MoE layer")
    return lines


def explain_experts(plan: Plan, model: Any, layers: Sequence[ExpertsLayer], *, batch_size: int | None = None,
                    seq_len: int | None = None) -> str:
    """Who holds which experts under ``plan``'s ``ep`` (a resolved plan; ``layers``: what
    ``sk.validate`` found), and, for ``batch_size`` sequences of ``seq_len`` tokens (default: one
    sequence per data rank, of the model's positions), the all-to-alls of one MoE layer."""
    ep = plan.mesh.size_of("ep")
    sizes = sorted({layer.num_experts for layer in layers})
    each = f"{sizes[0]} experts each" if len(sizes) == 1 else f"{sizes} experts"
    local = f"{sizes[0] // ep} whole experts per rank" if len(sizes) == 1 else "E / ep whole experts per rank"
    lines = [f"experts: {len(layers)} MoE layers ({_numbered([layer.name for layer in layers])}), {each}, "
             f"split over ep={ep}: {local}", *holdings(plan, layers)]
    return "\n".join(lines + _exchange_lines(plan, model, len(layers), batch_size, seq_len))


def _exchange_lines(plan: Plan, model: Any, moe_layers: int, batch_size: int | None,
                    seq_len: int | None) -> list[str]:
    from .analysis import analyse

    mesh, ep = plan.mesh, plan.mesh.size_of("ep")
    microbatches = plan.pipeline.microbatches if plan.pipeline is not None else 1
    batch_size = batch_size or mesh.data_size * microbatches
    try:
        a = analyse(model, seq_len=seq_len)
    except (PlanError, UsageError) as exc:
        return [f"all-to-all: not sized ({str(exc).splitlines()[0]})"]
    if a.experts is None:
        return []
    dtype = torch_dtype(plan.fsdp.param_dtype) if plan.fsdp.param_dtype else a.dtype
    tokens = batch_size * a.seq_len / mesh.data_size / microbatches / mesh.size_of("sp")
    rows = tokens * a.experts.top_k
    found = exchanges(tokens=tokens, top_k=a.experts.top_k, hidden=a.hidden, itemsize=dtype.itemsize,
                      num_experts=a.experts.num_experts, ep=ep)
    lines = [f"all-to-all per MoE layer and micro-batch, per rank: {tokens:g} tokens x top {a.experts.top_k} = "
             f"{rows:g} rows of {a.hidden} {str(dtype).removeprefix('torch.')} (balanced routing: 1/{ep} of them "
             f"stay on the rank)"]
    width = max(len(e.name) for e in found)
    lines.append(f"  {'exchange'.ljust(width)}  pass      bytes sent to the other ep ranks")
    for e in found:
        lines.append(f"  {e.name.ljust(width)}  {'backward' if e.backward else 'forward '}  {e.bytes:>12,}")
    per_step = moe_layers * microbatches * sum(e.bytes for e in found)
    lines.append(f"  per step: {per_step:,} B per rank ({moe_layers} MoE layers x {microbatches} micro-batch"
                 f"{'es' if microbatches > 1 else ''}); its time is sk.estimate's 'ep' part")
    return lines


__all__ = ["explain_experts", "holdings"]
