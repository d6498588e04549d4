"""A command line that is refused, or asks for help, is answered without importing torch (or
transformers, rich, numpy): those are imported only when a command runs; ``explain`` ends without
the interpreter's teardown, its output whole. Not a timing test: ``benchmarks/cli_startup.py``
measures the times."""

import json
import subprocess
import sys

#: Command lines refused while parsing (exit status 2), or help (exit status 0), in every sub-command.
REFUSED = [
    ["train", "--bogus"], ["train", "--lr", "nan"], ["train", "--model", "no-such-model"], ["train", "--zero", "4"],
    ["explain", "--bogus"], ["explain", "--batch-size", "0"], ["explain", "--recompute", "half"],
    ["plan", "--bogus"], ["plan", "--model", "gpt2", "--devices", "8", "--global-batch", "8", "--seq", "64",
                          "--optimizer", "lion"],
    ["generate", "--bogus"], ["generate", "--model", "llama-70b", "--hf", "x", "--prompt", "a",
                              "--max-new-tokens", "1"],
    ["checkpoint", "--bogus"], ["checkpoint", "convert", "a", "--to", "hf", "b", "--dtype", "half"],
    ["data", "--bogus"], ["data", "shard", "a", "b", "--shards", "0"],
    ["calibrate", "--bogus"], ["calibrate", "--world", "zero"],
    ["replicas", "--bogus"],
    ["serve", "--bogus"], ["serve", "--hf", "x", "--port", "70000"],
    ["no-such-command"],
]
HELP = [["--help"], *([name, "--help"] for name in ("train", "explain", "plan", "generate", "checkpoint", "data",
                                                    "calibrate", "replicas", "serve"))]
HEAVY = ("torch", "transformers", "rich", "numpy")

_PROBE = """
import contextlib, io, json, sys
from shardkit.cli import main
answers = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code
    imported = sorted({m.split('.')[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
    answers.append({"argv": " ".join(argv), "status": status, "said": out.getvalue()[:300], "imported": imported})
print(json.dumps(answers))
"""


def _answers(argvs: list[list[str]]) -> list[dict]:
    """Each command line's exit status, output and the heavy packages imported so far (one process for all:
    the first command line that imports one is the one named)."""
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argvs), json.dumps(HEAVY)], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def test_refused_command_lines_import_no_torch():
    wrong = [a for a in _answers(REFUSED) if a["status"] != 2 or a["imported"] or "shardkit" not in a["said"]]
    assert not wrong, json.dumps(wrong, indent=1)


def test_help_imports_no_torch():
    wrong = [a for a in _answers(HELP) if a["status"] != 0 or a["imported"] or "usage: shardkit" not in a["said"]]
    assert not wrong, json.dumps(wrong, indent=1)


def test_explain_as_the_program_ends_at_once_with_all_its_output():
    """``shardkit explain`` skips the interpreter's teardown (``cli.exit_now``): into a pipe (block-buffered)
    nothing is lost, and an invalid plan still exits 2 with its message."""
    done = subprocess.run([sys.executable, "-m", "shardkit", "explain", "--model", "gpt-tiny", "--mesh", "tp=2"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("step time: ") and "MFU" in done.stdout.splitlines()[-1]
    refused = subprocess.run([sys.executable, "-m", "shardkit", "explain", "--model", "gpt-tiny", "--mesh", "tp=3"],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "not divisible by tp=3" in refused.stderr, refused.stderr
