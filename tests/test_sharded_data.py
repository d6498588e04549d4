"""Sharded data folders: ``write_shards`` / ``shardkit data`` (format, manifest, atomic write) and
``ShardedDataset`` (samples, a global order fixed by seed and epoch, exact resume across
data-parallel degrees, manifest checks, pickling). Tiny data: a few KB under tmp paths."""

from __future__ import annotations

import doctest
import hashlib
import itertools
import json
import os
import pickle
import random
import re
import shutil
import string
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import shardkit as sk
from shardkit.cli import main
from shardkit.io.data import TextShards
from shardkit.io.manifest import DataError
from shardkit.io.order import epoch_order
from shardkit.io.shard_writer import write_shards
from shardkit.io.sharded_data import ShardedDataset, split_problem
from shardkit.plan import UsageError

SRC = Path(__file__).resolve().parents[1] / "src"
SHARDS = 5
SEQ_LEN = 8


def _write_corpus(root: Path) -> Path:
    """Text files of random letters (one in a sub-folder, one empty), plus files the walk skips."""
    rng = random.Random(0)
    (root / "sub").mkdir(parents=True)
    for name, size in [("a.txt", 1500), ("b.md", 2600), ("sub/c.txt", 700), ("empty.txt", 0)]:
        (root / name).write_text("".join(rng.choice(string.ascii_letters + " \n") for _ in range(size)))
    (root / "blob.bin").write_bytes(b"\x00\x01binary")
    (root / ".hidden.txt").write_text("not read")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def folder(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("written") / "out"
    write_shards(corpus, out, shards=SHARDS)
    return out


@pytest.fixture(scope="module")
def dataset(folder) -> ShardedDataset:
    return ShardedDataset(folder, seq_len=SEQ_LEN, seed=3)


def _shard_bytes(folder: Path) -> list[bytes]:
    manifest = json.loads((folder / "manifest.json").read_text())
    return [(folder / entry["name"]).read_bytes() for entry in manifest["shards"]]


# -- writing ----------------------------------------------------------------------------------

@settings(max_examples=12)
@given(shards=st.integers(1, 40))
def test_shards_are_the_text_stream_cut_evenly_with_a_true_manifest(corpus, shards):
    stream = bytes(TextShards(corpus, max_bytes=2**30).stream.tolist())  # every text file, then a newline
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        manifest = write_shards(corpus, out, shards=shards)
        pieces = _shard_bytes(out)
        written = json.loads((out / "manifest.json").read_text())
    assert b"".join(pieces) == stream
    assert len(pieces) == shards and max(map(len, pieces)) - min(map(len, pieces)) <= 1
    assert written["format"] == "shardkit.bytes" and written["version"] == 1 and written["dtype"] == "uint8"
    assert written["source"] == {"path": str(corpus.resolve()), "files": 3, "bytes": 1500 + 2600 + 700}
    assert written["total_bytes"] == written["total_tokens"] == len(stream) == manifest.total_bytes
    assert [(e["bytes"], e["tokens"], e["sha256"]) for e in written["shards"]] == \
        [(len(p), len(p), hashlib.sha256(p).hexdigest()) for p in pieces]


def test_a_single_file_is_a_source_and_an_empty_out_folder_is_used(tmp_path):
    (tmp_path / "one.txt").write_text("abcdefghij")
    (tmp_path / "out").mkdir()
    manifest = write_shards(tmp_path / "one.txt", tmp_path / "out", shards=3)
    assert _shard_bytes(tmp_path / "out") == [b"abc", b"defg", b"hij\n"]  # 11 bytes: cuts at 11//3 and 22//3
    assert manifest.source.files == 1 and manifest.source.bytes == 10


def test_overwrite_replaces_the_whole_folder(corpus, tmp_path):
    out = tmp_path / "out"
    write_shards(corpus, out, shards=7)
    with pytest.raises(UsageError, match="exists and is not empty; pass --overwrite"):
        write_shards(corpus, out, shards=2)
    write_shards(corpus, out, shards=2, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "shard-00000.bin", "shard-00001.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing left beside it


def test_an_error_mid_write_leaves_no_folder_and_keeps_the_previous_one(corpus, tmp_path):
    def fail_after_first_file(done, total):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_shards(corpus, tmp_path / "new", shards=3, progress=fail_after_first_file)
    assert list(tmp_path.iterdir()) == []
    write_shards(corpus, tmp_path / "old", shards=3)
    before = _shard_bytes(tmp_path / "old")
    with pytest.raises(OSError, match="disk full"):
        write_shards(corpus, tmp_path / "old", shards=2, overwrite=True, progress=fail_after_first_file)
    assert [p.name for p in tmp_path.iterdir()] == ["old"] and _shard_bytes(tmp_path / "old") == before
    ShardedDataset(tmp_path / "old", seq_len=4).verify()


def test_a_killed_write_leaves_only_a_hidden_folder_without_manifest(corpus, tmp_path):
    kill = ("import os, signal, sys\n"
            "from shardkit.io.shard_writer import write_shards\n"
            "def die(done, total):\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "write_shards(sys.argv[1], sys.argv[2], shards=3, progress=die)\n")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", kill, str(corpus), str(out)], env={**os.environ, "PYTHONPATH": str(SRC)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == -9, run.stderr
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].name.startswith(".out.partial-") and left[0].is_dir()
    assert any(left[0].iterdir()) and not (left[0] / "manifest.json").exists()
    with pytest.raises(DataError, match="does not exist"):
        ShardedDataset(out)
    write_shards(corpus, out, shards=3)  # the leftover does not get in the way
    assert len(ShardedDataset(out, seq_len=4)) > 0


@pytest.mark.parametrize(("make", "message"), [
    (lambda src, out: (src / "missing", out), "SRC '.*missing' does not exist"),
    (lambda src, out: (src / "blob.bin", out), "has no text"),
    (lambda src, out: (src, src / "sub" / "out"), "overlap"),
    (lambda src, out: (src / "sub", src), "overlap"),
    (lambda src, out: (src, src / "a.txt"), "is a file"),
])
def test_bad_paths_are_refused_before_anything_is_written(corpus, tmp_path, make, message):
    src, out = make(corpus, tmp_path / "out")
    with pytest.raises(UsageError, match=message):
        write_shards(src, out, shards=2, overwrite=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("shards", "message"), [(0, "an integer >= 1"), (True, "an integer >= 1"),
                                                 (10**6, r"valid shard counts are 1\.\.4803")])
def test_bad_shard_counts_are_refused(corpus, tmp_path, shards, message):
    with pytest.raises(UsageError, match=message):
        write_shards(corpus, tmp_path / "out", shards=shards)


# -- samples and order ------------------------------------------------------------------------

@settings(max_examples=15)
@given(seq_len=st.integers(1, 200))
def test_samples_are_windows_of_their_shard_counted_from_the_manifest(folder, seq_len):
    shards = _shard_bytes(folder)
    ds = ShardedDataset(folder, seq_len=seq_len)
    expected = [shard[k * seq_len: k * seq_len + seq_len + 1] for shard in shards
                for k in range((len(shard) - 1) // seq_len)]
    assert len(ds) == len(expected)
    tokens = ds.samples(torch.arange(len(ds)))
    assert tokens.dtype == torch.int64 and tokens.shape == (len(ds), seq_len + 1)
    assert [bytes(row) for row in tokens.to(torch.uint8).numpy()] == expected


@settings(max_examples=50)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 10**6), cut=st.floats(0, 1))
def test_an_epoch_order_is_a_permutation_fixed_by_seed_and_epoch(n, seed, epoch, cut):
    order = epoch_order(n, seed, epoch)
    assert sorted(order.tolist()) == list(range(n))
    middle = int(cut * n)
    pieces = [epoch_order(n, seed, epoch, 0, middle), epoch_order(n, seed, epoch, middle, n)]
    assert [i for piece in pieces for i in piece.tolist()] == order.tolist()


def test_epochs_and_seeds_give_different_orders(folder, dataset):
    first = dataset.order(epoch=0)
    assert torch.equal(first, ShardedDataset(folder, seq_len=SEQ_LEN, seed=3).order(0))  # a fresh object agrees
    assert not torch.equal(first, dataset.order(epoch=1))
    assert not torch.equal(first, ShardedDataset(folder, seq_len=SEQ_LEN, seed=4).order(0))
    assert not torch.equal(first, torch.arange(len(dataset)))


# -- the loader: ranks, positions, resume -----------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@settings(max_examples=40)
@given(data=st.data(), global_batch=st.sampled_from([1, 4, 6, 12, 30, 60]), epoch=st.integers(0, 3))
def test_rank_slices_make_up_the_global_batch_in_order_whatever_the_degree(dataset, data, global_batch, epoch):
    ranks = data.draw(st.sampled_from(_divisors(global_batch)), label="ranks")
    position = data.draw(st.integers(0, len(dataset)), label="position")
    order = dataset.order(epoch)
    loaders = [dataset.loader(global_batch, rank, ranks, position, epoch) for rank in range(ranks)]
    assert len({len(loader) for loader in loaders}) == 1
    assert len(loaders[0]) == (len(dataset) - position) // global_batch  # the last partial batch is dropped
    for b, parts in enumerate(zip(*loaders)):
        indices = torch.cat([index for index, _ in parts])
        assert torch.equal(indices, order[position + b * global_batch: position + (b + 1) * global_batch])
        for index, tokens in parts:
            assert tokens.shape == (global_batch // ranks, SEQ_LEN + 1)
            assert torch.equal(tokens, dataset.samples(index))
    assert {loader.position for loader in loaders} == {position + len(loaders[0]) * global_batch}


@settings(max_examples=60)
@given(global_batch=st.sampled_from([12, 24]),
       phases=st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 6, 12]), st.integers(0, 12)), min_size=1, max_size=6),
       epoch=st.integers(0, 2))
