"""Checkpoints on disk: ``sk.save`` and ``sk.load``, atomic and checked, in any plan.

``path`` is a folder of checkpoints, one sub-folder per saved step::

    path/
      step-00000100/
        .metadata                 DCP's index: every tensor, its shape, dtype, and where its parts are
        __0_0.distcp              rank 0's shards of the model and optimizer state (DCP), __1_0.distcp, ...
        rng-00000.json            rank 0's random-number-generator states, rng-00001.json, ...
        manifest.json             written last: step, plan, model identity, permutations, extra, and
                                  every other file's size and sha256
      step-00000200/
      .step-00000300.tmp-node7-4242-9f3a1c2b/    a save in progress (host, pid), or one that was killed: never loaded

**Atomic.** Every rank writes into the hidden temporary folder; every file is synced; rank 0
writes the manifest last (it names the process that saved), syncs the folder and renames it to
``step-*``. A folder named ``step-*`` is therefore complete, and one that is not is damaged:
refused by name, never passed over (:mod:`shardkit.checkpoint.steps`). A process killed at any
moment leaves the earlier checkpoints as they were, plus at most a hidden ``.step-*.tmp-*``
folder (delete it when no save is running). Two runs saving one step: the second rename fails,
and that run's :class:`CheckpointError` names the folder and the process that saved it.

**Checked.** :func:`load` compares every file with the manifest (size, then sha256: the ranks
share the reading) and the model's parameters (names, shapes, dtypes) with those saved, and
refuses a damaged checkpoint or another model's, naming the files and tensors, before any
weight changes. State is read by :mod:`shardkit.checkpoint.state` (DCP), which reshards into
whatever plan the model now has.

Both are collectives: every rank of the world calls them with its part of the model. In one
process without a process group they work alone.
"""

from __future__ import annotations

import json
import math
import operator
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..io.folders import sync_folder, writer_tag
from ..io.manifest import sha256_of
from ..plan import Plan
from ..plan.errors import UsageError
from . import rng
from .manifest import (
    MANIFEST_NAME,
    CheckpointError,
    FileEntry,
    Manifest,
    Parameters,
    checksum_problems,
    damage_message,
    model_mismatch,
    read_manifest,
    rng_file_name,
    size_problems,
)
from .ranks import all_gather, everyone, from_rank0, rank, single_process_quiet, world_size
from .state import load_state, permutations, save_state
from .steps import (
    STEP_FOLDER,
    checkpoint_to_load,
    checkpoints_beside,
    complete_checkpoints,
    latest_checkpoint,
    remove_older,
    step_folder_name,
)

# -- the public functions -------------------------------------------------------------------------

