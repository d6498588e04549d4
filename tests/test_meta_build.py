"""Models built on the meta device: ``sk.shard`` allocates only each rank's shards, and the
full weights are bitwise the same whatever the plan (and in one process); buffers built on
meta are computed by the model's initialisation; a rank's peak is its shards and one module's
full tensors; ``sk.verify`` takes a meta builder; a parameter nothing initialises is refused.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
from model_zoo import build_gpt2, build_llama_tied, build_llama_untied, build_phi3, loss, tokens
from torch import nn

import shardkit as sk
from shardkit.models.hf import GPT2_RULES, LLAMA_RULES
from shardkit.observe.memory import TensorMemoryPeak, tensors_nbytes
from shardkit.planner.initialisation import uninitialised
from shardkit.runtime.apply import full_state_dict
from shardkit.runtime.materialize import materialize

warnings.filterwarnings("ignore", message=".*token_id.*")
BUILDERS = {b.__name__: b for b in (build_gpt2, build_llama_tied, build_llama_untied, build_phi3)}


def _single(build) -> dict[str, torch.Tensor]:
    model = materialize(sk.meta_model(build))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _build_and_gather(ctx, build):
    return full_state_dict(sk.shard(sk.meta_model(build), ctx.plan))


CASES = [  # (world size, mesh, builder, rules)
    (4, "fsdp=4", "build_gpt2", None),
    (4, "dp=2,tp=2", "build_gpt2", GPT2_RULES),  # packed c_attn: each rank's rows are runs of the full tensor
    (4, "fsdp=2,tp=2", "build_phi3", "from_hf"),
    (4, "fsdp=2,tp=2", "build_llama_tied", LLAMA_RULES),
    (4, "pp=2,fsdp=2", "build_llama_untied", None),
    (3, "fsdp=3", "build_llama_tied", None),  # uneven shards
    (2, "tp=2", "build_phi3", "from_hf"),
    (2, "pp=2", "build_llama_untied", None),
    (1, "dp=1", "build_gpt2", None),
]


@pytest.mark.parametrize("size, mesh, builder, rules", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_the_full_weights_are_the_same_whatever_the_plan(world, size, mesh, builder, rules):
    build = BUILDERS[builder]
    layout = sk.LayoutMap.from_hf(sk.meta_model(build)) if rules == "from_hf" else rules
    parsed = sk.Mesh.parse(mesh)
    plan = sk.Plan(parsed, layout, pipeline=sk.Pipeline(microbatches=2, schedule="gpipe") if "pp" in parsed else None)
    merged: dict[str, torch.Tensor] = {}
    for part in world(size).run(_build_and_gather, build, plan=plan):
        merged.update(part)
    expected = _single(build)
    assert set(merged) == set(expected)
    assert all(torch.equal(merged[n], expected[n]) for n in expected), \
        [n for n in expected if not torch.equal(merged[n], expected[n])]


def test_gpt2_scaled_projections_and_ties_are_the_models_own():
    """GPT-2 scales c_proj when it initialises the attention around it; the tie is kept."""
    model = materialize(sk.meta_model(build_gpt2), seed=3)
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    expected = model.config.initializer_range / (2 * model.config.n_layer) ** 0.5
    assert abs(std - expected) < 0.25 * expected
    assert model.lm_head.weight is model.transformer.wte.weight
    other = materialize(sk.meta_model(build_gpt2), seed=4)
    assert not torch.equal(other.transformer.wte.weight, model.transformer.wte.weight)


def _meta_device_llama():
    with torch.device("meta"):
        return build_llama_tied()


def _forward_and_buffers(ctx, inputs):
    model = sk.shard(_meta_device_llama(), ctx.plan)
    with torch.no_grad():
        logits = model(inputs).logits
    return logits, {n: b.clone() for n, b in model.named_buffers()}


def test_buffers_built_on_meta_are_computed_by_the_initialisation(world):
    """Every tensor on meta (``torch.device("meta")``): the rotary frequencies are recomputed."""
    inputs, _ = tokens(batch=2, seq=8)
    reference = materialize(sk.meta_model(build_llama_tied))
    with torch.no_grad():
        expected = reference(inputs).logits
    results = world(2).run(_forward_and_buffers, inputs, plan=sk.Plan(sk.Mesh(tp=2), LLAMA_RULES))
    for logits, buffers in results:
        assert buffers and all(torch.equal(b, dict(reference.named_buffers())[n]) for n, b in buffers.items())
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def _wide_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=8, n_embd=128, n_head=4, vocab_size=1024, n_positions=64))


def _peak_of_sharding(ctx):
    model = sk.meta_model(_wide_gpt2)
    with TensorMemoryPeak() as peak:
        model = sk.shard(model, ctx.plan)
    return peak.peak_bytes(), tensors_nbytes(model.parameters())


def test_a_rank_holds_its_shards_and_one_modules_full_tensors(world):
    model = _wide_gpt2()
    whole = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())  # the embedding: its module's only tensor
    for mesh, rules in (("fsdp=4", None), ("fsdp=2,tp=2", GPT2_RULES)):
        for rank, (peak, shards) in enumerate(world(4).run(_peak_of_sharding, plan=sk.Plan(sk.Mesh.parse(mesh), rules))):
            assert shards < whole / 3
            assert peak <= shards + largest + 2**17, (mesh, rank, peak, shards, largest)  # + the 64 KiB check mask


def test_verify_takes_a_meta_builder(world):
    batch = tokens(batch=4, seq=16)
    result = sk.verify(partial(sk.meta_model, build_llama_tied), sk.Plan(sk.Mesh(fsdp=2, tp=2), LLAMA_RULES), batch,
                       loss_fn=loss, steps=2, world=world(4))
    assert result.ok, result


class _Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.gain


def _with_gain():
    return nn.Sequential(nn.Linear(8, 8), _Gain())


class _DataInit(nn.Module):
    """Initialises its own parameter through ``.data`` and a view: counts as written."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4, 4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.scale.data.normal_()
        self.scale.data[0].zero_()


