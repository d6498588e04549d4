"""Ring attention (context parallel) against full-sequence causal SDPA, and the sequence layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.plan import Mesh, Plan, PlanError, UsageError
from shardkit.runtime import ring_kernels
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
    with pytest.raises(UsageError, match="kernel='fast'.*'efficient_cuda', 'flash_cpu', 'flash_cuda', 'math'"):
        ring_attention(q, q, q, group=None, kernel="fast")
    with pytest.raises(UsageError, match=r"kernel='flash_cuda'.* cpu torch.float32.*valid there: 'auto' or one of "
                                         r"\['flash_cpu', 'math'\]"):
        ring_attention(q, q, q, group=None, kernel="flash_cuda")


# -- the kernels on CUDA, faked on CPU --------------------------------------------------------
@pytest.mark.parametrize("dtype,head_dim,expected", [
    (torch.bfloat16, 64, "flash_cuda"), (torch.float16, 16, "flash_cuda"), (torch.bfloat16, 12, "efficient_cuda"),
    (torch.float32, 64, "efficient_cuda"), (torch.float64, 64, "math"),
])
def test_auto_takes_the_fused_kernels_on_cuda(monkeypatch, dtype, head_dim, expected):
    monkeypatch.setattr(ring_kernels, "device_type", lambda t: "cuda")
    assert ring_kernels.choose("auto", torch.zeros(1, 2, 8, head_dim, dtype=dtype)).name == expected


class FakeAten:
    """Stand-ins for the CUDA SDPA ops: the math kernel's output and log-sum-exp, with the calls recorded."""

    def __init__(self):
        self.calls = []

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout, causal, debug, *, scale):
        self.calls.append(("flash", q.dtype, causal, dropout, debug))
        out, lse, _ = ring_kernels._math_forward(q, k, v, scale, causal)
        return (out.to(q.dtype), lse.float(), "cum_q", "cum_k", q.shape[2], k.shape[2], "seed", "offset", None)

    def _scaled_dot_product_flash_attention_backward(self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                                                     dropout, causal, seed, offset, *, scale):
        assert (cum_q, cum_k, max_q, max_k, seed, offset) == ("cum_q", "cum_k", q.shape[2], k.shape[2], "seed",
                                                              "offset"), "the block's own forward state"
        assert lse.dtype == torch.float32 and lse.is_contiguous() and out.dtype == q.dtype
        self.calls.append(("flash_backward", q.dtype, causal, dropout))
        return tuple(g.to(q.dtype) for g in ring_kernels._math_backward(dout, q, k, v, out, lse, scale, causal, None))

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, compute_lse, dropout, causal, *, scale):
        self.calls.append(("efficient", q.dtype, causal, dropout, bias, compute_lse))
        out, lse, _ = ring_kernels._math_forward(q, k, v, scale, causal)
        padded = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32), value=1e4)  # as the CUDA kernel pads
        return out.to(q.dtype), padded, "seed", "offset"

    def _scaled_dot_product_efficient_attention_backward(self, dout, q, k, v, bias, out, lse, seed, offset, dropout,
                                                         mask, causal, *, scale):
        assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= q.shape[2] and (seed, offset) == ("seed", "offset")
        self.calls.append(("efficient_backward", q.dtype, causal, dropout, bias, tuple(mask)))
        grads = ring_kernels._math_backward(dout, q, k, v, out, lse[..., :q.shape[2]], scale, causal, None)
        return (*(g.to(q.dtype) for g in grads), None)


