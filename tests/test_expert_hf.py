"""Mixtures of experts in and out of HuggingFace folders: one tensor per expert (as published and
as ``save_pretrained`` writes them) and stacked (as the model holds them).

In: under ``ep`` (and ``fsdp x ep``) every rank's shards hold the checkpoint's exact values, and a
rank reads the tensors of its own experts only (counted, tensor by tensor and byte by byte). A
folder that cannot fill the model (an expert missing, one too many, a wrong shape) is refused
before anything is read, naming the tensor. Out: ``sk.export_hf`` from the model sharded under
``ep`` and ``shardkit checkpoint convert`` from a checkpoint saved under ``ep`` write what
``save_pretrained`` writes, which ``from_pretrained`` reads back to the sharded model's logits.
One job per world runs every case.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from model_zoo import with_expert_tp_entries
from safetensors import safe_open
from safetensors.torch import save_file
from test_hf_weights import names_and_shapes

import shardkit as sk
from shardkit.models.hf import build_tiny_mixtral, build_tiny_qwen2_moe
from shardkit.planner.meta import meta_model
from shardkit.runtime.materialize import open_weights

warnings.filterwarnings("ignore", message=".*token_id.*")

BUILDERS = {"mixtral": build_tiny_mixtral, "qwen2-moe": build_tiny_qwen2_moe}
#: An expert's tensor in either model's files: ``...experts.3.w1.weight`` (Mixtral), ``...experts.3.up_proj.weight``.
PER_EXPERT = re.compile(r"layers\.(\d+)\.\w+\.experts\.(\d+)\.\w+\.weight$")
STACKED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
#: (model, folder layout, mesh, export?) per world size; ``"convert"``: a checkpoint saved too, converted here.
CASES = {2: [("mixtral", "per-expert", "ep=2", "convert"), ("qwen2-moe", "per-expert", "ep=2", "export"),
             ("qwen2-moe", "stacked", "ep=2", "")],
         4: [("mixtral", "per-expert", "fsdp=2,ep=2", "export"), ("mixtral", "stacked", "ep=4", "")]}


def _perturbed(build):
    model = build()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``{(model, layout): (folder, source model)}``: per-expert as ``save_pretrained`` writes it (in
    several files), stacked as the model holds it."""
    out = {}
    for name, build in BUILDERS.items():
        source = _perturbed(build)
        per_expert = tmp_path_factory.mktemp(f"{name}-per-expert")
        source.save_pretrained(per_expert, max_shard_size="60KB")
        stacked = tmp_path_factory.mktemp(f"{name}-stacked")
        save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(stacked / "model.safetensors"))
        source.config.save_pretrained(stacked)
        out[name, "per-expert"] = (str(per_expert), source)
        out[name, "stacked"] = (str(stacked), source)
    return out


def _held_experts(model) -> dict[str, set[int]]:
    """``{layer: experts this rank holds a part of}``, from where its shards sit in the full tensors."""
    from shardkit.runtime.pieces import pieces

    held: dict[str, set[int]] = {}
    for name, param in model.named_parameters():
        found = STACKED.search(name)
        if found:
            for piece in pieces(param):
                held.setdefault(found.group(1), set()).update(range(piece.box[0].start, piece.box[0].stop))
    return held


def _load_and_export(ctx, cases):
    """Each case: load under its plan counting every box read, then the full weights (rank 0),
    the experts read and held, logits, and the export / checkpoint where asked."""
    import shardkit.checkpoint.export as export
    from shardkit.io.safetensors import SafetensorsFile
    from shardkit.runtime.apply import full_state_dict

    reads: list[tuple[str, tuple[slice, ...], int]] = []
    original = SafetensorsFile.read

    def counting(self, name, box=None):
        out = original(self, name, box)
        reads.append((name, box, out.numel() * out.element_size()))
        return out

    received: list[tuple[int, ...]] = []  # the shapes rank 0 receives while exporting
    receive = export._receive

    def counting_receive(source, shape, dtype):
        received.append(tuple(shape))
        return receive(source, shape, dtype)

    SafetensorsFile.read, export._receive = counting, counting_receive
    results = []
    try:
        for build_name, folder, mesh, out, convert in cases:
            reads.clear()
            model = sk.shard(meta_model(BUILDERS[build_name]), sk.Plan(mesh=sk.Mesh.parse(mesh)), ctx, weights=folder)
            read = list(reads)
            weights = full_state_dict(model)
            with torch.no_grad():
                logits = model(TOKENS).logits
            received.clear()
            if out is not None:
                sk.export_hf(out + "/export", model, max_shard_size="60KB")
            if convert:
                sk.save(out + "/checkpoint", model, step=1)
            results.append((weights if ctx.rank == 0 else None, read, _held_experts(model), logits, list(received)))
    finally:
        SafetensorsFile.read, export._receive = original, receive
    return results