@example(global_batch=12, phases=[(4, 5), (3, 7), (2, 3), (4, 0)], epoch=0)  # the issue's 4 -> 3 -> 2 -> 4
def test_a_resume_across_degrees_delivers_every_sample_of_the_epoch_once(dataset, global_batch, phases, epoch):
    """Each phase reads some batches on every rank of its degree and saves the position; the
    last phase reads to the end of the epoch."""
    delivered, position = [], 0
    for i, (ranks, batches) in enumerate(phases):
        last = i == len(phases) - 1
        loaders = [dataset.loader(global_batch, rank, ranks, position, epoch) for rank in range(ranks)]
        for loader in loaders:
            taken = list(loader) if last else list(itertools.islice(loader, batches))
            delivered += [i for indices, _ in taken for i in indices.tolist()]
        assert len({loader.position for loader in loaders}) == 1  # every rank saves the same position
        position = loaders[0].position
    assert len(delivered) == len(set(delivered)) == position  # no duplicates, one sample per position
    assert set(delivered) == set(dataset.order(epoch, 0, position).tolist())  # no gaps
    assert 0 <= len(dataset) - position < global_batch  # only a last partial global batch is left out


@settings(max_examples=40)
@given(global_batch=st.integers(1, 500), ranks=st.integers(2, 64))
def test_a_global_batch_that_does_not_split_names_the_valid_sizes(global_batch, ranks):
    if global_batch % ranks == 0:
        return
    found = re.fullmatch(rf"global_batch={global_batch} does not split over ranks={ranks}; valid global batches "
                         rf"near {global_batch}: ([\d, ]+); valid ranks for global_batch={global_batch}: ([\d, ]+)",
                         split_problem(global_batch, ranks))
    near, valid_ranks = ([int(x) for x in group.split(", ")] for group in found.groups())
    assert near and all(size % ranks == 0 and abs(size - global_batch) < ranks for size in near)
    assert valid_ranks == _divisors(global_batch)


