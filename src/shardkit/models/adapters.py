"""What torch's tensor-parallel styles cannot know about a model's attention.

``ColwiseParallel`` splits a projection's output features contiguously. That is right when
the features are whole heads in order (Llama's separate q/k/v, the reference GPT: both
reshape heads with ``-1``, so a rank runs its local heads unchanged), but two things are
outside the styles' reach:

- head counts: a projection of 2 kv heads x 16 features splits evenly over 4 ranks, yet
  each rank would hold half a head. :func:`tensor_parallel_problems` reports it before launch.
- fused projections: GPT-2's ``c_attn`` (a transformers ``Conv1D``, weight ``[in, out]``)
  computes ``[q | k | v]`` in one matrix; a contiguous split would give rank 0 all of q and
  part of k. :func:`adapt_for_tensor_parallel` permutes its columns so the contiguous split
  gives every rank its own q, k and v heads, and tells the module its local width.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..plan import PlanError


def tensor_parallel_problems(model: nn.Module, tp_size: int) -> list[str]:
    """Head-count constraints ``tp_size`` breaks: one line per distinct attention shape.

    Knows GPT-2 attention (``c_attn`` + ``num_heads``) and q/k/v attention with ``head_dim``
    (Llama family, the reference GPT). Works on the meta device.

    >>> from shardkit.models.gpt import GPT, GPTConfig
    >>> print(tensor_parallel_problems(GPT(GPTConfig(layers=1, heads=4)), 3)[0])
    tensor parallel tp=3: attention 'layers.0.attn' has 4 heads, but each rank must hold whole heads; valid tp sizes: [1, 2, 4]
    """
    if tp_size < 1:
        raise PlanError(f"tensor parallel size {tp_size} must be >= 1")
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, module in model.named_modules():
        counts = _head_counts(module)
        if counts is not None:
            shapes.setdefault(counts, []).append(name)
    problems = []
    for (heads, kv_heads), names in shapes.items():
        if heads % tp_size or kv_heads % tp_size:
            common = math.gcd(heads, kv_heads)
            valid = [d for d in range(1, common + 1) if common % d == 0]
            what = f"{heads} heads" if heads == kv_heads else f"{heads} query heads and {kv_heads} key/value heads"
            more = f" (and {len(names) - 1} more like it)" if len(names) > 1 else ""
            problems.append(f"tensor parallel tp={tp_size}: attention {names[0]!r}{more} has {what}, but each "
                            f"rank must hold whole heads; valid tp sizes: {valid}")
    return problems


def adapt_for_tensor_parallel(model: nn.Module, tp_size: int, tp_rank: int) -> dict[str, tuple[int, torch.Tensor]]:
    """Patch ``model`` in place so a contiguous ``Shard`` of its parameters runs per rank.

    Call on the full (unsharded) model before the tensor-parallel styles are applied.
    GPT-2 fused ``c_attn``: its weight columns (dim 1) and bias (dim 0) are permuted from
    ``[q | k | v]`` to rank-major ``[q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...]`` (same
    ``Parameter`` objects) and the module's ``split_size`` becomes the local width. The
    permutation is the same on every rank (``tp_rank`` is checked, not used: a rank finds
    its heads by the contiguous shard). Returns ``{parameter name: (dim, perm)}`` for every
    permuted parameter; ``permuted.index_select(dim, torch.argsort(perm))`` is the original.
    Raises :class:`PlanError` when ``tp_size`` does not divide the head counts.

    >>> from shardkit.models.gpt import build_tiny_gpt
    >>> adapt_for_tensor_parallel(build_tiny_gpt(), 2, 0)   # whole heads already, nothing to patch
    {}
    """
    if not 0 <= tp_rank < tp_size:
        raise PlanError(f"tp_rank={tp_rank} is outside the tensor-parallel group of size {tp_size}; valid: 0..{tp_size - 1}")
    problems = tensor_parallel_problems(model, tp_size)
    if problems:
        raise PlanError(problems)
    perms: dict[str, tuple[int, torch.Tensor]] = {}
    if tp_size == 1:
        return perms
    for name, module in model.named_modules():
        if _is_gpt2_attention(module):
            perms.update(_split_fused_qkv(name, module, tp_size))
    return perms


def _is_gpt2_attention(module: nn.Module) -> bool:
    return hasattr(module, "c_attn") and hasattr(module, "split_size") and hasattr(module, "num_heads")


def _head_counts(module: nn.Module) -> tuple[int, int] | None:
    """``(query heads, key/value heads)`` of an attention module, ``None`` for anything else."""
    if _is_gpt2_attention(module):
        return module.num_heads, module.num_heads
    head_dim = getattr(module, "head_dim", None)
    q_proj, k_proj = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
    if isinstance(head_dim, int) and isinstance(q_proj, nn.Linear) and isinstance(k_proj, nn.Linear):
        return q_proj.out_features // head_dim, k_proj.out_features // head_dim
    return None


def _split_fused_qkv(name: str, attn: nn.Module, tp_size: int) -> dict[str, tuple[int, torch.Tensor]]:
    """Permute ``attn.c_attn`` to rank-major order and set ``attn.split_size`` to the local width."""
    width = attn.split_size
    if width != attn.embed_dim:
        raise PlanError(f"attention {name!r} was already adapted for tensor parallel (split_size={width}, "
                        f"embed_dim={attn.embed_dim}); adapt a freshly built model once")
    c_attn = attn.c_attn
    parts = c_attn.weight.shape[1] // width  # 3 for [q | k | v]; 2 for cross-attention's [k | v]
    local = width // tp_size
    perm = torch.cat([torch.arange(rank * local, (rank + 1) * local) + part * width
                      for rank in range(tp_size) for part in range(parts)])
    prefix = f"{name}.c_attn." if name else "c_attn."
    permuted = {}
    with torch.no_grad():
        for pname, dim in (("weight", 1), ("bias", 0)):
            param = getattr(c_attn, pname, None)
            if param is not None:
                param.copy_(param.index_select(dim, perm.to(param.device)))
                permuted[prefix + pname] = (dim, perm)
    attn.split_size = local
    return permuted
