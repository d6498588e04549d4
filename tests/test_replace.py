"""Nothing lost when a folder is written: ``sk.convert_to_hf`` / ``shardkit checkpoint convert``
refuse an output that overlaps the checkpoints; ``overwrite`` (``sk.export_hf``,
``sk.convert_to_hf``, ``sk.write_shards``) never deletes what the write does not make and replaces
atomically: a process killed with SIGKILL at every step of a replacement, and at random moments,
leaves the old folder or the new one, complete (read back by transformers and by our readers).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import replace_kill
import torch
from safetensors.torch import load_file
from torch import nn

import shardkit as sk
from shardkit.checkpoint.export import EXPORT_FILES
from shardkit.cli import main
from shardkit.io.folders import FolderWrite, overlap
from shardkit.io.hf_weights import HFWeights, WeightsError
from shardkit.io.manifest import DataError
from shardkit.io.shard_writer import write_shards
from shardkit.plan import UsageError

SRC = Path(__file__).resolve().parents[1] / "src"


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (symlinks as their targets), by relative path: its sha256."""
    found = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = f"-> {os.readlink(path)}"
        elif path.is_file():
            found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture
def checkpoints(tmp_path) -> Path:
    """``tmp_path/runs/ck``: two checkpoints of a small model; an unrelated file beside the folder."""
    root = tmp_path / "runs" / "ck"
    model = nn.Linear(4, 3)
    for step in (1, 2):
        sk.save(root, model, step=step)
    (tmp_path / "runs" / "notes.txt").write_text("mine, beside the checkpoints")
    return root


OUTPUTS = {  # (the checkpoint argument, the output) relative to tmp_path
    "the same folder": ("runs/ck", "runs/ck"),
    "its parent": ("runs/ck", "runs"),
    "one of its step folders": ("runs/ck", "runs/ck/step-00000001"),
    "the step folder read": ("runs/ck/step-00000002", "runs/ck/step-00000002"),
    "the folder of the step read": ("runs/ck/step-00000002", "runs/ck"),
    "a new folder inside it": ("runs/ck", "runs/ck/hf"),
    "a symlink to a step folder": ("runs/ck", "link-to-step"),
    "a symlink to the folder": ("runs/ck", "link-to-folder"),
}


@pytest.mark.parametrize("case", OUTPUTS)
def test_convert_refuses_an_output_that_overlaps_the_checkpoints(checkpoints, tmp_path, case):
    (tmp_path / "link-to-step").symlink_to(checkpoints / "step-00000001")
    (tmp_path / "link-to-folder").symlink_to(checkpoints)
    source, out = (tmp_path / part for part in OUTPUTS[case])
    before = _tree(tmp_path)
    with pytest.raises(UsageError, match=r"overlap \((the same folder|the second is inside the first|the first is "
                                         r"inside the second)\): .* neither may hold the other"):
        sk.convert_to_hf(source, out, overwrite=True)
    assert _tree(tmp_path) == before  # every checkpoint, and the file beside them
    assert main(["checkpoint", "convert", str(source), "--to", "hf", str(out), "--overwrite"]) == 2
    assert _tree(tmp_path) == before


def test_convert_never_replaces_a_folder_it_did_not_write(checkpoints, tmp_path):
    """Beside the checkpoint read (no overlap), a sibling checkpoint is never replaced."""
    before = _tree(tmp_path)
    with pytest.raises(UsageError, match=r"step-00000001' holds .metadata, __0_0.distcp, manifest.json, "
                                         r"rng-00000.json, which this write does not make"):
        sk.convert_to_hf(checkpoints / "step-00000002", checkpoints / "step-00000001", overwrite=True)
    assert _tree(tmp_path) == before
    out = sk.convert_to_hf(checkpoints, tmp_path / "hf")
    assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_export_overwrite_replaces_an_export_and_never_what_it_did_not_write(tmp_path):
    folder = tmp_path / "export"
    sk.export_hf(folder, nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), max_shard_size="10KB")
    assert "model-00001-of-00004.safetensors" in os.listdir(folder)
    model = nn.Linear(2, 2)
    sk.export_hf(folder, model, overwrite=True)  # an export's files, replaced: the old shards are gone
    assert sorted(os.listdir(folder)) == ["model.safetensors"] and [p.name for p in tmp_path.iterdir()] == ["export"]
    assert torch.equal(load_file(folder / "model.safetensors")["weight"], model.weight)

    (folder / "tokenizer.json").write_text("{}")
    before = _tree(tmp_path)
    with pytest.raises(UsageError, match=r"export' holds tokenizer.json, which this write does not make: replacing "
                                         r"the folder would delete them, so nothing was written"):
        sk.export_hf(folder, nn.Linear(3, 3), overwrite=True)
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(UsageError, match="a-file' is a file; give a folder to write into"):
        sk.export_hf(tmp_path / "a-file", nn.Linear(3, 3), overwrite=True)
    assert _tree(tmp_path) == {**before, "a-file": hashlib.sha256(b"mine").hexdigest()}