def test_the_issue_example_of_a_batch_that_does_not_split(dataset):
    with pytest.raises(UsageError) as caught:
        dataset.loader(global_batch=12, rank=0, ranks=5)
    assert str(caught.value).endswith("global_batch=12 does not split over ranks=5; valid global batches near 12: "
                                      "10, 15; valid ranks for global_batch=12: 1, 2, 3, 4, 6, 12")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"global_batch": 0}, r"global_batch=0 is not valid; valid: 1\.\.\d+"),
    ({"global_batch": 10**6}, r"global_batch=1000000 is not valid; valid: 1\.\.\d+ \(the samples of an epoch\)"),
    ({"global_batch": 2.0}, "global_batch=2.0 is not valid"),
    ({"global_batch": 4, "ranks": 0}, "ranks=0 is not valid; valid: the data-parallel degree"),
    ({"global_batch": 4, "ranks": 4, "rank": 4}, r"rank=4 is not valid; valid: 0\.\.3 \(ranks=4\)"),
    ({"global_batch": 4, "rank": -1}, "rank=-1 is not valid"),
    ({"global_batch": 4, "position": -1}, r"position=-1 is not valid; valid: 0\.\.\d+ \(samples of the epoch"),
    ({"global_batch": 4, "position": 10**6}, "position=1000000 is not valid"),
    ({"global_batch": 4, "epoch": -1}, r"epoch=-1 is not valid; valid: 0, 1, 2, \.\.\."),
    ({"global_batch": 4, "epoch": True}, "epoch=True is not valid"),
])
def test_bad_loader_arguments_are_refused_one_message_each(dataset, kwargs, message):
    with pytest.raises(UsageError, match=message) as caught:
        dataset.loader(**kwargs)
    assert str(caught.value).startswith("loader(") and "\n" not in str(caught.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"seq_len": 0}, "seq_len=0 is not valid; valid: tokens per sample"),
    ({"seed": -1}, "seed=-1 is not valid"),
    ({"seq_len": 10_000}, r"seq_len=10000: the longest shard .* has 961 tokens, .* valid: seq_len < 961"),
])
def test_bad_dataset_arguments_are_refused(folder, kwargs, message):
    with pytest.raises(UsageError, match=message):
        ShardedDataset(folder, **kwargs)


