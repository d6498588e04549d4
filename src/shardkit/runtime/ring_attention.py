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
``torch.distributed.batch_isend_irecv`` (:mod:`shardkit.runtime.p2p`: each ring step's sends
and receives, key/values and gradient accumulators alike, in one batch, as NCCL needs), which
runs on gloo and NCCL alike. Each block runs a fused SDPA kernel that returns the log-sum-exp
(flash or memory-efficient on CUDA, flash on CPU; :mod:`shardkit.runtime.ring_kernels`).

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
from . import p2p
from .ring_kernels import accumulation_dtype, choose


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
def _ring_step(group: dist.ProcessGroup, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> list:
    """Start one ring step in one batch (:func:`~shardkit.runtime.p2p.exchange`): ``send`` to the next
    rank, ``recv`` from the previous one, in that order on both sides (async works)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    return p2p.exchange(group, [(nxt, t) for t in send], [(prev, t) for t in recv])


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


class _RingAttention(torch.autograd.Function):
    """Exact causal attention over the sp ring; float32 (or wider) merging of partial results;
    grouped-query attention without repeating k/v in transit."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, kernel):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        forward_fn = choose(kernel, q).forward
        groups, acc = q.shape[1] // k.shape[1], accumulation_dtype(q)
        kv = torch.stack([k, v]).contiguous()
        # [batch, len, heads, dim] in memory, as SDPA returns it: the caller's transpose back to
        # [batch, len, heads * dim] is then a view, not a copy kept alive for the output projection
        batch, heads, length, dim = q.shape
        out = torch.zeros(batch, length, heads, dim, dtype=acc, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        saved = []  # each block's kernel state for its backward
        for step in range(size):
            incoming = torch.empty_like(kv) if step < size - 1 else None
            works = _ring_step(group, [kv], [incoming]) if incoming is not None else []
            rows, cols, causal = _step_blocks(step, (rank - step) % size, rank, q.shape[2])
            kb, vb = (_expand_heads(t[:, :, cols], groups) for t in kv)
            block_out, block_lse, block_saved = forward_fn(q[:, :, rows], kb, vb, scale, causal)
            saved.append(block_saved)
            block_lse = block_lse.to(acc)
            merged = torch.logaddexp(lse[:, :, rows], block_lse)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(-1)
                               + block_out.to(acc) * torch.exp(block_lse - merged).unsqueeze(-1))
            lse[:, :, rows] = merged
            p2p.wait(works)
            kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.kernel, ctx.blocks = group, scale, kernel, saved
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        backward_fn = choose(ctx.kernel, q).backward
        groups, acc = q.shape[1] // k.shape[1], accumulation_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = None  # the accumulator of the keys held at the previous step, to send on with them
        for step in range(size):
            incoming = torch.empty_like(kv) if step < size - 1 else None
            # one batch per step (NCCL needs a ring's sends and receives in one group): the previous keys'
            # accumulator goes on to the next rank, while the accumulator for the keys we now hold (which the
            # previous rank finished at its previous step) comes in, with the next keys
            dkv_in = torch.empty(kv.shape, dtype=acc, device=kv.device) if step else None
            sends = ([dkv] if step else []) + ([kv] if incoming is not None else [])
            works = _ring_step(group, sends, [t for t in (dkv_in, incoming) if t is not None])
            rows, cols, causal = _step_blocks(step, (rank - step) % size, rank, q.shape[2])
            kb, vb = (_expand_heads(t[:, :, cols], groups) for t in kv)
            dqb, dkb, dvb = backward_fn(dout[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows],
                                        lse[:, :, rows], scale, causal, ctx.blocks[step])
            dq[:, :, rows] += dqb
            p2p.wait(works)
            dkv = dkv_in if dkv_in is not None else torch.zeros(kv.shape, dtype=acc, device=kv.device)
            dkv[0, :, :, cols] += _reduce_heads(dkb, groups)
            dkv[1, :, :, cols] += _reduce_heads(dvb, groups)
            kv = incoming
        if size > 1:  # the last accumulator on to its owner (the next rank), ours back from the previous
            own = torch.empty((2, *k.shape), dtype=acc, device=k.device)
            p2p.wait(_ring_step(group, [dkv], [own]))
            dkv = own
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   scale: float | None = None, kernel: str = "auto") -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence split across ``group``.

    ``q``: ``[batch, heads, local_len, head_dim]``; ``k``, ``v``: ``[batch, kv_heads, local_len,
    head_dim]`` (``heads`` a multiple of ``kv_heads``: grouped-query attention). Tensors hold
    this rank's tokens in the load-balanced layout of :func:`shard_sequence`. Differentiable;
    equal to ``F.scaled_dot_product_attention(..., is_causal=True)`` on the full sequence.
    ``kernel``: the per-block attention (:data:`~shardkit.runtime.ring_kernels.KERNELS`);
    ``"auto"`` takes torch's fused kernels that return the log-sum-exp (flash or memory-efficient
    on CUDA, flash on CPU) and float32 matmuls where none runs.

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
    choose(kernel, q)
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


__all__ = ["RingAttention", "gather_sequence", "ring_attention", "sequence_positions", "shard_sequence",
           "unshard_sequence"]
