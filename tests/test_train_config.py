"""``shardkit train --config``: the job file's fields, flags over the file, and a real logged run.

The step's options (gradient accumulation, clipping, the schedule) are checked against one process:
two processes with the batch in two micro-batches give the losses one process gives on the whole batch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

import shardkit.cli.train as train_cli
from shardkit.cli import build_parser, main
from shardkit.models.gpt import GPT_RULES
from shardkit.observe.metrics import METRICS_FILE
from shardkit.plan import Mesh, Plan, UsageError
from shardkit.training.checks import check_job
from shardkit.training.config import TrainConfig
from shardkit.training.fields import FIELDS, JobError, load_job
from shardkit.training.plans import job_plan
from shardkit.training.run import train as sk_train
from shardkit.training.step import lr_factor

DOC = Path(__file__).parents[1] / "docs" / "train.md"
SOURCES = Path(__file__).parents[1] / "src" / "shardkit"


def _doc_job() -> str:
    """The complete job file of docs/train.md, exactly as written there."""
    match = re.search(r"<!-- job\.yaml -->\n```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert match, "docs/train.md lost its complete job file"
    return match.group(1)


def test_the_docs_complete_file_loads_every_field(tmp_path):
    (tmp_path / "job.yaml").write_text(_doc_job())
    job = load_job(tmp_path / "job.yaml")
    every = {dest for dest, _ in FIELDS.values()}
    # eval.holdout: the other way to eval.data; precision.loss_scale: float16's, a comment beside bfloat16
    assert set(job) == every - {"init_from", "momentum", "eval_holdout", "loss_scale"}
    assert job["plan"] == Plan(mesh=Mesh(fsdp=2))
    assert (job["lr"], job["betas"], job["grad_accum"], job["resume"]) == (3e-3, (0.9, 0.95), 2, True)
    assert job["data"] == tmp_path / "data" / "train"      # relative to the file's folder
    assert job["eval_data"] == tmp_path / "data" / "val"


BAD = [
    ("stpes: 10", ["unknown keys ['stpes']", "'steps'"]),
    ("optimizer: {name: adam}", ["optimizer.name", "['adamw', 'sgd']", "'adam'"]),
    ("optimizer: {lr: 3e-3}", ["optimizer.lr", "number > 0", "3.0e-3 or 0.003"]),
    ("optimizer: {lr: 0}", ["optimizer.lr", "number > 0", "int 0"]),
    ("optimizer: {betas: [0.9]}", ["optimizer.betas", "two numbers"]),
    ("optimizer: {betas: [0.9, 1.5]}", ["optimizer.betas", "[0, 1)"]),
    ("optimizer: {lrate: 0.1}", ["section 'optimizer'", "['lrate']", "'lr'"]),
    ("optimizer: [adamw]", ["optimizer must be a mapping", "list"]),
    ("optimizer:", ["section 'optimizer' is empty"]),
    ("steps: '100'", ["steps must be an integer >= 1", "str '100'"]),
    ("steps: true", ["steps must be an integer >= 1", "bool True"]),
    ("seed: -1", ["seed must be an integer >= 0"]),
    ("timeout: .inf", ["timeout must be a number > 0"]),
    ("batch: {global: 8.0}", ["batch.global must be an integer >= 1", "float 8.0"]),
    ("batch: {grad_accum: 0}", ["batch.grad_accum must be an integer >= 1"]),
    ("clip_grad_norm: 'no'", ["clip_grad_norm must be a number > 0"]),
    ("schedule: {warmup_steps: 1.5}", ["schedule.warmup_steps must be an integer >= 0"]),
    ("schedule: {min_lr: -0.1}", ["schedule.min_lr must be a number >= 0"]),
    ("precision: {param_dtype: bf16}", ["precision.param_dtype", "'bfloat16'"]),
    ("checkpoint: {resume: 'false'}", ["checkpoint.resume", "true", "false", "str 'false'"]),
    ("checkpoint: {every: 0}", ["checkpoint.every must be an integer >= 1"]),
    ("logging: {log_dir: ''}", ["logging.log_dir must be a non-empty string"]),
    ("logging: {every: null}", ["logging.every must be an integer >= 1", "null"]),
    ("eval: {batches: two}", ["eval.batches must be an integer >= 1"]),
    ("data: {folder: 3}", ["data.folder must be a non-empty string", "int 3"]),
    ("build: lazy", ["build must be one of ['meta', 'full']"]),
    ("plan: 3", ["plan must be a plan mapping", "'auto'"]),
    ("plan: {mesh: {fsdp: 2}, sequence_parallel: 'false'}", ["plan: plan field 'sequence_parallel'"]),
    ("steps: 1\nsteps: 2", ["key 'steps' is given twice"]),
    ("[1, 2]", ["must be a mapping"]),
]


@pytest.mark.parametrize(("text", "expected"), BAD, ids=[text for text, _ in BAD])
def test_each_bad_field_is_named(tmp_path, capsys, no_processes, text, expected):
    (tmp_path / "job.yaml").write_text(text + "\n")
    assert main(["train", "--config", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    # only a problem of the file's plan is an invalid plan; every other field is the job's
    prefix = "shardkit: invalid plan: " if text.startswith("plan:") else "shardkit train: "
    assert err.startswith(prefix + "job file"), err
    for part in expected:
        assert part in err, err


def test_every_problem_of_a_file_is_listed_at_once(tmp_path):
    (tmp_path / "job.yaml").write_text("steps: 0\noptimizer: {lr: -1, name: rmsprop}\n")
    with pytest.raises(JobError) as caught:
        load_job(tmp_path / "job.yaml")
    assert [p.split(": ", 1)[1].split(" must")[0] for p in caught.value.problems] == \
        ["steps", "optimizer.lr", "optimizer.name"]


INCONSISTENT = [
    ("optimizer: {name: sgd, betas: [0.9, 0.95]}", ["optimizer.betas=[0.9, 0.95]: only AdamW"]),
    ("optimizer: {momentum: 0.9}", ["optimizer.momentum=0.9: only SGD"]),
    ("schedule: {warmup_steps: 5}", ["schedule.warmup_steps=5: --warmup-steps and --min-lr", "give both"]),
    ("steps: 10\nschedule: {warmup_steps: 10, min_lr: 0.0}",
     ["job.yaml: schedule.warmup_steps=10 is not below steps=10", "valid: 0..9"]),
    ("optimizer: {lr: 0.001}\nschedule: {warmup_steps: 1, min_lr: 0.01}",
     ["job.yaml: schedule.min_lr=0.01 is above optimizer.lr=0.001"]),
    ("batch: {global: 8, grad_accum: 3}", ["job.yaml: batch.global=8 does not split into batch.grad_accum=3"]),
    ("batch: {global: 6, grad_accum: 2}", ["job.yaml: batch.global=6 / batch.grad_accum=2 = 3"]),
    ("plan: {mesh: {pp: 2}, pipeline: {microbatches: 4}}\nbatch: {global: 8, grad_accum: 4}",
     ["batch.global=8 / batch.grad_accum=4 = 2 / seq_len", "does not split into 4 equal micro-batches"]),
    ("eval: {every: 5}", ["job.yaml: eval.every=5: --eval-every and --eval-data"]),
    ("data: {folder: text}\neval: {every: 5, data: text}", ["is the training data"]),
    ("plan: {mesh: {fsdp: 2}, fsdp: {param_dtype: float16}}\nprecision: {param_dtype: bfloat16}",
     ["precision.param_dtype is 'bfloat16' but the plan's fsdp.param_dtype is 'float16'"]),
    ("model: gpt-smal", ["job file", "model: unknown model 'gpt-smal'"]),
    ("model: llama-70b", ["model: 'llama-70b' has shapes only"]),
]


@pytest.mark.parametrize(("text", "expected"), INCONSISTENT, ids=[t for t, _ in INCONSISTENT])
def test_fields_that_cannot_run_together_are_refused_before_any_process(tmp_path, capsys, no_processes, text,
                                                                        expected):
    for folder in ("text", "held"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.txt").write_text("some text " * 400)
    defaults = "model: gpt-tiny\n" * ("model:" not in text) + "plan: {mesh: {fsdp: 2}}\n" * ("plan:" not in text)
    (tmp_path / "job.yaml").write_text(defaults + text + "\n")
    assert main(["train", "--config", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    for part in expected:
        assert part in err, err


def test_held_out_data_smaller_than_a_batch_is_refused_before_any_process(tmp_path, capsys, no_processes):
    from shardkit.io.shard_writer import write_shards

    (tmp_path / "held_out.txt").write_text("x" * 100)
    write_shards(tmp_path / "held_out.txt", tmp_path / "held_out", shards=1)   # 3 samples of 32 tokens
    (tmp_path / "job.yaml").write_text("model: gpt-tiny\nplan: {mesh: {fsdp: 2}}\nbatch: {global: 8}\n"
                                       "eval: {data: held_out, every: 5}\n")
    assert main(["train", "--config", str(tmp_path / "job.yaml")]) == 2
    assert "held_out has 3 samples of 32 tokens, fewer than one global batch of 8" in capsys.readouterr().err


def test_flags_given_win_over_the_file_and_defaults_do_not(tmp_path):
    (tmp_path / "plan.yaml").write_text(Plan(mesh=Mesh(dp=2)).to_yaml())
    (tmp_path / "job.yaml").write_text("model: gpt-tiny\nsteps: 100\noptimizer: {lr: 0.01}\nplan: plan.yaml\n"
                                       "batch: {global: 4}\n")

    def merged(*flags: str):
        config = train_cli.build_config(build_parser().parse_args(["train", "--config", str(tmp_path / "job.yaml"),
                                                                   *flags]))
        plan, _ = job_plan(config)
        return config, plan

    config, plan = merged()
    assert (config.steps, config.lr, config.batch_size, config.seed, plan.mesh) == (100, 0.01, 4, 0, Mesh(dp=2))
    config, plan = merged("--steps", "60", "--lr", "0.5", "--mesh", "fsdp=2")   # 60 is --steps' default
    assert (config.steps, config.lr, config.batch_size, plan.mesh) == (60, 0.5, 4, Mesh(fsdp=2))
    assert type(config.steps) is int and type(config.seed) is int
    job = check_job(config, plan, 2)
    assert (job.config.model, job.config.steps, job.config.lr, job.config.batch_size, job.seq_len) == \
        ("gpt-tiny", 60, 0.5, 4, 32)


def test_a_transformers_config_file_is_a_model(tmp_path):
    from shardkit.models.hf import tiny_llama_config

    (tmp_path / "config.json").write_text(tiny_llama_config().to_json_string())
    (tmp_path / "job.yaml").write_text("model: config.json\nplan: {mesh: {fsdp: 2}}\n")
    args = build_parser().parse_args(["train", "--config", str(tmp_path / "job.yaml"), "--mesh", "fsdp=2,tp=2"])
    plan, world_size = train_cli.build_plan(args)
    job = check_job(train_cli.build_config(args), plan, world_size)
    assert job.config.model == str(tmp_path / "config.json") and job.seq_len == tiny_llama_config().max_position_embeddings
    assert plan.rules is not None and "tp" in plan.rules.axes()   # transformers' own tensor-parallel plan


@pytest.mark.parametrize(("config", "message"), [
    ('{"model_type": "nope"}', "model_type 'nope' is not one transformers knows"),
    (None, "cannot read transformers config file"),
    ('{"model_type": "llama", "model_type": "gpt2"}', "key 'model_type' is given twice"),
])
def test_a_bad_transformers_config_file_is_named(tmp_path, capsys, no_processes, config, message):
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    assert main(["train", "--model", str(tmp_path / "config.json"), "--mesh", "fsdp=2"]) == 2
    assert message in capsys.readouterr().err


def test_the_schedule_warms_up_then_decays_to_min_lr():
    factors = [lr_factor(s, 10, 4, 0.1) for s in range(10)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and factors[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(factors[4:], factors[5:], strict=False))


def _text_folders(tmp_path: Path) -> tuple[Path, Path]:
    train, held_out = tmp_path / "train", tmp_path / "held_out"
    for folder, package in ((train, "plan"), (held_out, "io")):
        folder.mkdir()
        for source in sorted((SOURCES / package).glob("*.py"))[:4]:
            (folder / source.name).write_text(source.read_text())
    return train, held_out


def _losses(world, plan: Plan, job: TrainConfig) -> list[float]:
    return sk_train(replace(job, plan=plan), world=world).losses


def test_accumulation_clipping_and_schedule_equal_one_process(tmp_path, world):
    train, _ = _text_folders(tmp_path)
    job = TrainConfig("gpt-tiny", data=train, steps=4, batch_size=4, seq_len=16, lr=3e-3, seed=0, warmup_steps=1,
                      min_lr=3e-4, weight_decay=0.1, clip_grad_norm=0.5)
    one = _losses(world(1), Plan(mesh=Mesh(fsdp=1)), job)
    two = _losses(world(2), Plan(mesh=Mesh(fsdp=2)), replace(job, grad_accum=2))
    unclipped = _losses(world(1), Plan(mesh=Mesh(fsdp=1)), replace(job, clip_grad_norm=None))
    assert two == pytest.approx(one, rel=2e-5, abs=2e-5)
    assert abs(unclipped[-1] - one[-1]) > 1e-3   # the clipping changed the steps
    tp = _losses(world(2), Plan(mesh=Mesh(tp=2), rules=GPT_RULES), job)   # plain and DTensor gradients mixed
    assert tp == pytest.approx(one, rel=2e-5, abs=2e-5)
    # SGD without clipping sees the gradients' scale (AdamW and clipping hide it)
    sgd_job = replace(job, optimizer="sgd", momentum=0.9, weight_decay=None, clip_grad_norm=None, lr=0.5)
    dp = _losses(world(2), Plan(mesh=Mesh(dp=2)), replace(sgd_job, grad_accum=2))
    sgd = _losses(world(1), Plan(mesh=Mesh(fsdp=1)), sgd_job)
    assert dp == pytest.approx(sgd, rel=2e-5, abs=2e-5)


def test_a_logged_run_writes_tensorboard_and_jsonl_with_eval(tmp_path, lend_world):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, held_out = _text_folders(tmp_path)
    (tmp_path / "job.yaml").write_text(
        "model: gpt-tiny\nsteps: 4\nplan: {mesh: {fsdp: 2}}\nclip_grad_norm: 1.0\n"
        "data: {folder: train, seq_len: 16}\nbatch: {global: 4}\n"
        "optimizer: {name: adamw, lr: 0.01}\nschedule: {warmup_steps: 2, min_lr: 0.001}\n"
        "logging: {log_dir: logs}\neval: {data: held_out, every: 2, batches: 2}\n")
    assert main(["train", "--config", str(tmp_path / "job.yaml")]) == 0

    lines = [json.loads(line) for line in (tmp_path / "logs" / METRICS_FILE).read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    evals = [line for line in lines if "eval" in line]
    assert [line["step"] for line in steps] == [1, 2, 3, 4] and [line["step"] for line in evals] == [2, 4]
    for line in steps:
        assert set(line) == {"step", "loss", "lr", "grad_norm", "tokens_per_s", "memory_bytes", "comm_bytes"}
        assert set(line["memory_bytes"]) == set(line["comm_bytes"]) == {"rank0", "rank1"}
        assert line["tokens_per_s"] > 0 and line["grad_norm"] > 0 and line["comm_bytes"]["rank1"] > 0
    assert [line["lr"] for line in steps] == pytest.approx([0.01 * lr_factor(s, 4, 2, 0.1) for s in range(4)])
    for line in evals:
        assert line["eval"]["perplexity"] == pytest.approx(math.exp(line["eval"]["loss"]))

    board = EventAccumulator(str(tmp_path / "logs"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "memory_bytes/rank0", "memory_bytes/rank1",
            "comm_bytes/rank0", "eval/loss", "eval/perplexity"} <= tags
    assert [e.value for e in board.Scalars("loss")] == pytest.approx([line["loss"] for line in steps])
    assert [e.step for e in board.Scalars("eval/perplexity")] == [2, 4]


def test_a_pipeline_accumulates_clips_evaluates_and_logs_the_norm_of_every_stage(tmp_path, lend_world):
    """pp=2 with accumulation, clipping and evaluation through shardkit train: the logged norm is the whole
    model's (every stage's gradients), clipped to 0.5 from above it; the held-out loss is fsdp=2's."""
    _text_folders(tmp_path)
    (tmp_path / "job.yaml").write_text(
        "model: gpt-tiny\nsteps: 2\nplan: {mesh: {pp: 2}, pipeline: {microbatches: 2}}\nclip_grad_norm: 0.5\n"
        "data: {folder: train, seq_len: 16}\nbatch: {global: 8, grad_accum: 2}\nlogging: {log_dir: logs}\n"
        "eval: {data: held_out, every: 1, batches: 2}\n")
    assert main(["train", "--config", str(tmp_path / "job.yaml")]) == 0
    lines = [json.loads(line) for line in (tmp_path / "logs" / METRICS_FILE).read_text().splitlines()]
    steps, evals = [line for line in lines if "loss" in line], [line["eval"] for line in lines if "eval" in line]
    assert [line["step"] for line in steps] == [1, 2] and len(evals) == 2
    # the same weights (built on meta, seeded by module name), data and updates under fsdp=2: the first step's
    # norm before clipping is the same number, so the pipeline's counts every stage; and the same eval losses
    (tmp_path / "job.yaml").write_text((tmp_path / "job.yaml").read_text()
                                       .replace("{mesh: {pp: 2}, pipeline: {microbatches: 2}}", "{mesh: {fsdp: 2}}")
                                       .replace("log_dir: logs", "log_dir: logs-fsdp"))
    assert main(["train", "--config", str(tmp_path / "job.yaml")]) == 0
    whole = [json.loads(line) for line in (tmp_path / "logs-fsdp" / METRICS_FILE).read_text().splitlines()]
    assert steps[0]["grad_norm"] == pytest.approx(whole[0]["grad_norm"], rel=1e-4) and whole[0]["grad_norm"] > 0.5
    assert [e["loss"] for e in evals] == pytest.approx([line["eval"]["loss"] for line in whole if "eval" in line],
                                                       rel=1e-4)


