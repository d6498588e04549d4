"""Checkpoints: ``sk.save`` / ``sk.load`` and ``shardkit checkpoint inspect``.

Resharding round trips keep parameters and AdamW state bitwise (fsdp=4 -> tp=2 x dp=2 -> one
process -> pp=2 or tp=4 -> fsdp=4, the reference GPT and GPT-2); a resume continues exactly
(same plan: bitwise, data order included; another plan: within sk.verify's tolerances); RNG
states come back per rank; a save killed with SIGKILL at random moments never costs the last
checkpoint; every kind of damage is refused naming the file and its tensors; keep_last; the
latest complete checkpoint is the one loaded. Worlds of 1, 2, 3 and 4 processes; tiny models.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import checkpoint_kill
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import build_llama_tied
from torch import nn
from torch.distributed.tensor import DTensor

import shardkit as sk
from shardkit.checkpoint import rng
from shardkit.checkpoint.manifest import MANIFEST_NAME, METADATA_NAME, tensors_by_file
from shardkit.checkpoint.state import OPTIMIZER, state_dicts
from shardkit.checkpoint.store import complete_checkpoints
from shardkit.cli import main
from shardkit.models.gpt import GPT, GPT_RULES, GPTConfig, build_tiny_gpt, gpt_loss
from shardkit.models.hf import GPT2_RULES, LLAMA_RULES, build_tiny_gpt2, hf_loss
from shardkit.plan import UsageError
from shardkit.runtime.verify import TOLERANCES

SRC = Path(__file__).resolve().parents[1] / "src"
MODELS = {"gpt": (build_tiny_gpt, GPT_RULES, gpt_loss), "gpt2": (build_tiny_gpt2, GPT2_RULES, hf_loss),
          "llama-tied": (build_llama_tied, LLAMA_RULES, hf_loss)}
LR = 1e-2


def plan_for(model: str, **mesh: int) -> sk.Plan:
    rules = MODELS[model][1] if "tp" in mesh else None
    pipeline = sk.Pipeline(schedule="gpipe", microbatches=2) if "pp" in mesh else None
    return sk.Plan(mesh=sk.Mesh(**mesh), rules=rules, pipeline=pipeline)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full, canonical parameters and optimizer state this rank holds (a collective): DTensors
    gathered, packed tensor-parallel rows put back in order as ``sk.full_state_dict`` does."""
    permutations = getattr(model, "_sk_permutations", {})
    optimizer_state = {}
    for key, value in state_dicts(model, optimizer)[OPTIMIZER].items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            name = key.removeprefix("state.").rpartition(".")[0]
            if name in permutations and value.dim():
                dim, perm = permutations[name]
                value = value.index_select(dim, torch.argsort(perm))
            value = value.detach().clone()
        optimizer_state[key] = value
    copies = getattr(model, "tied_copies", {})  # a later pipeline stage's copy of a tied parameter
    return {copies.get(n, n): v for n, v in sk.full_state_dict(model).items()}, optimizer_state


