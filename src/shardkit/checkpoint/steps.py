"""The ``step-*`` folders of a folder of checkpoints: which one is the latest, which are complete,
and which ``keep_last`` removes.

``sk.save`` names a folder ``step-*`` only once it is complete (the rename is its last step), so
every ``step-*`` entry is a checkpoint, and one that is not what its manifest says is
**damaged**: refused by name, never passed over for the one before it. Only the hidden folders
of saves in progress or killed (``.step-*.tmp-*``) and of interrupted removals are passed over.

- *the latest*: the ``step-*`` entry of the highest step. Damaged (not a folder, no manifest, a
  manifest cut short, edited or of another step, a file missing, extra or of the wrong size) it
  is refused, naming it: :func:`latest_checkpoint`, :func:`checkpoint_to_load` (``sk.load``,
  ``shardkit train --resume``, ``shardkit checkpoint inspect``/``convert``, ``generate``);
- *complete*: a ``step-*`` folder with a valid manifest of its own step, every file listed
  present at its size and nothing else (``sk.load`` reads every byte for the sha256 too);
- *keep_last*: removes complete checkpoints beyond the newest N. A damaged one is never removed
  (it may be what the user wants to inspect or repair) nor counted; the save warns, naming it.

>>> import tempfile
>>> latest_checkpoint(tempfile.mkdtemp()) is None, step_folder_name(123)
(True, 'step-00000123')
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import warnings
from pathlib import Path

from ..io.folders import sync_folder
from .manifest import (
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    damage_message,
    read_manifest,
    size_problems,
)

STEP_FOLDER = re.compile(r"step-(\d{8,})")


def step_folder_name(step: int) -> str:
    """The folder of a step's checkpoint (at least 8 digits, so names sort as numbers do).

    >>> step_folder_name(123)
    'step-00000123'
    """
    return f"step-{step:08d}"


def step_entries(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every entry of ``root`` named ``step-*`` (folders or not), lowest step first."""
    if not root.is_dir():
        return []
    return sorted((int(match[1]), child) for child in root.iterdir() if (match := STEP_FOLDER.fullmatch(child.name)))


def checked_manifest(folder: Path) -> Manifest:
    """The manifest of checkpoint ``folder``; :class:`CheckpointError` when the folder is not one, has
    no manifest or a bad one, or (named ``step-*``) one of another step."""
    if not folder.is_dir():
        raise CheckpointError(f"{str(folder)!r} is not a folder; give a folder of checkpoints (step-* folders "
                              f"written by sk.save) or one checkpoint folder")
    manifest = read_manifest(folder)
    match = STEP_FOLDER.fullmatch(folder.name)
    if match and int(match[1]) != manifest.step:
        raise CheckpointError(f"checkpoint {str(folder)!r} has the manifest of step {manifest.step}, not of "
                              f"step {int(match[1])}: renamed, or its manifest copied from another checkpoint")
    return manifest


def damage(folder: Path) -> str | None:
    """What is wrong with checkpoint ``folder`` that a look at its manifest and file sizes shows, or None."""
    try:
        manifest = checked_manifest(folder)
    except CheckpointError as error:
        return str(error)
    sized = size_problems(folder, manifest)
    return "; ".join(f"{name} {what}" for name, what in sized.items()) or None


def complete_checkpoints(path: str | os.PathLike) -> list[Path]:
    """The complete checkpoints in folder ``path`` (see the module docstring), lowest step first."""
    return [folder for _, folder in step_entries(Path(path)) if damage(folder) is None]


def checkpoints_beside(folder: str | os.PathLike) -> list[str]:
    """The names of the other complete checkpoints in checkpoint ``folder``'s parent, newest first."""
    folder = Path(folder)
    return [other.name for other in reversed(complete_checkpoints(folder.parent)) if other != folder]


def _latest(root: Path) -> tuple[Path, Manifest] | None:
    """The ``step-*`` folder of the highest step in ``root`` and its manifest; None when there is none."""
    entries = step_entries(root)
    if not entries:
        return None
    folder = entries[-1][1]
    try:
        return folder, checked_manifest(folder)
    except CheckpointError as error:
        raise CheckpointError(damaged_latest(folder, str(error))) from None


