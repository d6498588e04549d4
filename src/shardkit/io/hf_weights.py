"""HuggingFace weights in: a safetensors checkpoint read lazily, box by box.

``sk.shard(model, plan, weights="path/to/hf-model")`` gives each rank's shards their values from
a HuggingFace checkpoint folder (``model.safetensors``, or ``model.safetensors.index.json`` and
its ``model-0000k-of-0000n.safetensors`` files) without any rank holding the whole model: each
rank reads only the bytes of the boxes of each tensor it holds
(:class:`~shardkit.io.safetensors.SafetensorsFile`).

Every name, shape and dtype is checked against the model on the meta device before any weight
is used, and every problem is named at once (the tensor, the file, what the model expects).
Pickled checkpoints (``pytorch_model.bin``, ``*.pt``) are refused: unpickling runs code from the
file. Why not ``from_pretrained``: it materialises the full model on every rank.

>>> import tempfile, torch
>>> from safetensors.torch import save_file
>>> folder = tempfile.mkdtemp()
>>> save_file({"weight": torch.arange(6.).reshape(2, 3)}, f"{folder}/model.safetensors")
>>> weights = HFWeights(folder)
>>> weights.check({"weight": ((2, 3), torch.float32)})
>>> weights.read("weight", (slice(1, 2), slice(0, 3)), torch.float32)
tensor([[3., 4., 5.]])
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from ..plan import UsageError
from .folders import interrupted_replacement
from .safetensors import SafetensorsError, SafetensorsFile
from .stacked import Stacking, collect_stacked, read_stacked, stacked_problems

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")

class WeightsError(UsageError):
    """A weights checkpoint that cannot fill this model: every problem, named."""


class HFWeights:
    """A HuggingFace safetensors checkpoint (folder or single ``.safetensors`` file).

    Opening reads only the headers: ``keys`` maps every tensor name to ``(file, shape, dtype)``.
    :meth:`check` matches them with a model's parameters; :meth:`read` returns one box of one
    tensor, converted to the parameter's dtype.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.files = _files(self.path)
        self.keys: dict[str, tuple[Path, tuple[int, ...], torch.dtype]] = {}
        self._open: dict[Path, SafetensorsFile] = {}
        self._names: dict[str, str] = {}
        self._stacks: dict[str, tuple[dict[tuple[int, int], str], int, int]] = {}  # name: pieces, sources, rows
        problems = []
        for file, expected in self.files.items():
            try:
                self._open[file] = handle = SafetensorsFile(file)
            except SafetensorsError as error:
                problems.append(str(error))
                continue
            for key, (shape, dtype) in handle.tensors.items():
                self.keys[key] = (file, shape, dtype)
            if expected is not None:
                stray = sorted(set(expected) - set(handle.tensors))
                if stray:
                    problems.append(f"{INDEX} maps {_few(stray)} to {file.name}, which does not hold "
                                    f"{'it' if len(stray) == 1 else 'them'}")
        if problems:
            raise WeightsError("cannot read the weights at " + str(self.path) + ":\n  - " + "\n  - ".join(problems))

    def check(self, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
              ties: Iterable[Iterable[str]] = (), ignore: Iterable[str] = (), prefix: str = "",
              buffers: Mapping[str, tuple[int, ...]] | None = None, rename: Callable[[str], str] = str,
              merged: Iterable[str] = (), stacked: Iterable[tuple[str, Iterable[str]]] = ()) -> None:
        """Match the checkpoint with a model: ``expected`` is ``{parameter: (shape, dtype)}``.

        A parameter is found under its own name, or under its name with the model's ``prefix``
        (transformers' ``base_model_prefix``: ``model``, ``transformer``) taken off or put on, or,
        for tied parameters (``ties``:
        groups of names sharing one tensor), under any name of its group. A missing parameter, a
        shape that differs, a dtype that cannot be converted, and a tensor nobody asked for (unless
        it matches a regex in ``ignore``, like transformers' ``_keys_to_ignore_on_load_unexpected``)
        are all errors, named together. ``buffers``: names the model may also take from the
        checkpoint when it holds them, with their shapes (persistent buffers, like BERT's
        ``position_ids``). ``rename``: a checkpoint name to the model's (transformers' renamings,
        see :class:`~shardkit.families.base.WeightNames`); ``merged``: patterns of tensors the
        model's library merges on loading, named in the error when tensors are missing; ``stacked``:
        ``(target, sources)`` of experts the model stacks and the checkpoint may hold one tensor per
        expert (:mod:`shardkit.io.stacked`): every expert's tensors must be there, with their shapes.
        """
        spelled = {rename(key): key for key in self.keys}  # the model's names for the checkpoint's tensors
        stackings = [Stacking(target, tuple(sources)) for target, sources in stacked]
        per_expert = collect_stacked(spelled, stackings)
        groups = {name: [name] for name in expected}
        for group in ties:
            members = list(group)
            for name in members:
                groups[name] = members
        problems, used = [], set()
        for name, (shape, dtype) in expected.items():
            key = next((spelled[k] for member in groups[name] for k in _spellings(member, prefix) if k in spelled), None)
            parts = next((per_expert[k] for k in _spellings(name, prefix) if k in per_expert), None)
            if key is None and parts is not None:
                problems += self._stack(name, shape, dtype, parts, stackings, spelled)
                used.update(spelled[k] for k in parts.values())
                continue
            if key is None:
                problems.append(f"parameter {name!r} {_shape(shape)} is not in the checkpoint"
                                + _nearest(name, self.keys))
                continue
            used.add(key)
            file, found, stored = self.keys[key]
            if tuple(found) != tuple(shape):
                problems.append(f"{key!r} in {file.name} has shape {_shape(found)}; the model's {name!r} is "
                                f"{_shape(shape)} (a checkpoint of another configuration?)")
            elif stored.is_floating_point != dtype.is_floating_point:
                problems.append(f"{key!r} in {file.name} holds {stored}; the model's {name!r} is {dtype}")
            self._names.update({member: key for member in groups[name]})
        for name, shape in (buffers or {}).items():
            key = next((spelled[k] for k in _spellings(name, prefix) if k in spelled), None)
            if key is None:
                continue
            used.add(key)
            file, found, _ = self.keys[key]
            if tuple(found) != tuple(shape):
                problems.append(f"{key!r} in {file.name} has shape {_shape(found)}; the model's buffer {name!r} is "
                                f"{_shape(shape)}")
            self._names[name] = key
        patterns = [re.compile(p) for p in ignore]
        stray = sorted(k for k in set(self.keys) - used if not any(p.search(k) for p in patterns))
        if stray:
            problems.append(f"the checkpoint holds {len(stray)} tensor(s) the model has no parameter for: "
                            f"{_few(stray)} (a checkpoint of another model?)")
        merged = list(merged)
        if problems and merged:
            problems.append(f"the model's library merges checkpoint tensors matching {_few(merged)} into one on "
                            f"loading; shardkit reads tensors box by box and cannot merge them: save the model in "
                            f"the merged layout first")
        if problems:
            raise WeightsError(f"the weights at {self.path} do not fit this model:\n  - " + "\n  - ".join(problems))

    def _stack(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, parts: dict[tuple[int, int], str],
               stackings: list[Stacking], spelled: dict[str, str]) -> list[str]:
        """Match the stacked parameter ``name`` with its per-expert tensors ``parts`` (model spellings)."""
        def where(key: str) -> str:
            return f"{spelled[key]!r} in {self.keys[spelled[key]][0].name}"

        problems = stacked_problems(name, shape, parts, stackings, lambda key: self.keys[spelled[key]][1], where)
        problems += [f"{where(key)} holds {self.keys[spelled[key]][2]}; the model's {name!r} is {dtype}"
                     for key in parts.values() if self.keys[spelled[key]][2].is_floating_point != dtype.is_floating_point]
        sources = len(next(s for s in stackings if s.stacks(name)).sources)
        self._stacks[name] = ({k: spelled[v] for k, v in parts.items()}, sources, shape[1] // sources if len(shape) > 1 else 0)
        return problems

    def holds(self, name: str) -> bool:
        """Whether :meth:`check` matched ``name`` with a tensor of the checkpoint."""
        return name in self._names or name in self._stacks

    def read(self, name: str, box: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        """Box ``box`` of parameter ``name`` (matched by :meth:`check`), as ``dtype``; a parameter
        stacked from one tensor per expert is read from the tensors of the experts in ``box`` only."""
        if name in self._stacks:
            pieces, sources, rows = self._stacks[name]
            return read_stacked(pieces, sources, box, dtype, lambda key, part: self._read(key, part, dtype), rows)
        return self._read(self._names.get(name, name), box, dtype)

    def _read(self, key: str, box: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
        file, _, _ = self.keys[key]
        return self._open[file].read(key, box).to(dtype)


def _files(path: Path) -> dict[Path, list[str] | None]:
    """``{safetensors file: the names the index maps to it (None without an index)}``."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise WeightsError(f"{path} is not a .safetensors file; shardkit reads only safetensors "
                               f"(a pickled checkpoint can run code when loaded)")
        return {path: None}
    if not path.is_dir():
        raise WeightsError(f"no weights at {path}: give a HuggingFace model folder or a .safetensors file"
                           f"{interrupted_replacement(path)}")
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise WeightsError(f"{path / INDEX} is not a safetensors index (a JSON object with a "
                               f"'weight_map'): {error}") from None
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{path / INDEX}: 'weight_map' must map tensor names to file names")
        files: dict[Path, list[str] | None] = {}
        for key, name in weight_map.items():
            files.setdefault(path / str(name), []).append(key)  # type: ignore[union-attr]
        missing = sorted(f.name for f in files if not f.is_file())
        if missing:
            raise WeightsError(f"{path / INDEX} names {len(missing)} file(s) that are not in {path}: {_few(missing)}")
        return files
    if (path / SINGLE).is_file():
        return {path / SINGLE: None}
    pickled = [name for name in PICKLED if (path / name).exists()]
    if pickled:
        raise WeightsError(f"{path} holds only pickled weights ({', '.join(pickled)}); shardkit never unpickles "
                           f"(loading a pickle can run code): convert them to safetensors first, e.g. with "
                           f"transformers: from_pretrained(...).save_pretrained(out, safe_serialization=True)")
    loose = sorted(path.glob("*.safetensors"))
    if loose:
        return {file: None for file in loose}
    raise WeightsError(f"no {SINGLE} or {INDEX} in {path}")


def _spellings(name: str, prefix: str) -> list[str]:
    """``name``, then with the model's ``prefix`` taken off (a base model's checkpoint, for a
    model with a head) or put on (the other way round)."""
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name[len(prefix) + 1:]]
    return [name, f"{prefix}.{name}"]


def _nearest(name: str, keys: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(keys), n=1, cutoff=0.8)
    return f" (closest there: {close[0]!r})" if close else ""


def _shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _few(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


__all__ = ["HFWeights", "WeightsError"]