@pytest.fixture(scope="module")
def loaded(world, folders, tmp_path_factory):
    found = {}
    for size, cases in CASES.items():
        jobs = [(model, folders[model, layout][0], mesh,
                 str(tmp_path_factory.mktemp(f"{model}-{size}")) if out else None, out == "convert")
                for model, layout, mesh, out in cases]
        runs = world(size).run(_load_and_export, jobs)
        for i, case in enumerate(cases):
            found[case] = ([run[i] for run in runs], jobs[i][3])
    return found


ALL = [c for cases in CASES.values() for c in cases]


@pytest.mark.parametrize("case", ALL, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in ALL])
def test_each_rank_reads_its_own_experts_into_exact_shards(loaded, folders, case):
    model, layout, mesh, _ = case
    ranks, _ = loaded[case]
    _, source = folders[model, layout]
    expected = dict(source.named_parameters())
    weights = ranks[0][0]
    assert set(weights) == set(expected)
    assert all(torch.equal(weights[n], expected[n]) for n in weights), [n for n in weights
                                                                       if not torch.equal(weights[n], expected[n])]
    experts = source.config.num_local_experts if model == "mixtral" else source.config.num_experts
    share = experts // len(ranks)  # experts a rank holds: E / ep, split further by fsdp in fsdp=2,ep=2
    expert_bytes = sum(p.numel() * p.element_size() for n, p in expected.items() if STACKED.search(n))
    for _, read, held, _, _ in ranks:
        assert len(held) == 2 and all(len(h) == share for h in held.values())
        seen: dict[str, set[int]] = {}
        nbytes = 0
        for key, box, size in read:
            if layout == "per-expert" and PER_EXPERT.search(key):
                layer, expert = PER_EXPERT.search(key).groups()
                seen.setdefault(layer, set()).add(int(expert))
                nbytes += size
            elif layout == "stacked" and STACKED.search(key):
                layer = STACKED.search(key).group(1)
                seen.setdefault(layer, set()).update(range(box[0].start, box[0].stop))
                nbytes += size
        assert seen == held  # exactly the experts this rank holds, never all of them
        assert all(len(s) < experts for s in seen.values())
        assert nbytes == expert_bytes * share // experts


def _logits_equal(ranks, folder):
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = back(TOKENS).logits
    for rank in ranks:
        torch.testing.assert_close(rank[3], theirs, rtol=1e-5, atol=1e-5)


EXPORTED = [c for c in ALL if c[3]]


