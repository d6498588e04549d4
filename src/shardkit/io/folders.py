"""Folders written whole, never over what is not ours: the one home of the overlap check and of
replacing a folder atomically (``sk.write_shards``, ``sk.export_hf``, ``sk.convert_to_hf``).

**Overlap.** :func:`overlap` says whether two paths are one folder or one inside the other,
symlinks followed and folders compared by device and inode (a bind mount is the folder it shows).

**Replacing.** :class:`FolderWrite` puts a new folder at ``path`` so that a process killed at
any instant leaves at ``path`` the old folder or the new one, each complete:

1. *prepare*: leftovers of writers that died are recovered (below); then what is at ``path`` is
   checked: a file, or a non-empty folder without ``overwrite``, or anything in it that this
   writer does not write (``ours(name)`` false: a file the user keeps there), is refused;
2. *open*: the new folder is written into a hidden sibling ``.NAME.partial-HOST-PID-RANDOM``
   (same file system), locked with ``flock`` while its writer lives;
3. *commit*: every file and the folder are synced; then, ``path`` absent, one ``rename``;
   ``path`` present, the two folders swap names in one atomic step (Linux
   ``renameat2(RENAME_EXCHANGE)``) and the old one, now under the hidden name, is deleted.
   Where the file system cannot swap: ``rename(path, .NAME.replaced-HOST-PID-RANDOM)``, then
   ``rename(hidden, path)``, then the old folder is deleted. Each step is synced.

What a kill leaves, and what the next write to ``path`` does with it (it holds each leftover's
lock first, so it never touches the folder of a writer still alive: that is refused, naming it):

- during 1-2, or after the swap while the old folder is deleted: ``path`` is the old folder,
  or the new one; a ``.NAME.partial-*`` folder is left, removed;
- between the two renames of the fallback: ``path`` is absent and ``.NAME.replaced-*`` holds the
  old folder, complete: it is renamed back to ``path`` (a warning says so) before anything else.
  A reader in between finds no folder (:func:`interrupted_replacement` names the leftover);
- after the second rename: ``path`` is the new folder; the ``.NAME.replaced-*`` left is removed.

>>> import tempfile
>>> root = Path(tempfile.mkdtemp())
>>> overlap(root, root / "out"), overlap(root / "a", root / "b")
('the second is inside the first', None)
>>> write = FolderWrite(root / "out", ours=lambda name: name == "a.txt")
>>> write.prepare(overwrite=False, label="OUT", occupied="OUT is not empty")
>>> with write.open() as folder:
...     _ = (folder / "a.txt").write_text("new")
>>> sorted(p.name for p in root.iterdir()), (root / "out" / "a.txt").read_text()
(['out'], 'new')
>>> shutil.rmtree(root)
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import re
import secrets
import shutil
import socket
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..plan.errors import UsageError

_HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def overlap(first: str | os.PathLike, second: str | os.PathLike) -> str | None:
    """How two paths overlap: ``'the same folder'``, ``'the second is inside the first'`` or
    ``'the first is inside the second'``; ``None`` when neither holds the other. Symlinks are
    followed; existing folders are compared by device and inode, so two names of one folder
    (a bind mount, a hard-linked path) are one folder.

    >>> overlap("/data/run", "/data/run/step-00000001"), overlap("/data/a", "/data/b")
    ('the second is inside the first', None)
    """
    a, b = _identities(Path(first)), _identities(Path(second))
    if a[0] == b[0]:
        return "the same folder"
    if a[0] in b:
        return "the second is inside the first"
    if b[0] in a:
        return "the first is inside the second"
    return None


def _identities(path: Path) -> list[object]:
    """The identity of ``path`` and of every folder above it: ``(device, inode)`` where it exists,
    else the resolved path (a folder not yet made is inside nothing but what its path says)."""
    found: list[object] = []
    for part in [resolved := path.resolve(), *resolved.parents]:
        try:
            status = part.stat()
        except OSError:
            found.append(str(part))
        else:
            found.append((status.st_dev, status.st_ino))
    return found


def writer_of(name: str) -> str:
    """Who writes a temporary folder named ``...-HOST-PID-RANDOM``, for messages.

    >>> writer_of(".out.partial-node7-4242-9f3a1c2b")
    'process 4242 on node7'
    """
    parts = name.rsplit("-", 3)
    return f"process {parts[-2]} on {parts[-3]}" if len(parts) == 4 else f"the writer of {name}"


def writer_tag() -> str:
    """``HOST-PID`` of this process, as temporary folders carry it in their names."""
    return f"{_HOST}-{os.getpid()}"


def interrupted_replacement(path: str | os.PathLike) -> str:
    """For a reader that finds nothing at ``path``: ``'; ...'`` naming a folder a killed replacement
    left beside it (renamed back by the next write), or ``''``."""
    path = Path(path)
    backups = sorted(p.name for p in _leftovers(path) if ".replaced-" in p.name) if path.parent.is_dir() else []
    if not backups:
        return ""
    return (f"; {backups[-1]} beside it holds the previous folder, left by a write that was killed while "
            f"replacing it: the next write to {path.name} puts it back, or rename it to {path.name}")


class FolderWrite:
    """Write a new folder at ``path`` whole (see the module docstring): :meth:`prepare`, then
    ``with write.open() as folder:`` (the folder is in place when the block ends without an
    error, removed when it raises). A symlink at ``path`` is followed: its target is replaced."""

    def __init__(self, path: str | os.PathLike, ours: Callable[[str], bool]):
        self.path, self.ours = Path(path), ours
        self.target = Path(os.path.realpath(self.path))
        self.staging: Path | None = None
        self._locks: list[int] = []

    def prepare(self, overwrite: bool, label: str, occupied: str, source: tuple[str, Path] | None = None) -> None:
        """Recover what killed writers left, then check ``path``. :class:`UsageError` for a file
        there, a ``source`` ``(its label, path)`` that overlaps it, a non-empty folder without
        ``overwrite`` (the message ``occupied``), entries this writer does not write, or another
        writer alive; ``label`` names ``path`` in messages."""
        self._recover(label)
        target = self.target
        if os.path.lexists(target) and not target.is_dir():
            raise UsageError(f"{label} is a file; give a folder to write into (a file is never replaced)")
        how = None if source is None else overlap(source[1], self.path)
        if how is not None:
            raise UsageError(f"{source[0]} and {label} overlap ({how}): {label} is written whole and replaces "
                             f"what is there, so neither may hold the other; write to a folder outside {source[0]}")
        entries = sorted(os.listdir(target)) if target.is_dir() else []
        if entries and not overwrite:
            raise UsageError(occupied)
        foreign = [name for name in entries if not self.ours(name)]
        if foreign:
            raise UsageError(f"{label} holds {', '.join(foreign)}, which this write does not make: replacing the folder "
                             f"would delete them, so nothing was written; move them out of it, or write elsewhere")

    @contextmanager
    def open(self) -> Iterator[Path]:
        """The hidden folder to write into, locked; in place at ``path`` when the block ends."""
        self.target.parent.mkdir(parents=True, exist_ok=True)
        staging = self.target.parent / f".{self.target.name}.partial-{writer_tag()}-{secrets.token_hex(4)}"
        staging.mkdir()
        self.staging = staging
        try:
            self._locks.append(_locked(staging))
            yield staging
            self._commit(staging)
        finally:
            if self.staging is not None:
                shutil.rmtree(self.staging, ignore_errors=True)
            for handle in self._locks:
                os.close(handle)
            self._locks.clear()

    def _commit(self, staging: Path) -> None:
        target, parent = self.target, self.target.parent
        _sync_tree(staging)
        if not os.path.lexists(target):
            os.rename(staging, target)
            self.staging = None
            sync_folder(parent)
            return
        self._locks.append(_locked(target))  # the old folder: a leftover of it is never taken for a dead writer's
        if _exchange(staging, target):
            old = staging  # the new folder is at path, the old one under the hidden name
            self.staging = None
        else:
            old = parent / f".{target.name}.replaced-{writer_tag()}-{secrets.token_hex(4)}"
            os.rename(target, old)
            sync_folder(parent)
            os.rename(staging, target)
            self.staging = None
        sync_folder(parent)
        shutil.rmtree(old)

    def _recover(self, label: str) -> None:
        """Leftovers of writes to ``path`` whose writers died: a previous folder a kill left aside
        goes back to ``path``; the rest is removed. A leftover still locked is a live writer: refused."""
        if not self.target.parent.is_dir():
            return
        held: list[tuple[Path, int]] = []
        try:
            for leftover in _leftovers(self.target):
                try:
                    handle = _locked(leftover)
                except FileNotFoundError:
                    continue
                except BlockingIOError:
                    raise UsageError(f"{label} is being written by {writer_of(leftover.name)} (into {leftover.name} "
                                     f"beside it); wait until it ends, or write elsewhere") from None
                held.append((leftover, handle))
            backups = [path for path, _ in held if ".replaced-" in path.name]
            if backups and not os.path.lexists(self.target):
                previous = max(backups, key=lambda p: p.stat().st_mtime)
                os.rename(previous, self.target)
                sync_folder(self.target.parent)
                warnings.warn(f"{self.path}: the previous folder was put back from {previous.name}, left by a write "
                              f"that was killed while replacing it", stacklevel=3)
            for leftover, _ in held:
                if os.path.lexists(leftover):
                    shutil.rmtree(leftover)
        finally:
            for _, handle in held:
                os.close(handle)


def _leftovers(target: Path) -> list[Path]:
    """The hidden folders that writes to ``target`` make beside it."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(partial|replaced)-\w+-\d+-[0-9a-f]+")
    return sorted(p for p in target.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir())