@settings(max_examples=12)
@given(text=st.text(string.ascii_letters, min_size=1, max_size=30), seq_len=st.integers(1, 40))
def test_a_folder_too_short_for_seq_len_says_the_longest_seq_len_it_allows(text, seq_len):
    """One-token shards allow no seq_len at all (never "valid: seq_len < 1"); otherwise the longest one is named."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a.txt").write_text(text)
        total = len(text) + 1
        for shards in (total, 1):
            out = Path(tmp) / f"out-{shards}"
            write_shards(Path(tmp) / "a.txt", out, shards=shards)
            longest = -(-total // shards)
            if seq_len < longest:
                continue
            with pytest.raises(UsageError) as caught:
                ShardedDataset(out, seq_len=seq_len)
            message = str(caught.value)
            assert str(out) in message and f"{total} tokens in all" in message and not re.search(r"seq_len < 1\b", message)
            if longest == 1:
                assert "no seq_len fits (a sample needs at least 2 tokens)" in message
                assert f"with --shards 1, seq_len up to {total - 1}" in message
            else:
                assert f"valid: seq_len < {longest} (at most {longest - 1})" in message
                assert len(ShardedDataset(out, seq_len=longest - 1)) >= 1  # what it says is valid is


def test_bad_order_and_sample_arguments_are_refused(dataset):
    with pytest.raises(UsageError, match=r"^order\(epoch=-1, start=0, stop=None\): epoch=-1 is not valid"):
        dataset.order(-1)
    with pytest.raises(UsageError, match=r"start=5 is not valid; valid: 0\.\.stop=2"):
        dataset.order(0, 5, 2)
    with pytest.raises(UsageError, match=rf"^samples\(indices\): valid indices are 0\.\.{len(dataset) - 1}"):
        dataset.samples([0, len(dataset)])


def test_a_finished_epoch_yields_nothing_and_the_next_starts_at_zero(dataset):
    end = len(dataset) - len(dataset) % 12
    assert list(dataset.loader(12, position=end)) == [] and len(dataset.loader(12, position=len(dataset))) == 0
    assert len(dataset.loader(12, position=0, epoch=1)) == len(dataset) // 12


# -- manifest checks --------------------------------------------------------------------------

@pytest.fixture
def copy(folder, tmp_path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def _flip_a_byte(path: Path, offset: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: (d / "shard-00002.bin").unlink(), "shard-00002.bin is missing"),
    (lambda d: os.truncate(d / "shard-00003.bin", 100), "shard-00003.bin has 100 bytes, the manifest says 961"),
    (lambda d: (d / "shard-00005.bin").write_bytes(b"stray"), "shard-00005.bin is not in the manifest"),
    (lambda d: (d / "manifest.json").unlink(), "has no readable manifest.json"),
    (lambda d: (d / "manifest.json").write_text("{"), "manifest.json' is not valid JSON"),
    (lambda d: (d / "manifest.json").write_text(json.dumps({**json.loads((d / "manifest.json").read_text()),
                                                             "version": 2})), "reads 'shardkit.bytes' version 1"),
    (lambda d: (d / "manifest.json").write_text(json.dumps({**json.loads((d / "manifest.json").read_text()),
                                                             "shards": "all"})), "field 'shards' must be a JSON list"),
])
def test_a_folder_that_does_not_match_its_manifest_is_refused_at_open_naming_the_file(copy, damage, message):
    damage(copy)
    with pytest.raises(DataError, match=message) as caught:
        ShardedDataset(copy, seq_len=SEQ_LEN)
    assert str(copy) in str(caught.value) and "shardkit data shard" in str(caught.value)


def test_an_altered_byte_is_found_on_first_read_of_its_shard_or_by_verify(copy):
    _flip_a_byte(copy / "shard-00001.bin")
    (copy / ".DS_Store").write_bytes(b"hidden files are ignored")
    ds = ShardedDataset(copy, seq_len=SEQ_LEN)  # sizes match: opening succeeds
    ds.samples([0])  # shard 0 is intact
    first_of_shard_1 = int(ds.first_sample[1])
    with pytest.raises(DataError, match=r"shard-00001.bin has sha256 \w+\.\.\., the manifest says \w+\.\.\. \(altered\)"):
        ds.samples([first_of_shard_1])
    with pytest.raises(DataError, match="shard-00001.bin has sha256"):
        ShardedDataset(copy, seq_len=SEQ_LEN).verify()


def test_a_shard_is_checked_once_per_process_then_read_through_a_memmap(copy):
    ds = ShardedDataset(copy, seq_len=SEQ_LEN)
    before = ds.samples([0])
    _flip_a_byte(copy / "shard-00000.bin", offset=0)  # after the check: read as it is now, not re-hashed
    assert ds.samples([0])[0, 0] == before[0, 0] ^ 1


# -- pickling ---------------------------------------------------------------------------------

def test_pickling_sends_the_folder_and_manifest_not_bytes_and_checks_again(copy):
    ds = ShardedDataset(copy, seq_len=SEQ_LEN, seed=7)
    ds.samples(torch.arange(len(ds)))  # every shard mapped
    payload = pickle.dumps(ds)
    assert len(payload) < 2000 < ds.manifest.total_bytes
    clone = pickle.loads(payload)
    assert torch.equal(clone.order(2), ds.order(2)) and torch.equal(clone.samples([5, 9]), ds.samples([5, 9]))
    _flip_a_byte(copy / "shard-00004.bin")
    with pytest.raises(DataError, match="shard-00004.bin"):
        pickle.loads(payload).samples([len(ds) - 1])


def test_the_fingerprint_changes_with_what_the_order_and_samples_depend_on(copy, dataset):
    same = ShardedDataset(copy, seq_len=SEQ_LEN, seed=3).fingerprint
    assert same == dataset.fingerprint and len(same) == 16
    assert ShardedDataset(copy, seq_len=SEQ_LEN + 1, seed=3).fingerprint != same
    assert ShardedDataset(copy, seq_len=SEQ_LEN, seed=4).fingerprint != same
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"][0]["sha256"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert ShardedDataset(copy, seq_len=SEQ_LEN, seed=3).fingerprint != same


def test_the_facade_exports_the_data_api():
    assert (sk.ShardedDataset, sk.write_shards, sk.DataError) == (ShardedDataset, write_shards, DataError)
    assert issubclass(sk.DataError, sk.UsageError)


# -- the command line -------------------------------------------------------------------------

def _exit(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_data_shard_then_check(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = _exit(["data", "shard", str(corpus), str(out), "--shards", "4"], capsys)
    assert (code, err) == (0, "")
    assert stdout == f"shardkit data shard: wrote 4 shards to {out}: 4.7 KiB (4,803 byte tokens) from 3 text file(s) in {corpus}\n"
    code, stdout, err = _exit(["data", "check", str(out), "--seq-len", "16"], capsys)
    assert (code, err) == (0, "") and "sizes and sha256 match the manifest; 299 samples of 16 + 1 tokens" in stdout
    assert len(ShardedDataset(out, seq_len=16)) == 299  # shards of 1200, 1201, 1201, 1201 bytes: 74 + 3 * 75
    code, _, err = _exit(["data", "shard", str(corpus), str(out), "--shards", "2"], capsys)
    assert code == 2 and err == f"shardkit data: OUT '{out}' exists and is not empty; pass --overwrite " \
                                "(overwrite=True) to replace it, or choose another folder\n"
    assert _exit(["data", "shard", str(corpus), str(out), "--shards", "2", "--overwrite"], capsys)[0] == 0
    assert len(ShardedDataset(out).manifest.shards) == 2
    _flip_a_byte(out / "shard-00001.bin")
    code, stdout, err = _exit(["data", "check", str(out)], capsys)
    assert code == 2 and stdout == "" and err.count("\n") == 1 and "shard-00001.bin has sha256" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--shards", "0"], "shardkit data shard: argument --shards: must be a positive integer (1, 2, ...), got '0'"),
    ([], "shardkit data shard: the following arguments are required: --shards"),
    (["--shards", "99999"], "shardkit data: shards=99999: "),
    (["--shards", "2", "--pattern", "*.rst"], "shardkit data: SRC '{src}' has no text (pattern '*.rst'"),
])
def test_data_shard_errors_are_one_line_with_exit_2(corpus, tmp_path, capsys, args, message):
    code, stdout, err = _exit(["data", "shard", str(corpus), str(tmp_path / "out"), *args], capsys)
    assert code == 2 and stdout == "" and err.count("\n") == 1
    assert err.startswith(message.format(src=corpus))
    assert not (tmp_path / "out").exists()


def test_data_without_an_action_or_with_a_missing_folder_exits_2(tmp_path, capsys):
    assert _exit(["data"], capsys)[::2] == (2, "shardkit data: the following arguments are required: action\n")
    code, _, err = _exit(["data", "check", str(tmp_path / "nowhere")], capsys)
    assert code == 2 and err.startswith("shardkit data: data folder ") and "does not exist" in err


# -- docs/data.md -----------------------------------------------------------------------------

def test_the_resume_example_of_docs_data_md_runs_and_prints_what_the_page_shows(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the page's mkdtemp() lands under tmp_path
    page = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    code, shown = re.search(r"```python\n((?:(?!```).)*)```\n\n```text\n(.*?)```", page, re.S).groups()
    exec(compile(code, "docs/data.md", "exec"), {"__name__": "docs_data_md"})
    printed = capsys.readouterr().out
    assert doctest.OutputChecker().check_output(shown, printed, doctest.ELLIPSIS), printed
