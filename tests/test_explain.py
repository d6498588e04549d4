"""explain_plan / estimate_memory / `shardkit explain`: per-device shapes and bytes, before launch."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.cli import main
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt
from shardkit.models.hf import GPT2_RULES, LLAMA_RULES, build_llama_70b, build_tiny_gpt2
from shardkit.plan import FSDPOptions, LayoutMap, Mesh, Plan, PlanError
from shardkit.planner.explain import estimate_memory, explain_plan
from shardkit.planner.meta import meta_model

TINY_GPT = build_tiny_gpt()

# Llama-3 70B by hand: hidden, layers, intermediate, vocab, kv width (8 heads x 128).
H, LAYERS, INTER, VOCAB, KV = 8192, 80, 28672, 128256, 1024


def _llama_70b_bytes_per_device(tp: int, fsdp: int) -> tuple[int, int]:
    """(parameter bytes per device, largest FSDP unit in elements) from the architecture, fp32."""
    layer = [  # tp-local (rows, cols): column-parallel split rows, row-parallel split cols, norms replicated
        (H // tp, H), (KV // tp, H), (KV // tp, H), (H, H // tp),
        (INTER // tp, H), (INTER // tp, H), (H, INTER // tp), (H, 1), (H, 1),
    ]
    root = [(VOCAB // tp, H), (VOCAB // tp, H), (H, 1)]  # vocab-parallel embedding, colwise lm_head, final norm
    elements = LAYERS * sum(math.ceil(r / fsdp) * c for r, c in layer) + sum(math.ceil(r / fsdp) * c for r, c in root)
    largest_unit = max(sum(r * c for r, c in layer), sum(r * c for r, c in root))
    return 4 * elements, largest_unit


def test_70b_on_meta_explains_bytes_per_device():
    model = build_llama_70b()
    assert all(p.device.type == "meta" for p in model.parameters())
    plan = Plan(Mesh(fsdp=-1, tp=8), LLAMA_RULES)
    text = explain_plan(plan, model, world_size=64)
    expected, _ = _llama_70b_bytes_per_device(tp=8, fsdp=8)
    assert f"parameter bytes per device: {expected:,} B" in text
    assert f"total / 64 devices = {70_553_706_496 * 4 / 64:,.0f} B" in text
    assert "fsdp   8" in text and "tp     8" in text and "FSDP2" in text  # mesh header with roles
    q_row = next(line for line in text.splitlines() if line.startswith("model.layers.{0..79}.self_attn.q_proj.weight"))
    assert re.search(r"x80\s+\[8192, 8192\]\s+#7\s+\(tp, None\)\s+colwise\s+\[1024, 8192\]\s+\[128, 8192\]\s+4,194,304", q_row)  # rule #7: LLAMA_RULES are transformers' plan, sorted (LayoutMap.from_hf)
    assert re.search(r"^model\.embed_tokens\.weight .* vocab-parallel ", text, re.M)
    assert re.search(r"o_proj\.weight .* rowwise ", text)
    assert len(text.splitlines()) < 50  # 723 tensors grouped into one row per distinct layer parameter
    assert "\x1b[" not in text


def test_70b_memory_estimate():
    """estimate_memory is sk.estimate's memory (one model of it): the state terms by hand from the
    architecture; FSDP2's gathered bytes peak at the root unit's post-backward: the root (the
    tp-local embedding and LM head, the final norm) gathered, its gradients (DTensor's backward of
    the vocab-parallel embedding makes the embedding's whole) and the last block's reduce-scatter input."""
    model = build_llama_70b()
    params, _ = _llama_70b_bytes_per_device(tp=8, fsdp=8)
    table = VOCAB // 8 * H
    block = 2 * (H // 8 * H + KV // 8 * H) + 3 * INTER // 8 * H + 2 * H
    root = 2 * table + H
    memory = estimate_memory(Plan(Mesh(fsdp=8, tp=8), LLAMA_RULES), model)
    assert (memory["parameters"], memory["gradients"], memory["optimizer"]) == (params, params, 2 * params)
    assert memory["gathered"] == 4 * (root + VOCAB * H + table + H + block)
    state = params * 3 + memory["overhead"]  # the gradients are not allocated until the backward
    assert state + memory["activations"] < memory["total"] < sum(v for k, v in memory.items() if k != "total")
    bf16 = Plan(Mesh(fsdp=8, tp=8), LLAMA_RULES, fsdp=FSDPOptions(param_dtype="bfloat16"))
    assert estimate_memory(bf16, model)["gathered"] == 2 * (root + VOCAB * H + table + H + block)
    assert estimate_memory(Plan(Mesh(tp=8), LLAMA_RULES), model)["gathered"] == 0


_TP_DIM = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "q_proj.bias": 0, "k_proj.bias": 0,
           "v_proj.bias": 0, "up_proj.weight": 0, "up_proj.bias": 0, "o_proj.weight": 1, "down_proj.weight": 1,
           "lm_head.weight": 0}  # the reference GPT's Megatron split, written out by hand


@settings(max_examples=25, deadline=None)
@given(fsdp=st.integers(1, 7), tp=st.sampled_from([1, 2, 4]))
def test_fsdp_pads_uneven_dim0_like_torch_chunk(fsdp, tp):
    mesh = Mesh(fsdp=fsdp, tp=tp) if tp > 1 else Mesh(fsdp=fsdp)
    expected = 0
    for name, param in TINY_GPT.named_parameters():
        local = param.detach()
        dim = next((d for suffix, d in _TP_DIM.items() if name.endswith(suffix)), None)
        if tp > 1 and dim is not None:
            local = local.chunk(tp, dim)[0]
        expected += local.chunk(fsdp, 0)[0].numel() * 4  # FSDP2 pads every shard to the first chunk's size
    rules = GPT_RULES if tp > 1 else None
    assert estimate_memory(Plan(mesh, rules), TINY_GPT)["parameters"] == expected
    assert f"parameter bytes per device: {expected:,} B" in explain_plan(Plan(mesh, rules), TINY_GPT)


def test_fsdp_shards_the_dim_a_layout_names_and_joins_sp():
    shapes = {"w": (6, 10), "v": (5,)}
    rules = LayoutMap([("w", (None, "fsdp")), ("v", None)])
    text = explain_plan(Plan(Mesh(fsdp=2), rules), shapes)
    assert re.search(r"^w\s+x1\s+\[6, 10\]\s+#0\s+\(None, fsdp\)\s+replicated\s+\[6, 10\]\s+\[6, 5\]", text, re.M)
    assert "parameter bytes per device: 80 B" in explain_plan(Plan(Mesh(fsdp=2, sp=2), rules), shapes)  # 4 x (6 x ceil(10/4) + ceil(5/4))
    assert "parameter bytes per device: 260 B" in explain_plan(Plan(Mesh(dp=2, sp=2), None), shapes)  # 4 x (60 + 5): sp alone replicates


def test_explain_shows_fsdp_padding_and_conv1d_mechanisms():
    text = explain_plan(Plan(Mesh(fsdp=3, tp=2), GPT2_RULES), meta_model(build_tiny_gpt2))
    assert re.search(r"^transformer\.wte\.weight\s+x1\s+\[256, 64\]\s+#3\s+None\s+replicated\s+\[256, 64\]\s+\[86, 64\]", text, re.M)
    assert re.search(r"^transformer\.h\.\{0\.\.1\}\.attn\.c_attn\.weight\s+x2 .* colwise \(Conv1D\)\s+\[64, 96\]\s+\[22, 96\]", text, re.M)
    assert re.search(r"^transformer\.h\.\{0\.\.1\}\.mlp\.c_proj\.weight\s+x2 .* rowwise \(Conv1D\)", text, re.M)


def test_explain_reports_unused_rules_and_dp_replication():
    rules = LayoutMap([(r"blocks\.\d+\.w", ("tp", None)), *GPT_RULES.items()])
    text = explain_plan(Plan(Mesh(dp=2, tp=2), rules), TINY_GPT)
    assert "unused rule #0 'blocks\\\\.\\\\d+\\\\.w' matches no parameter (a typo or a renamed module?)" in text
    assert "replicated over dp=2" in text
    with pytest.raises(AttributeError, match="sk.explain_plan"):  # model checks live in the planner now
        Plan(Mesh(dp=2, tp=2), rules).explain(TINY_GPT)


def test_explain_accepts_a_mapping_of_shapes():
    plan = Plan(Mesh(tp=2), LayoutMap([("w", ("tp", None)), ("b", None)]))
    text = explain_plan(plan, {"w": (4, 6), "b": (6,)})
    assert re.search(r"^w\s+x1\s+\[4, 6\]\s+#0\s+\(tp, None\)\s+sharded\s+\[2, 6\]", text, re.M)
    assert re.search(r"^b\s+x1\s+\[6\]\s+#1\s+None\s+replicated", text, re.M)


def test_explain_raises_plan_errors_naming_the_parameter():
    with pytest.raises(PlanError, match=r"'layers\.0\.attn\.q_proj\.weight'.*not divisible by tp=3"):
        explain_plan(Plan(Mesh(tp=3), GPT_RULES), TINY_GPT)
    with pytest.raises(PlanError, match="pass world_size="):
        explain_plan(Plan(Mesh(fsdp=-1, tp=2), GPT_RULES), TINY_GPT)


# -- the command line ---------------------------------------------------------------------------

def test_cli_explains_a_registered_model(capsys):
    assert main(["explain", "--model", "gpt-tiny", "--mesh", "fsdp=-1,tp=2", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^layers\.\{0\.\.1\}\.attn\.q_proj\.weight\s+x2\s+\[64, 64\]", out, re.M)
    assert "on 4 devices" in out


def test_cli_reads_a_plan_file(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    Plan(Mesh(tp=2), LayoutMap([(r"lm_head\.weight", ("tp", None)), (r".*", None)])).save(path)
    assert main(["explain", "--model", "gpt-tiny", "--plan", str(path)]) == 0
    assert re.search(r"^lm_head\.weight\s+x1\s+\[256, 64\]\s+#0\s+\(tp, None\)\s+colwise\s+\[128, 64\]",
                     capsys.readouterr().out, re.M)


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt-tiny", "--mesh", "tp=3"], "'layers.0.attn.q_proj.weight'"),
    (["--model", "llama-tiny", "--mesh", "tp=4"], "'model.layers.0.self_attn' (and 1 more like it) has 4 query heads"),
    (["--model", "gpt-tiny", "--mesh", "fsdp=-1"], "pass --world-size N"),
    (["--model", "gpt-tiny", "--plan", "no/such/plan.json"], "cannot read plan file 'no/such/plan.json'"),
])
def test_cli_exits_2_with_the_problem(argv, message, capsys):
    assert main(["explain", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_cli_bad_plan_file_names_the_parameter(tmp_path, capsys):
    path = tmp_path / "plan.json"
    Plan(Mesh(tp=3), LayoutMap([(r"lm_head\.weight", ("tp", None)), (r".*", None)])).save(path)
    assert main(["explain", "--model", "gpt-tiny", "--plan", str(path)]) == 2
    assert "'lm_head.weight'" in capsys.readouterr().err


def test_cli_70b(capsys):
    assert main(["explain", "--model", "llama-70b", "--mesh", "fsdp=-1,tp=8", "--world-size", "64"]) == 0
    expected, _ = _llama_70b_bytes_per_device(tp=8, fsdp=8)
    assert f"{expected:,} B" in capsys.readouterr().out
    assert torch.get_default_device().type == "cpu"  # building on meta left the default device alone


def test_cli_prints_one_memory_total_that_of_the_estimate(capsys):
    """One model of memory: `shardkit explain` prints one total per device, sk.estimate's for the same
    plan and batch, and sk.estimate_memory is that estimate's memory."""
    from shardkit.plan.text import format_bytes
    from shardkit.planner.estimate import estimate

    assert main(["explain", "--model", "gpt-tiny", "--mesh", "fsdp=2,tp=2", "--batch-size", "4"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "memory per device" in line]
    plan, model = Plan(Mesh(fsdp=2, tp=2), GPT_RULES), meta_model(build_tiny_gpt)
    expected = estimate(model, plan, batch_size=4, seq_len=32)
    assert len(lines) == 1 and f": {format_bytes(expected.memory['total'], digits=2)} of " in lines[0], lines
    assert estimate_memory(plan, model, batch_size=4, seq_len=32) == dict(expected.memory)
