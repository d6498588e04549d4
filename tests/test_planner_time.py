"""The step-time model's terms for DTensor dispatch and for matrix products' size (issue 17),
unit-level: arithmetic on measured costs, no processes."""

from __future__ import annotations

import dataclasses
import math

import pytest

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, GPTConfig, build_small_gpt
from shardkit.planner import step_time
from shardkit.planner.costs import Costs, Setting
from shardkit.planner.estimate import estimate
from shardkit.planner.hardware import Link
from shardkit.planner.memory import blocks_per_device
from shardkit.planner.step_time import OPTIMIZER_OPS, dtensor_ops, time_of

A100 = sk.Hardware.preset("a100-80g")
SEQ, BATCH = 64, 8


@pytest.fixture(scope="module")
def gpt():
    return sk.meta_model(build_small_gpt)


def test_a_tensor_parallel_rank_runs_its_split_linears_on_dtensors(gpt):
    n = Costs.of(gpt, SEQ, 2, None, rules=GPT_RULES).numbers
    # six split linears a block, each t, view, addmm, view on DTensors; Megatron SP adds the residual
    # stream's operators (norms, adds, dropouts); the parameters: the linears' twelve, and the norms' four
    assert n.block_dtensor_ops == (24, 28) and n.block_dtensor_params == (12, 16)
    assert Costs.of(gpt, SEQ, 1, None).numbers.block_dtensor_ops == (0, 0)


@pytest.mark.parametrize("plan, sp, plan_data", [
    (sk.Plan(sk.Mesh(tp=2), rules=GPT_RULES), 0, False),
    (sk.Plan(sk.Mesh(tp=2, dp=2), rules=GPT_RULES), 0, True),
    (sk.Plan(sk.Mesh(tp=2, fsdp=2), rules=GPT_RULES, sequence_parallel=True), 1, True)])
def test_a_tensor_parallel_step_pays_dtensor_overhead_per_counted_operator(gpt, plan, sp, plan_data):
    costs = Costs.of(gpt, SEQ, 2, None, rules=GPT_RULES)
    n, s = costs.numbers, Setting.of(plan)
    hw = dataclasses.replace(A100, dtensor_overhead=1e-5, dtensor_collective=0.0)
    without = time_of(costs, s, BATCH, dataclasses.replace(hw, dtensor_overhead=0.0))
    parts = time_of(costs, s, BATCH, hw)
    blocks = blocks_per_device(n, s)
    per_pass = 3 * (n.embedding_dtensor_ops[sp] + n.head_dtensor_ops[sp] + blocks * n.block_dtensor_ops[sp])
    # the optimizer's operators on DTensor parameters: every one with a data axis beside tp, else the split ones
    params = sum(map(len, (n.embedding_pieces, n.head_pieces))) + blocks * len(n.block_pieces) if plan_data \
        else n.embedding_dtensor_params[sp] + n.head_dtensor_params[sp] + blocks * n.block_dtensor_params[sp]
    expected = (s.microbatches * per_pass + params * OPTIMIZER_OPS["adamw"][1]) * 1e-5
    assert dtensor_ops(n, s, hw, blocks) == per_pass > 0
    assert parts["dtensor"] == pytest.approx(expected) and "dtensor" not in without
    assert sum(parts.values()) - sum(without.values()) == pytest.approx(expected)


@pytest.mark.parametrize("sequence_parallel, per_block", [(False, 2 + 2), (True, 2 * (2 + 2))])
def test_each_tensor_parallel_collective_pays_dtensors_launch(gpt, sequence_parallel, per_block):
    """Per block: without SP the two row-parallel outputs all-reduced forward and the two column-parallel
    inputs' gradients backward (q, k and v read one tensor and share its conversion, as fc reads its own);
    with SP each input gathered and each output reduce-scattered, forward and backward; plus the head's
    gathered logits and two all-reduces."""
    costs = Costs.of(gpt, SEQ, 2, None, rules=GPT_RULES)
    s = Setting.of(sk.Plan(sk.Mesh(tp=2), rules=GPT_RULES, sequence_parallel=sequence_parallel))
    assert costs.numbers.block_tp_boundaries == (2, 2)
    hw = dataclasses.replace(A100, dtensor_collective=0.0)
    without, parts = time_of(costs, s, BATCH, hw), time_of(costs, s, BATCH, dataclasses.replace(hw, dtensor_collective=1e-3))
    calls = s.microbatches * (blocks_per_device(costs.numbers, s) * per_block + 3)
    assert parts["dtensor"] - without["dtensor"] == pytest.approx(calls * 1e-3)
    assert {k: v for k, v in parts.items() if k != "dtensor"} == {k: v for k, v in without.items() if k != "dtensor"}


