"""``shardkit train`` with checkpoints, sharded data and HuggingFace weights.

A run stopped and resumed trains the same numbers as one that never stopped (bitwise under the
same plan, within verify's tolerance under another), from text or from a sharded data folder
(across epochs); ``--init-from`` starts from a HuggingFace folder's exact weights; ``shardkit
checkpoint convert`` writes what ``from_pretrained`` reads; and every way of getting these
flags wrong is refused before any process starts.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import shardkit as sk
import shardkit.observe.report as report
from shardkit.cli import main
from shardkit.io.batch_stream import BatchStream
from shardkit.models.registry import model_entry
from shardkit.runtime.verify import TOLERANCES

warnings.filterwarnings("ignore", message=".*token_id.*")
SMALL = ["--batch-size", "4", "--seq-len", "32", "--data-mb", "0.05"]


@pytest.fixture
def train(lend_world, monkeypatch, capfd):
    """``train(*argv)`` runs ``shardkit train`` on the shared worlds; returns (exit code, rank 0's
    losses, stdout)."""
    seen = []
    original = report.print_summary
    monkeypatch.setattr(report, "print_summary", lambda stats, *a, **k: (seen.append(stats), original(stats, *a, **k)))

    def run(*argv: str) -> tuple[int, list[float], str]:
        seen.clear()
        capfd.readouterr()
        code = main(["train", *argv])
        out = capfd.readouterr().out  # this process's lines (workers started earlier print elsewhere)
        return code, (seen[0][0].losses if seen else []), out

    return run


def _manifest(folder) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_a_resumed_run_trains_the_same_numbers_under_the_same_and_another_plan(train, tmp_path):
    base = ["--model", "gpt-tiny", *SMALL]
    code, whole, _ = train(*base, "--mesh", "fsdp=2", "--steps", "4")
    assert code == 0 and len(whole) == 4
    code, first, _ = train(*base, "--mesh", "fsdp=2", "--steps", "2", "--save", str(tmp_path / "ck"))
    assert code == 0 and first == whole[:2]
    code, rest, out = train(*base, "--mesh", "fsdp=2", "--steps", "4", "--resume", str(tmp_path / "ck"))
    assert code == 0
    assert rest == whole[2:]  # bitwise: model, AdamW state, RNG and data position all restored
    # the start line and the summary count the steps this run trained: 2 of 4 x 32 tokens, not 4
    assert "2 steps (3-4 of 4) of 4 x 32 tokens" in out and "per device: gpt-tiny, Mesh(fsdp=2), 2 steps (3-4 of 4)" in out
    assert "\n256 tokens in " in out and "(2 steps (3-4 of 4), including process start)" in out
    code, other, _ = train(*base, "--mesh", "tp=2", "--steps", "4", "--resume", str(tmp_path / "ck"))
    assert code == 0 and len(other) == 2
    assert all(abs(a - b) <= TOLERANCES["loss"] for a, b in zip(other, whole[2:])), (other, whole[2:])


def test_sharded_data_resumes_across_epochs_and_plans(train, tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 12)  # 1140 bytes: 35 samples of 32, 8 batches of 4 per epoch
    sk.write_shards(text, tmp_path / "data", shards=3)
    base = ["--model", "gpt-tiny", "--data", str(tmp_path / "data"), "--batch-size", "4", "--seq-len", "32"]
    code, whole, _ = train(*base, "--mesh", "dp=2", "--steps", "12")
    assert code == 0 and len(whole) == 12
    save = ["--save", str(tmp_path / "ck"), "--save-every", "3", "--keep-last", "2"]
    code, first, _ = train(*base, "--mesh", "dp=2", "--steps", "6", *save)
    assert code == 0 and first == whole[:6]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000003", "step-00000006"]
    assert _manifest(tmp_path / "ck" / "step-00000006")["extra"]["data"]["position"] == 24
    code, rest, _ = train(*base, "--mesh", "fsdp=2", "--steps", "12", *save, "--resume")
    assert code == 0 and len(rest) == 6
    assert all(abs(a - b) <= TOLERANCES["loss"] for a, b in zip(rest, whole[6:])), (rest, whole[6:])
    data = _manifest(tmp_path / "ck" / "step-00000012")["extra"]["data"]
    assert (data["epoch"], data["position"]) == (1, 16)  # 8 batches in epoch 0, then 4 of epoch 1
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000009", "step-00000012"]


def _perturbed_gpt2():
    model = model_entry("gpt2-tiny").build()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.01 * torch.randn(p.shape, generator=generator))
    return model


def test_init_from_a_hf_folder_starts_from_its_weights_and_converts_back(train, tmp_path):
    source = _perturbed_gpt2()
    source.save_pretrained(tmp_path / "hf")
    entry = model_entry("gpt2-tiny")
    batch = next(BatchStream.of(None, 32, 0, max_bytes=int(0.05 * 2**20)).batches(4, 1))
    with torch.no_grad():
        expected = entry.loss_fn(source(batch.inputs), batch.targets).item()
    code, losses, _ = train("--model", "gpt2-tiny", *SMALL, "--mesh", "fsdp=2", "--steps", "2",
                            "--init-from", str(tmp_path / "hf"), "--save", str(tmp_path / "ck"))
    assert code == 0 and abs(losses[0] - expected) <= 1e-5, (losses[0], expected)

    assert main(["checkpoint", "convert", str(tmp_path / "ck"), "--to", "hf", str(tmp_path / "out"),
                 "--max-shard-size", "100KB"]) == 0
    trained = model_entry("gpt2-tiny").build()
    sk.load(tmp_path / "ck", trained)  # the checkpoint read in this one process
    from transformers import GPT2LMHeadModel

    back = GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert all(torch.equal(p, dict(back.named_parameters())[n]) for n, p in trained.named_parameters())
    assert not torch.equal(trained.transformer.wte.weight, source.transformer.wte.weight)  # it trained
    assert main(["checkpoint", "convert", str(tmp_path / "ck"), "--to", "hf", str(tmp_path / "out")]) == 2


def test_init_from_a_folder_alone_builds_its_model_and_starts_from_its_weights(train, saved):
    """No --model: the folder's config.json is the model (before: gpt-small, refused for 71 missing tensors)."""
    batch = next(BatchStream.of(None, 32, 0, max_bytes=int(0.05 * 2**20)).batches(4, 1))
    with torch.no_grad():
        expected = model_entry("gpt2-tiny").loss_fn(_perturbed_gpt2()(batch.inputs), batch.targets).item()
    code, losses, out = train(*SMALL, "--mesh", "fsdp=2", "--steps", "1", "--init-from", str(saved / "hf"))
    assert code == 0 and abs(losses[0] - expected) <= 1e-5, (losses[0], expected, out)
    assert f"shardkit train: {saved / 'hf'} on Mesh(fsdp=2)" in out