def test_a_value_is_named_by_its_field_or_its_flag_with_the_prefix_of_its_kind(tmp_path, capsys, no_processes):
    job = tmp_path / "job.yaml"
    job.write_text("model: gpt-tiny\nplan: {mesh: {fsdp: 2}}\nschedule: {warmup_steps: 20, min_lr: 0.0}\n")
    assert main(["train", "--config", str(job), "--steps", "6"]) == 2
    assert capsys.readouterr().err == (f"shardkit train: {job}: schedule.warmup_steps=20 is not below --steps 6, so the "
                                       f"decay would never start; valid: 0..5\n")
    assert main(["train", "--model", "gpt-tiny", "--mesh", "fsdp=2", "--warmup-steps", "20", "--min-lr", "0",
                 "--steps", "6"]) == 2
    assert capsys.readouterr().err.startswith("shardkit train: --warmup-steps 20 is not below --steps 6")
    job.write_text("steps: 0\noptimizer: {lr: 0}\n")   # not the plan's fields: not an invalid plan
    assert main(["train", "--config", str(job)]) == 2
    assert capsys.readouterr().err.startswith(f"shardkit train: 2 problems:\n  - job file {str(job)!r}: steps must")
    (tmp_path / "plan.yaml").write_text("mesh: {fsdp: 2}\nrulez: []\n")   # a plan file the job file names
    job.write_text("model: gpt-tiny\nplan: plan.yaml\n")
    assert main(["train", "--config", str(job)]) == 2
    assert capsys.readouterr().err.startswith(f"shardkit: invalid plan: plan file {str(tmp_path / 'plan.yaml')!r}: "
                                              f"plan has unknown keys ['rulez']")


