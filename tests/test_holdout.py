"""``shardkit train --eval-holdout F``: evaluating on the end of the training data, never trained on.

A sharded folder holds out its last whole shards, text the last bytes of its stream; the parts are
disjoint, cover the data, and the fraction is part of the data position's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from shardkit.cli import main
from shardkit.io.batch_stream import BatchStream
from shardkit.io.data import TextShards
from shardkit.io.shard_writer import write_shards
from shardkit.io.sharded_data import ShardedDataset
from shardkit.observe.metrics import METRICS_FILE
from shardkit.plan import UsageError
from shardkit.training.fields import load_job

SOURCES = Path(__file__).parents[1] / "src" / "shardkit"


def _lines(count: int) -> str:
    """Lines 0000, 0001, ...: no window of 9 bytes or more occurs twice."""
    return "".join(f"{i:04d}\n" for i in range(count))


def _sharded(tmp_path: Path, shards: int) -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "corpus.txt").write_text(_lines(400))
    write_shards(tmp_path / "corpus.txt", tmp_path / "sharded", shards=shards)
    return tmp_path / "sharded"


def _numbered(tmp_path: Path) -> Path:
    """A text folder whose stream is 1000 bytes, lines 0000 .. 0199."""
    folder = tmp_path / "numbered"
    folder.mkdir()
    (folder / "lines.txt").write_text(_lines(200))
    return folder


def test_a_sharded_folder_holds_out_its_last_whole_shards(tmp_path):
    folder = _sharded(tmp_path, shards=4)
    whole = BatchStream.of(folder, seq_len=8, seed=0)
    train, held = whole.split(0.25)
    assert (train.source.shards, held.source.shards) == (range(0, 3), range(3, 4))
    assert whole.split(0.3)[1].source.shards == range(2, 4)          # ceil(0.3 x 4) = 2 whole shards
    # the training part is the whole folder's samples of shards 0-2, the held-out part those of shard 3
    every = whole.source.samples(range(len(whole.source)))
    parts = [part.source.samples(range(len(part.source))) for part in (train, held)]
    assert torch.equal(torch.cat(parts), every)
    assert len(train.source) == int(whole.source.first_sample[3])
    # batches drawn from each part read only its samples (the samples' contents are unique)
    samples = [set(map(tuple, part[:, :-1].tolist())) for part in parts]
    assert not samples[0] & samples[1]
    for part, own in zip((train, held), samples, strict=True):
        drawn = torch.cat([b.inputs for b in part.batches(batch_size=2, steps=len(part.source))])  # two epochs
        assert set(map(tuple, drawn.tolist())) == own
    assert "the last 1 of 4 shards" in held.describe() and "the first 3 of 4 shards" in train.describe()


def test_text_windows_stay_on_their_side_of_the_cut(tmp_path):
    whole = BatchStream.of(TextShards(_numbered(tmp_path), max_bytes=1000), seq_len=16, seed=0)
    stream = bytes(whole.source.stream.tolist())
    assert len(stream) == 1000
    train, held = whole.split(0.25)
    assert (train.source.byte_range, held.source.byte_range) == ((0, 750), (750, 1000))   # ceil(250) held out
    for part, (low, high) in ((train, (0, 750)), (held, (750, 1000))):
        offsets = set()
        for batch in part.batches(batch_size=8, steps=200):
            rows = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)
            for row in rows.tolist():
                window = bytes(row)
                offset = stream.find(window)
                assert offset == stream.rfind(window)                 # each window is found once
                offsets.add(offset)
        assert low <= min(offsets) and max(offsets) + 17 <= high        # seq_len + 1 bytes, never across the cut
        assert min(offsets) == low and max(offsets) + 17 == high        # and the whole part is drawn from
    assert held.describe().startswith("the last 25% of the text stream of")


def test_the_fingerprint_changes_with_the_fraction_and_not_without_holdout(tmp_path):
    text_folder = _numbered(tmp_path)
    text = BatchStream.of(text_folder, seq_len=16, seed=0, max_bytes=1000)
    old = hashlib.sha256(f"{text.source.digest}|16|0".encode()).hexdigest()[:16]   # the fingerprint before holdout
    assert text.fingerprint == old
    sharded = BatchStream.of(_sharded(tmp_path, shards=4), seq_len=8, seed=0)
    shards = [(shard.name, shard.size, shard.sha256) for shard in sharded.source.manifest.shards]
    old = hashlib.sha256(json.dumps({"shards": shards, "seq_len": 8, "seed": 0}).encode()).hexdigest()[:16]
    assert sharded.fingerprint == old
    for whole in (text, sharded):
        prints = [whole.fingerprint] + [part.fingerprint for f in (0.1, 0.2, 0.5) for part in whole.split(f)]
        assert len(set(prints)) == len(prints)       # 0.1 and 0.2 of 4 shards both hold out 1 shard, yet differ
        position = next(whole.split(0.1)[0].batches(batch_size=2, steps=1)).position
        whole.split(0.1)[0].check_position(position)
        for other, now in ((whole, "nothing"), (whole.split(0.2)[0], "0.2")):
            with pytest.raises(UsageError, match=rf"data position is for .*saved holding out 0.1 of the training "
                                                 rf"data \(--eval-holdout\), this run holds out {now}"):
                other.check_position(position)


def test_a_split_that_leaves_a_part_without_data_is_refused(tmp_path):
    with pytest.raises(UsageError, match=r"holding out 0.5 of the 1 shard\(s\) .* holds out 1, leaving none"):
        BatchStream.of(_sharded(tmp_path, shards=1), seq_len=8, seed=0).split(0.5)
    with pytest.raises(UsageError, match="leaves 990 to train on and 10 held out; each part needs seq_len \\+ 1 = 17"):
        BatchStream.of(_numbered(tmp_path), seq_len=16, seed=0, max_bytes=1000).split(0.01)


TINY = ["train", "--model", "gpt-tiny", "--mesh", "fsdp=2", "--seq-len", "16", "--batch-size", "4"]


@pytest.mark.parametrize(("flags", "expected"), [
    (["--eval-every", "2", "--eval-data", "{held}", "--eval-holdout", "0.1"],
     "held and --eval-holdout 0.1: give one"),
    (["--eval-holdout", "0.1"], "--eval-every and --eval-data or --eval-holdout"),
    (["--eval-every", "2"], "--eval-every and --eval-data or --eval-holdout"),
], ids=["both", "holdout-without-every", "every-alone"])
def test_holdout_flags_that_do_not_go_together_are_refused(tmp_path, capsys, no_processes, flags, expected):
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "a.txt").write_text("some text " * 400)
    assert main(TINY + [flag.format(held=tmp_path / "held") for flag in flags]) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "1", "-0.1", "1.5", "nan", "inf", "tenth", ""])
def test_a_bad_fraction_is_refused_by_the_flag(capsys, no_processes, value):
    with pytest.raises(SystemExit) as caught:
        main(TINY + ["--eval-every", "2", "--eval-holdout", value])
    assert caught.value.code == 2
    assert f"argument --eval-holdout: must be a fraction between 0 and 1 (exclusive) such as 0.1, got {value!r}" \
        in capsys.readouterr().err


def test_too_few_shards_and_too_small_parts_are_refused_before_any_process(tmp_path, capsys, no_processes):
    one = _sharded(tmp_path / "one", shards=1)
    assert main(TINY + ["--data", str(one), "--eval-every", "2", "--eval-holdout", "0.1"]) == 2
    assert "--eval-holdout 0.1: holding out 0.1 of the 1 shard(s)" in capsys.readouterr().err
    four = _sharded(tmp_path, shards=4)
    last = ShardedDataset(four, seq_len=16, shards=range(3, 4))
    assert main(TINY[:-1] + ["32", "--data", str(four), "--eval-every", "2", "--eval-holdout", "0.25"]) == 2
    assert f"--eval-holdout 0.25: the last 1 of 4 shards has {len(last)} samples of 16 tokens, fewer than one " \
        f"global batch of 32" in capsys.readouterr().err
    assert len(last) < 32
    text = _numbered(tmp_path)
    assert main(TINY + ["--data", str(text), "--eval-every", "2", "--eval-holdout", "0.01"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardkit train: --eval-holdout 0.01: holding out 0.01 of the 1,001 bytes of text leaves "
                          "990 to train on and 11 held out"), err   # the file and a newline


def test_the_job_file_holdout_field(tmp_path, capsys, no_processes):
    (tmp_path / "job.yaml").write_text("eval: {every: 2, holdout: 0.1}\n")
    assert load_job(tmp_path / "job.yaml") == {"eval_every": 2, "eval_holdout": 0.1}
    for value, shown in (('"0.1"', "str '0.1'"), ("1.5", "float 1.5"), ("0", "int 0"), (".nan", "float nan")):
        (tmp_path / "job.yaml").write_text(f"model: gpt-tiny\neval: {{every: 2, holdout: {value}}}\n")
        assert main(["train", "--config", str(tmp_path / "job.yaml")]) == 2
        err = capsys.readouterr().err
        assert f"eval.holdout must be a number > 0 and < 1, got {shown}" in err, err


def test_a_run_evaluates_on_the_held_out_end_of_its_text(tmp_path, capsys, lend_world):
    train = tmp_path / "train"
    train.mkdir()
    for source in sorted((SOURCES / "plan").glob("*.py"))[:4]:
        (train / source.name).write_text(source.read_text())
    assert main(TINY + ["--data", str(train), "--steps", "2", "--eval-every", "1", "--eval-holdout", "0.2",
                        "--eval-batches", "2", "--log-dir", str(tmp_path / "logs")]) == 0
    out = capsys.readouterr().out
    assert "evaluating on the last 20% of the text stream of" in out
    lines = [json.loads(line) for line in (tmp_path / "logs" / METRICS_FILE).read_text().splitlines()]
    evals = [line for line in lines if "eval" in line]
    assert [line["step"] for line in evals] == [1, 2]
    for line in evals:
        assert line["eval"]["perplexity"] == pytest.approx(math.exp(line["eval"]["loss"]))
