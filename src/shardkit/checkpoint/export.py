"""HuggingFace weights out: ``sk.export_hf(path, model)`` from a sharded model, streamed.

Writes what ``save_pretrained`` writes, so ``AutoModelForCausalLM.from_pretrained(path)`` (or
``sk.shard(..., weights=path)``) reads it: ``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` files of at most ``max_shard_size`` each with
``model.safetensors.index.json`` (``weight_map`` and ``metadata.total_size``), and the model's
``config.json`` (and ``generation_config.json``) when it has one.

Streaming: parameters are taken one at a time, in the model's order; the ranks holding one
gather it whole (``full_tensor`` within its mesh, packed-projection permutations undone), the
first of them sends it to rank 0, and rank 0 appends its bytes to the open file. No rank holds
more than its shards and one whole tensor (rank 0: two, the one written and the one arriving);
stacked experts travel one expert at a time, from the rank holding it whole.
Names are the unsharded model's; a tied parameter is written once under its first name, as
transformers does (``lm_head.weight`` is left out when tied to the embedding).

Why not DCP's ``consolidate_safetensors_files``/``HuggingFaceStorageWriter``: they write every
rank's shards first and consolidate from disk, needing the model twice on disk, and know
nothing of permuted packed projections.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..families import family_of
from ..families.base import WeightNames
from ..io.folders import FolderWrite
from ..io.hf_weights import INDEX, SINGLE
from ..io.safetensors import SafetensorsWriter
from ..io.stacked import Stacking, unstacked
from ..plan import UsageError
from ..plan.text import parse_bytes
from ..runtime import p2p
from ..runtime.devices import rank_device
from ..runtime.pieces import full_parameter, pieces
from .state import load_model_tensors
from .store import CONFIG_FILES, check_files, checkpoint_to_load, write_model_config


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _local_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    """``{name: (tensor, is parameter)}`` this rank holds: parameters (each tied one once, also
    across pipeline stages) and persistent buffers, in the model's order."""
    state = model.state_dict(keep_vars=True)  # first: FSDP2 reshards here a model a forward left unsharded
    copies = getattr(model, "tied_copies", {})
    out = {name: (p, True) for name, p in model.named_parameters() if name not in copies}
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, value in state.items():
        if name not in params and name not in out and isinstance(value, torch.Tensor):
            out[name] = (value, False)
    return out


Entry = tuple[str, tuple[int, ...], torch.dtype]  # name, full shape, dtype written
#: One tensor of the files: its name there, shape and dtype, the unit it comes from (a model
#: tensor, or one expert of stacked experts: ``(name, expert or None)``), and its rows of that
#: unit (an expert's part of stacked experts; ``None``: all of it).
Written = tuple[str, tuple[int, ...], torch.dtype, tuple[str, "int | None"], "slice | None"]


def _gather_catalogue(local: dict[str, tuple[torch.Tensor, bool]], dtype: torch.dtype | None,
                      world: int) -> tuple[list[Entry], dict[str, list[int]]]:
    """Every tensor of the whole model, in order, and the ranks holding each."""
    mine = [(name, tuple(t.shape), _written(t.dtype, dtype)) for name, (t, _) in local.items()]
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    entries: dict[str, Entry] = {}
    holders: dict[str, list[int]] = {}
    for rank, found in enumerate(everyone):
        for entry in found:
            entries.setdefault(entry[0], entry)
            holders.setdefault(entry[0], []).append(rank)
    return list(entries.values()), holders


def _written(stored: torch.dtype, asked: torch.dtype | None) -> torch.dtype:
    return stored if asked is None or not stored.is_floating_point else asked


def _as_written(entries: list[Entry], names: WeightNames) -> list[Written]:
    """The tensors of the files, in order, named as the model's library writes them: stacked
    experts as one tensor per expert where the library's files hold them so
    (:func:`~shardkit.io.stacked.unstacked`), each other tensor whole."""
    stackings = [Stacking(target, sources) for target, sources in names.stacked]
    out: list[Written] = []
    for name, shape, kind in entries:
        parts = unstacked(name, shape, stackings)
        if parts is None:
            out.append((names.to_checkpoint(name), shape, kind, (name, None), None))
            continue
        for part in parts:
            out.append((names.to_checkpoint(part.key), (part.rows.stop - part.rows.start, *shape[2:]), kind,
                        (name, part.expert), part.rows))
    return out


