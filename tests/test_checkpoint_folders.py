"""The folder of checkpoints: a damaged latest checkpoint is refused by name on every path that
picks "the latest" (``sk.load``, ``sk.latest_checkpoint``, ``shardkit checkpoint inspect`` and
``convert``, ``shardkit train --resume``), never passed over for the step before; only a save in
progress is; ``keep_last`` never removes a damaged one; two runs saving one step are told apart.
One process, no world: each case is a copy of a small folder.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import shardkit as sk
from shardkit.checkpoint import store
from shardkit.checkpoint.manifest import MANIFEST_NAME
from shardkit.cli import main

LATEST = "step-00000003"


def _save_steps(root: Path, steps, keep_last=None) -> None:
    model = nn.Linear(3, 2)
    for step in steps:
        with torch.no_grad():
            model.weight.fill_(step)
        sk.save(root, model, step=step, keep_last=keep_last)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("template") / "checkpoints"
    _save_steps(root, [1, 2, 3])
    return root


@pytest.fixture
def root(template, tmp_path) -> Path:
    copy = tmp_path / "checkpoints"
    shutil.copytree(template, copy)
    return copy


def _rewrite(folder: Path, change) -> None:
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    change(manifest)
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-3])


def _replace_by_a_file(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.write_text("not a folder")


#: Damage that a look at the manifest and the file sizes shows (sk.latest_checkpoint sees it too).
DAMAGE = {
    "manifest deleted": lambda f: (f / MANIFEST_NAME).unlink(),
    "manifest empty": lambda f: (f / MANIFEST_NAME).write_text(""),
    "manifest not JSON": lambda f: (f / MANIFEST_NAME).write_text("step: 3\n"),
    "manifest a JSON list": lambda f: (f / MANIFEST_NAME).write_text("[3]"),
    "manifest of step 1": lambda f: shutil.copy(f.parent / "step-00000001" / MANIFEST_NAME, f / MANIFEST_NAME),
    "step edited": lambda f: _rewrite(f, lambda m: m.update(step=2)),
    "extra edited": lambda f: _rewrite(f, lambda m: m.update(extra={"data": {"position": 1}})),
    "a permutation added": lambda f: _rewrite(f, lambda m: m["permutations"].update(weight=[0, [1, 0]])),
    "world_size of the wrong type": lambda f: _rewrite(f, lambda m: m.update(world_size="1")),
    "checksum removed": lambda f: _rewrite(f, lambda m: m.pop("checksum")),
    "version 1 with a checksum": lambda f: _rewrite(f, lambda m: m.update(version=1)),
    "a file missing": lambda f: (f / "__0_0.distcp").unlink(),
    "a file added": lambda f: (f / "notes.txt").write_text("mine"),
    "a file cut short": lambda f: _truncate(f / "rng-00000.json"),
    "not a folder": _replace_by_a_file,
}


def _refused_load(root: Path) -> str:
    model = nn.Linear(3, 2)
    before = model.weight.detach().clone()
    with pytest.raises(sk.CheckpointError) as error:
        sk.load(root, model)
    assert torch.equal(model.weight, before)  # nothing loaded: not step 2's weights
    return str(error.value)


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_latest_checkpoint_is_refused_naming_it_never_skipped(root, kind, capsys, tmp_path):
    DAMAGE[kind](root / LATEST)
    message = _refused_load(root)
    assert f"{LATEST}, is damaged, and an earlier one is never taken in its place" in message or \
        f"{LATEST}' is damaged" in message, message
    assert "step-00000002" in message  # what can be loaded instead is named
    with pytest.raises(sk.CheckpointError, match=f"{LATEST}"):
        sk.latest_checkpoint(root)
    assert main(["checkpoint", "inspect", str(root)]) == 2
    assert LATEST in capsys.readouterr().err
    with pytest.raises(sk.CheckpointError, match=LATEST):
        sk.convert_to_hf(root, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    model = nn.Linear(3, 2)
    assert sk.load(root / "step-00000002", model)["step"] == 2  # named, the step before loads
    assert bool((model.weight == 2).all())


def test_a_byte_changed_in_the_latest_is_refused_by_load(root):
    data = bytearray((root / LATEST / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 4
    (root / LATEST / "__0_0.distcp").write_bytes(data)
    message = _refused_load(root)
    assert f"checkpoint '{root / LATEST}' is damaged" in message and "__0_0.distcp has sha256" in message


@settings(max_examples=30)
@given(cut=st.floats(0, 1, exclude_max=True))
def test_a_manifest_cut_short_anywhere_is_refused(template, cut):
    with _copy(template) as root:
        manifest = root / LATEST / MANIFEST_NAME
        text = manifest.read_bytes()
        manifest.write_bytes(text[: int(cut * len(text))])
        assert LATEST in _refused_load(root)


def _fields(value, path=()):
    """The path of every value in a manifest (into objects and lists)."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _fields(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _fields(item, (*path, index))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=5)