def test_plans_without_dtensors_pay_none(gpt):
    for plan in (sk.Plan(sk.Mesh(dp=4)), sk.Plan(sk.Mesh(pp=2, dp=2), pipeline=sk.Pipeline(microbatches=2))):
        assert "dtensor" not in estimate(gpt, plan, batch_size=BATCH, seq_len=SEQ, hardware=A100).step_time_parts
    # FSDP keeps its sharded parameters as DTensors: the optimizer's operators on them, nothing else
    parts = estimate(gpt, sk.Plan(sk.Mesh(fsdp=4)), batch_size=BATCH, seq_len=SEQ, hardware=A100).step_time_parts
    n = Costs.of(gpt, SEQ, 1, None).numbers
    tensors = len(n.embedding_pieces) + len(n.head_pieces) + n.layers * len(n.block_pieces)
    assert parts["dtensor"] == pytest.approx(tensors * OPTIMIZER_OPS["adamw"][1] * A100.dtensor_overhead)


def test_a_products_efficiency_grows_with_its_size():
    sizes = [2 * n**3 for n in (512, 1024, 2048, 4096, 8192, 16384)]
    rates = [A100.matmul_efficiency_at(f, "bfloat16") for f in sizes]
    assert rates == sorted(rates) and rates[0] < 0.4 < 0.85 < rates[-1] < A100.matmul_efficiency
    assert sk.Hardware.preset("h100-80g").matmul_efficiency_at(2 * 8192**3, "bfloat16") == pytest.approx(0.79, abs=0.01)
    with pytest.raises(sk.UsageError, match="give a product's FLOPs"):
        A100.matmul_efficiency_at(0, "bfloat16")


def test_each_matrix_product_pays_the_fixed_latency(gpt):
    costs = Costs.of(gpt, SEQ, 1, None)
    n = costs.numbers
    assert (n.block_products, n.head_products, n.embedding_products) == (7, 1, 0)  # 6 linears + attention; LM head
    for recompute, again in (("none", 0), ("full", n.block_products)):
        s = Setting(dp=4, recompute=recompute)
        with_latency = time_of(costs, s, BATCH, A100)["compute"]
        without = time_of(costs, s, BATCH, dataclasses.replace(A100, matmul_latency=0.0))["compute"]
        products = 3 * (n.head_products + n.embedding_products) + n.layers * (3 * n.block_products + again)
        assert with_latency - without == pytest.approx(products * A100.matmul_latency)


def test_a_large_models_products_run_nearer_the_ceiling_than_a_small_ones():
    """Per token, the fixed time per product weighs more on a narrow model's small products."""
    shares = []
    for dim in (256, 8192):
        n = Costs.of(GPTConfig(vocab=1024, layers=2, dim=dim, heads=8, seq_len=2048), 2048, 1, None).numbers
        flops_time = 2048 * n.block_flops / (A100.peak_flops("float16") * A100.matmul_efficiency)
        shares.append(n.block_products * A100.matmul_latency / flops_time)
    assert shares[0] > 100 * shares[1]


