"""TextShards: a deterministic byte-level LM stream from local text files."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.io.data import TextShards, stdlib_root
from shardkit.plan import PlanError

STDLIB = TextShards(max_bytes=64 * 1024)


@settings(max_examples=20, deadline=None)
@given(seq_len=st.integers(1, 64), batch_size=st.integers(1, 8), seed=st.integers(0, 2**31), steps=st.integers(1, 4))
def test_batches_are_shifted_windows_of_the_stream_and_deterministic(seq_len, batch_size, seed, steps):
    text = bytes(STDLIB.stream.tolist())
    first = list(STDLIB.batches(seq_len, batch_size, seed, steps))
    again = list(TextShards(max_bytes=STDLIB.max_bytes).batches(seq_len, batch_size, seed, steps))
    assert len(first) == steps
    for (x, y), (x2, y2) in zip(first, again):
        assert x.dtype == y.dtype == torch.int64
        assert x.shape == y.shape == (batch_size, seq_len)
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])
        rows = torch.cat([x, y[:, -1:]], dim=1)  # each row with its next byte: a window of the stream
        assert all(bytes(row.tolist()) in text for row in rows)


def test_seeds_give_different_batches():
    (a, _), = STDLIB.batches(32, 4, seed=0, steps=1)
    (b, _), = STDLIB.batches(32, 4, seed=1, steps=1)
    assert not torch.equal(a, b)


def test_default_corpus_is_the_stdlib_python_sources_in_sorted_order():
    shards = TextShards(max_bytes=4096)
    files = []
    for path in shards.files():
        files.append(path)
        if len(files) == 20:
            break
    assert all(p.suffix == ".py" and stdlib_root() in p.parents for p in files)
    top = [p for p in files if p.parent == stdlib_root()]
    assert top == sorted(top)
    assert shards.stream.numel() == 4096
    assert shards.stream[:100].tolist() == list(files[0].read_bytes()[:100])


def test_folder_is_read_recursively_skipping_binary_and_undecodable(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_bytes(b"hello")
    (tmp_path / "b" / "c.md").write_bytes(b"world")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / ".hidden").write_bytes(b"secret")
    shards = TextShards(tmp_path)
    assert bytes(shards.stream.tolist()) == b"hello\nworld\n"
    assert bytes(TextShards(tmp_path, max_bytes=7).stream.tolist()) == b"hello\nw"
    assert bytes(TextShards(tmp_path, pattern="*.md").stream.tolist()) == b"world\n"


def test_pickling_sends_paths_not_the_stream(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"x" * 10_000)
    shards = TextShards(tmp_path)
    assert shards.stream.numel() == 10_001
    copy = pickle.loads(pickle.dumps(shards))
    assert len(pickle.dumps(shards)) < 1000
    assert torch.equal(copy.stream, shards.stream)


def test_folder_without_text_is_a_clear_error(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(PlanError, match="has no text files"):
        TextShards(tmp_path).check()
    with pytest.raises(PlanError, match="does not exist"):
        TextShards(tmp_path / "missing").check()


def test_sequence_longer_than_the_stream_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"short")
    with pytest.raises(PlanError, match="too few for seq_len=10"):
        next(TextShards(tmp_path).batches(10, 1, 0, 1))


def test_a_stream_too_short_for_any_seq_len_says_so(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"abc")
    with pytest.raises(PlanError, match=r"has 1 bytes .*too few for seq_len=1 .*too few for any seq_len") as caught:
        next(TextShards(tmp_path, byte_range=(1, 2)).batches(1, 1, 0, 1))
    assert "seq_len < 1" not in str(caught.value) and str(tmp_path) in str(caught.value)
    with pytest.raises(PlanError, match=r"has 4 bytes .*valid: seq_len <= 3, or more data"):
        next(TextShards(tmp_path).batches(4, 1, 0, 1))
    assert next(TextShards(tmp_path).batches(3, 1, 0, 1))[0].shape == (1, 3)


def test_the_fingerprint_is_of_the_data_not_of_the_path_they_are_read_by(tmp_path, monkeypatch):
    from shardkit.io.batch_stream import BatchStream
    from shardkit.io.shard_writer import write_shards
    from shardkit.plan import UsageError

    folder = tmp_path / "notes"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha " * 100)
    (folder / "sub" / "b.txt").write_text("beta " * 100)
    stream = BatchStream.of(folder, 16, 0)
    position = next(stream.batches(2, 1)).position
    monkeypatch.chdir(tmp_path)
    assert BatchStream.of("notes", 16, 0).fingerprint == stream.fingerprint          # a relative path
    monkeypatch.chdir(folder / "sub")
    assert BatchStream.of("../../notes", 16, 0).fingerprint == stream.fingerprint    # from another folder
    shutil.copytree(folder, tmp_path / "copy")
    BatchStream.of(tmp_path / "copy", 16, 0).check_position(position)                 # the same files elsewhere
    assert len({BatchStream.of(folder, *settings).fingerprint for settings in ((16, 0), (8, 0), (16, 1))}) == 3

    (tmp_path / "copy" / "sub" / "b.txt").write_text("gamma " * 100)                   # other text at the same path
    (tmp_path / "copy" / "a.txt").rename(tmp_path / "copy" / "c.txt")
    (folder / "sub" / "b.txt").write_text("beta " * 99 + "bet! ")                     # one byte changed
    for changed in (tmp_path / "copy", folder):
        with pytest.raises(UsageError, match="the checkpoint's data position is for text data"):
            BatchStream.of(changed, 16, 0).check_position(position)
    older = {"kind": "text", "data": "3a62b0c1d2e3f405", "batches": 1}   # no fingerprint_of: hashed the path
    with pytest.raises(UsageError, match="written by an older shardkit"):
        stream.check_position(older)

    (tmp_path / "corpus.txt").write_text("".join(f"{i:04d}\n" for i in range(400)))
    write_shards(tmp_path / "corpus.txt", tmp_path / "sharded", shards=2)
    shutil.copytree(tmp_path / "sharded", tmp_path / "moved")
    assert BatchStream.of(tmp_path / "moved", 8, 0).fingerprint == BatchStream.of(tmp_path / "sharded", 8, 0).fingerprint