def test_write_shards_overwrite_never_deletes_what_it_did_not_write(tmp_path):
    (tmp_path / "text.txt").write_text("hello world\n" * 50)
    out = tmp_path / "data"
    write_shards(tmp_path / "text.txt", out, shards=4)
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    with pytest.raises(UsageError, match="data' holds notes.txt, which this write does not make"):
        write_shards(tmp_path / "text.txt", out, shards=2, overwrite=True)
    assert _tree(out) == before
    (out / "notes.txt").unlink()
    write_shards(tmp_path / "text.txt", out, shards=2, overwrite=True)
    assert sorted(os.listdir(out)) == ["manifest.json", "shard-00000.bin", "shard-00001.bin"]


def test_overlap_follows_symlinks_and_sees_one_folder_under_two_names(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a" / "b")
    assert overlap(tmp_path / "a", tmp_path / "link") == "the second is inside the first"
    assert overlap(tmp_path / "link" / "new", tmp_path / "a") == "the first is inside the second"
    assert overlap(tmp_path / "a" / "b" / ".." / "b", tmp_path / "link") == "the same folder"
    assert overlap(tmp_path / "a" / "c", tmp_path / "a" / "b") is None


def test_a_writer_alive_is_never_disturbed_and_is_named(tmp_path):
    out = tmp_path / "export"
    write = FolderWrite(out, EXPORT_FILES.fullmatch)
    write.prepare(False, "out", "occupied")
    with write.open() as staging:
        (staging / "model.safetensors").write_bytes(b"")
        with pytest.raises(UsageError, match=rf"'{out}' is being written by process {os.getpid()} on "
                                             rf"\w+ \(into \.export\.partial-\w+-{os.getpid()}-[0-9a-f]+ beside it\)"):
            sk.export_hf(out, nn.Linear(2, 2), overwrite=True)
        assert staging.is_dir()
    assert os.listdir(out) == ["model.safetensors"]


def test_a_replacement_killed_between_its_two_renames_is_put_back_by_the_next_write(tmp_path):
    """The two-rename fallback leaves, killed between them, no folder and the old one aside: a reader
    is told where it is, and the next write puts it back before anything else."""
    out = tmp_path / "export"
    model = nn.Linear(2, 2)
    sk.export_hf(out, model)
    os.rename(out, tmp_path / ".export.replaced-host-12345-0badf00d")  # what a kill between the renames leaves
    (tmp_path / ".export.partial-host-12345-1badf00d").mkdir()
    with pytest.raises(WeightsError, match=r"\.export\.replaced-.* beside it holds the previous folder, left by a write "
                                           r"that was killed while replacing it"):
        HFWeights(out)
    with pytest.warns(UserWarning, match=r"the previous folder was put back from \.export\.replaced-"):
        with pytest.raises(UsageError, match="exists and is not an empty folder: pass overwrite=True"):
            sk.export_hf(out, nn.Linear(3, 3))
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    assert torch.equal(load_file(out / "model.safetensors")["weight"], model.weight)

    data = tmp_path / "data"
    (tmp_path / "t.txt").write_text("text " * 40)
    write_shards(tmp_path / "t.txt", data, shards=2)
    os.rename(data, tmp_path / ".data.replaced-host-1-2badf00d")
    with pytest.raises(DataError, match=r"does not exist .*\.data\.replaced-host-1-2badf00d beside it holds"):
        sk.ShardedDataset(data)


# -- kill -9 at every step and at random moments -------------------------------------------------------

KILLS = 12


def test_a_replacement_killed_at_any_moment_leaves_the_old_folder_or_the_new_one(tmp_path):
    job = Path(replace_kill.__file__)
    run = subprocess.run([sys.executable, str(job), str(tmp_path), str(KILLS), "0"], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    rounds = [json.loads(line) for line in run.stdout.splitlines()]
    by = Counter((r["kind"], r["mode"]) for r in rounds)
    assert set(by) == {(kind, mode) for kind in ("export", "data") for mode in ("exchange", "rename")}
    for found in rounds:
        assert found["found"] in (0, 1, "absent") and found["after"] in (0, 1), found  # never a mix, always readable
        assert found["left_after"] == [], found  # the next write clears what a kill left
        if found["mode"] == "exchange":
            assert found["found"] == found["after"], found  # no moment without a complete folder at OUT
        if "old" in found:  # killed at a named step: before the swap the old folder, after it the new one
            assert found["after"] in (found["old"], found["new"])
    steps = {key: [r["how"] for r in rounds if (r["kind"], r["mode"]) == key and r["how"].startswith(("before", "after"))]
             for key in by}
    assert all(any("_exchange" in how for how in hows) for (_, mode), hows in steps.items() if mode == "exchange")
    assert all(sum("rename" in how for how in hows) == 4 for (_, mode), hows in steps.items() if mode == "rename")
    gaps = [r for r in rounds if r["found"] == "absent"]
    assert gaps and all(r["mode"] == "rename" and "replaced" in r["left"] for r in gaps)  # put back, then
    assert sum("partial" in r["left"] for r in rounds if r["how"].startswith("random")) >= KILLS  # mid-write kills
