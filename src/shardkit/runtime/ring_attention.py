"""Causal ring attention over an ``sp`` group, and the load-balanced sequence layout it assumes.

Every rank of the ``sp`` group holds a slice of the sequence. Attention needs every key
for every query, so key/value chunks travel around the ring by point-to-point sends while
each rank keeps its queries; the partial softmax results are combined exactly through their
log-sum-exp. The backward pass rings the key/value chunks again, together with their
gradient accumulators, which end at the rank that owns them.

Causal load balancing: the sequence is cut into ``2 x sp`` chunks and rank ``r`` holds chunks
``r`` and ``2*sp-1-r`` (one early, one late), so every rank does the same causal work.

Why not torch's ``torch.distributed.tensor.experimental.context_parallel`` (checked on torch
2.13): it intercepts only the CUDA SDPA kernels (flash, memory-efficient, cuDNN). On CPU,
SDPA runs ``aten._scaled_dot_product_flash_attention_for_cpu``, for which it raises "does not
have a sharding strategy registered"; it also shards its buffers in place, which fails for
leaf tensors that require grad. This module therefore implements the ring with
``torch.distributed.batch_isend_irecv``, which runs on gloo and NCCL alike. Each block runs
torch's fused CPU flash-attention op on CPU (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward, which return and take the log-sum-exp), or plain float32 matmuls elsewhere.

>>> import torch
>>> shard_sequence(torch.arange(8), sp_rank=0, sp_size=2, dim=0).tolist()
[0, 1, 6, 7]
>>> sequence_positions(8, sp_rank=1, sp_size=2).tolist()
[2, 3, 4, 5]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..plan import PlanError, UsageError


# -- load-balanced sequence layout ------------------------------------------------------------
def _check_length(length: int, sp_size: int, what: str) -> None:
    if length % (2 * sp_size):
        below = length // (2 * sp_size) * (2 * sp_size)
        raise PlanError(f"{what} has length {length}, which does not split into 2 x sp = {2 * sp_size} "
                        f"load-balanced chunks for context parallel (sp={sp_size}); use a multiple of "
                        f"{2 * sp_size}, e.g. {below or 2 * sp_size} or {below + 2 * sp_size}")


def shard_sequence(t: torch.Tensor, sp_rank: int, sp_size: int, dim: int = 1) -> torch.Tensor:
    """This sp rank's part of ``t`` along ``dim``: chunks ``r`` and ``2*sp-1-r`` of ``2*sp``.

    >>> shard_sequence(torch.arange(8).view(1, 8), 1, 2).tolist()
    [[2, 3, 4, 5]]
    """
    if sp_size == 1:
        return t
    _check_length(t.shape[dim], sp_size, f"tensor dim {dim} (the sequence)")
    chunks = t.chunk(2 * sp_size, dim=dim)
    return torch.cat([chunks[sp_rank], chunks[2 * sp_size - 1 - sp_rank]], dim=dim)


def unshard_sequence(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Reassemble the full sequence from every sp rank's part (in sp rank order).

    >>> parts = [shard_sequence(torch.arange(8), r, 2, dim=0) for r in range(2)]
    >>> unshard_sequence(parts, dim=0).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    sp_size = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [halves[r][0] for r in range(sp_size)] + [halves[r][1] for r in reversed(range(sp_size))]
    return torch.cat(ordered, dim=dim)


def sequence_positions(seq_len: int, sp_rank: int, sp_size: int, device: torch.device | str | None = None
                       ) -> torch.Tensor:
    """Global positions of this sp rank's tokens in a sequence of ``seq_len`` (load-balanced order)."""
    return shard_sequence(torch.arange(seq_len, device=device), sp_rank, sp_size, dim=0)


