"""sk.analyse and the catalogue: published sizes, FLOPs and saved activations per token measured on
fake tensors, equal to a real CPU forward's saved bytes, tensor-parallel ranks at local shapes;
operator calls and non-matmul memory traffic, checked by hand on a small model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardkit as sk
from shardkit.models.gpt import GPT, GPT_RULES, GPTConfig
from shardkit.models.hf import LLAMA_RULES, tiny_gpt2_config, tiny_llama_config
from shardkit.plan import LayoutMap, PlanError, UsageError
from shardkit.planner import analysis
from shardkit.planner.catalogue import CATALOGUE, MEGATRON_TABLE1, catalogue_config

SEQ = 24


def _hf(config, device: str | None = None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if device is None:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def _real_saved_per_token(model: nn.Module, seq: int, vocab: int) -> float:
    """Bytes autograd keeps for backward in one real CPU forward + loss, each storage once, weights excluded."""
    fixed = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in fixed:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    model.train()
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits.reshape(-1, vocab), ids.reshape(-1))
    loss.backward()  # the saved tensors were real and sufficient
    return sum(seen.values()) / seq


# -- the catalogue ------------------------------------------------------------------------------------
def test_catalogue_parameter_counts_are_the_published_ones():
    billions = {name: analysis.analyse(name).total_params / 1e9 for name in CATALOGUE}
    assert round(billions["llama3-8b"], 2) == 8.03
    assert round(billions["llama3-70b"], 1) == 70.6
    assert round(billions["llama3-405b"], 1) == 405.9
    assert abs(billions["gpt3-175b"] / 175 - 1) < 0.01
    assert round(billions["gpt2"] * 1000) == 124
    assert round(billions["gpt2-medium"] * 1000) == 355
    assert round(billions["gpt2-large"] * 1000) == 774
    assert round(billions["gpt2-xl"] * 1000) == 1558
    for row in MEGATRON_TABLE1:
        assert abs(billions[row.name] / row.params_b - 1) < 0.03, (row.name, billions[row.name], row.params_b)
        config = catalogue_config(row.name)
        assert (config.n_head, config.n_embd, config.n_layer, config.vocab_size, config.n_positions) == \
            (row.heads, row.hidden, row.layers, 51200, 2048)


def test_megatron_table_is_consistent_with_its_published_aggregates():
    aggregate_pflops = [4.4, 8.8, 18.2, 34.6, 70.8, 143.8, 227.1, 297.4, 410.2, 502.0]  # the table's last column
    assert [r.params_b for r in MEGATRON_TABLE1] == [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0]
    for row, pflops in zip(MEGATRON_TABLE1, aggregate_pflops, strict=True):
        assert row.tp * row.pp * row.dp == row.gpus
        assert abs(row.gpus * row.tflops_per_gpu / 1000 / pflops - 1) < 0.01, row.name
        assert abs(row.tflops_per_gpu / 312 * 100 - row.percent_peak) < 1, row.name  # A100 peak: 312 TFLOP/s


def test_unknown_catalogue_name_lists_every_known_one():
    with pytest.raises(UsageError) as caught:
        sk.analyse("llama-8b")
    message = str(caught.value)
    assert "'llama-8b'" in message and "did you mean 'llama3-8b'" in message
    assert all(name in message for name in CATALOGUE)


# -- what is measured -------------------------------------------------------------------------------
def test_block_flops_are_twice_its_parameters_at_short_sequences_and_attention_grows_with_length():
    short, long = sk.analyse("llama3-8b", seq_len=128), sk.analyse("llama3-8b", seq_len=8192)
    assert abs(short.block.flops / (2 * short.block.params) - 1) < 0.05
    assert long.block.flops > short.block.flops
    # only the attention core depends on the length, linearly per token (seq x seq scores)
    assert long.block.flops_per_token["attention_core"] == 64 * short.block.flops_per_token["attention_core"]
    for component in ("attention", "mlp", "norm"):
        assert long.block.flops_per_token[component] == short.block.flops_per_token[component]
    assert short.embedding.flops == 0 and short.head.flops_per_token["logits"] == 2 * 4096 * 128256


@pytest.mark.parametrize("config", [GPTConfig(layers=3, seq_len=32), tiny_llama_config(num_hidden_layers=3),
                                    tiny_gpt2_config(n_layer=3)], ids=["gpt", "llama", "gpt2"])
def test_a_tensor_parallel_rank_holds_and_computes_its_share(config):
    one, two = sk.analyse(config, seq_len=SEQ), sk.analyse(config, seq_len=SEQ, tp=2)
    hidden_bytes = one.hidden * 4  # fp32: the block input each rank keeps whole (norm outputs, residual)
    assert two.activations_per_token() < one.activations_per_token()
    assert two.block.activations_per_token["attention_core"] == one.block.activations_per_token["attention_core"] / 2
    assert two.block.activations_per_token["norm"] == one.block.activations_per_token["norm"]
    # the MLP keeps its (replicated) input whole and the rest, split by tp, halves
    assert two.block.activations_per_token["mlp"] - hidden_bytes == \
        (one.block.activations_per_token["mlp"] - hidden_bytes) / 2
    for component in ("attention_core", "attention", "mlp"):
        assert two.block.flops_per_token[component] == one.block.flops_per_token[component] / 2
    # the output layer is split over the vocabulary, except GPT-2's, tied to its embedding and replicated
    assert two.head.flops == (one.head.flops if one.tied else one.head.flops / 2)
    assert two.head.activations == one.head.activations  # ... and gathered: the loss sees every logit
    assert two.total_params == one.total_params
    # the same operators run on smaller tensors; torch's gather is communication, not an operator counted
    assert (two.embedding.ops, two.block.ops, two.head.ops) == (one.embedding.ops, one.block.ops, one.head.ops)
    assert two.block.traffic_per_token < one.block.traffic_per_token
    assert two.head.traffic_per_token == one.head.traffic_per_token  # log-softmax and loss over every logit


def test_llama3_8b_at_tp8_holds_an_eighth_of_every_split_weight():
    one, eight = sk.analyse("llama3-8b", seq_len=256), sk.analyse("llama3-8b", seq_len=256, tp=8)
    norms = 2 * 4096  # two RMSNorm weights per block, replicated
    assert eight.block.params == (one.block.params - norms) // 8 + norms
    assert eight.embedding.params == one.embedding.params // 8  # vocabulary-parallel embedding
    assert eight.head.params == (one.head.params - 4096) // 8 + 4096
    assert eight.tp_rules() == LLAMA_RULES and sk.analyse("gpt-tiny").tp_rules() == GPT_RULES


def test_saved_bytes_equal_a_real_cpu_forward():
    """The fake-CPU measurement sees the kernels a real CPU forward runs: the flash kernel (output
    and log-sum-exp) for SDPA, the probabilities for eager attention and for SDPA with dropout."""
    cases = [
        (GPTConfig(layers=3, seq_len=32), lambda c: GPT(c)),
        (tiny_llama_config(num_hidden_layers=3), _hf),
        (tiny_llama_config(num_hidden_layers=3, attn_implementation="eager"), _hf),
        (tiny_gpt2_config(n_layer=3, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1), _hf),
    ]
    for config, build in cases:
        torch.manual_seed(0)
        real = _real_saved_per_token(build(config), SEQ, 256)
        measured = sk.analyse(config, seq_len=SEQ)
        assert measured.activations_per_token() == real, config
    assert not sk.analyse(cases[1][0], seq_len=SEQ).notes
    assert "probabilities" in sk.analyse(cases[2][0], seq_len=SEQ).notes[0]


def test_a_module_and_its_config_give_the_same_analysis():
    for config, meta in [(tiny_llama_config(num_hidden_layers=3), lambda c: _hf(c, "meta")),
                         (tiny_gpt2_config(n_layer=3), lambda c: _hf(c, "meta")),
                         (GPTConfig(layers=3, seq_len=32), lambda c: GPT(c))]:
        module = meta(config)
        for tp in (1, 2):
            a, b = sk.analyse(config, seq_len=SEQ, tp=tp), sk.analyse(module, seq_len=SEQ, tp=tp)
            assert (a.embedding, a.block, a.head, a.layers, a.total_params) == \
                (b.embedding, b.block, b.head, b.layers, b.total_params)
            assert a.block.ops == b.block.ops > 0 and a.block.traffic_per_token == b.block.traffic_per_token > 0
        assert b.total_params == sum(p.numel() for p in module.parameters())


class _MLPBlock(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _TinyLM(nn.Module):
    """Embedding -> blocks of Linear -> GELU -> Linear -> output layer: every operator known by hand."""

    def __init__(self, vocab: int = 32, hidden: int = 8, inner: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_MLPBlock(hidden, inner) for _ in range(layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.lm_head(x)


_TINY_RULES = LayoutMap([(r"layers\.\d+\.fc1\.weight", ("tp", None)), (r"layers\.\d+\.fc1\.bias", ("tp",)),
                         (r"layers\.\d+\.fc2\.weight", (None, "tp")), (r".*", None)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operator_calls_and_traffic_of_a_small_model_by_hand(dtype):
    vocab, hidden, inner, seq = 32, 8, 16, 4
    size = torch.finfo(dtype).bits // 8
    for tp in (1, 2):
        a = sk.analyse(_TinyLM(vocab, hidden, inner), seq_len=seq, tp=tp, dtype=dtype, rules=_TINY_RULES)
        # a linear layer on [1, seq, hidden] is views + one addmm/mm; views launch no kernel
        assert (a.embedding.ops, a.block.ops, a.head.ops) == (1, 3, 3)
        # block: only GELU is priced by bytes, its input and output [seq, inner / tp]
        assert a.block.traffic_per_token == 2 * inner // tp * size
        # embedding: the int64 ids, the rows read and written (not the whole table)
        assert a.embedding.traffic_per_token == 8 + 2 * hidden * size
        # head: log-softmax reads and writes [seq, vocab]; the loss reads the targets, one
        # log-probability per target, and writes the loss and its total weight (two scalars)
        assert a.head.traffic_per_token == 2 * vocab * size + 8 + size + 2 * size / seq


def test_traffic_grows_with_the_hidden_size_and_operator_calls_do_not():
    small = sk.analyse(tiny_llama_config(), seq_len=SEQ)
    wide = sk.analyse(tiny_llama_config(hidden_size=128, intermediate_size=256), seq_len=SEQ)
    assert wide.block.ops == small.block.ops > 20  # norms, rotary, SDPA, gated MLP, residuals
    assert wide.block.traffic_per_token > 1.9 * small.block.traffic_per_token
    assert wide.head.traffic_per_token > small.head.traffic_per_token
    bf16 = sk.analyse(tiny_llama_config(), seq_len=SEQ, dtype=torch.bfloat16)
    # in bf16 each of the block's two RMSNorms casts to fp32 and back: two more kernels each
    assert bf16.block.ops == small.block.ops + 4
    assert bf16.block.traffic_per_token < small.block.traffic_per_token


def test_the_bytes_saved_in_bfloat16_are_measured_with_what_stays_float32():
    config = tiny_llama_config()
    llama = sk.analyse(config, seq_len=SEQ)
    # measured in bfloat16 as a model built in it is: per component the same bytes
    assert llama.block.half_activations_per_token == \
        sk.analyse(config, seq_len=SEQ, dtype=torch.bfloat16).block.activations_per_token
    # each of the block's two RMSNorms saves a float32 copy of its input and its float32 rsqrt per token
    assert llama.block.fixed_activations_per_token["norm"] == 2 * (4 * config.hidden_size + 4)
    assert llama.block.half_activations_per_token["norm"] > llama.block.activations_per_token["norm"] / 2
    gpt = sk.analyse("gpt-tiny", seq_len=16)  # a LayerNorm that does not upcast: its bytes halve
    assert gpt.block.fixed_activations_per_token["norm"] == 0
    assert gpt.block.half_activations_per_token["norm"] == gpt.block.activations_per_token["norm"] / 2
    # full recompute's rebuilt block: what it makes and holds, its input aside (saved by the first norm)
    assert 0 < llama.block.rebuilt_per_token < llama.block.activations


def test_a_module_is_left_as_it_was():
    model = GPT(GPTConfig(layers=4, seq_len=32))
    model.eval()
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    result = sk.analyse(model, seq_len=16, tp=2)
    assert result.layers == 4 and len(model.layers) == 4 and not model.training
    assert all(p is before[n][0] and p.data_ptr() == before[n][1] for n, p in model.named_parameters())
    assert model.layers[0].attn.q_proj.weight.shape == (64, 64)


def test_sizes_ties_and_dtype():
    gpt2 = sk.analyse("gpt2", seq_len=128)
    assert (gpt2.hidden, gpt2.heads, gpt2.kv_heads, gpt2.vocab, gpt2.intermediate, gpt2.layers) == \
        (768, 12, 12, 50257, 3072, 12)
    assert gpt2.tied and gpt2.head.params == 2 * 768  # the tied output layer is counted in the embedding
    llama = sk.analyse("llama3-70b", seq_len=128, dtype=torch.bfloat16)
    assert (llama.heads, llama.kv_heads, llama.head_dim, llama.intermediate, llama.family) == \
        (64, 8, 128, 28672, "llama")
    assert not llama.tied and llama.dtype == torch.bfloat16
    assert llama.block.param_bytes == 2 * llama.block.params
    fp32 = sk.analyse("llama3-70b", seq_len=128)
    assert llama.block.activations < fp32.block.activations
    assert sk.analyse("llama3-70b", seq_len=128) is fp32  # cached


def test_wrong_arguments_are_named_with_what_is_valid():
    with pytest.raises(PlanError, match=r"tp=3.*valid tp sizes: \[1, 2, 4\]"):
        sk.analyse("gpt-tiny", tp=3)
    with pytest.raises(PlanError, match=r"valid tp sizes: \[1, 2, 4, 8\]"):
        sk.analyse("llama3-8b", tp=16)
    with pytest.raises(UsageError, match=r"seq_len=64.*at most 32 positions"):
        sk.analyse("gpt-tiny", seq_len=64)
    with pytest.raises(UsageError, match="tp must be a positive integer, got True"):
        sk.analyse("gpt-tiny", tp=True)
    with pytest.raises(UsageError, match="dtype must be a floating"):
        sk.analyse("gpt-tiny", dtype=torch.int64)
    with pytest.raises(UsageError, match="not a language model"):
        sk.analyse(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(PlanError, match="no layout rules split Sequential"):
        sk.analyse(nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([nn.Linear(4, 4)])), seq_len=4, tp=2)


def test_a_deep_model_is_measured_on_two_blocks_and_cached():
    """Why analysing llama3-405b takes a fraction of a second (timed in benchmarks/planner.py, not here):
    the model measured has BLOCKS_BUILT blocks whatever its depth, and asking again is a cache hit."""
    a = sk.analyse("llama3-405b", tp=8)
    built = analysis.probe_model("llama3-405b")
    assert a.layers == 126 and len(built.model.layers) == analysis.BLOCKS_BUILT == 2
    assert sk.analyse("llama3-405b", tp=8) is a


def test_a_module_without_rules_is_split_by_the_rules_its_dataflow_implies():
    """No built-in rules, no transformers plan: tp > 1 uses sk.infer_tp_rules (fc1 column, fc2 row, head vocab)."""
    model = _TinyLM(vocab=32, hidden=8, inner=16)
    inferred = sk.analyse(model, seq_len=4, tp=2)
    assert inferred.tp_rules() == sk.infer_tp_rules(model)
    block = sk.analyse(model, seq_len=4, tp=1).block
    assert inferred.block.params == (8 * 16 + 16) // 2 + 16 * 8 // 2 + 8 == block.params - (8 * 16 + 16 * 8 + 16) // 2
