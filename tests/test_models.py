"""Reference GPT, HuggingFace families, their rule sets, the tensor-parallel adapters, the registry."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardkit.models.gpt import GPT, GPT_RULES, GPTConfig, build_tiny_gpt, gpt_loss, tiny_config
from shardkit.models.hf import GPT2_RULES, LLAMA_RULES, build_tiny_gpt2, build_tiny_llama, hf_loss
from shardkit.models.registry import MODELS, model_entry
from shardkit.plan import Mesh, Plan, PlanError, UsageError
from shardkit.planner.meta import meta_model
from shardkit.planner.tensor_parallel import tensor_parallel_problems
from shardkit.planner.validate import validate
from shardkit.runtime.tensor_parallel import prepare_shard

TINY_GPT = build_tiny_gpt()  # read-only in these tests; tests that modify a model build their own


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread; two threads on a busy 2-core machine spin-wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- reference GPT --------------------------------------------------------------------------

def test_gpt_forward_shape_and_module_names():
    idx = torch.randint(0, 256, (3, 16))
    assert TINY_GPT(idx).shape == (3, 16, 256)
    names = {n for n, _ in TINY_GPT.named_parameters()}
    for expected in ("embed.weight", "pos_embed.weight", "layers.1.norm1.weight", "layers.0.attn.q_proj.bias",
                     "layers.0.attn.o_proj.weight", "layers.1.mlp.down_proj.weight", "norm_f.weight", "lm_head.weight"):
        assert expected in names
    assert "lm_head.bias" not in names
    assert TINY_GPT.lm_head.weight is not TINY_GPT.embed.weight  # untied


def test_gpt_builder_is_deterministic():
    first, second = build_tiny_gpt().state_dict(), build_tiny_gpt().state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    torch.manual_seed(1)
    other = GPT(tiny_config()).state_dict()
    assert not torch.equal(first["layers.0.attn.q_proj.weight"], other["layers.0.attn.q_proj.weight"])


@settings(max_examples=10, deadline=None)
@given(seq=st.integers(2, 32), cut=st.integers(1, 31), seed=st.integers(0, 2**16))
def test_gpt_is_causal_and_positions_default_to_arange(seq, cut, seed):
    cut = min(cut, seq - 1)
    idx = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(seed))
    changed = idx.clone()
    changed[:, cut:] = (changed[:, cut:] + 1) % 256
    with torch.no_grad():
        out, out_changed = TINY_GPT(idx), TINY_GPT(changed)
        explicit = TINY_GPT(idx, positions=torch.arange(seq))
    torch.testing.assert_close(out[:, :cut], out_changed[:, :cut])
    assert not torch.allclose(out[:, cut:], out_changed[:, cut:])
    torch.testing.assert_close(out, explicit)


def test_gpt_positions_select_the_position_embedding():
    idx = torch.randint(0, 256, (1, 4))
    with torch.no_grad():
        shifted = TINY_GPT(idx, positions=torch.arange(4, 8))
        assert not torch.allclose(shifted, TINY_GPT(idx))


def test_gpt_attention_fn_is_replaceable():
    model = build_tiny_gpt()
    seen = []

    def recording(q, k, v):
        seen.append(q.shape)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    for layer in model.layers:
        layer.attn.attention_fn = recording
    model(torch.zeros(2, 8, dtype=torch.long))
    assert seen == [(2, 4, 8, 16)] * 2


def test_gpt_loss_is_mean_cross_entropy():
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    manual = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(gpt_loss(logits, targets), manual)
    torch.testing.assert_close(hf_loss(logits, targets), manual)

    class Output:
        pass

    output = Output()
    output.logits = logits
    torch.testing.assert_close(hf_loss(output, targets), manual)


def test_gpt_config_rejects_heads_not_dividing_dim():
    with pytest.raises(ValueError, match="dim=64 is not divisible by heads=3"):
        GPTConfig(dim=64, heads=3)


# -- rule sets ------------------------------------------------------------------------------

@pytest.mark.parametrize("build, rules, tp, expected", [
    (build_tiny_gpt, GPT_RULES, 2, {"layers.0.attn.q_proj.weight": (32, 64), "layers.0.attn.o_proj.weight": (64, 32),
                                    "layers.0.attn.q_proj.bias": (32,), "lm_head.weight": (128, 64),
                                    "embed.weight": (256, 64)}),
    (build_tiny_gpt, GPT_RULES, 4, {"layers.1.mlp.up_proj.weight": (64, 64), "layers.1.mlp.down_proj.weight": (64, 64)}),
    (build_tiny_llama, LLAMA_RULES, 2, {"model.layers.0.self_attn.k_proj.weight": (16, 64),
                                        "model.layers.0.mlp.down_proj.weight": (64, 64),
                                        "model.embed_tokens.weight": (128, 64), "lm_head.weight": (128, 64),
                                        "model.norm.weight": (64,)}),
    (build_tiny_gpt2, GPT2_RULES, 2, {"transformer.h.0.attn.c_attn.weight": (64, 96),
                                      "transformer.h.0.attn.c_attn.bias": (96,),
                                      "transformer.h.0.attn.c_proj.weight": (32, 64),
                                      "transformer.h.0.attn.c_proj.bias": (64,),
                                      "transformer.h.1.mlp.c_fc.weight": (64, 128),
                                      "transformer.wte.weight": (256, 64)}),
    (build_tiny_gpt2, GPT2_RULES, 4, {"transformer.h.0.mlp.c_proj.weight": (64, 64)}),
])
def test_rules_validate_and_give_local_shapes(build, rules, tp, expected):
    model = meta_model(build)
    report = validate(Plan(Mesh(tp=tp), rules), model)
    assert report.warnings == []  # every rule matches something
    local = {name: p.local_shape(report.mesh) for name, p in report.layouts.params.items()}
    for name, shape in expected.items():
        assert local[name] == shape, name
    assert tensor_parallel_problems(model, tp) == []


def test_gpt2_lm_head_is_tied_and_listed_once():
    model = build_tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names


# -- head-count problems ----------------------------------------------------------------------

def test_llama_tp_not_dividing_kv_heads_is_a_problem():
    model = meta_model(build_tiny_llama)
    with pytest.raises(PlanError, match="2 key/value heads"):  # the shapes divide evenly, the heads do not
        validate(Plan(Mesh(tp=4), LLAMA_RULES), model)
    problems = tensor_parallel_problems(model, 4)  # 2 kv heads do not split over 4 ranks
    assert len(problems) == 1
    assert "'model.layers.0.self_attn'" in problems[0] and "1 more" in problems[0]
    assert "4 query heads and 2 key/value heads" in problems[0] and "valid tp sizes: [1, 2]" in problems[0]


@pytest.mark.parametrize("build, heads", [(build_tiny_gpt, 4), (build_tiny_gpt2, 4)])
def test_tp_not_dividing_heads_is_a_problem(build, heads):
    model = meta_model(build)
    problems = tensor_parallel_problems(model, 3)
    assert len(problems) == 1 and f"has {heads} heads" in problems[0] and "valid tp sizes: [1, 2, 4]" in problems[0]
    assert tensor_parallel_problems(model, 8) and not tensor_parallel_problems(model, 1)


def test_70b_head_counts():
    model = MODELS["llama-70b"].build()
    assert tensor_parallel_problems(model, 8) == []
    (problem,) = tensor_parallel_problems(model, 16)
    assert "64 query heads and 8 key/value heads" in problem and "[1, 2, 4, 8]" in problem


def _planned(model: nn.Module, tp: int, rules):
    """What sk.validate plans for the tp axis of ``model`` (the runtime applies exactly this)."""
    return validate(Plan(Mesh(tp=tp), rules), model).facts.tensor_parallel["tp"]


# -- per-rank attention math: sum of row-parallel partial outputs equals the full output -------

def _rank_linear(linear: nn.Linear, rank: int, tp: int, dim: int, bias_owner: bool) -> nn.Linear:
    """What rank ``rank`` of a contiguous Shard(dim) holds of ``linear`` (row-parallel bias on rank 0 only)."""
    local = copy.deepcopy(linear)
    local.weight = nn.Parameter(linear.weight.detach().chunk(tp, dim)[rank].clone())
    if linear.bias is not None:
        bias = linear.bias.detach()
        local.bias = nn.Parameter(bias.chunk(tp)[rank].clone() if dim == 0 else bias * bias_owner)
    return local


def _sum_of_ranks(attn: nn.Module, tp: int, names_col: tuple[str, ...], name_row: str, run) -> torch.Tensor:
    total = 0
    for rank in range(tp):
        local = copy.deepcopy(attn)
        for name in names_col:
            setattr(local, name, _rank_linear(getattr(attn, name), rank, tp, 0, False))
        setattr(local, name_row, _rank_linear(getattr(attn, name_row), rank, tp, 1, rank == 0))
        total = total + run(local)
    return total


@pytest.mark.parametrize("tp", [2, 4])
def test_reference_gpt_attention_runs_local_heads_without_adapter(tp):
    model = build_tiny_gpt()
    assert prepare_shard(model, _planned(model, tp, GPT_RULES)) == {}
    attn, x = model.layers[0].attn, torch.randn(2, 8, 64)
    with torch.no_grad():
        summed = _sum_of_ranks(attn, tp, ("q_proj", "k_proj", "v_proj"), "o_proj", lambda m: m(x))
        torch.testing.assert_close(summed, attn(x))


def test_llama_attention_runs_local_heads_without_adapter():
    model = build_tiny_llama()
    assert prepare_shard(model, _planned(model, 2, LLAMA_RULES)) == {}
    attn, x = model.model.layers[0].self_attn, torch.randn(2, 8, 64)
    rope = model.model.rotary_emb(x, torch.arange(8)[None])

    def run(module):
        return module(x, position_embeddings=rope, attention_mask=None)[0]

    with torch.no_grad():
        summed = _sum_of_ranks(attn, 2, ("q_proj", "k_proj", "v_proj"), "o_proj", run)
        torch.testing.assert_close(summed, run(attn))


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_fused_qkv_adapter_gives_each_rank_its_heads(tp):
    model = build_tiny_gpt2()
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        expected = attn(x)[0]
    weight, bias = attn.c_attn.weight, attn.c_attn.bias
    original_weight, original_bias = weight.detach().clone(), bias.detach().clone()

    perms = prepare_shard(model, _planned(model, tp, GPT2_RULES))

    assert sorted(perms) == [f"transformer.h.{i}.attn.c_attn.{p}" for i in (0, 1) for p in ("bias", "weight")]
    assert attn.c_attn.weight is weight and attn.c_attn.bias is bias  # same Parameter objects
    assert attn.split_size == 64 // tp
    dim, perm = perms["transformer.h.0.attn.c_attn.weight"]
    assert dim == 1 and not torch.equal(weight, original_weight)
    torch.testing.assert_close(weight.detach().index_select(1, torch.argsort(perm)), original_weight)
    bias_dim, bias_perm = perms["transformer.h.0.attn.c_attn.bias"]
    torch.testing.assert_close(bias.detach().index_select(bias_dim, torch.argsort(bias_perm)), original_bias)

    local_width = 3 * 64 // tp
    summed = 0
    with torch.no_grad():
        for rank in range(tp):  # each rank: a contiguous Shard(1) of c_attn, Shard(0) of c_proj
            local = copy.deepcopy(attn)
            local.c_attn.weight = nn.Parameter(weight.detach().chunk(tp, 1)[rank].clone())
            local.c_attn.bias = nn.Parameter(bias.detach().chunk(tp, 0)[rank].clone())
            local.c_attn.nf = local_width
            local.c_proj.weight = nn.Parameter(attn.c_proj.weight.detach().chunk(tp, 0)[rank].clone())
            local.c_proj.bias = nn.Parameter(attn.c_proj.bias.detach() * (rank == 0))
            summed = summed + local(x)[0]
    torch.testing.assert_close(summed, expected)


def test_gpt2_adapter_refuses_a_second_pass():
    model = build_tiny_gpt2()
    planned = _planned(model, 2, GPT2_RULES)
    prepare_shard(model, planned)
    with pytest.raises(UsageError, match="already adapted"):
        prepare_shard(model, planned)


def test_gpt2_adapter_works_on_meta():
    model = meta_model(build_tiny_gpt2)
    perms = prepare_shard(model, _planned(model, 4, GPT2_RULES))
    assert perms["transformer.h.1.attn.c_attn.weight"][1].device.type == "cpu"
    assert model.transformer.h[1].attn.split_size == 16


# -- registry --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small", "llama-tiny", "gpt2-tiny"])
def test_registered_models_build_run_and_validate(name):
    entry = model_entry(name)
    model = entry.build()
    inputs, targets = entry.sample_batch(batch_size=2, seed=3)
    assert inputs.shape == targets.shape == (2, entry.seq_len)
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < entry.vocab
    with torch.no_grad():
        loss = entry.loss_fn(model(inputs), targets)
    assert abs(float(loss) - torch.log(torch.tensor(float(entry.vocab)))) < 0.5  # near-uniform at init
    validate(Plan(Mesh(tp=2), entry.rules), model)
    assert not entry.meta_only


def test_registry_70b_is_meta_only_with_real_shapes():
    entry = MODELS["llama-70b"]
    model = entry.build()
    assert entry.meta_only and all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 70_553_706_496
    assert model.config.num_key_value_heads == 8 and model.config.intermediate_size == 28672


def test_unknown_model_names_the_valid_ones():
    with pytest.raises(PlanError, match="unknown model 'gpt-huge'.*gpt-tiny"):
        model_entry("gpt-huge")