def _ring_on_fake_cuda(ctx, heads, kv_heads, seq, head_dim):
    """The ring over stand-ins of the CUDA kernels: float32 against SDPA (memory-efficient kernel), bfloat16
    against the ring's math kernel (flash); and the calls the stand-ins saw."""
    fake, saved = FakeAten(), (ring_kernels.ATEN, ring_kernels.device_type)
    ring_kernels.ATEN, ring_kernels.device_type = fake, lambda t: "cuda"
    try:
        diffs = _ring_vs_sdpa(ctx, 2, heads, kv_heads, seq, head_dim, "auto")
        group = ctx.mesh["sp"].get_group()
        sp_rank, sp = ctx.coordinates()["sp"], ctx.plan.mesh["sp"]
        qkvd = [shard_sequence(t.bfloat16(), sp_rank, sp, dim=2) for t in _qkvd(2, 2, heads, kv_heads, seq, head_dim)]
        grads = {}
        for kernel in ("auto", "math"):
            local = [t.clone().requires_grad_() for t in qkvd[:3]]
            out = ring_attention(*local, group, kernel=kernel)
            out.backward(qkvd[3])
            grads[kernel] = [out.float()] + [t.grad.float() for t in local]
    finally:
        ring_kernels.ATEN, ring_kernels.device_type = saved
    bf16 = max(float((a - b).abs().max()) for a, b in zip(grads["auto"], grads["math"]))
    return diffs, bf16, sorted(set(fake.calls), key=str)


def test_ring_attention_runs_the_cuda_kernels_it_chooses_and_merges_their_lse(world):
    results = world(2).run(_ring_on_fake_cuda, 4, 2, 16, 8, plan=Plan(mesh=Mesh(sp=2)))
    f32, bf16 = torch.float32, torch.bfloat16
    for rank, (diffs, bf16_diff, calls) in enumerate(results):
        assert max(diffs.values()) < TOL, f"rank {rank}: {diffs}"
        assert bf16_diff < 2e-2, f"rank {rank}: bfloat16 flash ring differs from the math ring by {bf16_diff}"
        assert calls == sorted({  # no upcast, no dropout; causal on the own block only
            ("efficient", f32, True, 0.0, None, True), ("efficient", f32, False, 0.0, None, True),
            ("efficient_backward", f32, True, 0.0, None, (True, True, True, False)),
            ("efficient_backward", f32, False, 0.0, None, (True, True, True, False)),
            ("flash", bf16, True, 0.0, False), ("flash", bf16, False, 0.0, False),
            ("flash_backward", bf16, True, 0.0), ("flash_backward", bf16, False, 0.0)}, key=str), calls


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


def _ring_counts(ctx):
    """(calls, float32 passes over the rank's queries) ring attention runs forward and backward."""
    from shardkit.planner.counters import OpCounter

    group = ctx.mesh["sp"].get_group()
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    ring_attention(q, k, v, group).sum().backward()  # warm-up
    for t in (q, k, v):
        t.grad = None  # in a model q, k and v are no leaves: nothing accumulates into a .grad
    forward, backward = [], []
    with OpCounter(lambda traffic, *_: forward.append(traffic)):
        out = ring_attention(q, k, v, group)
    with OpCounter(lambda traffic, *_: backward.append(traffic)):
        out.backward(torch.ones_like(out))
    unit = q.numel() * 4
    return (len(forward), sum(forward) / unit), (len(backward), sum(backward) / unit)


@pytest.mark.parametrize("sp", [2, 4])
def test_the_planner_prices_the_rings_own_operators_as_they_run(world, sp):
    """step_time.RING_OPS / RING_TRAFFIC (the ring's calls and passes beyond plain SDPA's own) are the
    counts of the ring as it runs: they move with torch or with runtime/ring_attention.py."""
    from shardkit.planner.step_time import RING_OPS, RING_TRAFFIC

    (calls_f, passes_f), (calls_b, passes_b) = world(4).run(_ring_counts, plan=Plan(mesh=Mesh(sp=sp, fsdp=4 // sp)))[0]
    sdpa = ((1, 0.0), (5, 19.1))  # plain SDPA's own, already in the model's costs
    for (calls, passes), (own_calls, own_passes), ops, traffic in zip(
            ((calls_f, passes_f), (calls_b, passes_b)), sdpa, RING_OPS, RING_TRAFFIC):
        assert calls - own_calls == ops[0] * sp + ops[1]
        assert passes - own_passes == pytest.approx(traffic[0] * sp + traffic[1], abs=0.2)
