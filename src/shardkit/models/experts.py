"""Stacked experts computed group by group: the one computation of an experts module's tokens,
in one process and on an expert-parallel rank alike.

An *experts module* is what transformers 5 puts in every MoE layer (``MixtralExperts``,
``Qwen2MoeExperts``, ...) and what the reference GPT's :class:`~shardkit.models.gpt.Experts`
copies: ``gate_up_proj [E, 2 * ffn, dim]`` (``[E, dim, 2 * ffn]`` when the module says
``is_transposed``), ``down_proj [E, dim, ffn]``, optional ``gate_up_proj_bias [E, 2 * ffn]`` and
``down_proj_bias [E, dim]``, and ``forward(hidden_states [T, dim], top_k_index [T, k],
top_k_weights [T, k]) -> [T, dim]``. Its gating is the module's own ``_apply_gate`` (transformers
gives every experts class one), else ``act_fn(gate) * up`` on the two halves.

Tokens sorted by expert make one contiguous group per expert, and
``torch.nn.functional.grouped_mm`` multiplies every group by its expert's matrix in one call.
It runs on CPU for float32, bfloat16 and float16 (on CUDA for bfloat16) when every row is a
multiple of 16 bytes; where it cannot (float64, float32 on CUDA, a width such as 12 in
bfloat16) the groups are multiplied one expert at a time, the same arithmetic
(:func:`grouped_mm_runs` says which). On the meta device (shardkit's checks before launch) a
stand-in of the right shape is computed instead.

>>> import torch
>>> from shardkit.models.gpt import build_tiny_gpt_moe
>>> experts = build_tiny_gpt_moe().layers[0].mlp.experts
>>> x, index = torch.randn(3, 64), torch.tensor([[0, 1], [1, 3], [2, 0]])
>>> sort_by_expert(index, 4).counts.tolist()
[2, 2, 1, 1]
>>> experts(x, index, torch.full((3, 2), 0.5)).shape
torch.Size([3, 64])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: Dtypes ``torch.nn.functional.grouped_mm`` takes per device type (torch 2.13: its CPU kernel
#: takes these three; on CUDA, bfloat16 on devices of compute capability 8.0 or more).
GROUPED_MM_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


@dataclass(frozen=True)
class Sorted:
    """Every (token, slot) pair of a top-k routing sorted by expert: ``order`` (positions in the
    flattened ``[T * k]`` routing, expert-major, stable), ``counts [E]`` pairs per expert."""

    order: torch.Tensor
    counts: torch.Tensor


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> Sorted:
    """Sort a routing ``[T, k]`` by expert (stable: ties keep token order, so the result is deterministic)."""
    flat = top_k_index.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return Sorted(torch.argsort(flat, stable=True), counts)


def grouped_mm_runs(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``grouped_mm(rows [S, K], weight [G, K, N])`` runs here: a device and dtype it takes
    and rows of a multiple of 16 bytes (what torch 2.13's kernels require of every stride)."""
    device = rows.device
    if not hasattr(F, "grouped_mm") or rows.dtype not in GROUPED_MM_DTYPES.get(device.type, ()) \
            or weight.dtype != rows.dtype:
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return False
    size = rows.element_size()
    return (weight.shape[-2] * size) % 16 == 0 and (weight.shape[-1] * size) % 16 == 0


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: torch 2.13's CPU ``grouped_mm``
    backward rejects an expanded gradient (``out.sum().backward()`` gives one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, transposed: bool = False,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``rows [S, in]`` in groups of ``counts`` (one per expert, in order) times each expert's
    ``weight [G, out, in]`` (``[G, in, out]`` when ``transposed``), plus its ``bias [G, out]``."""
    matrices = weight if transposed else weight.transpose(-2, -1)  # [G, in, out]
    if rows.is_meta:  # shardkit's checks: grouped_mm's meta kernel takes bfloat16 only and the loop needs values;
        out = rows @ matrices.sum(dim=0)  # the same shape, dtype and dependence on every expert's weights
    elif grouped_mm_runs(rows, matrices):
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)
        out = _ContiguousGrad.apply(F.grouped_mm(rows.contiguous(), matrices, offs=offsets))
    else:  # a dtype or width grouped_mm does not take: one expert at a time, the same products
        out = torch.cat([part @ matrices[g] for g, part in enumerate(rows.split(counts.tolist()))])
    if bias is not None:
        out = out + bias.repeat_interleave(counts, dim=0, output_size=rows.shape[0])
    return out


def expert_mlp(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor,
               weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Each group of ``rows`` (``counts`` rows per expert, in expert order) through its expert's
    gated MLP. ``weights``: the tensors to use instead of the module's own, by name (an
    expert-parallel rank's local experts)."""
    weights = weights if weights is not None else dict(experts.named_parameters(recurse=False))
    transposed = bool(getattr(experts, "is_transposed", False))
    hidden = grouped_linear(rows, weights["gate_up_proj"], counts, transposed, weights.get("gate_up_proj_bias"))
    if hasattr(experts, "_apply_gate"):
        hidden = experts._apply_gate(hidden)
    else:
        gate, up = hidden.chunk(2, dim=-1)
        hidden = experts.act_fn(gate) * up
    return grouped_linear(hidden, weights["down_proj"], counts, transposed, weights.get("down_proj_bias"))


def combine(expert_out: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Rows in sorted order (``order``) back to ``[T, dim]``: each weighted by its router weight,
    put back in (token, slot) order and summed over the ``k`` slots of a token (a fixed order:
    deterministic, unlike an atomic scatter)."""
    tokens, k = top_k_weights.shape
    unsorted = torch.empty_like(expert_out).index_copy(0, order, expert_out)
    weighted = unsorted * top_k_weights.reshape(-1, 1).to(unsorted.dtype)
    return weighted.view(tokens, k, -1).sum(dim=1)


def local_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of one process: every (token, slot) sorted by expert, grouped products, combined."""
    routed = sort_by_expert(top_k_index, experts.num_experts)
    rows = hidden_states[routed.order // top_k_index.shape[-1]]
    out = expert_mlp(experts, rows, routed.counts)
    return combine(out, routed.order, top_k_weights).to(hidden_states.dtype)


__all__ = ["GROUPED_MM_DTYPES", "Sorted", "combine", "expert_mlp", "grouped_linear", "grouped_mm_runs",
           "local_experts_forward", "sort_by_expert"]
