"""The attention kernels of ring attention's blocks, chosen by device and dtype.

Each block of :mod:`shardkit.runtime.ring_attention` is the attention of some query rows over
some key columns; the ring merges the blocks through their log-sum-exp, so a kernel must
return it (and its backward take the *final* output and log-sum-exp: flash-attention's
identity makes each block's gradients exact, and they simply add up). torch's SDPA kernels
that return the log-sum-exp are private aten ops (``F.scaled_dot_product_attention`` does not
return it), the same ones torch's own context parallel calls on CUDA
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``):

- ``flash_cuda``: ``aten._scaled_dot_product_flash_attention`` (CUDA, float16/bfloat16,
  head_dim a multiple of 8 up to 256), no score matrix, no upcast of q/k/v;
- ``efficient_cuda``: ``aten._scaled_dot_product_efficient_attention`` (CUDA, float32 too; its
  log-sum-exp comes padded to a multiple of 32 positions, which the backward takes back);
- ``flash_cpu``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (about 15x faster than
  "math" on one thread);
- ``math``: plain matmuls in float32 (float64 for float64 inputs) with a full score matrix per
  block, for every device and dtype (CUDA float64, CPU float16).

``"auto"`` (:func:`choose`) takes the first of those that runs on the inputs.

>>> choose("auto", torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)).name
'flash_cpu'
>>> choose("auto", torch.zeros(1, 2, 8, 16, dtype=torch.float16)).name
'math'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..plan import UsageError

#: The aten namespace the fused kernels are called through (a test puts stand-ins here).
ATEN: Any = torch.ops.aten
#: The efficient kernel's log-sum-exp is padded to a multiple of this many positions.
LSE_ALIGN = 32


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs: what the ring merges its blocks in."""
    return torch.promote_types(t.dtype, torch.float32)


def device_type(t: torch.Tensor) -> str:
    """``t``'s device type (one function, so that a test can fake a CUDA tensor on CPU)."""
    return t.device.type


@dataclass(frozen=True)
class Kernel:
    """A block kernel: ``forward(q, k, v, scale, causal) -> (out, lse, saved)`` and
    ``backward(dout, q, k, v, out, lse, scale, causal, saved) -> (dq, dk, dv)``; ``saved`` is what
    the forward returns for the backward of the same block (the fused kernels' rng state)."""

    name: str
    forward: Callable
    backward: Callable


def _flash_cpu_forward(q, k, v, scale, causal):
    out, lse = ATEN._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    return out, lse, None


def _flash_cpu_backward(dout, q, k, v, out, lse, scale, causal, saved):
    return ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
        0.0, causal, scale=scale)


def _flash_cuda_forward(q, k, v, scale, causal):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = ATEN._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_cuda_backward(dout, q, k, v, out, lse, scale, causal, saved):
    cum_q, cum_k, max_q, max_k, seed, offset = saved
    return ATEN._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.to(torch.float32).contiguous(), cum_q, cum_k, max_q, max_k,
        0.0, causal, seed, offset, scale=scale)[:3]


def _efficient_cuda_forward(q, k, v, scale, causal):
    out, lse, seed, offset = ATEN._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                           scale=scale)
    return out, lse[..., :q.shape[-2]], (seed, offset)


def _efficient_cuda_backward(dout, q, k, v, out, lse, scale, causal, saved):
    seed, offset = saved
    padded = F.pad(lse.to(torch.float32), (0, -lse.shape[-1] % LSE_ALIGN)).contiguous()
    return ATEN._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, k, v, None, out.contiguous(), padded, seed, offset, 0.0, [True, True, True, False],
        causal, scale=scale)[:3]


def _scores(q, k, scale, causal):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _math_forward(q, k, v, scale, causal):
    acc = accumulation_dtype(q)
    s = _scores(q.to(acc), k.to(acc), scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc)), lse, None


def _math_backward(dout, q, k, v, out, lse, scale, causal, saved):
    acc = accumulation_dtype(q)
    q, k, v, dout = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - (dout * out.to(acc)).sum(-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


#: ``kernel`` name -> :class:`Kernel`, in the order ``"auto"`` tries them.
KERNELS = {kernel.name: kernel for kernel in (
    Kernel("flash_cuda", _flash_cuda_forward, _flash_cuda_backward),
    Kernel("efficient_cuda", _efficient_cuda_forward, _efficient_cuda_backward),
    Kernel("flash_cpu", _flash_cpu_forward, _flash_cpu_backward),
    Kernel("math", _math_forward, _math_backward),
)}


def _runs(name: str, q: torch.Tensor) -> bool:
    """Whether kernel ``name`` runs on inputs like ``q`` ([batch, heads, len, head_dim])."""
    device, dtype, head_dim = device_type(q), q.dtype, q.shape[-1]
    if name == "flash_cuda":
        return device == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256
    if name == "efficient_cuda":
        return device == "cuda" and dtype in (torch.float16, torch.bfloat16, torch.float32)
    if name == "flash_cpu":
        return device == "cpu" and dtype != torch.float16
    return True


def choose(name: str, q: torch.Tensor) -> Kernel:
    """The kernel ``name`` (``"auto"``: the first of :data:`KERNELS` that runs on ``q``'s device and dtype)."""
    if name == "auto":
        return next(KERNELS[n] for n in KERNELS if _runs(n, q))
    if name not in KERNELS:
        raise UsageError(f"ring_attention(kernel={name!r}); valid: 'auto' or one of {sorted(KERNELS)}")
    if not _runs(name, q):
        valid = [n for n in KERNELS if _runs(n, q)]
        raise UsageError(f"ring_attention(kernel={name!r}) does not run on {device_type(q)} {q.dtype} inputs of head_dim "
                         f"{q.shape[-1]}; valid there: 'auto' or one of {valid}")
    return KERNELS[name]


__all__ = ["ATEN", "KERNELS", "LSE_ALIGN", "Kernel", "accumulation_dtype", "choose", "device_type"]