def damaged_latest(folder: Path, problem: str) -> str:
    """The refusal of a damaged latest checkpoint: what is wrong, and how to go on."""
    others = checkpoints_beside(folder)
    earlier = f"load an earlier one by its folder ({', '.join(others)} beside it), or " if others else ""
    return (f"the latest checkpoint in {str(folder.parent)!r}, {folder.name}, is damaged, and an earlier one is never "
            f"taken in its place: {problem}. Nothing was loaded; inspect it with 'shardkit checkpoint inspect "
            f"{folder}'; to go on, {earlier}move {folder.name} out of the folder")


def latest_checkpoint(path: str | os.PathLike) -> Path | None:
    """The checkpoint of the highest step in folder ``path``, or None when it holds none (or does
    not exist); :class:`CheckpointError` naming it when that one is damaged (an earlier one is
    never returned in its place).

    >>> latest_checkpoint("/no/such/folder") is None
    True
    """
    found = _latest(Path(path))
    if found is None:
        return None
    folder, manifest = found
    sized = size_problems(folder, manifest)
    if sized:
        raise CheckpointError(damaged_latest(folder, damage_message(folder, manifest, sized)))
    return folder


def checkpoint_to_load(path: Path) -> tuple[Path, Manifest]:
    """The checkpoint folder ``path`` names (itself, or the latest in it) and its manifest, checked
    (see :func:`checked_manifest`; the files are compared by :func:`~shardkit.checkpoint.store.check_files`)."""
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} is not a folder; give a folder of checkpoints (step-* "
                              f"folders written by sk.save) or one checkpoint folder")
    if (path / MANIFEST_NAME).exists() or STEP_FOLDER.fullmatch(path.name):
        return path, checked_manifest(path)
    found = _latest(path)
    if found is None:
        saving = sorted(p.name for p in path.glob(".step-*.tmp-*"))
        raise CheckpointError(f"{str(path)!r} holds no checkpoint (no step-* folder written by sk.save)"
                              + (f"; saves in progress or killed: {', '.join(saving)}" if saving else ""))
    return found


def nothing_saved(path: Path) -> bool:
    """Whether ``path`` holds nothing to resume from: it does not exist, or it is a folder with no
    ``step-*`` entry that is not itself a checkpoint (a damaged checkpoint is something: refused on load)."""
    if STEP_FOLDER.fullmatch(path.name) or (path / MANIFEST_NAME).exists():
        return False
    return not path.exists() or (path.is_dir() and not step_entries(path))


def remove_older(root: Path, keep_last: int, written: Path) -> None:
    """Remove complete checkpoints beyond the newest ``keep_last`` (never ``written``), each first
    renamed aside so that a kill halfway through a removal never leaves a partial ``step-*`` folder.
    Damaged ones are kept, and a warning names them."""
    complete = complete_checkpoints(root)
    for folder in complete[:-keep_last]:
        if folder != written:
            aside = root / f".{folder.name}.removing-{secrets.token_hex(4)}"
            os.rename(folder, aside)
            sync_folder(root)
            shutil.rmtree(aside)
    for leftover in root.glob(".step-*.removing-*"):  # removals a kill interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    damaged = [folder.name for _, folder in step_entries(root) if folder not in complete]
    if damaged:
        warnings.warn(f"sk.save(keep_last={keep_last}): kept {', '.join(damaged)} in {root}, not counted: a folder "
                      f"named step-* that is not a complete checkpoint (damaged, or being copied in) is never "
                      f"removed; inspect it with 'shardkit checkpoint inspect', then remove it yourself",
                      stacklevel=6)  # sk.save's caller (remove_older, _commit, its lambda, from_rank0, save)


__all__ = ["STEP_FOLDER", "checked_manifest", "checkpoint_to_load", "checkpoints_beside", "complete_checkpoints",
           "damage", "damaged_latest", "latest_checkpoint", "nothing_saved", "remove_older", "step_entries",
           "step_folder_name"]
