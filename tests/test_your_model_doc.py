"""docs/your-model.md is real: its Python blocks run, in order, as one session, and print what
the page shows; its excerpts are in examples/your_model.py; its shell commands get as far as
launch (or fail with the message shown); its rules file is the rules of the Python blocks.

A ```text block right after a ```python or ```bash block is that block's output, compared line
by line (trailing spaces ignored) with ``...`` matching anything, as in doctests. A ```text
block after another ```text block quotes an output shown earlier on the page.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import shardkit as sk
import shardkit.cli.train as train_cli
import shardkit.runtime.verify as verify_module
from shardkit.cli import main
from shardkit.cli.options import load_rules

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "your-model.md"
EXAMPLE = ROOT / "examples" / "your_model.py"
EXCERPT_MARK = "# examples/your_model.py\n"
# The doc imports ``examples.your_model`` from the checkout's root, as a reader does. Worlds start
# after collection, so their processes inherit this path and can unpickle the builders.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from examples.your_model import TINY_LM_RULES, build_qwen2  # noqa: E402


@dataclass(frozen=True)
class Block:
    """One fenced code block of the page: its language, its text (dedented) and its first line."""

    lang: str
    code: str
    line: int
    expected: str | None = None  # the ```text block that follows it: its output


class Launched(Exception):
    """Raised instead of starting processes, where a test stops at launch."""


def page_blocks() -> list[Block]:
    """Every fenced block in page order, each ```text block attached to the block before it."""
    text = DOC.read_text()
    found = []
    for match in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```$", text, re.M | re.S):
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(match.group(2), textwrap.dedent(match.group(3)), line))
    blocks: list[Block] = []
    for block in found:
        if block.lang == "text" and blocks and blocks[-1].lang in ("python", "bash") and blocks[-1].expected is None:
            last = blocks.pop()
            blocks.append(Block(last.lang, last.code, last.line, block.code))
        else:
            blocks.append(block)
    return blocks


def matches(expected: str, got: str) -> bool:
    """``got`` equals ``expected`` line by line (trailing spaces ignored), ``...`` matching anything."""
    def clean(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()) + "\n"

    return doctest.OutputChecker().check_output(clean(expected), clean(got), doctest.ELLIPSIS)


def run_python_blocks(launch) -> tuple[list[tuple[Block, str | None]], dict]:
    """Run the page's Python blocks in order in one namespace, as one ``python`` session would, with
    ``sk.verify``'s launch replaced by ``launch``; return each block with its output (``None``:
    it launched a world where ``launch`` refused), and the namespace."""
    namespace: dict = {"__name__": "__main__"}
    results = []
    for block in page_blocks():
        if block.lang != "python" or block.code.startswith(EXCERPT_MARK):
            continue
        out = io.StringIO()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(verify_module, "launch", launch)
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(block.code, f"{DOC.name}:{block.line}", "exec"), namespace)
            except Launched:
                results.append((block, None))
                continue
        results.append((block, out.getvalue()))
    return results, namespace


def check_outputs(results: list[tuple[Block, str | None]]) -> None:
    """Every block that shows its output printed it (all mismatches reported at once)."""
    wrong = [f"docs/your-model.md line {block.line} printed:\n{out}" for block, out in results
             if out is not None and block.expected is not None and not matches(block.expected, out)]
    assert not wrong, "\n".join(wrong)


def refuse_launch(*args, **kwargs):
    raise Launched


# -- the Python blocks ------------------------------------------------------------------------------

def test_python_blocks_print_what_the_page_shows():
    """Every block runs; the two ``sk.verify`` calls stop at launch (see the world test)."""
    results, namespace = run_python_blocks(refuse_launch)
    check_outputs(results)
    assert namespace["rules"] == TINY_LM_RULES  # Part 2's rules are the example module's
    launched = [block for block, out in results if out is None]
    assert len(launched) == 2 and all("sk.verify(" in block.code for block in launched)
    printed = "".join(out for _, out in results if out)
    for block in page_blocks():  # a ```text block after a ```text block quotes an output shown before
        if block.lang == "text":
            assert block.code.strip() in printed, f"line {block.line} is no output of the page's code"