def merged(states: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Every rank's full state together (pipeline stages hold different parameters; the copies of a
    parameter tied across stages must be bitwise equal)."""
    parameters, optimizer = {}, {}
    for p, o in states:
        for mine, theirs in ((p, parameters), (o, optimizer)):
            for key, value in mine.items():
                assert key not in theirs or _same(value, theirs[key]), f"the copies of {key} differ"
                theirs[key] = value
    return parameters, optimizer


def differences(state: tuple[dict, dict], expected: tuple[dict, dict]) -> list[str]:
    """The names whose value is not bitwise the expected one (or that one side lacks)."""
    wrong = []
    for got, want in zip(state, expected):
        wrong += sorted(set(got) ^ set(want))
        wrong += [k for k in want if k in got and not _same(got[k], want[k])]
    return wrong


def _same(a, b) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, ctx=None, batch: int = 4) -> None:
    tokens = torch.randint(0, 256, (batch, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if ctx is not None:
        inputs, targets = ctx.shard_batch(inputs, targets)
    if hasattr(model, "step"):
        model.step(inputs, targets, loss_fn)
    else:
        loss_fn(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad()


def draws() -> tuple[list[float], float, float]:
    """One value from each generator a checkpoint restores."""
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


# -- one process, no process group ------------------------------------------------------------------

def test_save_and_load_in_one_process_without_a_process_group(tmp_path):
    model = build_tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train_one_step(model, optimizer, gpt_loss)
    saved = full_state(model, optimizer)
    path = sk.save(tmp_path, model, optimizer, step=12, extra={"data": {"epoch": 1, "position": 48}})
    after_save = draws()
    train_one_step(model, optimizer, gpt_loss)  # weights, optimizer state and generators move on
    assert differences(full_state(model, optimizer), saved)

    info = sk.load(tmp_path, model, optimizer)
    assert differences(full_state(model, optimizer), saved) == []
    assert draws() == after_save
    assert info == {"step": 12, "extra": {"data": {"epoch": 1, "position": 48}}, "plan": None, "path": path,
                    "world_size": 1, "rng": "restored"}
    assert path == tmp_path / "step-00000012" and sk.latest_checkpoint(tmp_path) == path
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["optimizer"] == "AdamW" and manifest["model"]["parameters"]["embed.weight"] == \
        {"shape": [256, 64], "dtype": "float32"}
    assert {f["name"] for f in manifest["files"]} == {METADATA_NAME, "__0_0.distcp", "rng-00000.json"}


# -- resharding round trips ---------------------------------------------------------------------------

def hop(ctx, model_name: str, root: Path, step: int, first: bool):
    """Shard the model by this job's plan; train one step (first hop) or load the latest checkpoint;
    return the full state and what load said; save at ``step``."""
    build, _, loss_fn = MODELS[model_name]
    model = sk.shard(sk.meta_model(build), ctx.plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    info = None
    if first:
        train_one_step(model, optimizer, loss_fn, ctx)
    else:
        info = sk.load(root, model, optimizer)
    state = full_state(model, optimizer)
    sk.save(root, model, optimizer, step=step)
    return state, info and {key: info[key] for key in ("step", "plan", "world_size", "rng")}


def one_process_hop(model_name: str, root: Path, step: int):
    build = MODELS[model_name][0]
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    info = sk.load(root, model, optimizer)
    state = full_state(model, optimizer)
    sk.save(root, model, optimizer, step=step)
    return state, {key: info[key] for key in ("step", "plan", "world_size", "rng")}


#: GPT-2 (transformers) cannot be cut into pipeline stages; tp=4 permutes its fused c_attn
#: differently from tp=2, so its rows are read whole and reordered on the way in and out. The
#: tied Llama's embedding and LM head are one parameter, a copy on each end of a pipeline.
HOPS = {"gpt": [{"fsdp": 4}, {"dp": 2, "tp": 2}, None, {"pp": 2}, {"fsdp": 4}],
        "gpt2": [{"fsdp": 4}, {"dp": 2, "tp": 2}, None, {"tp": 4}, {"fsdp": 4}],
        "llama-tied": [{"pp": 2}, None, {"pp": 2, "tp": 2}, {"fsdp": 4}, {"pp": 2, "fsdp": 2}]}


@pytest.mark.world
@pytest.mark.parametrize("model_name", sorted(HOPS))
def test_resharding_round_trip_keeps_parameters_and_optimizer_state_bitwise(world, tmp_path, model_name):
    expected, previous = None, None
    for step, mesh in enumerate(HOPS[model_name], start=1):
        if mesh is None:
            plan, (state, info) = None, one_process_hop(model_name, tmp_path, step)
        else:
            plan = plan_for(model_name, **mesh)
            results = world(plan.mesh.size).run(hop, model_name, tmp_path, step, expected is None, plan=plan)
            state, info = merged([s for s, _ in results]), results[0][1]
        if expected is None:
            expected = state
            kinds = {key.rpartition(".")[2] for key in state[1] if key.startswith("state.")}
            assert kinds == {"exp_avg", "exp_avg_sq", "step"}
        else:
            assert differences(state, expected) == [], f"{model_name} under {mesh}"
            assert info == {"step": step - 1, "plan": previous, "world_size": 1 if previous is None else
                            previous.mesh.size, "rng": "restored"}
        previous = plan


# -- RNG states per rank, worlds of 3, 2, 4 and 1 -----------------------------------------------------

def save_then_draw(ctx, root: Path):
    model = sk.shard(sk.meta_model(build_tiny_gpt), ctx.plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train_one_step(model, optimizer, gpt_loss, ctx, batch=6)
    torch.manual_seed(100 + ctx.rank)  # each rank its own streams, as in a training loop
    random.seed(200 + ctx.rank)
    np.random.seed(300 + ctx.rank)
    sk.save(root, model, optimizer, step=7)
    return full_state(model, optimizer), draws()


def load_then_draw(ctx, root: Path):
    sharded = ctx.plan is not None
    model = sk.shard(sk.meta_model(build_tiny_gpt), ctx.plan) if sharded else build_tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    torch.manual_seed(12345)
    info = sk.load(root, model, optimizer)
    return full_state(model, optimizer), draws(), info["rng"]


@pytest.mark.world
def test_fsdp3_round_trip_and_rng_states_per_rank_whatever_the_number_of_ranks(world, tmp_path):
    saved = world(3).run(save_then_draw, tmp_path, plan=plan_for("gpt", fsdp=3))
    expected = merged([state for state, _ in saved])
    restored = world(3).run(load_then_draw, tmp_path, plan=plan_for("gpt", fsdp=3))
    for rank, (state, drawn, how) in enumerate(restored):
        assert differences(state, expected) == [] and (drawn, how) == (saved[rank][1], "restored")
    fewer = world(2).run(load_then_draw, tmp_path, plan=plan_for("gpt", fsdp=2))
    assert [(drawn, how) for _, drawn, how in fewer] == [(saved[r][1], "restored") for r in range(2)]
    more = world(4).run(load_then_draw, tmp_path, plan=plan_for("gpt", dp=2, tp=2))
    assert [(drawn, how) for _, drawn, how in more[:3]] == [(saved[r][1], "restored") for r in range(3)]
    rng.reseed(7, 3)  # a rank the save did not have: seeded from (step, rank)
    assert more[3][1:] == (draws(), "reseeded")
    assert all(differences(state, expected) == [] for state, _, _ in more)
    alone = world(1).run(load_then_draw, tmp_path)  # a process group of one, no plan
    assert differences(alone[0][0], expected) == [] and alone[0][1:] == (saved[0][1], "restored")


# -- exact resume with the data position --------------------------------------------------------------

SEQ_LEN, GLOBAL_BATCH, FIRST_STEPS, THEN_STEPS = 16, 6, 3, 3
PLAN_A = plan_for("gpt", fsdp=2, tp=2)


def train(ctx, data: Path, root: Path, steps: int, save_at: tuple[int, ...] = (), resume: bool = False,
          snapshots: tuple[int, ...] = ()):
    """``steps`` steps of the tiny GPT on the sharded data, from the start or from the latest checkpoint;
    returns the losses and ``{n: full state after n steps of this run}`` for n in ``snapshots``."""
    dataset = sk.ShardedDataset(data, seq_len=SEQ_LEN, seed=0)
    model = sk.shard(sk.meta_model(build_tiny_gpt), ctx.plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    step, epoch, position = 0, 0, 0
    if resume:
        info = sk.load(root, model, optimizer)
        saved = info["extra"]["data"]
        assert saved["fingerprint"] == dataset.fingerprint
        step, epoch, position = info["step"], saved["epoch"], saved["position"]
    loader = dataset.loader(GLOBAL_BATCH, rank=ctx.data_rank, ranks=ctx.data_world, position=position, epoch=epoch)
    losses, states = [], {}
    for _, tokens in loader:
        losses.append(model.step(tokens[:, :-1], tokens[:, 1:], gpt_loss).item())
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step in save_at:
            data_state = {"epoch": epoch, "position": loader.position, "fingerprint": dataset.fingerprint}
            sk.save(root, model, optimizer, step=step, extra={"data": data_state})
        if len(losses) in snapshots:
            states[len(losses)] = full_state(model, optimizer)
        if len(losses) == steps:
            return losses, states
    raise AssertionError("the data ran out")


def merged_run(results) -> tuple[list[float], dict[int, tuple[dict, dict]]]:
    """Rank 0's losses and every rank's snapshots merged."""
    snapshots = {n: merged([states[n] for _, states in results]) for n in results[0][1]}
    return results[0][0], snapshots


@pytest.fixture(scope="module")
def run_a(world, tmp_path_factory):
    """Under plan A (fsdp=2 x tp=2): FIRST + THEN steps uninterrupted, and FIRST steps saved at
    steps FIRST - 1 and FIRST (two checkpoints of one layout: the damage tests use both)."""
    root = tmp_path_factory.mktemp("resume")
    (root / "text.txt").write_text(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(60)))
    sk.write_shards(root / "text.txt", root / "data", shards=3)
    uninterrupted = merged_run(world(4).run(train, root / "data", root / "unused", FIRST_STEPS + THEN_STEPS,
                                            snapshots=(FIRST_STEPS + 1, FIRST_STEPS + THEN_STEPS), plan=PLAN_A))
    world(4).run(train, root / "data", root / "checkpoints", FIRST_STEPS, (FIRST_STEPS - 1, FIRST_STEPS), plan=PLAN_A)
    return root, uninterrupted


@pytest.mark.world
def test_resume_under_the_same_plan_continues_bitwise_with_the_data_order(run_a, world):
    root, (losses, states) = run_a
    resumed_losses, resumed = merged_run(world(4).run(train, root / "data", root / "checkpoints", THEN_STEPS,
                                                      resume=True, snapshots=(THEN_STEPS,), plan=PLAN_A))
    assert resumed_losses == losses[FIRST_STEPS:]
    assert differences(resumed[THEN_STEPS], states[FIRST_STEPS + THEN_STEPS]) == []


@pytest.mark.world
def test_resume_under_another_plan_is_within_verify_tolerances(run_a, world):
    """As sk.verify compares: every loss, and the weights one step after the resume (a step from the
    same weights). Later steps drift further in the last bits: AdamW divides by the root of tiny
    second moments, so a bias whose gradient is zero in exact arithmetic (attention's k_proj.bias)
    moves by noise, differently under each plan."""
    root, (losses, states) = run_a
    resumed_losses, resumed = merged_run(world(3).run(train, root / "data", root / "checkpoints", THEN_STEPS,
                                                      resume=True, snapshots=(1,), plan=plan_for("gpt", fsdp=3)))
    assert np.allclose(resumed_losses, losses[FIRST_STEPS:], rtol=0, atol=TOLERANCES["loss"])
    (parameters, _), (expected, _) = resumed[1], states[FIRST_STEPS + 1]
    worst = max((parameters[name] - expected[name]).abs().max().item() for name in expected)
    assert worst <= TOLERANCES["weight"] * LR


# -- damage: refused before any weight changes, naming the file and its tensors ------------------------

def _checkpoint_copy(run_a) -> Path:
    root, _ = run_a
    copy = Path(tempfile.mkdtemp()) / "step-00000003"
    shutil.copytree(root / "checkpoints" / "step-00000003", copy)
    return copy


def _refused(folder: Path, build=build_tiny_gpt, optimizer: bool = False) -> str:
    """Load ``folder`` into a fresh model; return the CheckpointError's message (weights unchanged)."""
    model = build()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(sk.CheckpointError) as error:
        sk.load(folder, model, torch.optim.AdamW(model.parameters()) if optimizer else None)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    return str(error.value)


def _damage(path: Path, kind: str, where: float, bit: int) -> None:
    data = bytearray(path.read_bytes())
    if kind == "delete":
        path.unlink()
    elif kind == "truncate":
        path.write_bytes(data[: int(where * len(data))])
    else:
        data[int(where * len(data))] ^= 1 << bit
        path.write_bytes(data)


@settings(max_examples=25)
@given(kind=st.sampled_from(["truncate", "flip", "delete"]), which=st.integers(0, 100),
       where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_truncated_flipped_or_deleted_file_is_refused_naming_it_and_its_tensors(run_a, kind, which, where, bit):
    folder = _checkpoint_copy(run_a)
    names = sorted(json.loads((folder / MANIFEST_NAME).read_text())["files"], key=lambda f: f["name"])
    name = names[which % len(names)]["name"]
    tensors = tensors_by_file(folder)
    _damage(folder / name, kind, where, bit)
    message = _refused(folder)
    what = {"delete": "is missing", "truncate": "(truncated)", "flip": "(altered, or a file of another checkpoint)"}
    assert f"{name} " in message and what[kind] in message
    if name in tensors:  # a DCP data file: its tensors are named
        assert tensors[name][0] in message
    elif name == METADATA_NAME:
        assert "DCP's index of every tensor" in message
    else:
        assert f"rank {int(name[4:9])}'s random-number-generator states" in message
    shutil.rmtree(folder.parent)


def test_a_file_of_another_checkpoint_or_an_extra_file_is_refused(run_a):
    root, _ = run_a
    folder = _checkpoint_copy(run_a)
    shutil.copy(root / "checkpoints" / "step-00000002" / "__1_0.distcp", folder / "__1_0.distcp")
    (folder / "notes.txt").write_text("not part of it")
    message = _refused(folder)
    assert "__1_0.distcp has sha256" in message and "a file of another checkpoint" in message
    assert tensors_by_file(folder)["__1_0.distcp"][0] in message
    assert "notes.txt is not in the manifest" in message
    shutil.rmtree(folder.parent)


def test_another_models_checkpoint_or_optimizer_is_refused_naming_the_tensors(run_a):
    folder = _checkpoint_copy(run_a)
    message = _refused(folder, build_tiny_gpt2)
    assert "another model's parameters" in message and "not in the model: embed.weight [256, 64] float32" in message
    assert "not in the checkpoint: transformer.h.0.attn.c_attn.bias [192] float32" in message
    narrower = _refused(folder, lambda: GPT(GPTConfig(vocab=256, layers=2, dim=32, heads=4, seq_len=32)))
    assert "shapes or dtypes differ: embed.weight: checkpoint [256, 64] float32, model [256, 32] float32" in narrower
    model = build_tiny_gpt()
    with pytest.raises(sk.CheckpointError, match="holds AdamW state, not SGD; pass an optimizer of class AdamW"):
        sk.load(folder, model, torch.optim.SGD(model.parameters(), lr=0.1))
    shutil.rmtree(folder.parent)


def damaged_load(ctx, folder: Path):
    """Load a damaged checkpoint in a world; the error is returned, not raised, so the world lives on."""
    model = sk.shard(sk.meta_model(build_tiny_gpt), ctx.plan)
    before = sk.full_state_dict(model)
    try:
        sk.load(folder, model)
    except sk.CheckpointError as error:
        after = sk.full_state_dict(model)
        return str(error), all(torch.equal(after[name], before[name]) for name in before)
    return None, False


@pytest.mark.world
def test_damage_found_by_another_rank_is_refused_on_every_rank(run_a, world):
    folder = _checkpoint_copy(run_a)
    _damage(folder / "__2_0.distcp", "flip", 0.5, 3)  # the files are shared: rank 1 checks this one
    results = world(2).run(damaged_load, folder, plan=plan_for("gpt", fsdp=2))
    assert [unchanged for _, unchanged in results] == [True, True]
    assert results[0][0] == results[1][0] and "__2_0.distcp has sha256" in results[0][0]
    shutil.rmtree(folder.parent)


# -- the folder of checkpoints: latest complete, keep_last, arguments -----------------------------------

def _save_steps(root: Path, steps, keep_last=None) -> nn.Module:
    model = nn.Linear(3, 2)
    for step in steps:
        with torch.no_grad():
            model.weight.fill_(step)
        sk.save(root, model, step=step, keep_last=keep_last)
    return model


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_load_takes_the_latest_checkpoint_passing_over_only_a_half_written_one(tmp_path):
    _save_steps(tmp_path, [1, 2])
    shutil.copytree(tmp_path / "step-00000002", tmp_path / ".step-00000003.tmp-99-dead")  # a killed save
    model = nn.Linear(3, 2)
    assert sk.load(tmp_path, model)["step"] == 2 and bool((model.weight == 2).all())
    assert sk.latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    shutil.copytree(tmp_path / "step-00000002", tmp_path / "step-00000004", ignore=shutil.ignore_patterns(MANIFEST_NAME))
    shutil.copytree(tmp_path / "step-00000002", tmp_path / "step-00000005")
    (tmp_path / "step-00000005" / MANIFEST_NAME).write_text('{"format": "shardkit.checkpoint", "ver')  # cut short
    with pytest.raises(sk.CheckpointError, match="step-00000004' has no readable manifest.json .*: it is incomplete"):
        sk.load(tmp_path / "step-00000004", model)
    with pytest.raises(sk.CheckpointError, match=r"manifest.json' is not valid JSON"):
        sk.load(tmp_path / "step-00000005", model)
    for latest in ("step-00000005", "step-00000004"):  # a damaged latest is refused, never skipped in silence
        with pytest.raises(sk.CheckpointError, match=f"the latest checkpoint in .*, {latest}, is damaged.* "
                                                     r"load an earlier one by its folder \(step-00000002, "):
            sk.load(tmp_path, model)
        shutil.rmtree(tmp_path / latest)
    empty = tmp_path / "none"
    (empty / ".step-00000007.tmp-99-dead").mkdir(parents=True)
    with pytest.raises(sk.CheckpointError, match="holds no checkpoint .*; saves in progress or killed: .step-00000007"):
        sk.load(empty, model)
    _damage(tmp_path / "step-00000002" / "__0_0.distcp", "flip", 0.9, 0)  # the latest is damaged: refused,
    with pytest.raises(sk.CheckpointError, match=r"__0_0.distcp has sha256 .*Load another checkpoint "
                                                 r"\(step-00000001 beside it\)"):  # never skipped in silence
        sk.load(tmp_path, model)


def test_keep_last_removes_only_older_complete_checkpoints(tmp_path):
    (tmp_path / ".step-00000009.tmp-77-running").mkdir(parents=True)  # another run's save in progress
    (tmp_path / "step-00000008").mkdir()  # a step-* folder without a manifest: not ours to remove
    _save_steps(tmp_path, range(1, 6), keep_last=2)
    assert _steps(tmp_path) == [".step-00000009.tmp-77-running", "step-00000004", "step-00000005", "step-00000008"]
    _save_steps(tmp_path, [0], keep_last=1)  # never the one just written, even when it is not the newest
    assert _steps(tmp_path) == [".step-00000009.tmp-77-running", "step-00000000", "step-00000005", "step-00000008"]


def test_save_refuses_wrong_arguments_and_a_step_saved_before(tmp_path):
    model = nn.Linear(3, 2)
    for kwargs, message in [({"step": -1}, r"step=-1\): step must be an integer >= 0"),
                            ({"step": True}, "step=True"),
                            ({"step": 1, "extra": {"data": torch.zeros(1)}}, r"extra\['data'\] is a Tensor"),
                            ({"step": 1, "extra": {"loss": float("nan")}}, r"extra\['loss'\] is nan"),
                            ({"step": 1, "keep_last": 0}, r"keep_last=0\): keep the newest N")]:
        with pytest.raises(UsageError, match=message):
            sk.save(tmp_path, model, **kwargs)
    sk.save(tmp_path, model, step=1)
    with pytest.raises(sk.CheckpointError, match="step-00000001' exists: step 1 was saved before"):
        sk.save(tmp_path, model, step=1)
    assert _steps(tmp_path) == ["step-00000001"]  # and no temporary folder left behind


# -- atomic: kill -9 at random moments ------------------------------------------------------------------

KILLS = 20


def test_a_save_killed_at_any_moment_leaves_the_last_checkpoint_loadable(tmp_path):
    root = tmp_path / "checkpoints"
    job = Path(checkpoint_kill.__file__)
    run = subprocess.run([sys.executable, str(job), str(root), str(KILLS), "0"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    rounds = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(rounds) == KILLS
    for found in rounds:  # a completed save is never lost; what loads is one saved step, exactly
        assert found["exact"] and found["extra"] == {"step": found["loaded"]}
        assert found["last_complete"] <= found["loaded"] <= found["last_complete"] + 1
    assert sum("tmp" in found["left"] for found in rounds) >= KILLS // 4  # many kills landed mid-save
    model = checkpoint_kill.build()
    assert sk.load(root, model)["step"] == rounds[-1]["loaded"] and checkpoint_kill.exact(model, rounds[-1]["loaded"])
    assert len(complete_checkpoints(root)) <= checkpoint_kill.KEEP_LAST + 1


# -- shardkit checkpoint inspect ------------------------------------------------------------------------

def test_inspect_shows_step_plan_tensors_and_checked_files_and_exits_2_on_damage(run_a, capsys):
    root, _ = run_a
    assert main(["checkpoint", "inspect", str(root / "checkpoints")]) == 0
    out = capsys.readouterr().out
    assert "step-00000003 (the latest of 2 complete in" in out and "step: 3\n" in out and "saved by: 4 processes" in out
    assert "  mesh: {fsdp: 2, tp: 2}" in out and "optimizer: AdamW" in out and '"position": 18' in out
    assert any(line.split()[:4] == ["model.embed.weight", "[256,", "64]", "float32"] for line in out.splitlines())
    assert "optimizer.state.layers.0.attn.q_proj.weight.exp_avg_sq" in out
    assert "files: 9," in out and "every file matches the manifest" in out and out.count(" OK") == 9

    folder = _checkpoint_copy(run_a)
    _damage(folder / "__3_0.distcp", "truncate", 0.5, 0)
    assert main(["checkpoint", "inspect", str(folder)]) == 2
    captured = capsys.readouterr()
    assert "FAILED: has" in captured.out and captured.out.count(" OK") == 8
    error = captured.err.strip()
    assert "\n" not in error and error.startswith("shardkit checkpoint: checkpoint")
    assert "__3_0.distcp has" in error and tensors_by_file(folder)["__3_0.distcp"][0] in error
    shutil.rmtree(folder.parent)
