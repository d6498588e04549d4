"""The command line: typed flags (one line, exit 2, nothing started), ``--model package.module:function``,
``explain`` with the plan flags of ``train``, and the README's example."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardkit.cli.train as train_cli
from shardkit.cli import build_parser, main
from shardkit.models.gpt import GPT_RULES
from shardkit.runtime.world import WorldError
from shardkit.training.checks import check_job

ROOT = Path(__file__).resolve().parents[1]


def _exit(argv: list[str], capsys) -> tuple[int, str, str]:
    """``shardkit argv``: exit status, stdout, stderr (a command-line error exits while parsing)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- typed flags ------------------------------------------------------------------------------

BAD_FLAGS = [
    (["train", "--lr", "nan"], "--lr", "positive finite number, got 'nan'"),
    (["train", "--lr", "inf"], "--lr", "positive finite number, got 'inf'"),
    (["train", "--lr", "-1"], "--lr", "positive finite number, got '-1'"),
    (["train", "--lr", "0"], "--lr", "positive finite number, got '0'"),
    (["train", "--lr", "fast"], "--lr", "positive finite number, got 'fast'"),
    (["train", "--steps", "0"], "--steps", "positive integer (1, 2, ...), got '0'"),
    (["train", "--steps", "2.5"], "--steps", "positive integer (1, 2, ...), got '2.5'"),
    (["train", "--batch-size", "-4"], "--batch-size", "positive integer (1, 2, ...), got '-4'"),
    (["train", "--seq-len", "0"], "--seq-len", "positive integer (1, 2, ...), got '0'"),
    (["train", "--world-size", "0"], "--world-size", "positive integer (1, 2, ...), got '0'"),
    (["train", "--microbatches", "0"], "--microbatches", "positive integer (1, 2, ...), got '0'"),
    (["train", "--data-mb", "0"], "--data-mb", "positive finite number, got '0'"),
    (["train", "--data-mb", "nan"], "--data-mb", "positive finite number, got 'nan'"),
    (["train", "--timeout", "0"], "--timeout", "positive finite number, got '0'"),
    (["train", "--timeout", "-5"], "--timeout", "positive finite number, got '-5'"),
    (["train", "--timeout", "inf"], "--timeout", "positive finite number, got 'inf'"),
    (["train", "--seed", "-1"], "--seed", "integer >= 0, got '-1'"),
    (["train", "--data", ""], "--data", "must be a path, got ''"),
    (["train", "--split-points", "layers.2,"], "--split-points", "module names separated by commas"),
    (["train", "--schedule", "fast"], "--schedule", "invalid choice: 'fast'"),
    (["train", "--model", "gpt-huge"], "--model", "unknown model 'gpt-huge'; valid: gpt-moe, gpt-small, gpt-tiny"),
    (["train", "--model", "llama-70b"], "--model", "'llama-70b' has shapes only (meta device)"),
    (["explain", "--width", "0"], "--width", "positive integer (1, 2, ...), got '0'"),
    (["explain", "--world-size", "-1"], "--world-size", "positive integer (1, 2, ...), got '-1'"),
    (["explain", "--microbatches", "x"], "--microbatches", "positive integer (1, 2, ...), got 'x'"),
    (["explain", "--rules", ""], "--rules", "must be a path, got ''"),
    (["explain", "--model", "gpt-huge"], "--model", "or your builder as package.module:function"),
]


