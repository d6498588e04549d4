"""``shardkit train``: errors before launch, a short real run, and the measurements it reports."""

from __future__ import annotations

import json
import re

import pytest
import torch

import shardkit.cli.train as train_cli
import shardkit.observe.memory as memory
from shardkit.cli import build_parser, main
from shardkit.models.gpt import GPT_RULES
from shardkit.observe.memory import PeakMemory, state_bytes
from shardkit.observe.report import loss_trend
from shardkit.plan import LayoutMap, Mesh, Plan
from shardkit.training.checks import check_job
from shardkit.training.fields import JobError


def _files(tmp_path):
    (tmp_path / "not_a_list.yaml").write_text("pattern: layout\n")
    (tmp_path / "bad.yaml").write_text("[unclosed\n")
    (tmp_path / "unknown_axis.json").write_text('[["lm_head\\\\.weight", ["mp", null]], [".*", null]]')
    (tmp_path / "plan.yaml").write_text(Plan(mesh=Mesh(fsdp=2)).to_yaml())
    (tmp_path / "empty").mkdir()
    return tmp_path


INVALID = [
    (["--mesh", "fsdp=2,tp=3"], ["not divisible by tp=3", "lm_head.weight"]),
    (["--mesh", "fsdp=two"], ["'fsdp' has size 'two'"]),
    (["--mesh", "fsdp=-1,tp=2"], ["inferred (-1) axis", "--world-size"]),
    (["--mesh", "fsdp=2", "--world-size", "3"], ["the world has 3"]),
    (["--mesh", "fsdp=2", "--batch-size", "3"], ["--batch-size 3", "multiple of 2"]),
    (["--plan", "{tmp}/plan.yaml", "--mesh", "dp=2"], ["--plan is a whole plan", "--mesh"]),
    (["--plan", "{tmp}/missing.yaml"], ["cannot read plan file", "missing.yaml"]),
    (["--rules", "{tmp}/missing.json"], ["cannot read rules file", "missing.json"]),
    (["--rules", "{tmp}/not_a_list.yaml"], ["not_a_list.yaml", "list of [regex, layout] pairs"]),
    (["--rules", "{tmp}/bad.yaml"], ["bad.yaml", "neither JSON nor YAML"]),
    (["--rules", "{tmp}/unknown_axis.json"], ["axis 'mp'", "valid axes"]),
    (["--mesh", "fsdp=2", "--schedule", "gpipe"], ["--schedule", "no 'pp' axis"]),
    (["--mesh", "fsdp=2", "--profile", "{tmp}/profile"], ["--profile records the pipeline timeline", "pp=2"]),
    (["--mesh", "pp=2", "--schedule", "gpipe", "--microbatches", "3", "--batch-size", "4"],
     ["4 samples per data rank", "3 equal micro-batches"]),
    (["--mesh", "pp=2", "--split-points", "layers.9"], ["layers.9"]),
    (["--plan", "{tmp}/plan.yaml", "--microbatches", "2"], ["--plan is a whole plan", "--microbatches"]),
]


