"""Experts stacked in the model, one tensor per expert in the files.

transformers 5 holds a MoE layer's experts as stacked parameters (``gate_up_proj [E, 2F, D]``,
``down_proj [E, D, F]``), while published checkpoints, and ``save_pretrained``, hold one tensor
per expert: Mixtral's ``block_sparse_moe.experts.3.w1.weight`` / ``w3`` / ``w2``, Qwen2-MoE's
``mlp.experts.3.gate_proj.weight`` / ``up_proj`` / ``down_proj``. transformers' conversion
mapping says how they meet (a ``WeightConverter``: ``MergeModulelist(dim=0)``, then
``Concatenate(dim=1)`` when an expert has several sources), which
:meth:`~shardkit.families.base.Family.weight_names` hands over as data: a :class:`Stacking`
``(target, sources)``.

A stacked parameter is then a grid of the files' tensors: expert ``e``'s source ``i`` is the box
``[e, i * F : (i + 1) * F, ...]``. :func:`read_stacked` reads a box of the parameter from the
tensors it crosses only, so a rank holding experts 2 and 3 (``ep=2``) opens experts 2 and 3's
tensors and no other; :func:`unstacked` names the pieces an export writes, as
``save_pretrained`` names them.

>>> stacking = Stacking(".experts.gate_up_proj", (".experts.*.w1.weight", ".experts.*.w3.weight"))
>>> stacking.source_of("model.layers.0.mlp.experts.3.w3.weight")
('model.layers.0.mlp.experts.gate_up_proj', 1, 3)
>>> stacking.key_of("model.layers.0.mlp.experts.gate_up_proj", 1, 3)
'model.layers.0.mlp.experts.3.w3.weight'
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stacking:
    """A stacked parameter named ``...<target>`` is made of the tensors ``...<source>`` with
    ``*`` the expert, each expert's sources concatenated on their dim 0 in order."""

    target: str
    sources: tuple[str, ...]

    def _pattern(self, source: str) -> re.Pattern[str]:
        before, after = source.split("*")
        return re.compile(re.escape(before) + r"(\d+)" + re.escape(after) + "$")

    def source_of(self, key: str) -> tuple[str, int, int] | None:
        """``(stacked parameter, source index, expert)`` of a per-expert tensor name, or ``None``."""
        for part, source in enumerate(self.sources):
            found = self._pattern(source).search(key)
            if found:
                return key[:found.start()] + self.target, part, int(found.group(1))
        return None

    def stacks(self, name: str) -> bool:
        return name.endswith(self.target)

    def key_of(self, name: str, part: int, expert: int) -> str:
        """The per-expert tensor name of ``name``'s expert ``expert``, source ``part``."""
        return name[:len(name) - len(self.target)] + self.sources[part].replace("*", str(expert))


@dataclass(frozen=True)
class Piece:
    """One per-expert tensor of a stacked parameter: its name in the checkpoint, its expert and
    the rows of the parameter's dim 1 it fills."""

    key: str
    expert: int
    rows: slice


def unstacked(name: str, shape: tuple[int, ...], stackings: Iterable[Stacking]) -> list[Piece] | None:
    """The per-expert pieces ``save_pretrained`` writes for the stacked parameter ``name`` of
    ``shape`` (expert by expert, sources in order; the rows split evenly, as transformers'
    ``Chunk`` does), named as the model names them; ``None`` when ``name`` is not stacked.

    >>> stacking = Stacking(".experts.down_proj", (".experts.*.w2.weight",))
    >>> [p.key for p in unstacked("layers.0.experts.down_proj", (2, 8, 4), [stacking])]
    ['layers.0.experts.0.w2.weight', 'layers.0.experts.1.w2.weight']
    """
    stacking = next((s for s in stackings if s.stacks(name)), None)
    if stacking is None or len(shape) < 2:
        return None
    rows = shape[1] // len(stacking.sources)
    return [Piece(stacking.key_of(name, part, expert), expert, slice(part * rows, (part + 1) * rows))
            for expert in range(shape[0]) for part in range(len(stacking.sources))]


def collect_stacked(keys: Iterable[str], stackings: Iterable[Stacking]) -> dict[str, dict[tuple[int, int], str]]:
    """``{stacked parameter: {(source index, expert): key}}`` of the per-expert tensors among
    ``keys`` (names as the model spells them)."""
    stackings = list(stackings)
    found: dict[str, dict[tuple[int, int], str]] = {}
    for key in keys:
        for stacking in stackings:
            hit = stacking.source_of(key)
            if hit is not None:
                found.setdefault(hit[0], {})[hit[1], hit[2]] = key
                break
    return found


def stacked_problems(name: str, shape: tuple[int, ...], parts: dict[tuple[int, int], str],
                     stackings: Iterable[Stacking], shape_of: Callable[[str], tuple[int, ...]],
                     where: Callable[[str], str]) -> list[str]:
    """What keeps the per-expert tensors ``parts`` (``{(source, expert): key}``) from filling the
    parameter ``name`` of ``shape``: an expert missing or beyond ``E``, a tensor of another shape."""
    stacking = next(s for s in stackings if s.stacks(name))
    count, experts = len(stacking.sources), shape[0]
    whole = f"{name!r} {list(shape)}"
    if len(shape) < 2 or shape[1] % count:
        return [f"the model's {whole} cannot be stacked from {count} tensor(s) per expert {list(stacking.sources)}"]
    part_shape = (shape[1] // count, *shape[2:])
    problems = []
    for part, source in enumerate(stacking.sources):
        held = sorted(e for p, e in parts if p == part)
        missing = [e for e in range(experts) if e not in held]
        beyond = [e for e in held if e >= experts]
        if missing:
            problems.append(f"the model's {whole} is stacked from one tensor per expert, but the checkpoint has no "
                            f"{source!r} for expert(s) {missing} of {experts} (it has experts {held}): "
                            f"e.g. {stacking.key_of(name, part, missing[0])!r} is missing")
        if beyond:
            problems.append(f"the checkpoint holds {source!r} for expert(s) {beyond}, but the model's {whole} has "
                            f"{experts} experts (a checkpoint of another configuration?)")
        for expert in held:
            key = parts[part, expert]
            if expert < experts and tuple(shape_of(key)) != part_shape:
                problems.append(f"{where(key)} has shape {list(shape_of(key))}; as expert {expert}'s source {part} of "
                                f"the model's {whole} it must be {list(part_shape)}")
    return problems


def read_stacked(pieces: dict[tuple[int, int], str], parts: int, box: tuple[slice, ...], dtype: torch.dtype,
                 read: Callable[[str, tuple[slice, ...]], torch.Tensor], rows: int) -> torch.Tensor:
    """Box ``box`` of a stacked parameter, read from the per-expert tensors it crosses only.

    ``pieces``: ``{(source, expert): key}``; ``rows``: each source's rows (dim 1 of the parameter);
    ``read(key, box)``: a box of one checkpoint tensor."""
    out = torch.empty([s.stop - s.start for s in box], dtype=dtype)
    experts, lines, rest = box[0], box[1], box[2:]
    for expert in range(experts.start, experts.stop):
        for part in range(parts):
            start, stop = max(lines.start, part * rows), min(lines.stop, (part + 1) * rows)
            if start >= stop:
                continue
            value = read(pieces[part, expert], (slice(start - part * rows, stop - part * rows), *rest))
            out[expert - experts.start, start - lines.start:stop - lines.start] = value
    return out


__all__ = ["Piece", "Stacking", "collect_stacked", "read_stacked", "stacked_problems", "unstacked"]