def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int,
         extra: Any = None, keep_last: int | None = None) -> Path:
    """Write a checkpoint of ``model`` (and ``optimizer``) at ``step`` to ``path/step-00000123``; returns it.

    It holds the model's and optimizer's state (each rank its shards), every rank's RNG states,
    ``extra`` (JSON-able, taken from rank 0: the training loop's data position, for one), the
    plan, the permutations of packed tensor-parallel weights, and the model's parameter names,
    shapes and dtypes. With ``keep_last=N``, older complete checkpoints beyond the newest N
    are then removed (never this one). A collective: every rank calls it.

    >>> import shutil, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> model = nn.Linear(2, 2)
    >>> saved = model.weight.detach().clone()
    >>> save(folder, model, step=3, extra={"data": {"epoch": 0, "position": 48}}).name
    'step-00000003'
    >>> _ = nn.init.zeros_(model.weight)
    >>> info = load(folder, model)            # the latest complete checkpoint in the folder
    >>> info["step"], info["extra"], torch.equal(model.weight, saved)
    (3, {'data': {'epoch': 0, 'position': 48}}, True)
    >>> shutil.rmtree(folder)
    """
    _check_save(model, optimizer, step, extra, keep_last)
    step, keep_last = operator.index(step), None if keep_last is None else operator.index(keep_last)
    root = Path(path)
    final = root / step_folder_name(step)
    parameters, permuted = model_parameters(model), permutations(model)
    work = from_rank0(lambda: _begin(root, final))
    try:
        with single_process_quiet():
            save_state(work, model, optimizer)
        everyone(lambda: _write_synced(work / rng_file_name(rank()), json.dumps(rng.capture()).encode()))
        from_rank0(lambda: write_model_config(work, model))
        manifest = Manifest(step, world_size(), _plan_of(model), parameters, _optimizer_name(optimizer), permuted,
                            extra, _hash_files(work), {"host": socket.gethostname(), "pid": os.getpid()})
        from_rank0(lambda: _commit(work, final, manifest, keep_last))
    except BaseException:
        if rank() == 0:
            shutil.rmtree(work, ignore_errors=True)
        raise
    return final


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Read a checkpoint into ``model`` (and ``optimizer``), sharded by any plan; restore the RNG states.

    ``path``: a folder of checkpoints (the one of the highest step is read; damaged, it is
    refused, never passed over) or one checkpoint folder. Every file is checked against the
    manifest and the model's parameters against those saved before anything is read:
    :class:`CheckpointError` names what does not match.
    Returns ``{"step", "extra", "plan" (a Plan, or None), "path", "world_size" (of the save),
    "rng": "restored" | "reseeded"}``: this rank's generators are those rank ``r`` saved, or,
    on a rank the save did not have, seeded from ``(step, rank)``. A collective.

    >>> info = load(checkpoints, model, optimizer)          # doctest: +SKIP
    >>> loader = ds.loader(12, rank, ranks, position=info["extra"]["data"]["position"])  # doctest: +SKIP
    """
    _check_load(model, optimizer)
    folder, manifest = from_rank0(lambda: checkpoint_to_load(Path(path)))
    check_files(folder, manifest)
    _check_model(folder, manifest, model_parameters(model))
    _check_optimizer(folder, manifest, optimizer)
    with single_process_quiet():
        load_state(folder, model, optimizer, manifest.permutations)
    return {"step": manifest.step, "extra": manifest.extra,
            "plan": None if manifest.plan is None else Plan.from_dict(manifest.plan), "path": folder,
            "world_size": manifest.world_size, "rng": _restore_rng(folder, manifest)}


def model_parameters(model: nn.Module) -> Parameters:
    """``{name: (full shape, dtype)}`` of every parameter of the model, over all ranks (a collective:
    pipeline stages each hold some), each tied one once (a later stage's copy is its first name's)."""
    copies = getattr(model, "tied_copies", {})
    local = {name: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()
             if name not in copies}
    every = {}
    for found in all_gather(local):
        every.update(found)
    return dict(sorted(every.items()))


# -- arguments -------------------------------------------------------------------------------------

def _check_save(model: Any, optimizer: Any, step: Any, extra: Any, keep_last: Any) -> None:
    _check_load(model, optimizer, "save")
    if isinstance(step, bool) or _as_int(step) is None or step < 0:
        raise UsageError(f"sk.save(step={step!r}): step must be an integer >= 0 (the training step it was taken at)")
    problem = _json_problem(extra, "extra")
    if problem:
        raise UsageError(f"sk.save(extra=...): {problem}; extra must be JSON-able: dicts with string keys, lists, "
                         f"strings, finite numbers, booleans and None")
    if keep_last is not None and (isinstance(keep_last, bool) or _as_int(keep_last) is None or keep_last < 1):
        raise UsageError(f"sk.save(keep_last={keep_last!r}): keep the newest N checkpoints, N an integer >= 1, "
                         f"or None to keep them all")


def _check_load(model: Any, optimizer: Any, call: str = "load") -> None:
    if not isinstance(model, nn.Module):
        raise UsageError(f"sk.{call}(path, model): model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"sk.{call}(path, model, optimizer): optimizer must be a torch.optim.Optimizer or None, "
                         f"got {type(optimizer).__name__}")


def _as_int(value: Any) -> int | None:
    try:
        return operator.index(value)
    except TypeError:
        return None


def _json_problem(value: Any, where: str) -> str | None:
    """Where ``value`` is not strict JSON, e.g. ``extra['data'][0] is a Tensor``; None if it is."""
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} is {value}"
    if isinstance(value, (list, tuple)):
        return next((p for i, v in enumerate(value) if (p := _json_problem(v, f"{where}[{i}]"))), None)
    if isinstance(value, dict):
        for key, v in value.items():
            if not isinstance(key, str):
                return f"{where} has the key {key!r}, not a string"
            if problem := _json_problem(v, f"{where}[{key!r}]"):
                return problem
        return None
    return f"{where} is a {type(value).__name__}"


def _plan_of(model: nn.Module) -> dict[str, Any] | None:
    plan = getattr(model, "plan", None)
    return plan.to_dict() if isinstance(plan, Plan) else None


def _optimizer_name(optimizer: torch.optim.Optimizer | None) -> str | None:
    """The optimizer's class; under ZeRO-1 the class torch's ZeroRedundancyOptimizer wraps, whose state it
    holds (so a checkpoint resumes under any ZeRO stage)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim
    return None if optimizer is None else type(optimizer).__name__


# -- saving ----------------------------------------------------------------------------------------

def _begin(root: Path, final: Path) -> Path:
    """Rank 0: the new temporary folder beside ``final``, named with this host and process (refusing
    a step already saved)."""
    root.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(final):
        raise CheckpointError(f"sk.save: {str(final)!r} exists: step {int(STEP_FOLDER.fullmatch(final.name)[1])} "
                              f"was saved before, by {_writer(final)}; save another step, or remove that folder "
                              f"first to replace it")
    work = root / f".{final.name}.tmp-{writer_tag()}-{secrets.token_hex(4)}"
    work.mkdir()
    return work


