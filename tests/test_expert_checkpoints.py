"""Checkpoints of expert-parallel models: saved under ``ep=2``, ``fsdp=2 x ep=2``, ``tp=2 x ep=2`` and
``pp=2 x ep=2``, loaded under ``ep=4``, ``fsdp=4``, ``fsdp=2 x ep=2``, ``ep=2``, ``pp=2`` and one process,
parameters and AdamW state bitwise equal; a resume under the same plan makes the losses of the run it
interrupted.

The experts are DTensors sharded on dim 0 over ``ep`` (then FSDP over the remaining data axes):
DCP's index holds them at their global shape, each rank's box at its experts' rows (the ``tp`` ranks
of one ``ep`` rank hold the same rows: DCP writes them once). Three jobs (worlds of 2, 4 and 2
processes, each under a job plan of its own: a pipeline takes its mesh from the plan it applies) and
one process here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_checkpoint import differences, full_state, merged
from torch.distributed.checkpoint import FileSystemReader

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt_moe, gpt_loss

LR, BATCH, SEQ = 1e-2, 8, 16
#: The steps after the save: an uninterrupted run makes them, then a run resumed from the checkpoint.
AFTER = (2, 3)
EXPERT = "model.layers.0.mlp.experts.gate_up_proj"  # DCP's key of one stacked expert weight [4, 512, 64]


def plan_of(mesh: str) -> sk.Plan:
    pipeline = sk.Pipeline(schedule="gpipe", microbatches=2) if "pp" in mesh else None
    return sk.Plan(mesh=sk.Mesh.parse(mesh), pipeline=pipeline, rules=GPT_RULES if "tp" in mesh else None)


def _sharded(ctx, mesh: str):
    model = sk.shard(sk.meta_model(build_tiny_gpt_moe), plan_of(mesh), ctx)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _step(ctx, model, optimizer, mesh: str, seed: int) -> float:
    """One AdamW step on batch ``seed`` (this rank's share of it); the loss."""
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    plan = plan_of(mesh)
    inputs, targets = (t.chunk(plan.mesh.data_size)[plan.mesh.data_index(ctx.rank)] for t in
                       (tokens[:, :-1], tokens[:, 1:]))
    loss = model.step(inputs, targets, gpt_loss).item()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _save_and_resume(ctx, mesh: str, root: Path):
    """Under ``mesh``: one step, saved; the steps after it uninterrupted, then again from the checkpoint."""
    model, optimizer = _sharded(ctx, mesh)
    _step(ctx, model, optimizer, mesh, seed=1)
    sk.save(root, model, optimizer, step=1)
    saved = full_state(model, optimizer)
    uninterrupted = [_step(ctx, model, optimizer, mesh, seed) for seed in AFTER]
    model, optimizer = _sharded(ctx, mesh)
    info = sk.load(root, model, optimizer)
    resumed = [_step(ctx, model, optimizer, mesh, seed) for seed in AFTER]
    return saved, uninterrupted, resumed, info["step"]


def _load_under(ctx, meshes: list[str], root: Path):
    """The full state of ``root``'s checkpoint loaded under each mesh (a pipeline's stages merged here)."""
    out = {}
    for mesh in meshes:
        model, optimizer = _sharded(ctx, mesh)
        sk.load(root, model, optimizer)
        state = full_state(model, optimizer)
        out[mesh] = state if "pp" in mesh or ctx.rank == 0 else None
    return out


def _world2_saves(ctx, root: Path):
    return _save_and_resume(ctx, "ep=2", root / "ep2")


def _world4(ctx, root: Path):
    saves = {mesh: _save_and_resume(ctx, mesh, root / folder) for mesh, folder in FOUR}
    loads = {"ep=2": _load_under(ctx, ["ep=4", "fsdp=4", "fsdp=2,ep=2"], root / "ep2"),
             "tp=2,ep=2": _load_under(ctx, ["fsdp=2,ep=2", "fsdp=4"], root / "tp2ep2")}
    return saves, loads


def _world2_loads(ctx, root: Path):
    return {saved: _load_under(ctx, meshes, root / FOLDERS[saved]) for saved, meshes in
            (("fsdp=2,ep=2", ["ep=2", "pp=2"]), ("tp=2,ep=2", ["ep=2", "pp=2"]), ("pp=2,ep=2", ["ep=2"]))}


#: The plans saved in the world of 4, and each plan's checkpoint folder.
FOUR = (("fsdp=2,ep=2", "fsdp2ep2"), ("tp=2,ep=2", "tp2ep2"), ("pp=2,ep=2", "pp2ep2"))
FOLDERS = {"ep=2": "ep2", **dict(FOUR)}


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory):
    """``(root, {saved under: (each rank's save, each rank's loads by mesh)})``; each job under a plan of
    its own (a pipeline takes its mesh from the plan it applies, not the job's)."""
    root = tmp_path_factory.mktemp("expert-checkpoints")
    saved_ep2 = world(2).run(_world2_saves, root, plan=plan_of("ep=2"))
    saves4, loads4 = zip(*world(4).run(_world4, root, plan=plan_of("fsdp=2,ep=2")))
    loads2 = world(2).run(_world2_loads, root, plan=plan_of("ep=2"))
    found = {"ep=2": (saved_ep2, [rank["ep=2"] for rank in loads4])}
    for mesh, _ in FOUR:
        found[mesh] = ([rank[mesh] for rank in saves4], [rank.get(mesh, {}) for rank in (*loads2, *loads4)])
    return root, found