def gather_sequence(t: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """All-gather every sp rank's part of ``t`` over ``group`` and return the full sequence (no grad)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return unshard_sequence(parts, dim=dim)


# -- ring attention ---------------------------------------------------------------------------
def _exchange(group: dist.ProcessGroup, send: torch.Tensor | None, recv: torch.Tensor | None,
              extra_recv: torch.Tensor | None = None) -> list:
    """Start the ring step: send to the next rank, receive from the previous one (async works).

    Sends and receives between a pair of ranks must be posted in the same order on both
    sides (NCCL matches by order): ``extra_recv`` (a gradient accumulator) comes first.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    ops = []
    if extra_recv is not None:
        ops.append(dist.P2POp(dist.irecv, extra_recv, group=group, group_peer=prev))
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=nxt))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=prev))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # float32, or float64 for float64 inputs


def _step_blocks(step: int, src: int, rank: int, local_len: int) -> tuple[slice, slice, bool]:
    """Which local query rows attend to which columns of rank ``src``'s keys, and whether causally.

    Rank ``r`` holds chunks (r, 2n-1-r). Step 0 (own keys) is a plain causal block. Keys of an
    earlier rank: its first chunk precedes both of ours, its second follows both. Keys of a
    later rank: both precede our second chunk and follow our first.
    """
    half = local_len // 2
    everything = slice(0, local_len)
    if step == 0:
        return everything, everything, True
    if src < rank:
        return everything, slice(0, half), False
    return slice(half, local_len), everything, False


def _expand_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


# Block kernels: attention of some query rows over some key columns, returning the block's output
# and log-sum-exp; their backward takes the *final* output and log-sum-exp (flash-attention's
# identity: with those, each block's gradients are exact and simply add up).
def _flash_cpu_forward(q, k, v, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    return out, lse


def _flash_cpu_backward(dout, q, k, v, out, lse, scale, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
        0.0, causal, scale=scale)


def _scores(q, k, scale, causal):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _math_forward(q, k, v, scale, causal):
    acc = _accumulation_dtype(q)
    s = _scores(q.to(acc), k.to(acc), scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc)), lse