@pytest.mark.parametrize("plan, syncs", [
    (sk.Plan(sk.Mesh(dp=4)), lambda n, s: 1),  # DDP's last bucket
    (sk.Plan(sk.Mesh(fsdp=4), fsdp=sk.FSDPOptions(reshard_after_forward=False)),
     lambda n, s: (n.layers + 1) * 2),  # per unit a gather and a reduce-scatter
    (sk.Plan(sk.Mesh(fsdp=4)), lambda n, s: (n.layers + 1) * 3),  # resharded: gathered again backward
    (sk.Plan(sk.Mesh(pp=2), pipeline=sk.Pipeline(schedule="1f1b", microbatches=4)),
     lambda n, s: 2 * 4 + n.tied),  # each micro-batch received forward and backward, the tied gradient
    (sk.Plan(sk.Mesh(sp=4)), lambda n, s: 1 + n.layers * 2 * 3),  # DDP, and the ring's 3 steps each way
    (sk.Plan(sk.Mesh(tp=2), rules=GPT_RULES, sequence_parallel=True),
     lambda n, s: n.layers * 2 * (2 + 2) + 3)])
def test_each_blocking_collective_waits_for_the_last_rank(gpt, plan, syncs):
    """skew x sqrt(syncs x work): the step's work spread evenly over its blocking collectives, the
    loss's all-reduce over the world one of them; and sync_idle for each of them."""
    s = Setting.of(plan)
    costs = Costs.of(gpt, SEQ, s.tp, None, rules=plan.rules)
    parts = time_of(costs, s, BATCH, dataclasses.replace(A100, skew=0.02))
    assert "skew" not in time_of(costs, s, BATCH, A100)  # the presets measure none
    work = parts["compute"] + parts["bubble"] + parts["optimizer"] + parts.get("dtensor", 0.0)
    count = syncs(costs.numbers, s) + 1
    assert parts["skew"] == pytest.approx(0.02 * (count * work) ** 0.5)
    idle = time_of(costs, s, BATCH, dataclasses.replace(A100, sync_idle=0.001))
    assert idle["skew"] == pytest.approx(0.001 * count)
    loss = A100.link("all_reduce", across_nodes=False)
    assert parts["loss"] == pytest.approx(2 * math.ceil(math.log2(s.devices)) * loss.latency)  # a tree's


def test_a_plan_without_collectives_waits_for_no_one(gpt):
    one = time_of(Costs.of(gpt, SEQ, 1, None), Setting.of(sk.Plan(sk.Mesh(dp=1))), BATCH,
                  dataclasses.replace(A100, skew=0.02))
    assert "skew" not in one and "loss" not in one


@pytest.mark.parametrize("schedule, microbatches, slots", [("gpipe", 2, 5), ("1f1b", 4, 7), ("gpipe", 8, 11)])
def test_a_pipeline_on_shared_cores_is_no_shorter_than_its_critical_path(gpt, schedule, microbatches, slots):
    """4 stages on 2 cores: an idle stage lends its cores, but m + p - 1 slots of one stage's micro-batch,
    each on a core of its own (half the average process's shared time), are a floor."""
    s = Setting.of(sk.Plan(sk.Mesh(pp=4), pipeline=sk.Pipeline(schedule=schedule, microbatches=microbatches)))
    costs = Costs.of(gpt, SEQ, 1, None)
    shared = dataclasses.replace(A100, shared_compute=True, devices_per_node=4, overlap=0.0)
    unknown = time_of(costs, s, BATCH, shared)  # cores not given (files before cores_per_node): none
    parts = time_of(costs, s, BATCH, dataclasses.replace(shared, cores_per_node=2))
    work = parts["compute"]
    assert unknown["bubble"] == 0.0
    assert parts["bubble"] == pytest.approx(max(0.0, work * slots / (2 * microbatches) - work))
    assert (parts["bubble"] > 0) == (slots > 2 * microbatches)


def test_ring_attention_pays_its_own_merging_and_accumulating(gpt):
    """Per block and micro-batch: the ring's calls and float32 passes over the rank's queries, growing with sp."""
    from shardkit.planner.step_time import RING_OPS, RING_TRAFFIC, ring_work

    hw = dataclasses.replace(A100, op_overhead=1e-5, memory_bandwidth=1e10)
    costs = Costs.of(gpt, SEQ, 1, None)
    for sp in (2, 4):
        s = Setting.of(sk.Plan(sk.Mesh(sp=sp)))
        calls = sum(per * sp + fixed for per, fixed in RING_OPS)
        passes = sum(per * sp + fixed for per, fixed in RING_TRAFFIC)
        queries = BATCH * SEQ // sp * costs.numbers.hidden
        assert ring_work(s, hw, queries) == pytest.approx(calls * 1e-5 + passes * queries * 4 / 1e10)
        free = time_of(costs, s, BATCH, dataclasses.replace(hw, op_overhead=0.0, memory_bandwidth=1e30))["sp"]
        assert time_of(costs, s, BATCH, hw)["sp"] - free > costs.numbers.layers * ring_work(s, hw, queries) * 0.99
    assert calls == 14 * 4 + 15 * 4 - 4  # 57 forward, 61 backward, less SDPA's 1 + 5


