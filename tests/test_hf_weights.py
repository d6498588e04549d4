"""HuggingFace weights in (``sk.shard(..., weights=folder)``) and out (``sk.export_hf``).

In: every plan reads the checkpoint's exact values into its shards (bitwise), from a model
built on meta or not, and a checkpoint that does not fit is refused before anything is read,
with every problem named. Out: what any plan exports, transformers' ``from_pretrained`` reads
back to the same logits. Memory: a rank building on meta holds its shards and little more.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from model_zoo import build_gpt2, build_llama_tied, build_llama_untied, build_phi3
from safetensors.torch import load_file, save_file

import shardkit as sk
from shardkit.io.hf_weights import HFWeights, WeightsError
from shardkit.io.safetensors import SafetensorsError, SafetensorsFile, SafetensorsWriter
from shardkit.models.hf import GPT2_RULES, LLAMA_RULES
from shardkit.runtime.apply import full_state_dict
from shardkit.runtime.materialize import open_weights

warnings.filterwarnings("ignore", message=".*token_id.*")


def _perturbed(build):
    """``build()`` with weights no initialisation would give (so a load is told from an init)."""
    model = build()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{builder name: (folder, source model)}``, saved by transformers in several files."""
    out = {}
    for build in (build_gpt2, build_llama_tied, build_llama_untied, build_phi3):
        model = _perturbed(build)
        folder = tmp_path_factory.mktemp(build.__name__)
        model.save_pretrained(folder, max_shard_size="40KB")
        out[build.__name__] = (str(folder), model)
    return out


# --- safetensors, box by box ------------------------------------------------------------------

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


@st.composite
def _tensor_and_box(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    dtype = draw(st.sampled_from(_DTYPES))
    box = []
    for size in shape:
        start = draw(st.integers(0, size))
        box.append(slice(start, draw(st.integers(start, size))))
    tensor = (torch.arange(torch.Size(shape).numel()).reshape(shape) % 7).to(dtype)
    return tensor, tuple(box)


@given(_tensor_and_box())
def test_a_box_read_is_the_box_of_what_safetensors_wrote(tmp_path_factory, case):
    tensor, box = case
    path = tmp_path_factory.mktemp("st") / "t.safetensors"
    save_file({"before": torch.ones(3), "t": tensor, "after": torch.zeros(2)}, str(path))
    got = SafetensorsFile(path).read("t", box)
    assert got.dtype == tensor.dtype and torch.equal(got, tensor[box])


def test_what_we_write_safetensors_reads(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.randn(2, 2).bfloat16(), "s": torch.tensor(1.5)}
    with SafetensorsWriter(tmp_path / "x.safetensors", {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}) as out:
        for name, value in tensors.items():
            out.write(name, value)
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())


def test_a_writer_left_early_removes_its_file_and_says_what_is_missing(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(SafetensorsError, match="1 tensor.*never written.*'b'"):
        with SafetensorsWriter(path, {"a": ((2,), torch.float32), "b": ((2,), torch.float32)}) as out:
            out.write("a", torch.zeros(2))
    assert not path.exists()
    with pytest.raises(SafetensorsError, match="out of order"):
        with SafetensorsWriter(path, {"a": ((2,), torch.float32)}) as out:
            out.write("b", torch.zeros(2))


@pytest.mark.parametrize("damage, reason", [
    (lambda raw: raw[:-5], "truncated or its header damaged"),
    (lambda raw: raw[:12], "header is cut short"),
    (lambda raw: b"\x05\x00\x00\x00\x00\x00\x00\x00{oops", "not JSON"),
    (lambda raw: b"\xff" * 16, "not plausible"),
    (lambda raw: b"abc", "shorter than a safetensors header"),
])
def test_a_damaged_file_is_named_with_what_is_wrong(tmp_path, damage, reason):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(4, 4)}, str(path))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SafetensorsError, match=re.escape(str(path)) + ".*" + reason):
        SafetensorsFile(path)
    with pytest.raises(WeightsError, match=reason):
        HFWeights(tmp_path)