def test_a_parameter_nothing_initialises_is_named_and_refused():
    assert uninitialised(sk.meta_model(_with_gain)) == ["1.gain"]
    assert uninitialised(sk.meta_model(_DataInit)) == []
    assert all(not uninitialised(sk.meta_model(b)) for b in BUILDERS.values())
    with pytest.raises(sk.UsageError, match=r"parameter '1.gain' \(_Gain\) is not initialised"):
        materialize(sk.meta_model(_with_gain))


def _shard_uninitialised(ctx):
    return sk.shard(sk.meta_model(_with_gain), ctx.plan)


def test_shard_refuses_a_meta_model_it_cannot_initialise_before_allocating(world):
    with pytest.raises(sk.WorldError, match=r"initialisation writes no values for 1 parameter\(s\): '1.gain'"):
        world(2).run(_shard_uninitialised, plan=sk.Plan(sk.Mesh(fsdp=2)))


class _Huge(nn.Module):
    """Parameters no machine could allocate even untouched (a 1 TiB stack of experts, as DeepSeek-V3's
    are 30 GB a layer), made the ways constructors make them, and small buffers computed in it."""

    def __init__(self):
        super().__init__()
        self.experts = nn.Parameter(torch.empty(2**16, 2**11, 2**11))  # 2**38 floats: 1 TiB
        self.zeros = nn.Parameter(torch.zeros((2**20, 2**20)))
        self.full = nn.Parameter(torch.full((2**20, 2**20), 0.5))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))


def test_a_parameter_larger_than_the_machine_is_built_on_meta_and_small_buffers_stay_real():
    model = sk.meta_model(_Huge)
    assert {n: (p.device.type, tuple(p.shape)) for n, p in model.named_parameters()} == {
        "experts": ("meta", (2**16, 2**11, 2**11)), "zeros": ("meta", (2**20, 2**20)), "full": ("meta", (2**20, 2**20))}
    assert model.inv_freq.device.type == "cpu" and torch.allclose(model.inv_freq, 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))
    assert torch.empty(3).device.type == "cpu"  # only while building
