"""Ring attention (context parallel) against full-sequence causal SDPA, and the sequence layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.plan import Mesh, Plan, PlanError, UsageError
from shardkit.runtime.ring_attention import (
    gather_sequence,
    ring_attention,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)

TOL = 1e-5


# -- layout (no processes) --------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(sp=st.integers(1, 6), chunk=st.integers(1, 5), batch=st.integers(1, 3))
def test_shard_unshard_round_trip_and_positions(sp, chunk, batch):
    seq = 2 * sp * chunk
    full = torch.arange(batch * seq).view(batch, seq)
    parts = [shard_sequence(full, r, sp) for r in range(sp)]
    assert all(p.shape == (batch, seq // sp) for p in parts)
    assert torch.equal(unshard_sequence(parts), full)
    positions = [sequence_positions(seq, r, sp) for r in range(sp)]
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(seq))
    for r in range(sp):
        assert torch.equal(parts[r][0], full[0, positions[r]])


@pytest.mark.parametrize("sp", [2, 4])
def test_load_balanced_chunks_give_equal_causal_work(sp):
    seq = 8 * sp
    work = [int((sequence_positions(seq, r, sp) + 1).sum()) for r in range(sp)]  # keys seen per query
    assert len(set(work)) == 1
    plain = [int((torch.arange(seq).chunk(sp)[r] + 1).sum()) for r in range(sp)]
    assert len(set(plain)) == sp  # the naive contiguous split is unbalanced


@pytest.mark.parametrize("seq,sp", [(6, 2), (12, 4), (10, 4)])
def test_shard_sequence_rejects_lengths_not_divisible_by_two_sp(seq, sp):
    with pytest.raises(PlanError, match=rf"length {seq}.*2 x sp = {2 * sp}.*multiple of {2 * sp}"):
        shard_sequence(torch.zeros(1, seq), 0, sp)


def test_ring_attention_rejects_bad_shapes_and_kernels():
    q = torch.zeros(1, 4, 8, 4)
    with pytest.raises(UsageError, match="multiple of key/value heads"):  # a misused function: UsageError
        ring_attention(q, torch.zeros(1, 3, 8, 4), torch.zeros(1, 3, 8, 4), group=None)
    with pytest.raises(UsageError, match="kernel='fast'.*'flash_cpu', 'math'"):
        ring_attention(q, q, q, group=None, kernel="fast")


# -- ring attention in a world ----------------------------------------------------------------
def _qkvd(seed, batch, heads, kv_heads, seq, head_dim):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, generator=g) for _ in range(2))
    return q, k, v, torch.randn(batch, heads, seq, head_dim, generator=g)


def _ring_vs_sdpa(ctx, batch, heads, kv_heads, seq, head_dim, kernel):
    group = ctx.mesh["sp"].get_group()
    sp_rank, sp = ctx.coordinates()["sp"], ctx.plan.mesh["sp"]
    q, k, v, dout = _qkvd(0, batch, heads, kv_heads, seq, head_dim)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    groups = heads // kv_heads
    ref = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(groups, 1),
                                         full[2].repeat_interleave(groups, 1), is_causal=True)
    ref.backward(dout)
    local = [shard_sequence(t, sp_rank, sp, dim=2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, kernel=kernel)
    out.backward(shard_sequence(dout, sp_rank, sp, dim=2))
    diffs = {"out": (out - shard_sequence(ref, sp_rank, sp, dim=2)).abs().max().item()}
    for name, mine, theirs in zip("qkv", local, full):
        diffs["d" + name] = (mine.grad - shard_sequence(theirs.grad, sp_rank, sp, dim=2)).abs().max().item()
    return diffs


@pytest.mark.parametrize("kernel", ["flash_cpu", "math"])
@pytest.mark.parametrize("mesh,heads,kv_heads,seq", [
    (Mesh(sp=2), 2, 2, 16),
    (Mesh(sp=2, fsdp=2), 4, 2, 12),  # sp groups {0,2} and {1,3}; grouped-query attention
    (Mesh(sp=4), 2, 1, 24),
])
def test_ring_attention_equals_full_causal_sdpa_forward_and_backward(world, mesh, heads, kv_heads, seq, kernel):
    results = world(mesh.size).run(_ring_vs_sdpa, 2, heads, kv_heads, seq, 8, kernel, plan=Plan(mesh=mesh))
    for rank, diffs in enumerate(results):
        assert max(diffs.values()) < TOL, f"rank {rank}: {diffs}"


def _perturbation_reach(ctx, seq, positions):
    """For each position p: which outputs change when key/value p changes (full sequence order)."""
    group = ctx.mesh["sp"].get_group()
    sp_rank, sp = ctx.coordinates()["sp"], ctx.plan.mesh["sp"]
    q, k, v, _ = _qkvd(1, 1, 2, 2, seq, 4)
    base = gather_sequence(ring_attention(*(shard_sequence(t, sp_rank, sp, dim=2) for t in (q, k, v)), group),
                           group, dim=2)
    reach = {}
    for p in positions:
        k2, v2 = k.clone(), v.clone()
        k2[:, :, p] += 3.0
        v2[:, :, p] -= 3.0
        out = ring_attention(*(shard_sequence(t, sp_rank, sp, dim=2) for t in (q, k2, v2)), group)
        changed = (gather_sequence(out, group, dim=2) - base).abs().amax(dim=(0, 1, 3)) > 1e-6
        reach[p] = changed.nonzero().flatten().tolist()
    return reach


@pytest.mark.parametrize("sp", [2, 4])
def test_causality_holds_exactly_at_chunk_boundaries(world, sp):
    chunk, seq = 3, 6 * sp  # 2*sp chunks of 3 tokens
    boundaries = sorted({b + d for b in range(chunk, seq, chunk) for d in (-1, 0)} | {0, seq - 1})
    results = world(4).run(_perturbation_reach, seq, boundaries, plan=Plan(mesh=Mesh(sp=sp, fsdp=4 // sp)))
    for p in boundaries:
        assert results[0][p] == list(range(p, seq)), f"key {p} reached outputs {results[0][p]}"