@pytest.mark.parametrize(("argv", "flag", "message"), BAD_FLAGS, ids=[" ".join(a) for a, _, _ in BAD_FLAGS])
def test_a_bad_flag_exits_2_with_one_line_naming_it(capsys, no_processes, argv, flag, message):
    code, out, err = _exit(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and out == ""
    assert err.startswith(f"shardkit {argv[0]}: argument {flag}: ")
    assert message in err


@pytest.mark.parametrize("command", ["train", "explain"])
@pytest.mark.parametrize(("mesh", "message"), [
    ("", "mesh '' is empty; give axes as axis=size pairs"),
    ("fsdp=2,fsdp=4", "gives axis 'fsdp' twice (fsdp=2 and fsdp=4)"),
])
def test_a_bad_mesh_is_an_invalid_plan_naming_the_flag(capsys, no_processes, command, mesh, message):
    code, out, err = _exit([command, "--mesh", mesh], capsys)
    assert code == 2
    assert err.count("\n") == 1 and out == ""
    assert err.startswith("shardkit: invalid plan: --mesh: ") and message in err


def test_defaults_apply_only_to_absent_flags():
    default = build_parser().parse_args(["train"])
    assert (default.mesh, default.seq_len, default.lr, default.timeout) == (None, None, 3e-3, 1800.0)
    given = build_parser().parse_args(["train", "--lr", "1e-2", "--seq-len", "16", "--timeout", "90"])
    assert (given.lr, given.seq_len, given.timeout) == (0.01, 16, 90.0)
    assert check_job(train_cli.build_config(given), *train_cli.build_plan(given)).seq_len == 16
    assert check_job(train_cli.build_config(default), *train_cli.build_plan(default)).seq_len == 128  # gpt-small's


class _NoWorld:
    def __init__(self, size: int):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize(("argv", "timeout"), [([], 1800.0), (["--timeout", "2.5"], 2.5)])
def test_timeout_reaches_launch_and_a_failed_job_exits_1(monkeypatch, capsys, argv, timeout):
    seen = {}

    def failing_launch(fn, plan, job, world, timeout):
        seen["timeout"] = timeout
        raise WorldError(-1, f"job did not finish within {timeout} s")

    monkeypatch.setattr("shardkit.runtime.world.LocalWorld", _NoWorld)  # train imports them when it runs
    monkeypatch.setattr("shardkit.runtime.world.launch", failing_launch)
    code, _, err = _exit(["train", "--mesh", "fsdp=2", "--seq-len", "16", "--data-mb", "0.25", *argv], capsys)
    assert (code, seen["timeout"]) == (1, timeout)
    assert f"did not finish within {timeout} s" in err


# -- --model package.module:function ----------------------------------------------------------

def _rules_file(tmp_path: Path) -> Path:
    file = tmp_path / "gpt_rules.json"
    file.write_text(json.dumps(GPT_RULES.to_list()))
    return file


def test_explain_a_builder_path_as_its_registered_model(tmp_path, capsys, no_processes):
    by_path = ["explain", "--model", "shardkit.models.gpt:build_tiny_gpt"]
    assert _exit([*by_path, "--mesh", "fsdp=2"], capsys)[:2] == _exit(["explain", "--mesh", "fsdp=2"], capsys)[:2]
    with_rules = _exit([*by_path, "--rules", str(_rules_file(tmp_path))], capsys)  # default mesh fsdp=2,tp=2
    assert with_rules[0] == 0
    assert with_rules[:2] == _exit(["explain", "--model", "gpt-tiny"], capsys)[:2]
    assert re.search(r"^lm_head\.weight\s+x1\s+\[256, 64\]\s+#5\s+\(tp, None\)\s+colwise", with_rules[1], re.M)


def test_explain_a_model_from_a_test_module(capsys, no_processes):
    code, out, _ = _exit(["explain", "--model", "cli_models:build_tiny_lm", "--mesh", "fsdp=2"], capsys)
    assert code == 0
    assert out.startswith("Plan for TinyLM: 7 parameter tensors")


BAD_MODELS = [
    ("no_such_module:build", "module 'no_such_module' cannot be imported: ModuleNotFoundError"),
    ("cli_models:build_missing", "module 'cli_models' has no attribute 'build_missing'"),
    ("cli_models:NOT_CALLABLE", "is not callable (type int)"),
    ("cli_models:build_sized", "needs arguments (width); give a function that takes none"),
    ("cli_models:build_not_a_module", "returned a dict, not a torch.nn.Module"),
    ("cli_models:build_reading_weights", "cannot be built on the meta device"),
    (":build", "is not of the form package.module:function"),
]


@pytest.mark.parametrize("command", ["explain", "train"])
@pytest.mark.parametrize(("model", "message"), BAD_MODELS, ids=[m for m, _ in BAD_MODELS])
def test_a_bad_builder_path_names_the_problem(capsys, no_processes, command, model, message):
    code, out, err = _exit([command, "--model", model, "--mesh", "fsdp=2"], capsys)
    assert code == 2
    assert err.count("\n") == 1 and out == ""
    assert err.startswith(f"shardkit {command}: --model {model!r}: ") and message in err


@pytest.mark.parametrize("command", ["explain", "train"])
def test_a_model_axis_without_rules_says_to_pass_rules(capsys, no_processes, command):
    """No built-in rules, no transformers plan, and none inferable from the dataflow (tests/test_tp_infer.py
    covers the models where they are)."""
    code, _, err = _exit([command, "--model", "cli_models:build_head_only_lm", "--mesh", "fsdp=2,tp=2"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "mesh axis 'tp': model 'cli_models:build_head_only_lm' has no built-in layout rules" in err
    assert "no column/row pair found in HeadOnlyLM" in err and err.endswith("pass --rules FILE (see docs/your-model.md)\n")


# -- explain takes the plan flags of train ----------------------------------------------------

def test_explain_with_rules_file(tmp_path, capsys, no_processes):
    rules = tmp_path / "rules.yaml"
    rules.write_text("- ['lm_head\\.weight', [tp, null]]\n- ['.*', null]\n")
    code, out, _ = _exit(["explain", "--model", "gpt-tiny", "--mesh", "tp=2", "--rules", str(rules)], capsys)
    assert code == 0
    assert re.search(r"^lm_head\.weight\s+x1\s+\[256, 64\]\s+#0\s+\(tp, None\)\s+colwise\s+\[128, 64\]", out, re.M)
    assert re.search(r"^embed\.weight\s+x1\s+\[256, 64\]\s+#1\s+None\s+replicated", out, re.M)


def test_explain_with_a_pipeline(capsys, no_processes):
    code, out, _ = _exit(["explain", "--model", "gpt-tiny", "--mesh", "pp=2", "--schedule", "gpipe",
                          "--microbatches", "4", "--split-points", "layers.1"], capsys)
    assert code == 0
    assert "2 stages on pp=2, schedule gpipe, 4 micro-batches, stages by split points" in out
    assert re.search(r"^\s+1\s+1\s+layers\.1, norm_f, lm_head\s", out, re.M)


@pytest.mark.parametrize(("argv", "message"), [
    (["--mesh", "dp=2", "--schedule", "gpipe"], "no 'pp' axis"),
    (["--mesh", "pp=2", "--split-points", "layers.9"], "layers.9"),
    (["--plan", "plan.yaml", "--rules", "rules.yaml"], "--plan is a whole plan, so --rules cannot be combined"),
])
def test_explain_refuses_what_train_refuses(capsys, no_processes, argv, message):
    code, out, err = _exit(["explain", "--model", "gpt-tiny", *argv], capsys)
    assert code == 2 and out == ""
    assert err.startswith("shardkit: invalid plan:") and message in err


# -- the README's example ---------------------------------------------------------------------

def test_readme_example_is_the_quickstart_and_prints_its_table_once():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## Twenty lines\n\n```python\n(.*?)^```$", readme, re.M | re.S)
    example = ROOT / "examples" / "quickstart.py"
    assert block is not None and block.group(1) == example.read_text()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("Plan for GPT:") == 1  # not again in each of the worker processes
    assert "verify OK" in run.stdout