def _copies_only() -> sk.Hardware:
    """Instant links: only the wrappers' copies are left in ``dp`` / ``fsdp``, 10 µs a call, 10 GB/s."""
    instant = Link(bandwidth=1e30, latency=0.0)
    links = {c: instant for c in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    return dataclasses.replace(A100, intra_node=links, inter_node=links, op_overhead=1e-5, memory_bandwidth=1e10)


@pytest.mark.parametrize("recompute, runs", [("none", 3), ("selective", 4), ("full", 4)])
def test_the_attention_core_runs_at_the_fused_kernels_own_rate(gpt, recompute, runs):
    """At half the matmul rate the attention core's FLOPs (forward, backward twice, once more under
    recompute) take twice as long; nothing else in the step moves."""
    costs = Costs.of(gpt, SEQ, 1, None)
    n = costs.numbers
    s = Setting.of(sk.Plan(sk.Mesh(dp=1), recompute=recompute))
    whole, half = (time_of(costs, s, BATCH, dataclasses.replace(A100, attention_efficiency=e)) for e in (1.0, 0.5))
    core = BATCH * SEQ * n.layers * runs * n.core_flops / (A100.peak_flops("float32") * A100.matmul_efficiency)
    assert half["compute"] - whole["compute"] == pytest.approx(core, rel=1e-6)
    assert {k: v for k, v in half.items() if k not in ("compute", "skew")} == \
        {k: v for k, v in whole.items() if k not in ("compute", "skew")}


def test_only_a_fused_attention_kernel_runs_at_its_own_rate():
    """A Llama with eager attention runs its core as matrix products (at their rate, whatever the fused
    kernel's); the same Llama on SDPA runs a fused kernel, priced at ``attention_efficiency`` of them."""
    from shardkit.models.hf import tiny_llama_config

    for implementation, fused in (("eager", False), ("sdpa", True)):
        costs = Costs.of(tiny_llama_config(num_hidden_layers=2, attn_implementation=implementation), SEQ, 1, None)
        assert costs.numbers.fused_attention is fused and costs.numbers.core_flops > 0
        s = Setting.of(sk.Plan(sk.Mesh(dp=1)))
        whole, half = (time_of(costs, s, BATCH, dataclasses.replace(A100, attention_efficiency=e))["compute"]
                       for e in (1.0, 0.5))
        assert (half > whole) is fused


def test_data_parallel_pays_its_own_copies(gpt):
    """DDP scales each gradient into its bucket and copies it back (2 calls, 4 passes); FSDP2 copies each
    unit's shard in and the unit out per all-gather, the gradients in per reduce-scatter (2 and 1 calls)."""
    from shardkit.planner.wrapper_costs import DDP_COPIES, FSDP_COPIES

    hw = _copies_only()
    costs = Costs.of(gpt, SEQ, 1, None)
    n = costs.numbers
    params = n.layers * n.block_params + n.embedding_params + n.head_params  # the one device holds them all
    tensors = len(n.embedding_pieces) + len(n.head_pieces) + n.layers * len(n.block_pieces)
    ddp = time_of(costs, Setting.of(sk.Plan(sk.Mesh(dp=4))), BATCH, hw)["dp"]
    assert DDP_COPIES == (2, 4)
    assert ddp == pytest.approx(tensors * 2 * 1e-5 + 4 * params * 4 / 1e10, rel=0.02)
    units = n.layers + 1
    for reshard, gathers in ((False, 1), (True, 2)):
        s = Setting.of(sk.Plan(sk.Mesh(fsdp=4), fsdp=sk.FSDPOptions(reshard_after_forward=reshard)))
        fsdp = time_of(costs, s, BATCH, hw)["fsdp"]
        calls = units * (gathers * FSDP_COPIES["all_gather"] + FSDP_COPIES["reduce_scatter"])
        moved = gathers * 2 * (params / 4 + params) * 4 + 2 * params * 4
        assert fsdp == pytest.approx(calls * 1e-5 + moved / 1e10, rel=0.02)


def test_fsdp2s_replicate_reduces_its_one_unit_in_the_open_ddp_its_buckets_behind_the_backward(gpt, monkeypatch):
    """Only the wrappers' all-reduce left (copies free, every overlap perfect): DDP hides all its buckets but
    the last behind the backward; FSDP2's replicate (mixed precision here) all-reduces the whole model as one
    unit once the backward has ended, every byte of it on the critical path, in one call."""
    link = Link(bandwidth=1e9, latency=1e-4)
    links = {c: link for c in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    hw = dataclasses.replace(A100, intra_node=links, inter_node=links, op_overhead=0.0, memory_bandwidth=1e30,
                             overlap=1.0)
    n = Costs.of(gpt, SEQ, 1, None).numbers
    params = n.layers * n.block_params + n.embedding_params + n.head_params
    for dtype, itemsize in (("bfloat16", 2), ("float16", 2)):
        s = Setting.of(sk.Plan(sk.Mesh(dp=4), fsdp=sk.FSDPOptions(param_dtype=dtype)))
        whole = link.latency * 2 * 3 + 2 * 3 / 4 * params * itemsize / link.bandwidth  # a ring's, in one call
        assert time_of(Costs.of(gpt, SEQ, 1, None), s, BATCH, hw)["dp"] == pytest.approx(whole, rel=1e-6)
    monkeypatch.setattr(step_time, "DDP_BUCKET_BYTES", params * 4 // 4 + 1)  # 4 buckets of float32 gradients
    ddp = time_of(Costs.of(gpt, SEQ, 1, None), Setting.of(sk.Plan(sk.Mesh(dp=4))), BATCH, hw)["dp"]
    whole = link.latency * 2 * 3 * 4 + 2 * 3 / 4 * params * 4 / link.bandwidth
    assert whole / 4 <= ddp < whole  # the last bucket in the open, the others behind the backward


@pytest.mark.parametrize("plan, per_tensor, per_unit", [
    (sk.Plan(sk.Mesh(tp=2, dp=2), rules=GPT_RULES), 1, 2),  # FSDP2's replicate: a copy per tensor, 2 per unit
    (sk.Plan(sk.Mesh(dp=4), fsdp=sk.FSDPOptions(param_dtype="bfloat16")), 2, 3),  # and a cast each, one cast back
    (sk.Plan(sk.Mesh(dp=4)), 2, 0)])  # DDP itself: its bucket's mul and copy_ per gradient
def test_plans_fsdp2s_replicate_runs_pay_its_copies_not_ddps(gpt, plan, per_tensor, per_unit):
    """tp with a data axis and mixed precision run on FSDP2's replicate (``memory.ddp`` says so), whose
    copies are its own: each parameter copied to its unsharded tensor at the forward (cast first under
    bfloat16), the gradients chunk_cat and copied once per unit (cast back); not DDP's 2 per gradient."""
    s = Setting.of(plan)
    costs = Costs.of(gpt, SEQ, s.tp, None, rules=GPT_RULES)
    n = costs.numbers
    tensors = len(n.embedding_pieces) + len(n.head_pieces) + n.layers * len(n.block_pieces)
    free = dataclasses.replace(_copies_only(), memory_bandwidth=1e30)
    assert time_of(costs, s, BATCH, free)["dp"] == pytest.approx((tensors * per_tensor + per_unit) * 1e-5, rel=1e-6)
    parts = estimate(gpt, plan, batch_size=BATCH, seq_len=SEQ, hardware=free).step_time_parts
    assert parts["dp"] == pytest.approx((tensors * per_tensor + per_unit) * 1e-5, rel=1e-6)