def _one_process(folder: Path) -> tuple[dict, dict]:
    model = build_tiny_gpt_moe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    sk.load(folder, model, optimizer)
    return full_state(model, optimizer)


@pytest.mark.parametrize("saved_under,loaded_under", [
    ("ep=2", ["ep=4", "fsdp=4", "fsdp=2,ep=2", "one process"]),
    ("fsdp=2,ep=2", ["ep=2", "pp=2", "one process"]),
    ("tp=2,ep=2", ["ep=2", "fsdp=2,ep=2", "fsdp=4", "pp=2", "one process"]),
    ("pp=2,ep=2", ["ep=2", "one process"]),
])
def test_a_checkpoint_saved_under_ep_loads_under_any_plan_bitwise(runs, saved_under, loaded_under):
    root, found = runs
    saves, loads = found[saved_under]
    expected = merged([run[0] for run in saves])
    assert any(".experts." in key and key.endswith(".exp_avg_sq") for key in expected[1])  # AdamW moments kept
    for mesh in loaded_under:
        ranks = [rank[mesh] for rank in loads if mesh in rank and rank[mesh] is not None]
        state = _one_process(root / FOLDERS[saved_under]) if mesh == "one process" else merged(ranks)
        assert mesh == "one process" or ranks, mesh
        assert differences(state, expected) == [], mesh


@pytest.mark.parametrize("mesh", ["ep=2", "fsdp=2,ep=2", "tp=2,ep=2", "pp=2,ep=2"])
def test_resume_under_the_same_plan_makes_the_losses_of_the_uninterrupted_run(runs, mesh):
    saves, _ = runs[1][mesh]
    for _, uninterrupted, resumed, step in saves:
        assert resumed == uninterrupted and step == 1


@pytest.mark.parametrize("folder,boxes", [("ep2", [(0, 2), (2, 2)]), ("fsdp2ep2", [(0, 1), (1, 1), (2, 1), (3, 1)]),
                                          ("tp2ep2", [(0, 2), (2, 2)]), ("pp2ep2", [(0, 2), (2, 2)])])
def test_dcp_holds_the_experts_at_their_global_shape_each_rank_its_rows(runs, folder, boxes):
    """Under ep=2 each rank writes its 2 experts; under fsdp=2 x ep=2 FSDP splits them once more (1 each);
    under tp=2 x ep=2 the two tp ranks' equal rows are written once; under pp=2 x ep=2 stage 0 writes layer 0."""
    metadata = FileSystemReader(str(runs[0] / folder / "step-00000001")).read_metadata()
    entry = metadata.state_dict_metadata[EXPERT]
    assert tuple(entry.size) == (4, 512, 64)
    assert sorted((c.offsets[0], c.sizes[0]) for c in entry.chunks) == boxes
    assert all(tuple(c.sizes[1:]) == (512, 64) for c in entry.chunks)
    moment = metadata.state_dict_metadata[f"optimizer.state.{EXPERT.removeprefix('model.')}.exp_avg"]
    assert tuple(moment.size) == (4, 512, 64) and len(moment.chunks) == len(boxes)


def test_shardkit_generate_under_ep_reads_the_checkpoint_as_one_process(runs, world, monkeypatch):
    """``shardkit generate --mesh ep=2`` from the checkpoint saved under fsdp=2 x ep=2: every rank makes
    the tokens one process makes with the weights loaded (which differ from the initial weights')."""
    import shardkit.runtime.world as world_module
    from shardkit.cli import main
    from shardkit.runtime.generate import generate

    ranks, launch = [], world_module.launch
    monkeypatch.setattr("shardkit.runtime.world.launch",  # on the shared world, keeping each rank's tokens
                        lambda fn, plan, *args, world_size, timeout: ranks.extend(
                            launch(fn, plan, *args, world=world(world_size), timeout=timeout)))
    folder = runs[0] / "fsdp2ep2"
    assert main(["generate", "--model", "gpt-moe", "--checkpoint", str(folder), "--mesh", "ep=2",
                 "--prompt-ids", "3,141,59,26", "--max-new-tokens", "6"]) == 0
    model = build_tiny_gpt_moe()
    initial = generate(model, torch.tensor([[3, 141, 59, 26]]), max_new_tokens=6)[0, 4:].tolist()
    sk.load(folder, model)
    loaded = generate(model, torch.tensor([[3, 141, 59, 26]]), max_new_tokens=6)[0, 4:].tolist()
    assert ranks == [loaded, loaded] and loaded != initial