# --- a checkpoint folder matched with a model, before anything is read --------------------------

def test_pickled_weights_are_refused_unread(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"a pickle would run code here")
    with pytest.raises(WeightsError, match="only pickled weights.*pytorch_model.bin.*never unpickles"):
        HFWeights(tmp_path)
    with pytest.raises(WeightsError, match="no weights at"):
        HFWeights(tmp_path / "absent")
    with pytest.raises(WeightsError, match="not a .safetensors file"):
        HFWeights(tmp_path / "pytorch_model.bin")


def test_an_index_that_names_absent_files_or_tensors_is_refused(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="names 1 file.*two.safetensors"):
        HFWeights(tmp_path)
    index["weight_map"] = {"a": "one.safetensors", "b": "one.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="maps 'b' to one.safetensors, which does not hold it"):
        HFWeights(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(WeightsError, match="not a safetensors index"):
        HFWeights(tmp_path)


def test_a_checkpoint_of_another_configuration_is_refused_naming_every_tensor(tmp_path, checkpoints):
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                         tie_word_embeddings=False))
    wider.save_pretrained(tmp_path)
    with pytest.raises(WeightsError) as caught:
        open_weights(str(tmp_path), sk.meta_model(build_llama_untied))
    text = str(caught.value)
    assert "'model.embed_tokens.weight' in model.safetensors has shape [256, 32]; the model's " \
           "'model.embed_tokens.weight' is [256, 64]" in text
    assert "parameter 'model.layers.3.mlp.up_proj.weight' [128, 64] is not in the checkpoint" in text
    assert text.count("\n  - ") > 10  # every problem, not the first


def test_missing_stray_and_renamed_tensors(tmp_path, checkpoints):
    folder, source = checkpoints["build_llama_untied"]
    state = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    state["model.extra.weight"] = torch.zeros(3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError) as caught:
        open_weights(str(tmp_path), sk.meta_model(build_llama_untied))
    assert "parameter 'lm_head.weight' [256, 64] is not in the checkpoint" in str(caught.value)
    assert "1 tensor(s) the model has no parameter for: 'model.extra.weight'" in str(caught.value)


