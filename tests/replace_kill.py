"""Run by tests/test_replace.py: a folder replaced again and again (``sk.export_hf(..., overwrite=True)``
or ``sk.write_shards(..., overwrite=True)``) by a process killed with SIGKILL; after each kill the
folder must be a complete export (or data folder), the old one or the new one, never a mix.

    python tests/replace_kill.py WORK KILLS SEED

Every KIND with every MODE, each in its own folder under WORK. KIND: ``export`` (a tiny Llama, four safetensors files, an index and config.json; read back by
transformers' ``from_pretrained`` after every kill) or ``data`` (shard files and a manifest; read
back by ``ShardedDataset.verify``). MODE: ``exchange`` (the one-step swap of Linux) or ``rename``
(the two-rename fallback, as on a file system that cannot swap).

Two kinds of rounds, each a process forked from this one (milliseconds, not a fresh Python):

- *steps*: one replacement, killed just before, then just after, each file-system step it takes
  (every ``rename``, swap and ``rmtree``), until a round completes without reaching its step;
- *random*: replacements in a loop, killed after a random delay within one replacement's time.

After each kill this process looks at OUT as a reader would (``found``: which folder, or
``absent``), then as the next writer does (recovery: ``after``). Prints one JSON line per round.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

import torch

import shardkit as sk

WIDTH = 64


def build(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


class Writer:
    """Writes version 0 or 1 of the folder at OUT."""

    def __init__(self, kind: str, work: Path):
        self.kind = kind
        if kind == "export":
            self.models = [build(0), build(1)]
        else:
            self.sources = []
            for version in (0, 1):
                source = work / f"source-{version}.txt"
                source.write_text("".join(f"line {i} of version {version}\n" for i in range(4000 + 1000 * version)))
                self.sources.append(source)

    def write(self, version: int, out: Path, overwrite: bool = True) -> None:
        if self.kind == "export":
            sk.export_hf(out, self.models[version], max_shard_size="60KB", overwrite=overwrite)
        else:
            sk.write_shards(self.sources[version], out, shards=3 + 2 * version, overwrite=overwrite)

    def ours(self, name: str) -> bool:
        if self.kind == "export":
            from shardkit.checkpoint.export import EXPORT_FILES

            return bool(EXPORT_FILES.fullmatch(name))
        from shardkit.io.shard_writer import DATA_FILES

        return bool(DATA_FILES.fullmatch(name))

    def read(self, out: Path, version: int) -> bool:
        """Whether a reader gets version ``version`` from OUT: transformers' from_pretrained, or our data reader."""
        if self.kind == "export":
            from transformers import AutoModelForCausalLM

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                back = AutoModelForCausalLM.from_pretrained(out)
            expected = self.models[version].state_dict()
            return all(torch.equal(value, expected[name]) for name, value in back.state_dict().items())
        dataset = sk.ShardedDataset(out, seq_len=8)
        dataset.verify()
        return dataset.manifest.source.path == str(self.sources[version].resolve())


def contents(folder: Path) -> dict[str, str] | None:
    """``{name: sha256}`` of every file of ``folder``; None when there is no folder."""
    if not folder.is_dir():
        return None
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def hidden(out: Path) -> list[str]:
    """What writes left beside OUT, by kind (partial, replaced, or the old shardkit's incomplete, old)."""
    return sorted(p.name.removeprefix(f".{out.name}.").split("-")[0] for p in out.parent.iterdir()
                  if p.name.startswith(f".{out.name}."))


def counting_kill(at: int, after: bool, log: Path) -> None:
    """In a forked writer: SIGKILL itself at file-system step ``at`` (just before it, or just after it),
    each step's name logged as it starts."""
    from shardkit.io import folders

    steps = [0]

    def wrap(function):
        def counted(*args, **kwargs):
            index = steps[0]
            steps[0] += 1
            with log.open("a") as file:
                file.write(f"{getattr(function, '__name__', 'step')}\n")
            if index == at and not after:
                os.kill(os.getpid(), signal.SIGKILL)
            result = function(*args, **kwargs)
            if index == at and after:
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        return counted

    os.rename = wrap(os.rename)
    shutil.rmtree = wrap(shutil.rmtree)
    folders._exchange = wrap(folders._exchange)


