"""``shardkit train``: values that could not run as written are refused before any process starts (exit 2,
one line naming the flag or field and what would be valid), never coerced or dropped; Ctrl-C is one line too."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardkit.cli.train as train_cli
from shardkit.cli import build_parser, main
from shardkit.cli.options import SEED_MAX, seed
from shardkit.io.batch_stream import BatchStream
from shardkit.io.data import TextShards
from shardkit.io.shard_writer import write_shards
from shardkit.io.sharded_data import ShardedDataset
from shardkit.models.gpt import GPT_RULES
from shardkit.plan import LayoutMap, Mesh
from shardkit.training.checks import check_job
from shardkit.training.fields import load_job
from shardkit.training.plans import job_plan

TINY = ["train", "--model", "gpt-tiny", "--mesh", "fsdp=2", "--seq-len", "16", "--batch-size", "4"]


def _text(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "a.txt").write_text("".join(f"{i:04d}\n" for i in range(400)))
    return folder


def _sharded(tmp_path: Path, shards: int = 1) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "corpus.txt").write_text("".join(f"{i:04d}\n" for i in range(400)))
    write_shards(tmp_path / "corpus.txt", tmp_path / "sharded", shards=shards)
    return tmp_path / "sharded"


def _args(*argv: str):
    return build_parser().parse_args(["train", *argv])


def _checked(args):
    """The job ``shardkit train`` would launch for ``args``, checked."""
    config = train_cli.build_config(args)
    return check_job(config, *job_plan(config))


# 1. seeds: 0 .. 2**64 - 1, what torch.Generator and the data take; beyond is refused by the flag and the field

def test_a_seed_beyond_64_bits_is_refused_by_the_flag_and_the_field(tmp_path, capsys, no_processes):
    with pytest.raises(SystemExit) as caught:
        main(TINY + ["--seed", "99999999999999999999999"])
    assert caught.value.code == 2
    assert "argument --seed: must be a 64-bit seed (at most 2**64 - 1 = 18446744073709551615), an integer >= 0, got " \
        "'99999999999999999999999'" in capsys.readouterr().err
    (tmp_path / "job.yaml").write_text("seed: 99999999999999999999999\n")
    assert main(["train", "--config", str(tmp_path / "job.yaml")]) == 2
    assert "seed must be an integer >= 0 and <= 18446744073709551615 (2**64 - 1" in capsys.readouterr().err
    # the largest seed is accepted and works where the workers use it: text windows and a sharded epoch order
    assert seed(str(SEED_MAX)) == SEED_MAX and _args("--seed", str(SEED_MAX)).seed == SEED_MAX
    (tmp_path / "job.yaml").write_text(f"seed: {SEED_MAX}\n")
    assert load_job(tmp_path / "job.yaml") == {"seed": SEED_MAX}
    next(BatchStream.of(TextShards(_text(tmp_path / "text"), max_bytes=4096), 8, SEED_MAX).batches(2, 1))
    next(BatchStream.of(_sharded(tmp_path), 8, SEED_MAX).batches(2, 1))
    for text in ("-1", str(SEED_MAX + 1), "1.0"):
        with pytest.raises(SystemExit):
            main(TINY + ["--seed", text])


# 2. eval.batches without eval.every, logging.every without log_dir: refused when given, not as defaults

@pytest.mark.parametrize(("given", "expected"), [
    (["--eval-batches", "3"], "--eval-batches 3 applies only with --eval-every (eval.every)"),
    (["--eval-batches", "1"], "--eval-batches 1 applies only with --eval-every"),  # the default's value
    (["--log-every", "5"], "--log-every 5 applies only with --log-dir (logging.log_dir)"),
])
def test_a_value_that_would_be_ignored_is_refused(tmp_path, capsys, no_processes, given, expected):
    assert main(TINY + given) == 2
    assert capsys.readouterr().err.startswith(f"shardkit train: {expected}")
    file = "eval: {batches: 3}" if "--eval-batches" in given else "logging: {every: 5}"
    (tmp_path / "job.yaml").write_text(f"model: gpt-tiny\nplan: {{mesh: {{fsdp: 2}}}}\n{file}\n")
    assert main(["train", "--config", str(tmp_path / "job.yaml"), "--seq-len", "16", "--batch-size", "4"]) == 2
    field = "eval.batches=3" if "--eval-batches" in given else "logging.every=5"
    assert capsys.readouterr().err.startswith(f"shardkit train: {tmp_path / 'job.yaml'}: {field} applies only with")


def test_the_defaults_of_eval_batches_and_log_every_are_not_refused(tmp_path):
    args = _args("--model", "gpt-tiny", "--mesh", "fsdp=2", "--seq-len", "16", "--batch-size", "4",
                 "--data", str(_text(tmp_path / "text")))
    job = _checked(args)
    assert (job.config.eval_batches, job.config.log_every, job.config.log_dir, job.eval_data) == (1, 1, None, None)


# 3. plan options as flags with the job file's plan: refused; --mesh/--plan replace the file's whole plan

def test_a_plan_option_flag_with_the_files_plan_is_refused(tmp_path, capsys, no_processes):
    (tmp_path / "job.yaml").write_text("model: gpt-tiny\nplan: {mesh: {dp: 2}}\n")
    job = ["train", "--config", str(tmp_path / "job.yaml")]
    assert main(job + ["--zero", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardkit train: --zero 2: an option of the plan, and the job "
                                                   "file gives the plan"), err
    assert "plan: {..., zero: 2}" in err and "--mesh AXES" in err
    assert main(job + ["--schedule", "gpipe", "--microbatches", "4", "--recompute", "full"]) == 2
    assert "plan: {..., recompute: full, pipeline: {schedule: gpipe, microbatches: 4}}" in capsys.readouterr().err
    (tmp_path / "auto.yaml").write_text("model: gpt-tiny\nplan: auto\n")
    assert main(["train", "--config", str(tmp_path / "auto.yaml"), "--zero", "1"]) == 2
    assert "--zero 1: the job file's plan is 'auto'" in capsys.readouterr().err


def test_mesh_or_plan_flags_replace_the_files_plan_and_options_go_in_the_file(tmp_path):
    (tmp_path / "job.yaml").write_text("model: gpt-tiny\nplan: {mesh: {dp: 2}, zero: 1}\n")
    plan, world_size = train_cli.build_plan(_args("--config", str(tmp_path / "job.yaml")))
    assert (plan.mesh, plan.zero, world_size) == (Mesh(dp=2), 1, 2)
    plan, world_size = train_cli.build_plan(_args("--config", str(tmp_path / "job.yaml"), "--mesh", "fsdp=2",
                                                  "--zero", "2"))
    assert (plan.mesh, plan.zero, world_size) == (Mesh(fsdp=2), 2, 2)


# 4. evaluation batches beyond a sharded held-out set

def test_eval_batches_beyond_sharded_held_out_data_are_refused(tmp_path, capsys, no_processes):
    train, held = _sharded(tmp_path / "train", shards=4), _sharded(tmp_path / "held")
    samples = len(ShardedDataset(held, seq_len=16))
    fit = samples // 4
    assert main(TINY + ["--data", str(train), "--eval-data", str(held), "--eval-every", "2",
                        "--eval-batches", str(fit + 1)]) == 2
    assert f"--eval-batches {fit + 1} x --batch-size 4 = {4 * (fit + 1)} samples, but --eval-data {held} has " \
        f"{samples} samples of 16 tokens, so evaluation would repeat them; valid: --eval-batches 1..{fit}" \
        in capsys.readouterr().err
    last = len(ShardedDataset(train, seq_len=16, shards=range(3, 4)))
    assert main(TINY + ["--data", str(train), "--eval-holdout", "0.25", "--eval-every", "2",
                        "--eval-batches", "100000"]) == 2
    assert f"--eval-holdout 0.25 (the last 1 of 4 shards) has {last} samples of 16 tokens, so evaluation would " \
        f"repeat them; valid: --eval-batches 1..{last // 4}" in capsys.readouterr().err
    args = _args(*TINY[1:], "--data", str(train), "--eval-data", str(held), "--eval-every", "2",
                 "--eval-batches", str(fit))
    assert _checked(args).config.eval_batches == fit   # as many as fit: runs
    text = _text(tmp_path / "text")   # random windows: any number of batches
    args = _args(*TINY[1:], "--data", str(train), "--eval-data", str(text), "--eval-every", "2",
                 "--eval-batches", "100000")
    assert _checked(args).config.eval_batches == 100000


# 5. a held-out folder inside (or containing) the training folder

def test_held_out_data_inside_or_around_the_training_data_is_refused(tmp_path, capsys, no_processes):
    train = _text(tmp_path / "data" / "train")
    _text(tmp_path / "data" / "val")
    for data, held, how in ((train, tmp_path / "data", "contains"), (tmp_path / "data", train, "is inside")):
        assert main(TINY + ["--data", str(data), "--eval-data", str(held), "--eval-every", "2"]) == 2
        assert f"--eval-data {held} {how} the training data --data {data}" in capsys.readouterr().err
    args = _args(*TINY[1:], "--data", str(train), "--eval-data", str(tmp_path / "data" / "val"), "--eval-every", "2")
    assert _checked(args).eval_data is not None   # siblings are fine


# 6. a job file's plan mapping without rules gets the model's rules, as --mesh does

def test_a_file_plan_without_rules_gets_the_models_rules_as_the_mesh_flag_does(tmp_path):
    (tmp_path / "job.yaml").write_text("model: gpt-tiny\nplan: {mesh: {tp: 2}}\n")
    args = _args("--config", str(tmp_path / "job.yaml"), "--seq-len", "16", "--batch-size", "4",
                 "--data", str(_text(tmp_path / "text")))
    plan, world_size = train_cli.build_plan(args)
    by_flag, _ = train_cli.build_plan(_args("--model", "gpt-tiny", "--mesh", "tp=2"))
    assert plan.rules == by_flag.rules == GPT_RULES
    assert check_job(train_cli.build_config(args), plan, world_size).config.model == "gpt-tiny"   # validates: every parameter has a rule
    (tmp_path / "job.yaml").write_text("model: gpt-tiny\nplan: {mesh: {tp: 2}, rules: [['.*', null]]}\n")
    plan, _ = train_cli.build_plan(_args("--config", str(tmp_path / "job.yaml")))
    assert plan.rules == LayoutMap([(".*", None)])   # rules given are kept
    (tmp_path / "job.yaml").write_text("model: gpt-tiny\nplan: {mesh: {fsdp: 2}}\n")
    assert train_cli.build_plan(_args("--config", str(tmp_path / "job.yaml")))[0].rules is None   # plain FSDP


# 7. Ctrl-C: one line and exit status 130

def test_an_interrupt_is_one_line_and_130(monkeypatch, capsys, no_processes):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "build_config", interrupted)
    assert main(TINY) == 130
    assert capsys.readouterr().err == "shardkit train: interrupted\n"


# --plan auto: the planner's accumulation steps unless --grad-accum (or batch.grad_accum) is given

def test_plan_auto_takes_the_planners_accumulation_unless_it_is_given(monkeypatch):
    from types import SimpleNamespace

    import shardkit.cli.plan as plan_cli
    import shardkit.planner.autoshard as autoshard_module
    from shardkit.plan import Plan, PlanError

    best = SimpleNamespace(plan=Plan(mesh=Mesh(fsdp=2)), grad_accum=2, reason="the fastest")
    monkeypatch.setattr(autoshard_module, "autoshard", lambda *args, **kwargs: [best])
    monkeypatch.setattr(plan_cli, "local_hardware", lambda world_size: None)
    monkeypatch.setattr(plan_cli, "candidates_text", lambda *args: "")
    config = train_cli.build_config(_args("--plan", "auto", "--model", "gpt-tiny", "--world-size", "2"))
    assert job_plan(config) == (best.plan, 2) and config.grad_accum == 2   # the default 1 is not given
    with pytest.raises(PlanError, match="no plan among the best 1 runs with --grad-accum 1"):
        train_cli.build_plan(_args("--plan", "auto", "--model", "gpt-tiny", "--world-size", "2", "--grad-accum", "1"))


# 8. an every-N-steps value longer than the run would never act: refused by the flag and the field

@pytest.mark.parametrize(("flags", "field", "never"), [
    (["--eval-every", "10", "--eval-holdout", "0.1"], "eval: {every: 10, holdout: 0.1}", "evaluate"),
    (["--save-every", "10", "--save", "{tmp}/ck"], "checkpoint: {every: 10, dir: ck}", "save before the last step"),
    (["--log-every", "10", "--log-dir", "{tmp}/logs"], "logging: {every: 10, log_dir: logs}", "log before the last step"),
], ids=["eval", "save", "log"])
def test_an_interval_longer_than_the_run_is_refused(tmp_path, capsys, no_processes, flags, field, never):
    _text(tmp_path / "text")
    flag = f"{flags[0]} 10"
    refusal = (f"this run trains steps 1..2 (--steps 2), and none is a multiple of 10, so it would never {never}; "
               f"valid: 1..2 (at most --steps)")
    assert main(TINY + ["--steps", "2", "--data", str(tmp_path / "text"), *(f.format(tmp=tmp_path) for f in flags)]) == 2
    assert capsys.readouterr().err == f"shardkit train: {flag}: {refusal}\n"
    job = tmp_path / "job.yaml"
    job.write_text(f"model: gpt-tiny\nplan: {{mesh: {{fsdp: 2}}}}\nsteps: 2\ndata: {{folder: text, seq_len: 16}}\n"
                   f"batch: {{global: 4}}\n{field}\n")
    name = field.split(":")[0] + ".every=10"
    assert main(["train", "--config", str(job)]) == 2
    assert capsys.readouterr().err == f"shardkit train: {job}: {name}: {refusal.replace('--steps 2', 'steps=2')}\n"
    args = _args("--config", str(job), "--steps", "10")  # as long as the run: it acts at its last step
    assert _checked(args).config.steps == 10
