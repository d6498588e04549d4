"""Layers that mix positions under context parallel (``sp``) and Megatron sequence parallel: found on the
meta device and refused by name before launch, or made whole (causal convolutions: each chunk given the
positions before it), verified against one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import (
    build_cohere,
    build_granite,
    build_llama_tied,
    build_mixtral,
    build_phi3,
    build_qwen2,
    build_qwen3,
)
from sequence_models import (
    MIXER_GPT_RULES,
    MIXERS,
    build_gpt_causal_conv,
    build_gpt_causal_conv_dense,
    build_gpt_causal_conv_dilated,
    build_gpt_cumsum,
    build_gpt_split_at_the_end,
    build_gpt_token_shift,
    build_gpt_with,
    build_jamba,
    build_lfm2,
)
from torch import nn

import shardkit as sk
from shardkit.families import family_of
from shardkit.models.gpt import build_tiny_gpt, gpt_loss
from shardkit.models.hf import build_tiny_llama, hf_loss
from shardkit.plan import Mesh, Plan, PlanError
from shardkit.planner.explain import explain_plan
from shardkit.planner.meta import meta_model
from shardkit.planner.sequence_checks import distinctive_length
from shardkit.planner.sequence_mixing import CausalConv
from shardkit.runtime.context_parallel import enable_context_parallel
from shardkit.runtime.halo import halo_conv1d
from shardkit.runtime.ring_attention import shard_sequence, unshard_sequence
from shardkit.runtime.verify import verify

SP2 = Plan(mesh=Mesh(sp=2))
MEGATRON = Plan(mesh=Mesh(tp=2), rules=MIXER_GPT_RULES, sequence_parallel=True)


def _problems(plan: Plan, build, *args) -> list[str]:
    try:
        sk.validate(plan, meta_model(build, *args))
    except PlanError as exc:
        return exc.problems
    return []


# -- context parallel: refused by name before launch (no processes) -------------------------------------
@pytest.mark.parametrize("mixer,module,op", [
    ("cumsum", "'layers.0.mixer' (CumulativeSum)", "aten.cumsum"),
    ("cummean", "'layers.0.mixer' (CumulativeMean)", "aten.cumsum"),
    ("gru", "'layers.0.mixer.rnn' (GRU)", "aten.unbind"),
    ("centred_conv", "'layers.0.mixer.conv' (Conv1d)", "aten.convolution"),
    ("conv2d", "'layers.0.mixer.conv' (Conv2d)", "aten.convolution"),
    ("token_shift", "'layers.0.mixer' (TokenShift)", "aten.constant_pad_nd"),
    ("roll", "'layers.0.mixer' (Rolled)", "aten.roll"),
    ("fft", "'layers.0.mixer' (Spectral)", "aten._fft_"),
    ("pool", "'layers.0.mixer' (Pooled)", "aten.avg_pool2d"),
    ("topk", "'layers.0.mixer' (TopPositions)", "aten.topk"),
    ("loop", "'layers.0.mixer' (Loop)", "aten.select"),
    ("mean", "'layers.0.mixer' (MeanPool)", "aten.mean"),
    ("sliced_table", "'layers.0' (WithMixer)", "a table sliced or a range made by the sequence's length"),
])
def test_context_parallel_refuses_each_op_mixing_positions_by_name(mixer, module, op):
    problems = _problems(SP2, build_gpt_with, mixer)
    assert len(problems) == 1, problems
    assert f"module {module}" in problems[0] and op in problems[0]
    assert "context parallel (sp=2)" in problems[0] and "valid: sp=1 for this model" in problems[0]


def test_every_mixer_of_the_zoo_is_covered():
    assert set(MIXERS) == {"cumsum", "cummean", "gru", "centred_conv", "conv2d", "token_shift", "roll", "fft", "pool",
                           "topk", "loop", "mean", "sliced_table"}


def test_jamba_mamba_layer_is_refused_under_sp_by_name():
    problems = _problems(SP2, build_jamba)
    assert len(problems) == 1, problems
    assert "module 'model.layers.0.mamba' (JambaMambaMixer)" in problems[0]
    assert "aten.select" in problems[0] and "a recurrence or a scan" in problems[0] and "sp=1" in problems[0]


def test_an_empty_piece_of_the_sequence_mixes_no_positions():
    """An empty cut holds no position and a join with empty pieces is the whole piece: accepted."""
    assert _problems(SP2, build_gpt_split_at_the_end) == []


def test_jamba_is_accepted_without_sp():
    assert _problems(Plan(mesh=Mesh(fsdp=2)), build_jamba) == []


def test_causal_convolutions_are_accepted_and_planned():
    report = sk.validate(SP2, meta_model(build_lfm2))
    assert report.facts.causal_convs == (CausalConv("model.layers.0.conv", 3, 1, 2, "model.layers.0.conv.conv.weight"),
                                         CausalConv("model.layers.2.conv", 3, 1, 2, "model.layers.2.conv.conv.weight"))
    for name, (kernel, dilation) in {"causal_conv": (3, 1), "causal_conv_dilated": (3, 2),
                                     "causal_conv_dense": (4, 1)}.items():
        report = sk.validate(SP2, meta_model(build_gpt_with, name))
        assert report.facts.causal_convs == (CausalConv("layers.0.mixer.conv", kernel, dilation, dilation * (kernel - 1),
                                                        "layers.0.mixer.conv.weight"),), name


def test_explain_shows_the_causal_convolutions_context_parallel_makes_whole():
    text = explain_plan(SP2, meta_model(build_lfm2), width=300)
    row = next(line for line in text.splitlines() if line.startswith("model.layers.{0,2}.conv.conv.weight"))
    assert "causal conv: 2 positions from the previous sp chunk" in row


@pytest.mark.parametrize("build", [build_tiny_gpt, build_tiny_llama, build_llama_tied, build_qwen2, build_qwen3,
                                   build_mixtral, build_phi3, build_granite, build_cohere])
def test_models_context_parallel_already_ran_are_still_accepted(build):
    report = sk.validate(Plan(mesh=Mesh(sp=2, fsdp=2)), meta_model(build))
    assert report.facts.causal_convs == ()


def test_context_parallel_turns_the_kv_cache_off_and_refuses_one_asked_for():
    model = build_tiny_llama()
    kwargs: dict = {}
    family_of(model).check_context_parallel_inputs(model, kwargs)
    assert kwargs == {"use_cache": False}
    with pytest.raises(PlanError, match="use_cache=True under context parallel"):
        family_of(model).check_context_parallel_inputs(model, {"use_cache": True})


@settings(max_examples=40)
@given(sizes=st.lists(st.integers(1, 400), min_size=1, max_size=6), limit=st.integers(5, 300))
def test_the_traced_length_is_a_prime_no_size_of_the_model_is_a_multiple_of(sizes, limit):
    model = nn.Module()
    for i, size in enumerate(sizes):
        model.register_buffer(f"b{i}", torch.zeros(size))
    length = distinctive_length(model, limit)
    primes = [p for p in range(5, min(limit, 127) + 1) if all(p % d for d in range(2, int(math.sqrt(p)) + 1))]
    fitting = [p for p in primes if not any(s >= p and s % p == 0 for s in sizes)]
    assert length == (max(fitting) if fitting else None)


# -- Megatron sequence parallel: what DTensor runs on the split stream, and what it cannot --------------
@pytest.mark.parametrize("mixer,module,why", [
    ("cummean", "'layers.0.mixer' (CumulativeMean)", "refuses to combine a sequence-split tensor with a plain one"),
    ("gru", "'layers.0.mixer.rnn' (GRU)", "refuses to combine a sequence-split tensor with a plain one"),
    ("pool", "'layers.0.mixer' (Pooled)", "no sharding rule for its backward (avg_pool2d_backward)"),
    ("centred_conv", "'layers.0.mixer.conv' (Conv1d)", "refuses to combine"),
    ("causal_conv", "'layers.0.mixer.conv' (Conv1d)", "refuses to combine"),
    ("sliced_table", "'layers.0' (WithMixer)", "refuses to combine"),
])
def test_megatron_sequence_parallel_refuses_what_dtensor_cannot_run(mixer, module, why):
    problems = _problems(MEGATRON, build_gpt_with, mixer)
    assert len(problems) == 1, problems
    assert "sequence_parallel=True splits the residual stream" in problems[0]
    assert f"module {module}" in problems[0] and why in problems[0] and "sequence_parallel=False" in problems[0]


@pytest.mark.parametrize("mixer", ["cumsum", "token_shift", "roll", "fft", "loop", "mean"])
def test_megatron_sequence_parallel_accepts_what_dtensor_gathers(mixer):
    assert _problems(MEGATRON, build_gpt_with, mixer) == []


# -- the halo exchange itself ----------------------------------------------------------------------------
def _halo_against_full(ctx, kernel: int, dilation: int, groups: int, length: int) -> tuple[float, float, float]:
    torch.manual_seed(0)
    channels = 6
    x = torch.randn(2, channels, length, requires_grad=True)
    weight = torch.randn(channels, channels // groups, kernel, requires_grad=True)
    bias = torch.randn(channels, requires_grad=True)
    padding = dilation * (kernel - 1)
    full = F.conv1d(x, weight, bias, padding=padding, dilation=dilation, groups=groups)[..., :length]
    upstream = torch.randn_like(full)
    (full * upstream).sum().backward()
    expected = [t.grad.clone() for t in (x, weight, bias)]
    group = ctx.mesh["sp"].get_group()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    local = shard_sequence(x.detach(), rank, size, dim=2).requires_grad_()
    w, b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    out = halo_conv1d(local, w, b, CausalConv("conv", kernel, dilation, padding), groups, group)
    assert out.shape[-1] == local.shape[-1] + padding and not out[..., local.shape[-1]:].any()
    out = out[..., :local.shape[-1]]
    (out * shard_sequence(upstream, rank, size, dim=2)).sum().backward()
    outs = [torch.empty_like(out) for _ in range(size)]
    grads = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(outs, out.detach().contiguous(), group=group)
    dist.all_gather(grads, local.grad.contiguous(), group=group)
    for t in (w.grad, b.grad):
        dist.all_reduce(t, group=group)
    return ((unshard_sequence(outs, dim=2) - full).abs().max().item(),
            (unshard_sequence(grads, dim=2) - expected[0]).abs().max().item(),
            max((w.grad - expected[1]).abs().max().item(), (b.grad - expected[2]).abs().max().item()))


@pytest.mark.parametrize("sp,kernel,dilation,groups,length", [
    (2, 3, 1, 6, 16), (2, 4, 2, 1, 24), (4, 3, 1, 6, 16), (4, 2, 3, 2, 24),
])
def test_halo_convolution_equals_the_whole_sequence_forward_and_backward(world, sp, kernel, dilation, groups, length):
    for rank, errors in enumerate(world(sp).run(_halo_against_full, kernel, dilation, groups, length,
                                                plan=Plan(mesh=Mesh(sp=sp)))):
        assert max(errors) < 1e-5, f"rank {rank}: output, input and weight gradient errors {errors}"


def _too_short(ctx):
    group = ctx.mesh["sp"].get_group()
    try:
        halo_conv1d(torch.zeros(1, 2, 4), torch.zeros(2, 1, 4), None, CausalConv("m.conv", 4, 1, 3), 2, group)
    except PlanError as exc:
        return str(exc)
    return "accepted"


def test_halo_refuses_chunks_shorter_than_the_halo(world):
    for text in world(2).run(_too_short, plan=SP2):
        assert "module 'm.conv' reads the 3 positions before each one" in text and "at least 12 positions" in text


# -- made whole: one process against sp ranks, every position (chunk starts included) ------------------
def _tokens(seq_len: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (batch, seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _logits(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def _every_position(ctx, build, loss_fn, seq_len: int) -> tuple[list[float], float]:
    """Largest logit error at each position of the reassembled sequence, and the largest gradient error."""
    inputs, targets = _tokens(seq_len)
    reference = build()
    ref_logits = _logits(reference(inputs))
    loss_fn(ref_logits, targets).backward()
    sp = ctx.mesh["sp"]
    rank, size, group = sp.get_local_rank(), sp.size(), sp.get_group()
    model = enable_context_parallel(build(), sp)
    logits = _logits(model(shard_sequence(inputs, rank, size)))
    loss_fn(logits, shard_sequence(targets, rank, size)).backward()
    parts = [torch.empty_like(logits) for _ in range(size)]
    dist.all_gather(parts, logits.detach().contiguous(), group=group)
    error = (unshard_sequence(parts) - ref_logits.detach()).abs().amax(dim=(0, 2))
    worst = 0.0
    for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        dist.all_reduce(p.grad, group=group)
        worst = max(worst, (p.grad / size - q.grad).abs().max().item())
    return error.tolist(), worst


@pytest.mark.parametrize("sp,build,loss_fn", [
    (2, build_lfm2, hf_loss),
    (4, build_lfm2, hf_loss),
    (2, build_gpt_causal_conv_dilated, gpt_loss),
    (4, build_gpt_causal_conv_dense, gpt_loss),
])
def test_causal_convolutions_under_context_parallel_equal_one_process_at_every_position(world, sp, build, loss_fn):
    seq_len = 32
    chunk = seq_len // (2 * sp)
    for rank, (errors, grad) in enumerate(world(sp).run(_every_position, build, loss_fn, seq_len,
                                                        plan=Plan(mesh=Mesh(sp=sp)))):
        starts = {p: errors[p] for p in range(0, seq_len, chunk)}
        assert max(starts.values()) < 1e-5, f"rank {rank}: logit error at chunk starts {starts}"
        assert max(errors) < 1e-5 and grad < 1e-5, f"rank {rank}: logits {max(errors):.2e}, gradients {grad:.2e}"


@pytest.mark.parametrize("build,plan,loss_fn", [
    (build_lfm2, SP2, hf_loss),
    (build_lfm2, Plan(mesh=Mesh(sp=2, fsdp=2)), hf_loss),
    (build_gpt_causal_conv, Plan(mesh=Mesh(dp=2, sp=2)), gpt_loss),
    (build_lfm2, Plan(mesh=Mesh(sp=2), recompute="full"), hf_loss),  # the halo exchanged again when recomputed
    (build_gpt_split_at_the_end, SP2, gpt_loss),  # an empty piece of the sequence, accepted: it runs and equals one
], ids=["lfm2-sp2", "lfm2-sp2-fsdp2", "gpt-causal-conv-dp2-sp2", "lfm2-sp2-recompute", "gpt-split-at-the-end-sp2"])
def test_verify_causal_convolutions_under_context_parallel(world, build, plan, loss_fn):
    result = verify(build, plan, _tokens(32, batch=4), loss_fn=loss_fn, steps=2, world=world(plan.mesh.size))
    assert result.ok, str(result)


@pytest.mark.parametrize("build", [build_gpt_cumsum, build_gpt_token_shift])
def test_verify_megatron_sequence_parallel_with_a_mixer_dtensor_gathers(world, build):
    result = verify(build, MEGATRON, _tokens(32, batch=4), loss_fn=gpt_loss, steps=2, world=world(2))
    assert result.ok, str(result)


def test_ring_attention_leaves_the_builders_config_as_it_was():
    """Installing ring attention on a transformers model writes the attention implementation into the
    model's own copy of its config: a builder reusing one config object (``partial(LlamaForCausalLM,
    config)``) builds its next model with the attention it asked for, not the ring's."""
    from transformers import LlamaForCausalLM

    from shardkit.families.hf import HF_ATTENTION, HFFamily
    from shardkit.models.hf import tiny_llama_config

    config = tiny_llama_config(num_hidden_layers=2)
    asked = config._attn_implementation
    model = LlamaForCausalLM(config)
    HFFamily().install_attention(model, lambda q, k, v, scale=None: q)
    assert config._attn_implementation == asked != HF_ATTENTION
    assert model.config._attn_implementation == HF_ATTENTION and model.config is not config
    attentions = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    assert attentions and all(m.config is model.config for m in attentions)  # one copy, shared as before
    assert LlamaForCausalLM(config).config._attn_implementation == asked