@pytest.mark.parametrize(("argv", "expected"), INVALID, ids=[" ".join(a) for a, _ in INVALID])
def test_invalid_input_exits_2_naming_the_problem_before_any_process(tmp_path, capsys, no_processes, argv, expected):
    tmp = _files(tmp_path)
    code = main(["train", *(a.format(tmp=tmp) for a in argv)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("shardkit: invalid plan:")
    for text in expected:
        assert text in err


NOT_A_PLAN = [
    (["--seq-len", "1000"], "--seq-len 1000: model 'gpt-small' has 128 positions; valid: 1..128"),
    (["--data", "{tmp}/empty"], "--data {tmp}/empty: data folder '{tmp}/empty' has no text files"),
    (["--plan", "{tmp}/rulez.yaml"], "plan file '{tmp}/rulez.yaml': plan has unknown keys ['rulez']"),
]


@pytest.mark.parametrize(("argv", "expected"), NOT_A_PLAN, ids=[" ".join(a) for a, _ in NOT_A_PLAN])
def test_each_error_has_the_prefix_of_its_kind_and_names_its_flag_or_file(tmp_path, capsys, no_processes, argv,
                                                                          expected):
    tmp = _files(tmp_path)
    (tmp / "rulez.yaml").write_text("mesh: {fsdp: 2}\nrulez: []\n")
    assert main(["train", *(a.format(tmp=tmp) for a in argv)]) == 2
    prefix = "shardkit: invalid plan: " if argv[0] == "--plan" else "shardkit train: "  # only the plan is a plan
    assert capsys.readouterr().err.startswith(prefix + expected.format(tmp=tmp))


def _args(*argv: str):
    return build_parser().parse_args(["train", *argv])


def test_rules_file_and_plan_file_become_the_plan(tmp_path):
    rules = [["layers\\.\\d+\\.mlp\\.up_proj\\.weight", ["tp", None]], [".*", None]]
    (tmp_path / "rules.json").write_text(json.dumps(rules))
    plan, world_size = train_cli.build_plan(_args("--mesh", "dp=-1,tp=2", "--world-size", "4",
                                                  "--rules", str(tmp_path / "rules.json")))
    assert (plan.mesh, world_size, plan.rules) == (Mesh(dp=2, tp=2), 4, LayoutMap(rules))
    saved = Plan(mesh=Mesh(fsdp=2, tp=2), rules=GPT_RULES)
    saved.save(tmp_path / "plan.json")
    assert train_cli.build_plan(_args("--plan", str(tmp_path / "plan.json"))) == (saved, 4)


def test_model_rules_apply_only_when_the_mesh_has_their_axes():
    assert train_cli.build_plan(_args())[0].rules == GPT_RULES                 # default mesh fsdp=2,tp=2
    assert train_cli.build_plan(_args("--mesh", "fsdp=2"))[0].rules is None   # plain FSDP, not an error


def test_short_run_trains_and_reports_every_rank(capsys, lend_world):
    code = main(["train", "--steps", "3", "--world-size", "2", "--mesh", "fsdp=2", "--seq-len", "16",
                 "--batch-size", "2", "--data-mb", "0.25", "--verify"])
    out = capsys.readouterr().out
    assert code == 0
    assert "verify OK" in out
    for rank in (0, 1):
        assert re.search(rf"│\s+{rank} │ fsdp={rank}\s", out), out
    assert "all_gather_into_tensor" in out and "reduce_scatter_tensor" in out
    assert "loss went down" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "cli_models:build_lm_with_100_tokens"],
     "its vocabulary has 100 tokens, but the training data are bytes (token ids 0..255)"),
    (["--model", "cli_models:build_lm_without_positions"], "cannot tell how many positions it takes"),
])
def test_a_builder_path_must_read_bytes_and_say_its_positions(capsys, no_processes, argv, message):
    assert main(["train", "--mesh", "fsdp=2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardkit train: --model {argv[1]!r}: ") and message in err
    assert err.count("\n") == 1


def test_a_builder_path_takes_its_sizes_from_the_model_or_the_flags():
    def job(*argv: str):
        args = _args("--mesh", "fsdp=2", *argv)
        return check_job(train_cli.build_config(args), *train_cli.build_plan(args))

    assert job("--model", "shardkit.models.gpt:build_small_gpt").seq_len == 128  # the reference GPT's config.seq_len
    assert job("--model", "cli_models:build_tiny_lm").seq_len == 32              # its position embedding
    assert job("--model", "cli_models:build_lm_without_positions", "--seq-len", "64").seq_len == 64
    with pytest.raises(JobError, match=r"--seq-len 64: model 'cli_models:build_tiny_lm' has 32 positions; valid: 1\.\.32"):
        job("--model", "cli_models:build_tiny_lm", "--seq-len", "64")


def test_short_run_of_a_model_given_by_its_builder(capsys, lend_world):
    code = main(["train", "--model", "cli_models:build_tiny_lm", "--steps", "2", "--world-size", "2", "--mesh", "fsdp=2",
                 "--seq-len", "16", "--batch-size", "2", "--data-mb", "0.25"])
    out = capsys.readouterr().out
    assert code == 0
    assert "shardkit train: cli_models:build_tiny_lm on Mesh(fsdp=2) (2 processes), 2 steps" in out
    for rank in (0, 1):
        assert re.search(rf"│\s+{rank} │ fsdp={rank}\s", out), out


def _held_by_fsdp(ctx):
    from torch.distributed.fsdp import fully_shard

    layer = torch.nn.Linear(8, 8, bias=False)
    fully_shard(layer, mesh=ctx.mesh["fsdp"])
    optimizer = torch.optim.AdamW(layer.parameters())
    before = state_bytes(layer, optimizer)
    layer(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return before, state_bytes(layer, optimizer)


def test_state_bytes_count_local_shards(world):
    for before, after in world(4).run(_held_by_fsdp, plan=Plan(mesh=Mesh(fsdp=4))):
        shard = 8 * 8 * 4 // 4  # a quarter of the float32 weight
        assert (before.params, before.grads, before.optimizer) == (shard, 0, 0)
        # AdamW keeps exp_avg and exp_avg_sq per shard, and a float32 step counter
        assert (after.params, after.grads, after.optimizer) == (shard, shard, 2 * shard + 4)


def test_peak_memory_without_a_resettable_mark_is_an_upper_bound(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "_CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    size = 64 * 2**20
    with PeakMemory("cpu") as mem:
        block = torch.ones(size // 4)
        del block
    assert "upper bound" in mem.method
    assert mem.peak_bytes() >= 0.9 * size


def test_peak_memory_is_measured_since_start():
    size = 64 * 2**20
    with PeakMemory("cpu") as big:
        block = torch.ones(size // 4)
        del block
    assert big.peak_bytes() >= 0.9 * size
    with PeakMemory("cpu") as small:
        torch.ones(16)
    if "VmHWM" in small.method:  # the high-water mark was reset, so the earlier peak does not count
        assert small.peak_bytes() < 0.5 * size


def test_loss_trend_compares_first_and_last_windows():
    trend = loss_trend([2.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0])
    assert (trend.first, trend.last, trend.window, trend.went_down) == (2.0, 3.0, 2, False)
    assert str(trend).startswith("loss did NOT go down")
