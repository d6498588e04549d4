"""HuggingFace weights out: ``sk.export_hf(path, model)`` from a sharded model, streamed.

Writes what ``save_pretrained`` writes, so ``AutoModelForCausalLM.from_pretrained(path)`` (or
``sk.shard(..., weights=path)``) reads it: ``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` files of at most ``max_shard_size`` each with
``model.safetensors.index.json`` (``weight_map`` and ``metadata.total_size``), and the model's
``config.json`` (and ``generation_config.json``) when it has one.

Streaming: parameters are taken one at a time, in the model's order; the ranks holding one
gather it whole (``full_tensor`` within its mesh, packed-projection permutations undone), the
first of them sends it to rank 0, and rank 0 appends its bytes to the open file. No rank holds
more than its shards and one whole tensor (rank 0: two, the one written and the one arriving).
Names are the unsharded model's; a tied parameter is written once under its first name, as
transformers does (``lm_head.weight`` is left out when tied to the embedding).

Why not DCP's ``consolidate_safetensors_files``/``HuggingFaceStorageWriter``: they write every
rank's shards first and consolidate from disk, needing the model twice on disk, and know
nothing of permuted packed projections.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..io.hf_weights import INDEX, SINGLE
from ..io.safetensors import SafetensorsWriter
from ..plan import UsageError
from ..plan.text import parse_bytes
from ..runtime.pieces import full_parameter


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _local_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    """``{name: (tensor, is parameter)}`` this rank holds: parameters (each tied one once) and
    persistent buffers, in the model's order."""
    out = {name: (p, True) for name, p in model.named_parameters()}
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, value in model.state_dict(keep_vars=True).items():
        if name not in params and name not in out and isinstance(value, torch.Tensor):
            out[name] = (value, False)
    return out


def _gather_catalogue(local: dict[str, tuple[torch.Tensor, bool]], dtype: torch.dtype | None,
                      world: int) -> list[tuple[str, tuple[int, ...], torch.dtype, list[int]]]:
    """Every tensor of the whole model, in order: ``(name, full shape, dtype written, ranks holding it)``."""
    mine = [(name, tuple(t.shape), t.dtype if dtype is None or not t.is_floating_point() else dtype)
            for name, (t, _) in local.items()]
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    catalogue: dict[str, tuple[tuple[int, ...], torch.dtype, list[int]]] = {}
    for rank, entries in enumerate(everyone):
        for name, shape, kind in entries:
            catalogue.setdefault(name, (shape, kind, []))[2].append(rank)
    return [(name, shape, kind, holders) for name, (shape, kind, holders) in catalogue.items()]


def _files(catalogue: list, limit: int) -> list[list[int]]:
    """Indices of ``catalogue`` per file: in order, a new file when the next tensor would pass
    ``limit`` bytes (a tensor larger than ``limit`` gets a file of its own), as transformers does."""
    files: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, dtype, _) in enumerate(catalogue):
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    return files


def export_hf(path: str | os.PathLike, model: nn.Module, *, max_shard_size: str | int = "2GB",
              dtype: torch.dtype | None = None, overwrite: bool = False,
              progress: Callable[[str, int], None] | None = None) -> Path:
    """Write ``model``'s full weights as a HuggingFace folder at ``path``; every rank calls it.

    ``max_shard_size``: the most bytes per ``.safetensors`` file (``"2GB"``, ``"500MiB"``);
    ``dtype``: cast floating tensors on the way out (``torch.bfloat16``); ``overwrite``: replace
    an existing folder (else an existing, non-empty ``path`` is an error). The folder appears
    whole or not at all (written under a temporary name, renamed last). ``progress(name,
    bytes)`` is called on rank 0 after each tensor. Returns ``path``.

    >>> import tempfile, torch
    >>> folder = export_hf(tempfile.mkdtemp() + "/out", torch.nn.Linear(3, 2))
    >>> sorted(p.name for p in folder.iterdir())
    ['model.safetensors']
    """
    path = Path(path)
    limit = parse_bytes(max_shard_size)
    rank, world = _rank_world()
    if rank == 0 and path.exists() and not overwrite and (not path.is_dir() or any(path.iterdir())):
        problem = f"{path} exists and is not an empty folder: pass overwrite=True to replace it"
    else:
        problem = ""
    problem = _agree(problem, world)
    if problem:
        raise UsageError(problem)
    permutations = getattr(model, "_sk_permutations", {})
    local = _local_tensors(model)
    catalogue = _gather_catalogue(local, dtype, world)
    files = _files(catalogue, limit)
    names = [SINGLE] if len(files) == 1 else [f"model-{k:05d}-of-{len(files):05d}.safetensors"
                                             for k in range(1, len(files) + 1)]
    staging = path.with_name(f".{path.name}.incomplete-{uuid.uuid4().hex[:8]}")
    staging = Path(_agree_value(str(staging), world))
    if rank == 0:
        staging.mkdir(parents=True)
    try:
        for file_name, members in zip(names, files):
            entries = [catalogue[i] for i in members]
            header = {n: (s, d) for n, s, d, _ in entries}
            with SafetensorsWriter(staging / file_name, header) if rank == 0 else nullcontext() as writer:
                for name, shape, kind, holders in entries:
                    tensor = _whole(name, local, permutations, holders, rank)
                    if rank == 0:
                        tensor = _receive(holders[0], shape, kind) if tensor is None else tensor.to(kind).cpu()
                        writer.write(name, tensor)
                        if progress is not None:
                            progress(name, tensor.numel() * tensor.element_size())
                    elif tensor is not None and rank == holders[0]:
                        dist.send(tensor.to(kind).contiguous().reshape(-1).view(torch.uint8), dst=0)
                    del tensor
        if rank == 0:
            _write_index_and_config(staging, model, catalogue, files, names)
            if path.exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            os.replace(staging, path)
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if world > 1:
        dist.barrier()
    return path


def _whole(name: str, local: dict, permutations: dict, holders: list[int], rank: int) -> torch.Tensor | None:
    """The whole tensor on every rank holding ``name`` (a collective among them), else None."""
    if rank not in holders:
        return None
    tensor, is_param = local[name]
    return full_parameter(tensor, permutations.get(name) if is_param else None)


def _receive(source: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A whole tensor sent by ``source`` (as bytes, so any dtype travels on any backend)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dist.recv(buffer, src=source)
    return buffer.view(dtype).reshape(shape).cpu()


def _agree(problem: str, world: int) -> str:
    """Rank 0's ``problem`` on every rank, so all raise or none do."""
    return _agree_value(problem, world)


def _agree_value(value: str, world: int) -> str:
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_index_and_config(folder: Path, model: nn.Module, catalogue: list, files: list[list[int]],
                            names: list[str]) -> None:
    if len(files) > 1:
        total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, s, d, _ in catalogue)
        weight_map = {catalogue[i][0]: file_name for file_name, members in zip(names, files) for i in members}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for attribute in ("config", "generation_config"):
        config = getattr(model, attribute, None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(folder)


__all__ = ["export_hf"]