def _per_expert(entries: list[Entry], names: WeightNames) -> set[str]:
    """The model tensors written one expert at a time (stacked experts the files hold per expert)."""
    stackings = [Stacking(target, sources) for target, sources in names.stacked]
    return {name for name, shape, _ in entries if unstacked(name, shape, stackings) is not None}


def _expert_owners(local: dict[str, tuple[torch.Tensor, bool]], stacked: set[str], world: int
                   ) -> dict[str, list[int]]:
    """``{stacked parameter: the rank holding each expert whole}`` (the first that does), for those
    whose every expert some rank holds whole; the others are gathered whole."""
    mine = {}
    for name in stacked & set(local):
        value = local[name][0]
        boxes = [piece.box for piece in pieces(value)]
        whole = all(b[d] == slice(0, value.shape[d]) for b in boxes for d in range(1, value.dim()))
        mine[name] = [(b[0].start, b[0].stop) for b in boxes] if whole else None
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    owners: dict[str, list[int]] = {}
    for name in stacked:
        held = [(rank, found.get(name)) for rank, found in enumerate(everyone) if name in found]
        if not held or any(ranges is None for _, ranges in held):
            continue
        experts = max(stop for _, ranges in held for _, stop in ranges)
        first = [next((rank for rank, ranges in held if any(a <= e < b for a, b in ranges)), None)
                 for e in range(experts)]
        if None not in first:
            owners[name] = first  # type: ignore[assignment]
    return owners


def _local_expert(value: torch.Tensor, expert: int) -> torch.Tensor:
    """Expert ``expert`` of stacked experts, from this rank's shard holding it whole."""
    piece = next(p for p in pieces(value) if p.box[0].start <= expert < p.box[0].stop)
    return piece.local[expert - piece.box[0].start]


def _groups(entries: list, limit: int) -> list[list]:
    """``entries`` per file: in order, a new file when the next tensor would pass ``limit``
    bytes (a tensor larger than ``limit`` gets a file of its own), as transformers does."""
    groups: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = _nbytes(entry)
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    return groups


def _nbytes(entry: Entry) -> int:
    return torch.Size(entry[1]).numel() * torch.empty((), dtype=entry[2]).element_size()


#: What an export holds: what ``overwrite`` may replace (anything else in the folder is the user's).
EXPORT_FILES = re.compile(rf"{re.escape(SINGLE)}|{re.escape(INDEX)}|model-\d{{5}}-of-\d{{5}}\.safetensors|"
                          rf"{'|'.join(map(re.escape, CONFIG_FILES))}")


def _prepared(path: Path, overwrite: bool, source: tuple[str, Path] | None = None) -> FolderWrite:
    """The export's :class:`~shardkit.io.folders.FolderWrite`, checked on rank 0 (every rank raises
    its refusal) before any tensor moves."""
    write = FolderWrite(path, EXPORT_FILES.fullmatch)
    problem = ""
    if _rank_world()[0] == 0:
        try:
            write.prepare(overwrite, repr(str(path)), f"{path} exists and is not an empty folder: pass overwrite=True "
                          f"(on the command line: --overwrite) to replace it", source)
        except UsageError as error:
            problem = str(error)
    problem = _rank0_value(problem, _rank_world()[1])
    if problem:
        raise UsageError(problem)
    return write