def test_the_first_logged_step_counts_only_its_own_communication(tmp_path, lend_world):
    """DDP broadcasts every parameter once when it sets up, which torch defers to the first forward: not step 1's."""
    train, _ = _text_folders(tmp_path)
    assert main(["train", "--model", "gpt-tiny", "--mesh", "dp=2", "--steps", "3", "--seq-len", "16", "--batch-size",
                 "4", "--data", str(train), "--log-dir", str(tmp_path / "logs")]) == 0
    lines = [json.loads(line) for line in (tmp_path / "logs" / METRICS_FILE).read_text().splitlines()]
    sent = [line["comm_bytes"]["rank0"] for line in lines]
    # the gradients' all-reduce each step; DDP's second step also re-sends its bucket layout (a few hundred bytes)
    assert sent[0] == sent[2] and 0 <= sent[1] - sent[0] < 0.01 * sent[0], sent


def test_the_docs_python_example_trains_with_sk_train(lend_world, monkeypatch, capsys):
    """docs/train.md's ``sk.train`` example, as written (on the shared world): every rank trains every step,
    and its losses are those ``shardkit train`` reports for the same job."""
    match = re.search(r"<!-- sk\.train -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, "docs/train.md lost its sk.train example"
    scope: dict = {}
    exec(compile(match.group(1), "docs/train.md", "exec"), scope)
    result = scope["result"]
    assert len(result.stats) == 2 and len(result.losses) == 3 and result.tokens == 3 * 4 * 16
    assert capsys.readouterr().out.startswith("shardkit train: gpt-tiny on Mesh(fsdp=2) (2 processes), 3 steps")
    seen = []  # the command finds print_summary where it lives when it runs
    monkeypatch.setattr("shardkit.observe.report.print_summary", lambda stats, *a, **k: seen.append(stats))
    assert main(["train", "--model", "gpt-tiny", "--mesh", "fsdp=2", "--steps", "3", "--batch-size", "4",
                 "--seq-len", "16", "--data-mb", "0.05", "--lr", "0.01"]) == 0
    assert seen[0][0].losses == result.losses



def test_a_job_file_read_from_python_names_fields_by_their_python_names(tmp_path):
    """TrainConfig.from_file: the file's fields, overridden by keyword; errors name each value where it was
    written: the file's field, else the TrainConfig field (no flags in Python)."""
    (tmp_path / "job.yaml").write_text("model: gpt-tiny\nsteps: 100\nplan: {mesh: {fsdp: 2}}\n"
                                       "schedule: {warmup_steps: 20, min_lr: 0.0}\n")
    config = TrainConfig.from_file(tmp_path / "job.yaml", steps=6, seq_len=16, batch_size=4)
    assert (config.model, config.steps, config.plan.mesh, config.given("lr")) == ("gpt-tiny", 6, Mesh(fsdp=2), False)
    with pytest.raises(JobError) as caught:
        check_job(config, *job_plan(config))
    assert str(caught.value) == (f"{tmp_path / 'job.yaml'}: schedule.warmup_steps=20 is not below steps=6, so the "
                                 f"decay would never start; valid: 0..5")
    with pytest.raises(UsageError, match="TrainConfig has no field stpes; valid: model, plan"):
        TrainConfig.from_file(tmp_path / "job.yaml", stpes=6)