def test_a_model_folder_is_built_from_its_config(saved, tmp_path, capsys, no_processes):
    """--model DIR (and a job file's model: or init_from: alone) builds the model of the folder's config.json;
    a folder without one is refused naming it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import shardkit.cli.train as train_cli
    from shardkit.cli import build_parser
    from shardkit.training.checks import check_job
    from shardkit.training.model import model_from_flag

    folder = saved / "hf"
    config = GPT2Config.from_pretrained(folder)
    with torch.device("meta"):
        reference = {n: p.shape for n, p in GPT2LMHeadModel(config).named_parameters()}
    built = model_from_flag(str(folder)).on_meta()
    assert {n: p.shape for n, p in built.named_parameters()} == reference
    (tmp_path / "job.yaml").write_text(f"init_from: {folder}\nplan: {{mesh: {{fsdp: 2}}}}\n")
    for argv in (["--model", str(folder), "--mesh", "fsdp=2"], ["--config", str(tmp_path / "job.yaml")]):
        args = build_parser().parse_args(["train", *argv])
        job = check_job(train_cli.build_config(args), *train_cli.build_plan(args))
        assert job.config.model == str(folder) and job.seq_len == config.n_positions
    (tmp_path / "empty").mkdir()
    assert main(["train", "--model", str(tmp_path / "empty"), "--mesh", "fsdp=2"]) == 2
    assert f"folder '{tmp_path / 'empty'}' has no config.json to build the model from" in capsys.readouterr().err
    assert main(["train", "--init-from", str(tmp_path / "empty"), "--mesh", "fsdp=2"]) == 2
    assert "has no config.json to build the model from" in capsys.readouterr().err


def _uninitialised_model():
    from torch import nn

    class Gain(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(64))

        def forward(self, x):
            return x * self.gain

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.gain, self.head = nn.Embedding(256, 64), Gain(), nn.Linear(64, 256)

        def forward(self, x):
            return self.head(self.gain(self.embed(x)))

    return Net()


REFUSED = [
    (["--save-every", "2"], "--save-every 2: needs --save DIR"),
    (["--keep-last", "2"], "--keep-last 2: needs --save DIR"),
    (["--resume"], "--resume without a folder resumes from --save DIR"),
    (["--save", "{ck}"], "already holds checkpoints (the latest: step-00000002): add --resume"),
    (["--resume", "{ck}", "--steps", "2"], "is at step 2, and --steps 2 counts from step 0: nothing left to train"),
    (["--resume", "{ck}", "--seq-len", "16"], "the checkpoint's data position is for text data"),
    (["--resume", "{ck}", "--model", "llama-tiny"], "holds another model's parameters"),
    # an interval is checked against the steps the resumed run trains: --save-every 2 saves at step 2 from step 0,
    # never from step 2 on
    (["--resume", "{ck}", "--save", "{ck}", "--save-every", "2", "--steps", "3"],
     "--save-every 2: this run trains step 3 (--steps 3, resuming at step 2), and none is a multiple of 2, so it "
     "would never save before the last step; valid: 1, 3"),
    (["--init-from", "{tmp}"], "no model.safetensors or model.safetensors.index.json"),
    (["--init-from", "{hf}", "--model", "llama-tiny"], "do not fit this model"),
    (["--model", "test_train_checkpoints:_uninitialised_model", "--seq-len", "8"],
     "'gain.gain'), so they cannot be made on the meta device; use --build full"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint folder holding gpt-tiny's step 2 (written in this process, without a world),
    and a GPT-2 HuggingFace folder."""
    from shardkit.planner.meta import meta_model
    from shardkit.runtime.materialize import materialize

    root = tmp_path_factory.mktemp("saved")
    model = materialize(meta_model(model_entry("gpt-tiny").build))
    optimizer = torch.optim.AdamW(model.parameters())
    stream = BatchStream.of(None, 32, 0, max_bytes=int(0.05 * 2**20))
    position = next(stream.batches(4, 2, {"kind": "text", "data": stream.fingerprint, "batches": 1})).position
    sk.save(root / "ck", model, optimizer, step=2, extra={"data": position})
    _perturbed_gpt2().save_pretrained(root / "hf")
    return root


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_checkpoint_and_weights_flags_are_refused_before_any_process(saved, tmp_path, capsys, no_processes,
                                                                      argv, message):
    values = {"ck": saved / "ck", "hf": saved / "hf", "tmp": tmp_path}
    args = ["train", "--model", "gpt-tiny", "--mesh", "fsdp=2", "--steps", "4", *SMALL]
    args += [a.format(**values) for a in argv]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_resume_with_nothing_saved_yet_says_it_starts_at_step_0(train, tmp_path):
    code, losses, out = train("--model", "gpt-tiny", *SMALL, "--mesh", "dp=2", "--steps", "1",
                              "--save", str(tmp_path / "ck"), "--resume")
    assert code == 0 and len(losses) == 1
    assert "no complete checkpoint in" in out and "starting at step 0" in out
    assert (tmp_path / "ck" / "step-00000001" / "manifest.json").is_file()