def _math_backward(dout, q, k, v, out, lse, scale, causal):
    acc = _accumulation_dtype(q)
    q, k, v, dout = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - (dout * out.to(acc)).sum(-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


#: ``kernel`` name -> (forward, backward). "flash_cpu" is torch's fused CPU flash-attention op
#: (about 15x faster than "math" on one thread, no ``local x local`` score matrix); "math" is
#: plain matmuls in float32, for every device.
KERNELS = {"flash_cpu": (_flash_cpu_forward, _flash_cpu_backward), "math": (_math_forward, _math_backward)}


def _kernel_for(name: str, q: torch.Tensor):
    if name == "auto":
        name = "flash_cpu" if q.device.type == "cpu" and q.dtype != torch.float16 else "math"
    if name not in KERNELS:
        raise UsageError(f"ring_attention(kernel={name!r}); valid: 'auto' or one of {sorted(KERNELS)}")
    return KERNELS[name]


class _RingAttention(torch.autograd.Function):
    """Exact causal attention over the sp ring; float32 (or wider) merging of partial results;
    grouped-query attention without repeating k/v in transit."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, kernel):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        forward_fn, _ = _kernel_for(kernel, q)
        groups, acc = q.shape[1] // k.shape[1], _accumulation_dtype(q)
        kv = torch.stack([k, v]).contiguous()
        # [batch, len, heads, dim] in memory, as SDPA returns it: the caller's transpose back to
        # [batch, len, heads * dim] is then a view, not a copy kept alive for the output projection
        batch, heads, length, dim = q.shape
        out = torch.zeros(batch, length, heads, dim, dtype=acc, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for step in range(size):
            incoming = torch.empty_like(kv) if step < size - 1 else None
            works = _exchange(group, kv if incoming is not None else None, incoming)
            rows, cols, causal = _step_blocks(step, (rank - step) % size, rank, q.shape[2])
            kb, vb = (_expand_heads(t[:, :, cols], groups) for t in kv)
            block_out, block_lse = forward_fn(q[:, :, rows], kb, vb, scale, causal)
            block_lse = block_lse.to(acc)
            merged = torch.logaddexp(lse[:, :, rows], block_lse)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(-1)
                               + block_out.to(acc) * torch.exp(block_lse - merged).unsqueeze(-1))
            lse[:, :, rows] = merged
            _wait(works)
            kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.kernel = group, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        _, backward_fn = _kernel_for(ctx.kernel, q)
        groups, acc = q.shape[1] // k.shape[1], _accumulation_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv_sent = None
        for step in range(size):
            incoming = torch.empty_like(kv) if step < size - 1 else None
            # the accumulator for the keys we now hold, from the rank that held them one step ago
            dkv_in = torch.empty(kv.shape, dtype=acc, device=kv.device) if step else None
            works = _exchange(group, kv if incoming is not None else None, incoming, extra_recv=dkv_in)
            rows, cols, causal = _step_blocks(step, (rank - step) % size, rank, q.shape[2])
            kb, vb = (_expand_heads(t[:, :, cols], groups) for t in kv)
            dqb, dkb, dvb = backward_fn(dout[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows],
                                        lse[:, :, rows], scale, causal)
            dq[:, :, rows] += dqb
            _wait(works)
            if dkv_sent is not None:
                _wait(dkv_sent)
            dkv = dkv_in if dkv_in is not None else torch.zeros(kv.shape, dtype=acc, device=kv.device)
            dkv[0, :, :, cols] += _reduce_heads(dkb, groups)
            dkv[1, :, :, cols] += _reduce_heads(dvb, groups)
            dkv_sent = _exchange(group, dkv, None) if size > 1 else None
            kv = incoming
        if size > 1:
            own = torch.empty((2, *k.shape), dtype=acc, device=k.device)
            _wait(_exchange(group, None, own))  # our keys' accumulator, back from its last stop
            _wait(dkv_sent)
            dkv = own
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   scale: float | None = None, kernel: str = "auto") -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence split across ``group``.

    ``q``: ``[batch, heads, local_len, head_dim]``; ``k``, ``v``: ``[batch, kv_heads, local_len,
    head_dim]`` (``heads`` a multiple of ``kv_heads``: grouped-query attention). Tensors hold
    this rank's tokens in the load-balanced layout of :func:`shard_sequence`. Differentiable;
    equal to ``F.scaled_dot_product_attention(..., is_causal=True)`` on the full sequence.
    ``kernel``: the per-block attention (see :data:`KERNELS`); ``"auto"`` takes torch's CPU
    flash kernel on CPU and ``"math"`` elsewhere.

    >>> out = ring_attention(q, k, v, group=mesh["sp"].get_group())   # doctest: +SKIP
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise UsageError(f"ring_attention needs q [batch, heads, local_len, head_dim] and k, v of the same "
                        f"batch, length and head_dim; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise UsageError(f"ring_attention: query heads ({q.shape[1]}) must be a multiple of key/value heads "
                        f"({k.shape[1]})")
    if q.shape[2] % 2:
        raise UsageError(f"ring_attention: local sequence length {q.shape[2]} must be even (two load-balanced "
                        f"chunks per rank); shard the sequence with shard_sequence")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    _kernel_for(kernel, q)
    return _RingAttention.apply(q, k, v, group, scale, kernel)


class RingAttention:
    """A causal ``attention_fn(q, k, v)`` running :func:`ring_attention` over ``group``."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, scale=scale)

    def __deepcopy__(self, memo: dict) -> RingAttention:
        return self  # process groups cannot be copied; the function holds no other state

    def __repr__(self) -> str:
        return f"RingAttention(sp={dist.get_world_size(self.group)})"


__all__ = ["KERNELS", "RingAttention", "gather_sequence", "ring_attention", "sequence_positions", "shard_sequence",
           "unshard_sequence"]