def fork(job) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            torch.set_num_threads(1)
            job()
        finally:
            os._exit(0)
    return pid


class Rounds:
    def __init__(self, kind: str, mode: str, out: Path):
        self.kind, self.mode, self.out = kind, mode, out
        self.writer = Writer(kind, out.parent)
        self.references = []
        for version in (0, 1):
            self.writer.write(version, out.parent / f"reference-{version}")
            self.references.append(contents(out.parent / f"reference-{version}"))
        self.writer.write(0, out)
        self.current = 0
        self.log = out.parent / "steps.log"

    def child_setup(self) -> None:
        if self.mode == "rename":
            from shardkit.io import folders

            folders._exchange = lambda first, second: False

    def version_at(self) -> int | str:
        found = contents(self.out)
        if found is None:
            return "absent"
        if found not in self.references:
            return f"mixed: {sorted(found)}"
        version = self.references.index(found)
        return version if self.writer.read(self.out, version) else "unreadable"

    def check(self, how: str) -> dict:
        """OUT as a reader finds it after a kill, then after the next writer's recovery."""
        found, left = self.version_at(), hidden(self.out)
        after = found
        try:
            from shardkit.io.folders import FolderWrite
        except ImportError:  # a shardkit before FolderWrite: no recovery to ask for
            pass
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                FolderWrite(self.out, self.writer.ours).prepare(True, "OUT", "OUT is not empty")
            after = self.version_at()
        if isinstance(after, int):
            self.current = after
        return {"how": how, "found": found, "after": after, "left": left, "left_after": hidden(self.out)}

    def steps(self, at: int, after: bool) -> dict | None:
        """One replacement killed at step ``at``; None when it completed before reaching it."""
        self.log.unlink(missing_ok=True)
        old, new = self.current, 1 - self.current

        def job() -> None:
            self.child_setup()
            counting_kill(at, after, self.log)
            self.writer.write(new, self.out)
            os._exit(3)

        _, status = os.waitpid(fork(job), 0)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3:
            self.current = new
            return None
        assert os.WIFSIGNALED(status), f"the writer failed: status {status}"
        steps = self.log.read_text().split()
        result = self.check(f"{'after' if after else 'before'} step {at}: {steps[at]}")
        return {**result, "old": old, "new": new}

    def random(self, rng: random.Random) -> dict:
        times = self.out.parent / "times.log"
        times.unlink(missing_ok=True)
        start = self.current

        def job() -> None:
            self.child_setup()
            version = 1 - start
            while True:
                self.writer.write(version, self.out)
                with times.open("a") as file:
                    file.write(f"{time.monotonic()}\n")
                version = 1 - version

        pid = fork(job)
        began = time.monotonic()
        while not times.exists() or len(times.read_text().split()) < 2:
            time.sleep(0.002)
            if time.monotonic() - began > 120:
                raise RuntimeError("the writer did not write twice in 120 s")
        first, second = map(float, times.read_text().split()[-2:])
        delay = rng.uniform(0, second - first)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return self.check(f"random: {delay:.4f} s into a write of {second - first:.4f} s")


def main(work: Path, kills: int, seed: int) -> None:
    torch.set_num_threads(1)
    rng = random.Random(seed)
    for kind in ("export", "data"):
        for mode in ("exchange", "rename"):
            out = work / f"{kind}-{mode}" / "out"
            out.parent.mkdir(parents=True)
            rounds = Rounds(kind, mode, out)
            for at in range(100):  # until a write completes before its step ``at``: every step was a kill point
                before = rounds.steps(at, after=False)
                if before is None:
                    break
                for result in (before, rounds.steps(at, after=True)):
                    print(json.dumps({"kind": kind, "mode": mode, **result}), flush=True)
            for _ in range(kills):
                print(json.dumps({"kind": kind, "mode": mode, **rounds.random(rng)}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