def _write_folder(write: FolderWrite, entries: list[Entry], max_shard_size: str | int,
                  tensors: Callable[[list[Entry]], Iterator[torch.Tensor | None]], finish: Callable[[Path], None],
                  progress: Callable[[str, int], None] | None, names: WeightNames) -> Path:
    """Write a HuggingFace folder: ``tensors(entries)`` yields the model's tensors in order, the
    :func:`_per_expert` ones expert by expert (on
    rank 0; other ranks' iterations do their part of gathering them and yield None); then the
    index and ``finish(folder)``. Rank 0 writes into a hidden folder that takes the place of
    ``write.path`` whole when complete (a kill at any moment leaves the old export or the new
    one). Tensors are written under the names the model's library writes (``names.to_checkpoint``),
    stacked experts one tensor per expert where its files hold them so (``names.stacked``)."""
    rank, world = _rank_world()
    groups = _groups(_as_written(entries, names), parse_bytes(max_shard_size))
    files = [SINGLE] if len(groups) == 1 else [f"model-{k:05d}-of-{len(groups):05d}.safetensors"
                                              for k in range(1, len(groups) + 1)]
    coming = tensors(entries)
    held: tuple[tuple[str, int | None], torch.Tensor | None] = (("", None), None)  # the unit being written
    with write.open() if rank == 0 else nullcontext() as staging:
        for file_name, group in zip(files, groups):
            header = {key: (shape, kind) for key, shape, kind, _, _ in group}
            with SafetensorsWriter(staging / file_name, header) if rank == 0 else nullcontext() as writer:
                for key, _, kind, unit, rows in group:
                    if held[0] != unit:
                        held = (("", None), None)  # freed before the next one is gathered
                        held = (unit, next(coming))
                    tensor = held[1] if rows is None or held[1] is None else held[1][rows]
                    if writer is not None and tensor is not None:
                        writer.write(key, tensor.to(kind).cpu())
                        if progress is not None:
                            progress(key, tensor.numel() * tensor.element_size())
        if rank == 0:
            if len(groups) > 1:
                weight_map = {key: file_name for file_name, group in zip(files, groups) for key, *_ in group}
                index = {"metadata": {"total_size": sum(map(_nbytes, entries))}, "weight_map": weight_map}
                (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            finish(staging)
    if world > 1:
        dist.barrier()
    return write.path


def export_hf(path: str | os.PathLike, model: nn.Module, *, max_shard_size: str | int = "2GB",
              dtype: torch.dtype | None = None, overwrite: bool = False,
              progress: Callable[[str, int], None] | None = None) -> Path:
    """Write ``model``'s full weights as a HuggingFace folder at ``path``; every rank calls it.

    ``max_shard_size``: the most bytes per ``.safetensors`` file (``"2GB"``, ``"500MiB"``);
    ``dtype``: cast floating tensors on the way out (``torch.bfloat16``); ``overwrite``: replace
    an existing export (else an existing, non-empty ``path`` is an error; a folder holding
    anything an export does not write, a tokenizer for one, is never replaced: the files are
    named). ``path`` is replaced atomically: written under a hidden name beside it, then swapped
    in, so a process killed at any moment leaves the old export or the new one, complete.
    ``progress(name, bytes)`` is called on rank 0 after each tensor. Returns ``path``.

    >>> import tempfile, torch
    >>> folder = export_hf(tempfile.mkdtemp() + "/out", torch.nn.Linear(3, 2))
    >>> sorted(p.name for p in folder.iterdir())
    ['model.safetensors']
    """
    write = _prepared(Path(path), overwrite)
    rank, world = _rank_world()
    permutations = getattr(model, "_sk_permutations", {})
    local = _local_tensors(model)
    entries, holders = _gather_catalogue(local, dtype, world)
    names = family_of(model).weight_names(model)
    stacked = _per_expert(entries, names)
    owners = _expert_owners(local, stacked, world)

    def tensors(everything: list[Entry]) -> Iterator[torch.Tensor | None]:
        for name, shape, kind in everything:  # every tensor of the model, in order
            if name in owners:  # stacked experts, one expert at a time from the rank holding it
                for expert, owner in enumerate(owners[name]):
                    tensor = _local_expert(local[name][0], expert).detach() if rank == owner else None
                    if rank == 0 and tensor is None:
                        tensor = _receive(owner, shape[1:], kind)
                    elif rank != 0 and rank == owner:
                        p2p.exchange_and_wait(None, sends=[(0, tensor.to(kind).contiguous().reshape(-1).view(torch.uint8))])
                    yield tensor if rank == 0 else None
                continue
            tensor = None
            if rank in holders[name]:  # a collective among the ranks holding it
                value, is_param = local[name]
                tensor = full_parameter(value, permutations.get(name) if is_param else None)
            if rank == 0 and tensor is None:
                tensor = _receive(holders[name][0], shape, kind)
            elif rank != 0 and rank == holders[name][0]:
                p2p.exchange_and_wait(None, sends=[(0, tensor.to(kind).contiguous().reshape(-1).view(torch.uint8))])
            if name in stacked:  # gathered whole (an expert split across ranks), written expert by expert
                yield from (tensor[e] if rank == 0 else None for e in range(shape[0]))
            else:
                yield tensor if rank == 0 else None

    def finish(folder: Path) -> None:
        write_model_config(folder, model)
        config = folder / "config.json"
        if dtype is not None and config.is_file():  # the config says the dtype the weights are in
            values = json.loads(config.read_text())
            values["dtype"] = str(dtype).removeprefix("torch.")
            values.pop("torch_dtype", None)
            config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")

    return _write_folder(write, entries, max_shard_size, tensors, finish, progress, names)


def convert_to_hf(checkpoint: str | os.PathLike, path: str | os.PathLike, *, max_shard_size: str | int = "2GB",
                  dtype: torch.dtype | None = None, overwrite: bool = False,
                  progress: Callable[[str, int], None] | None = None) -> Path:
    """Write the weights of a checkpoint saved by ``sk.save`` as a HuggingFace folder, in this
    one process, without building the model.

    ``checkpoint``: one checkpoint folder, or a folder of them (the latest complete one). Every
    file is checked first (sizes and sha256). Tensors are read with DCP a file's worth at a time
    (at most ``max_shard_size``), permutations undone; the checkpoint's ``config.json`` (saved
    when the model had a HuggingFace config) is copied beside them. ``path`` must lie outside
    ``checkpoint`` and not hold it (it is replaced whole). Other arguments as :func:`export_hf`.
    """
    if _rank_world()[1] > 1:
        raise UsageError("convert_to_hf reads a checkpoint in one process; in a launched world, sk.load it into "
                         "the sharded model and call sk.export_hf(path, model)")
    write = _prepared(Path(path), overwrite, (f"the checkpoint {str(checkpoint)!r}", Path(checkpoint)))
    folder, manifest = checkpoint_to_load(Path(checkpoint))
    check_files(folder, manifest)
    entries = [(name, tuple(shape), _written(getattr(torch, kind), dtype))
               for name, (shape, kind) in manifest.parameters.items()]
    stored = {name: getattr(torch, kind) for name, (_, kind) in manifest.parameters.items()}
    names = _names_of_saved(folder)
    stacked = _per_expert(entries, names)

    def tensors(everything: list[Entry]) -> Iterator[torch.Tensor]:
        for group in _groups(everything, parse_bytes(max_shard_size)):  # read a file's worth at a time
            state = {name: torch.empty(shape, dtype=stored[name]) for name, shape, _ in group}
            load_model_tensors(folder, state)
            for name, _, _ in group:
                tensor = state.pop(name)
                permutation = manifest.permutations.get(name)
                if permutation is not None:
                    dim, order = permutation
                    tensor = tensor.index_select(dim, torch.argsort(torch.tensor(order)))
                if name in stacked:
                    yield from tensor
                else:
                    yield tensor

    def finish(staging: Path) -> None:
        for name in CONFIG_FILES:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, staging / name)

    return _write_folder(write, entries, max_shard_size, tensors, finish, progress, names)


def _names_of_saved(folder: Path) -> WeightNames:
    """The tensor names the saved model's library writes, from the ``config.json`` kept in the
    checkpoint: the model's class is built on meta (no memory) to ask transformers; a checkpoint
    without a HuggingFace config keeps the model's names."""
    if not (folder / "config.json").is_file():
        return WeightNames()
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    architecture = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
    if architecture is None:
        return WeightNames()
    with torch.device("meta"):
        model = architecture(config)
    return family_of(model).weight_names(model)


def _rank0_value(value: str, world: int) -> str:
    """Rank 0's ``value`` on every rank (so all raise, or none do)."""
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _receive(source: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A whole tensor sent by ``source`` (as bytes, so any dtype travels on any backend)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=rank_device())
    p2p.exchange_and_wait(None, receives=[(source, buffer)])
    return buffer.view(dtype).reshape(shape).cpu()


__all__ = ["convert_to_hf", "export_hf"]