@pytest.mark.world
def test_verify_blocks_are_ok_on_a_two_process_world(world):
    """The same session with the worlds: each ``sk.verify`` of the page prints ``verify OK``."""
    shared, real = world(2), verify_module.launch

    def launch(*args, **kwargs):
        return real(*args, **{**kwargs, "world": shared})

    results, _ = run_python_blocks(launch)
    check_outputs(results)
    verified = [out for block, out in results if "sk.verify(build" in block.code]
    assert len(verified) == 2 and all(out.startswith("verify OK") for out in verified)


def test_excerpts_are_the_example_module():
    source = EXAMPLE.read_text()
    excerpts = [b for b in page_blocks() if b.lang == "python" and b.code.startswith(EXCERPT_MARK)]
    assert len(excerpts) == 2
    for block in excerpts:
        assert block.code[len(EXCERPT_MARK):] in source, f"line {block.line} is not in {EXAMPLE.name}"


# -- the rules file and the commands ----------------------------------------------------------------

def _rules_file(directory: Path) -> Path:
    (yaml_block,) = [b for b in page_blocks() if b.lang == "yaml"]
    path = directory / "rules.yaml"
    path.write_text(yaml_block.code)
    return path


def test_rules_file_is_the_rules_of_the_python_blocks(tmp_path):
    assert load_rules(_rules_file(tmp_path)) == TINY_LM_RULES


def test_commands_reach_launch_or_fail_as_shown(tmp_path, monkeypatch, capsys):
    """Run from a folder holding rules.yaml, with the checkout on the path; train stops at launch."""
    _rules_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI appends the current directory
    monkeypatch.setattr("shardkit.runtime.world.LocalWorld", refuse_launch)
    commands = [(b, line) for b in page_blocks() if b.lang == "bash" for line in b.code.splitlines()
                if line.startswith("shardkit ")]
    assert len(commands) == 6
    for block, line in commands:
        argv = shlex.split(line)[1:]
        try:
            code = main(argv)
        except Launched:
            code = None
        out, err = capsys.readouterr()
        where = f"docs/your-model.md line {block.line}: {line}"
        if code is None:  # train got as far as launch: its first line is printed before
            assert block.expected is not None and matches(block.expected.splitlines()[0], out.splitlines()[0]), out
        elif code == 2:  # refused before launch, with one line on stderr
            assert block.expected is not None and out == "" and matches(block.expected, err), f"{where}\n{err}"
        else:
            assert argv[0] == "explain" and code == 0 and out.startswith("Plan for "), f"{where}\n{err}"


def test_train_takes_a_transformers_models_rules_from_its_plan():
    """Part 1: no --rules, a mesh with tp: the rules of ``LayoutMap.from_hf``; plain FSDP: none."""
    parser = train_cli.argparse.ArgumentParser()
    sub = parser.add_subparsers()
    train_cli.register(sub)
    model = sk.meta_model(build_qwen2)

    def rules(*flags: str):
        args = parser.parse_args(["train", "--model", "examples.your_model:build_qwen2", *flags])
        return train_cli.build_plan(args)[0].rules

    assert rules("--mesh", "fsdp=2,tp=2") == sk.LayoutMap.from_hf(model)
    assert rules("--mesh", "fsdp=2") is None


def test_explain_command_prints_what_explain_plan_does(capsys):
    plan = sk.Plan(mesh=sk.Mesh(fsdp=2, tp=2), rules=sk.LayoutMap.from_hf(sk.meta_model(build_qwen2)))
    assert main(["explain", "--model", "examples.your_model:build_qwen2", "--mesh", "fsdp=2,tp=2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(sk.explain_plan(plan, sk.meta_model(build_qwen2)))
    assert "estimate (sk.estimate) on h100-80g" in out  # then the plan's estimate


def test_world_errors_start_as_the_page_says():
    assert str(sk.WorldError(1, "Traceback ...")).startswith("rank 1 failed:\n")
    assert str(sk.WorldTimeout(2.0, {0: "File ..."}, [1])).startswith("the job did not finish within its timeout of 2 s")
    assert all(issubclass(e, sk.ShardkitError) for e in (sk.PlanError, sk.UsageError, sk.WorldError, sk.WorldTimeout))