def _locked(folder: Path) -> int:
    """A descriptor of ``folder`` holding its exclusive ``flock`` (released when closed, or when the
    process dies); :class:`BlockingIOError` when another process holds it. On a file system without
    ``flock`` the descriptor holds no lock (writers there are not told apart)."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        raise
    except OSError as error:
        if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            os.close(handle)
            raise
    return handle


def _sync_tree(folder: Path) -> None:
    """Every file under ``folder``, then every folder, made durable."""
    for where, _, files in os.walk(folder):
        for name in files:
            handle = os.open(os.path.join(where, name), os.O_RDONLY)
            try:
                os.fsync(handle)
            finally:
                os.close(handle)
        sync_folder(Path(where))


def sync_folder(folder: Path) -> None:
    """Make the folder's entries (new, renamed, removed) durable."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """libc's ``renameat2``, which Python's ``os`` lacks (Linux, glibc 2.28 or later), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _exchange(first: Path, second: Path) -> bool:
    """Swap the names of two folders in one atomic step; False where the system or the file system
    cannot (the caller then renames in two steps)."""
    rename = _renameat2()
    if rename is None:
        return False
    if rename(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(error, os.strerror(error), str(second))


__all__ = ["FolderWrite", "interrupted_replacement", "overlap", "sync_folder", "writer_of", "writer_tag"]