@settings(max_examples=40)
@given(data=st.data(), value=JSON)
def test_any_field_of_the_latest_manifest_edited_is_refused(template, data, value):
    manifest = json.loads((template / LATEST / MANIFEST_NAME).read_text())
    path = data.draw(st.sampled_from([p for p in _fields(manifest) if p]))
    holder = manifest
    for key in path[:-1]:
        holder = holder[key]
    assume(holder[path[-1]] != value or type(holder[path[-1]]) is not type(value))
    holder[path[-1]] = value
    with _copy(template) as root:
        (root / LATEST / MANIFEST_NAME).write_text(json.dumps(manifest))
        assert LATEST in _refused_load(root)


class _copy:
    """A copy of the template folder, removed after (hypothesis examples share one test's tmp_path)."""

    def __init__(self, template: Path):
        self.template = template

    def __enter__(self) -> Path:
        import tempfile

        self.tmp = Path(tempfile.mkdtemp())
        shutil.copytree(self.template, self.tmp / "checkpoints")
        return self.tmp / "checkpoints"

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.tmp)


def test_only_a_save_in_progress_is_passed_over(root):
    shutil.copytree(root / LATEST, root / ".step-00000004.tmp-host-99-0badf00d")  # killed mid-save: no rename
    (root / ".step-00000004.tmp-host-99-0badf00d" / MANIFEST_NAME).unlink()
    model = nn.Linear(3, 2)
    assert sk.load(root, model)["step"] == 3 and sk.latest_checkpoint(root) == root / LATEST


@pytest.mark.parametrize("kind", ["manifest deleted", "a file missing", "a file added"])
def test_keep_last_never_removes_a_damaged_checkpoint_and_says_so(root, kind):
    DAMAGE[kind](root / "step-00000002")
    before = sorted(p.name for p in (root / "step-00000002").iterdir())
    with pytest.warns(UserWarning, match="keep_last=1\\): kept step-00000002 in .*, not counted: .* never removed"):
        _save_steps(root, [4], keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000004"]
    assert sorted(p.name for p in (root / "step-00000002").iterdir()) == before


def test_resume_and_save_refuse_a_damaged_latest_before_any_process(root, capsys, no_processes):
    DAMAGE["manifest empty"](root / LATEST)
    for flags in (["--resume", str(root)], ["--save", str(root), "--resume"], ["--save", str(root)],
                  ["--resume", str(root / LATEST)]):
        assert main(["train", "--model", "gpt-tiny", "--mesh", "dp=2", "--steps", "9", *flags]) == 2
        err = capsys.readouterr().err
        assert LATEST in err and "not valid JSON" in err and "starting at step 0" not in err, (flags, err)


# -- two runs saving one step --------------------------------------------------------------------------

def test_two_runs_saving_one_step_the_second_is_told_who_saved_it(tmp_path, monkeypatch):
    """The other run is a forked process that completes its save of step 5 between this run's
    manifest and its rename: the rename fails, and the error names the folder and that process."""
    commit = store._commit
    winner = {}

    def another_run_first(work, final, manifest, keep_last):
        pid = os.fork()
        if pid == 0:
            try:
                model = nn.Linear(3, 2)
                with torch.no_grad():
                    model.weight.fill_(50)
                monkeypatch.setattr(store, "_commit", commit)
                sk.save(tmp_path, model, step=5)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        winner["pid"] = pid
        commit(work, final, manifest, keep_last)

    monkeypatch.setattr(store, "_commit", another_run_first)
    model = nn.Linear(3, 2)
    with pytest.raises(sk.CheckpointError) as error:
        sk.save(tmp_path, model, step=5)
    message = str(error.value)
    assert f"'{tmp_path / 'step-00000005'}' was saved by process {winner['pid']} on {socket.gethostname()}" in message
    assert f"while this process (process {os.getpid()} on {socket.gethostname()})" in message
    assert "give each its own folder" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005"]  # this run's temporary folder is gone
    assert sk.load(tmp_path, model)["step"] == 5 and bool((model.weight == 50).all())  # the other run's, whole
    monkeypatch.setattr(store, "_commit", commit)
    with pytest.raises(sk.CheckpointError, match=rf"exists: step 5 was saved before, by process {winner['pid']} on"):
        sk.save(tmp_path, model, step=5)


def test_a_save_in_progress_carries_its_host_and_process_in_its_name(tmp_path, monkeypatch):
    seen = []
    commit = store._commit
    monkeypatch.setattr(store, "_commit", lambda work, *rest: (seen.append(work.name), commit(work, *rest)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sk.save(tmp_path, nn.Linear(2, 2), step=1)
    assert seen[0].startswith(".step-00000001.tmp-") and f"-{os.getpid()}-" in seen[0]
    saved_by = json.loads((tmp_path / "step-00000001" / MANIFEST_NAME).read_text())["saved_by"]
    assert saved_by == {"host": socket.gethostname(), "pid": os.getpid()}