def _writer(folder: Path) -> str:
    """Who saved checkpoint ``folder``, as its manifest says."""
    try:
        return read_manifest(folder).writer
    except CheckpointError:
        return "a process whose manifest cannot be read"


#: Modules whose classes wrap a model's class (shardkit's mixins, FSDP2's ``FSDP<Class>``).
WRAPPER_MODULES = ("shardkit.", "torch.distributed.")
#: The HuggingFace configuration files a checkpoint keeps beside the weights.
CONFIG_FILES = ("config.json", "generation_config.json")


def write_model_config(folder: Path, model: nn.Module) -> None:
    """The model's HuggingFace ``config.json`` (and ``generation_config.json``) into ``folder``,
    when it has them: what a HuggingFace export of the checkpoint needs beside the weights."""
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "save_pretrained", None)):
        # as save_pretrained does: the model's class, so the folder says what to build (not the classes
        # shardkit's mixins and FSDP2 derive from it)
        own = next(c for c in type(model).__mro__ if not c.__module__.startswith(WRAPPER_MODULES))
        config.architectures = [own.__name__]
        config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and callable(getattr(generation, "save_pretrained", None)):
        generation.save_pretrained(folder)


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _hash_files(work: Path) -> tuple[FileEntry, ...]:
    """Every file's size and sha256, the ranks sharing the reading (a collective)."""
    names = from_rank0(lambda: sorted(p.name for p in work.iterdir()))
    mine = names[rank()::world_size()]
    shares = everyone(lambda: [FileEntry(n, (work / n).stat().st_size, sha256_of(work / n)) for n in mine])
    return tuple(sorted((entry for share in shares for entry in share), key=lambda e: e.name))


def _commit(work: Path, final: Path, manifest: Manifest, keep_last: int | None) -> None:
    """Rank 0: the manifest, then the rename that makes the checkpoint complete; then keep_last."""
    _write_synced(work / MANIFEST_NAME, manifest.to_json().encode())
    sync_folder(work)
    try:
        os.rename(work, final)  # never two of one step: it fails if another run has just saved this one
    except OSError as error:
        if not os.path.lexists(final):
            raise
        raise CheckpointError(f"sk.save: {str(final)!r} was saved by {_writer(final)} while this process "
                              f"({manifest.writer}) was saving the same step ({error.strerror}); this save was "
                              f"discarded. Two runs are saving into {str(final.parent)!r}: give each its own "
                              f"folder") from None
    sync_folder(final.parent)
    if keep_last is not None:
        remove_older(final.parent, keep_last, final)


# -- loading ---------------------------------------------------------------------------------------

def check_files(folder: Path, manifest: Manifest) -> None:
    """Every file's size (every rank: one ``stat`` each), then the sha256 of this rank's share."""
    sized = size_problems(folder, manifest)
    share = [entry for entry in manifest.files[rank()::world_size()] if entry.name not in sized]
    problems = dict(sized)
    for found in everyone(lambda: checksum_problems(folder, share)):
        problems.update(found)
    if problems:
        raise CheckpointError(from_rank0(lambda: damage_message(folder, manifest, problems, checkpoints_beside(folder))))


def _check_model(folder: Path, manifest: Manifest, loading: Parameters) -> None:
    problems = model_mismatch(manifest.parameters, loading)
    if problems:
        raise CheckpointError(f"checkpoint {str(folder)!r} holds another model's parameters, nothing was loaded: "
                              f"{'; '.join(problems)}. Build the model it was saved from (its parameters are "
                              f"listed by 'shardkit checkpoint inspect {folder}')")


def _check_optimizer(folder: Path, manifest: Manifest, optimizer: torch.optim.Optimizer | None) -> None:
    name = _optimizer_name(optimizer)
    if name is not None and manifest.optimizer is None:
        raise CheckpointError(f"sk.load(optimizer={name}): checkpoint {str(folder)!r} was saved without an "
                              f"optimizer; pass optimizer=None, or load a checkpoint saved with one")
    if name is not None and name != manifest.optimizer:
        raise CheckpointError(f"sk.load(optimizer={name}): checkpoint {str(folder)!r} holds {manifest.optimizer} "
                              f"state, not {name}; pass an optimizer of class {manifest.optimizer}, or "
                              f"optimizer=None to load the model only")


def _restore_rng(folder: Path, manifest: Manifest) -> str:
    """This rank's generators as saved by the same rank, or seeded from (step, rank) on a rank the save did not have."""
    if rank() < manifest.world_size:
        rng.restore(json.loads((folder / rng_file_name(rank())).read_text()))
        return "restored"
    rng.reseed(manifest.step, rank())
    return "reseeded"


__all__ = ["CheckpointError", "check_files", "checkpoint_to_load", "checkpoints_beside", "complete_checkpoints",
           "latest_checkpoint", "load", "model_parameters", "save", "step_folder_name", "write_model_config"]