def test_a_base_model_checkpoint_fills_a_tied_model_with_a_head(tmp_path, checkpoints):
    """Keys without the ``model.`` prefix (a LlamaModel's), lm_head absent because tied."""
    _, source = checkpoints["build_llama_tied"]
    state = {k.removeprefix("model."): v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    weights = open_weights(str(tmp_path), sk.meta_model(build_llama_tied))
    box = (slice(0, 2), slice(0, 64))
    assert torch.equal(weights.read("lm_head.weight", box, torch.float32), source.lm_head.weight[box])


def test_gpt2_hub_layout_with_its_ignored_attention_buffers(tmp_path, checkpoints):
    """The hub's GPT-2 files: no ``transformer.`` prefix and ``h.N.attn.bias`` masks, which GPT-2
    declares ignorable (``_keys_to_ignore_on_load_unexpected``)."""
    _, source = checkpoints["build_gpt2"]
    state = {k.removeprefix("transformer."): v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    weights = open_weights(str(tmp_path), sk.meta_model(build_gpt2))
    box = (slice(0, 64), slice(0, 192))
    assert torch.equal(weights.read("transformer.h.1.attn.c_attn.weight", box, torch.float32),
                       source.transformer.h[1].attn.c_attn.weight)


def test_train_init_from_a_bad_folder_fails_before_any_process(tmp_path, no_processes, capsys):
    from shardkit.cli import main

    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    code = main(["train", "--model", "llama-tiny", "--mesh", "fsdp=2", "--steps", "1", "--init-from", str(tmp_path)])
    assert code == 2 and "never unpickles" in capsys.readouterr().err


# --- in every plan, and back out ----------------------------------------------------------------

def _load_and_export(ctx, build, folder, out, meta):
    model = sk.shard(sk.meta_model(build) if meta else build(), ctx.plan, weights=folder)
    held = full_state_dict(model)
    sk.export_hf(out, model, max_shard_size="30KB")
    return held


CASES = [  # (world size, mesh, builder, tensor-parallel rules)
    (4, "fsdp=4", "build_llama_tied", None),
    (4, "dp=2,tp=2", "build_gpt2", GPT2_RULES),  # packed c_attn: permuted shards
    (4, "fsdp=2,tp=2", "build_phi3", "from_hf"),  # packed qkv_proj and gate_up_proj
    (4, "pp=2,fsdp=2", "build_llama_untied", None),
    (4, "pp=4", "build_llama_untied", None),
    (3, "fsdp=3", "build_phi3", None),
    (2, "tp=2", "build_llama_tied", LLAMA_RULES),
    (1, "dp=1", "build_gpt2", None),
]
BUILDERS = {b.__name__: b for b in (build_gpt2, build_llama_tied, build_llama_untied, build_phi3)}


@pytest.mark.parametrize("size, mesh, builder, rules", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_every_plan_loads_the_checkpoint_exactly_and_exports_what_from_pretrained_reads(
        world, checkpoints, tmp_path, size, mesh, builder, rules):
    build = BUILDERS[builder]
    folder, source = checkpoints[builder]
    layout = sk.LayoutMap.from_hf(sk.meta_model(build)) if rules == "from_hf" else rules
    parsed = sk.Mesh.parse(mesh)
    plan = sk.Plan(parsed, layout, pipeline=sk.Pipeline(microbatches=2, schedule="gpipe") if "pp" in parsed else None)
    expected = dict(source.named_parameters())
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = source(tokens).logits
    for meta in (True, False) if size == 4 else (True,):
        out = tmp_path / f"export-{meta}"
        held = {}
        for part in world(size).run(_load_and_export, build, folder, str(out), meta, plan=plan):
            held.update(part)
        assert set(held) == set(expected)
        assert all(torch.equal(held[n], expected[n]) for n in held), [n for n in held if not torch.equal(held[n], expected[n])]
        back = type(source).from_pretrained(out).eval()
        with torch.no_grad():
            assert torch.equal(back(tokens).logits, reference)
        files = sorted(os.listdir(out))
        assert "config.json" in files and "model.safetensors.index.json" in files
        assert json.loads((out / "config.json").read_text())["architectures"] == [type(source).__name__]
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == [f for f in files if f.startswith("model-")]
        assert all(os.path.getsize(out / f) < 30_000 + 70_000 for f in files)  # ≤ limit, or one large tensor


def test_export_refuses_a_folder_in_use(world, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(sk.UsageError, match="exists and is not an empty folder: pass overwrite=True"):
        sk.export_hf(tmp_path, torch.nn.Linear(2, 2))
    assert (tmp_path / "keep.txt").read_text() == "mine"
    with pytest.raises(sk.UsageError, match="holds keep.txt, which this write does not make"):
        sk.export_hf(tmp_path, torch.nn.Linear(2, 2), overwrite=True)  # overwrite replaces an export, nothing else
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]
    (tmp_path / "keep.txt").unlink()
    sk.export_hf(tmp_path, torch.nn.Linear(3, 3))
    sk.export_hf(tmp_path, torch.nn.Linear(2, 2), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


# --- memory: shards, not the model --------------------------------------------------------------

def _build_wide_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=8, n_embd=128, n_head=4, vocab_size=1024, n_positions=64))


def _peak_of_meta_build(ctx, folder, out):
    from shardkit.observe.memory import TensorMemoryPeak, tensors_nbytes

    with TensorMemoryPeak() as built:
        model = sk.shard(sk.meta_model(_build_wide_gpt2), ctx.plan, weights=folder)
    with TensorMemoryPeak() as exported:
        sk.export_hf(out, model)
    return built.peak_bytes(), exported.peak_bytes(), tensors_nbytes(model.parameters())


def test_a_rank_holds_its_shards_and_one_tensor_while_building_and_exporting(world, tmp_path):
    model = _build_wide_gpt2()
    model.save_pretrained(tmp_path / "in")
    whole = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    results = world(4).run(_peak_of_meta_build, str(tmp_path / "in"), str(tmp_path / "out"),
                           plan=sk.Plan(sk.Mesh.parse("fsdp=4")))
    for rank, (built, exported, shards) in enumerate(results):
        assert shards < whole / 3
        assert built <= shards + largest, (rank, built, shards, largest)
        # a gathered tensor, its send, rank 0's write; and for a moment gloo's worker thread may still hold the
        # previous gather's buffers (a rank 1 read 3 x largest + 70 KB under load, 2 x largest alone): far
        # below the model whole (13 x largest), which is what this bounds
        assert exported <= 3 * largest + 2**18, (rank, exported, largest)


# --- names as transformers writes them, for models nobody here wrote -------------------------------

def names_and_shapes(folder) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            found.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
    return found


@pytest.mark.parametrize("builder", ["build_neox", "build_bert", "build_opt", "build_gemma", "build_gpt2"])
def test_one_process_export_names_tensors_as_save_pretrained_and_reads_them_back(tmp_path, builder):
    """GPT-NeoX's files say ``embed_out`` where the model says ``lm_head`` (transformers' renamings,
    applied both ways); tied heads are left out; BERT keeps its persistent buffers."""
    import model_zoo

    from shardkit.runtime.materialize import materialize

    build = getattr(model_zoo, builder)
    source = _perturbed(build)
    source.save_pretrained(tmp_path / "theirs", max_shard_size="50KB")
    model = materialize(sk.meta_model(build), source=open_weights(str(tmp_path / "theirs"), sk.meta_model(build)))
    assert all(torch.equal(p, dict(source.named_parameters())[n]) for n, p in model.named_parameters())
    sk.export_hf(tmp_path / "ours", model, max_shard_size="50KB")
    ours, theirs = names_and_shapes(tmp_path / "ours"), names_and_shapes(tmp_path / "theirs")
    assert ours == theirs
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(theirs) and index["metadata"]["total_size"] > 0


def test_convert_writes_the_names_of_the_saved_models_library(tmp_path):
    """A checkpoint keeps the model's config (its class named as save_pretrained names it), so
    convert asks transformers how that class's files name their tensors."""
    from model_zoo import build_neox

    source = _perturbed(build_neox)
    source.save_pretrained(tmp_path / "theirs")
    sk.save(tmp_path / "ck", source, step=1)
    config = json.loads((tmp_path / "ck" / "step-00000001" / "config.json").read_text())
    assert config["architectures"] == ["GPTNeoXForCausalLM"]
    sk.convert_to_hf(tmp_path / "ck", tmp_path / "ours")
    assert names_and_shapes(tmp_path / "ours") == names_and_shapes(tmp_path / "theirs")
    from transformers import GPTNeoXForCausalLM

    back = GPTNeoXForCausalLM.from_pretrained(tmp_path / "ours")
    assert all(torch.equal(p, dict(source.named_parameters())[n]) for n, p in back.named_parameters())


def test_an_export_cast_to_bfloat16_says_so_in_its_config(tmp_path):
    from shardkit.runtime.materialize import materialize

    model = materialize(sk.meta_model(build_llama_untied))
    sk.export_hf(tmp_path / "bf16", model, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    weights = HFWeights(tmp_path / "bf16")
    assert {dtype for _, _, dtype in weights.keys.values()} == {torch.bfloat16}
    assert model.config.to_dict().get("dtype") != "bfloat16"  # the model's own config is left alone