@pytest.mark.parametrize("case", EXPORTED, ids=[f"{c[0]}-{c[2]}" for c in EXPORTED])
def test_export_under_ep_writes_what_save_pretrained_writes_and_from_pretrained_reads(loaded, folders, case, tmp_path):
    ranks, out = loaded[case]
    folder, source = folders[case[0], "per-expert"]
    exported = Path(out) / "export"
    assert names_and_shapes(exported) == names_and_shapes(Path(folder))  # one tensor per expert, as published
    assert len(json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"]) > 20
    _logits_equal(ranks, exported)
    # rank 0 receives the experts it does not hold one by one, each from its rank: no layer's
    # stacked experts travel whole (a [E, ...] tensor), and nothing else is larger than one expert's
    received = ranks[0][4]
    experts = [shape for shape in received if shape in ((256, 64), (64, 128), (128, 64), (64, 64))]
    assert received and all(len(shape) == 2 for shape in received) and len(experts) >= 2 * 2 * 2
    if case[3] != "convert":
        return
    from shardkit.cli import main

    converted = ["checkpoint", "convert", f"{out}/checkpoint", "--to", "hf", str(tmp_path / "converted")]
    assert main([*converted, "--max-shard-size", "60KB"]) == 0  # shardkit checkpoint convert
    assert names_and_shapes(tmp_path / "converted") == names_and_shapes(Path(folder))
    _logits_equal(ranks, tmp_path / "converted")


# -- folders that cannot fill the model, refused before anything is read ---------------------------------------------
def _refusal(tmp_path, folders, change) -> str:
    folder, _ = folders["mixtral", "per-expert"]
    tensors = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(sk.WeightsError) as info:
        open_weights(str(tmp_path), meta_model(build_tiny_mixtral))
    return str(info.value)


def test_a_missing_expert_is_named(tmp_path, folders):
    text = _refusal(tmp_path, folders, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight"))
    assert ("the model's 'model.layers.1.mlp.experts.gate_up_proj' [4, 256, 64] is stacked from one tensor per "
            "expert, but the checkpoint has no '.experts.*.w3.weight' for expert(s) [3] of 4 (it has experts "
            "[0, 1, 2]): e.g. 'model.layers.1.mlp.experts.3.w3.weight' is missing") in text


def test_an_expert_of_the_wrong_shape_or_one_too_many_is_named(tmp_path, folders):
    def change(tensors):
        tensors["model.layers.0.block_sparse_moe.experts.2.w2.weight"] = torch.zeros(64, 64)
        tensors["model.layers.0.block_sparse_moe.experts.4.w2.weight"] = torch.zeros(64, 128)

    text = _refusal(tmp_path, folders, change)
    assert ("'model.layers.0.block_sparse_moe.experts.2.w2.weight' in model.safetensors has shape [64, 64]; as "
            "expert 2's source 0 of the model's 'model.layers.0.mlp.experts.down_proj' [4, 64, 128] it must be "
            "[64, 128]") in text
    assert ("the checkpoint holds '.experts.*.w2.weight' for expert(s) [4], but the model's "
            "'model.layers.0.mlp.experts.down_proj' [4, 64, 128] has 4 experts") in text


# -- transformers' expert-parallel plan ---------------------------------------------------------------------------------
@pytest.mark.parametrize("build", [build_tiny_mixtral, build_tiny_qwen2_moe])
def test_from_hf_with_ep_leaves_the_experts_to_ep_and_splits_attention(build):
    model = with_expert_tp_entries(meta_model(build))  # a tensor-parallel plan splitting the experts
    with_ep, tensor_parallel = sk.LayoutMap.from_hf(model, ep=True), sk.LayoutMap.from_hf(model)
    for name, _ in model.named_parameters():
        if STACKED.search(name):  # base_model_ep_plan's grouped_gemm: whole over tp, ep splits dim 0
            assert with_ep.lookup(name)[1] is None and tensor_parallel.lookup(name)[1] is not None
        elif ".self_attn." in name:
            assert with_ep.lookup(name)[1] == tensor_parallel.lookup(name)[1]


def test_sk_infer_tp_rules_resolves_like_the_expert_parallel_plan():
    """Inferred from the dataflow: attention split, the grouped-GEMM experts left whole for ``ep``."""
    from shardkit.plan.layout import resolve_layouts
    from shardkit.plan.plan import param_shapes

    model = meta_model(build_tiny_mixtral)
    shapes, mesh = param_shapes(model), sk.Mesh(tp=2)
    inferred = resolve_layouts(shapes, sk.infer_tp_rules(model), mesh).params
    planned = resolve_layouts(shapes, sk.LayoutMap.from_hf(model, ep=True), mesh).params
    assert {n: p.layout for n, p in inferred.items()} == {n: p.layout for n, p in planned.items()}
    assert inferred["model.layers.0.self_attn.q_proj.weight"].layout == ("tp", None)


def test_a_model_without_an_ep_plan_or_with_an_unknown_style_is_refused(monkeypatch):
    from shardkit.models.hf import build_tiny_llama

    with pytest.raises(sk.PlanError, match="LlamaForCausalLM has no expert-parallel plan in transformers"):
        sk.LayoutMap.from_hf(meta_model(build_tiny_llama), ep=True)
    model = meta_model(build_tiny_mixtral)
    monkeypatch.setattr(model, "_ep_plan", {"model.layers.*.mlp.experts": "ep_router"})
    with pytest.raises(sk.PlanError, match="plan entry 'model.layers.*.mlp.experts' of MixtralForCausalLM has style "
                                           "'ep_router', which has no shardkit equivalent"):
        sk.LayoutMap.from_hf(model, ep=True)
