"""Write a file or a folder so that it appears complete or not at all, even if the process is killed midway.

Everything is written under a temporary name (``.tmp-...``) beside its final place, flushed to disk with
``fsync``, and then renamed: within one file system a rename has no half-done state. On Linux and macOS the
folder's own entry is flushed too, so that the rename survives a power cut. A kill leaves at most a ``.tmp-...``
entry behind, which ``remove_temporaries`` clears before the next write.

Several processes writing one folder together agree on the outcome (helpers.checkpoint.together): if one fails, all
raise at once, instead of the others waiting for it at the next collective until the process group's timeout.

Windows (reasoned from Python's documentation, not run here): a folder cannot be opened as a file there
(``os.open`` raises PermissionError), so its entry is not flushed (``SYNC_FOLDERS``; other projects do the same,
e.g. influxdata/influxdb builds its ``SyncDir`` in pkg/file/file_unix.go only off Windows). ``os.fsync`` there
is ``_commit``, which refuses a file opened read-only, so files are flushed through a handle opened for writing.
``os.rename`` refuses an existing target there: folders are renamed only to free names, files are replaced with
``os.replace``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from helpers.checkpoint.together import FAILURES, fail_together
from helpers.distributed import rank, with_others

TEMPORARY_PREFIX = ".tmp-"
SYNC_FOLDERS = os.name != "nt"
"""Whether a folder's entry can be flushed: opening a folder (``os.open``) raises PermissionError on Windows."""


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` survive a power cut (the folder's entry is data too)."""
    if not SYNC_FOLDERS:
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_file(path: Path) -> None:
    """Flush a file someone else wrote (torch.save, safetensors) to disk, through a handle that may write."""
    with open(path, "r+b") as file:
        os.fsync(file.fileno())


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: readers see the old file or the new one, never half of it."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=TEMPORARY_PREFIX, delete=False) as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(file.name, path)
    fsync_dir(path.parent)


@contextmanager
def atomic_folder(path: Path, every_process: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path``; when the block ends, it becomes ``path``. Whoever writes a
    file into it flushes it (``fsync_file``) before the block ends.

    ``every_process``: all processes of the group write into the same folder (a collective: call it on every
    process); rank 0 renames it once all have finished. Otherwise only the caller writes. If the block raises on
    any process, every process raises (``fail_together``), nothing is renamed and the temporary folder stays for
    ``remove_temporaries``. An existing ``path`` is replaced (``replace_folder``), with a moment in which a kill
    leaves no folder there: a folder that must always exist goes under a new name, as helpers.checkpoint's do.
    """
    shared = every_process and with_others()
    renames = rank() == 0 or not shared
    temporary = [Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX, dir=path.parent)) if renames else None]
    if shared:
        dist.broadcast_object_list(temporary, src=0)
    error = None
    try:
        yield temporary[0]
    except FAILURES as raised:
        error = raised
    if shared:
        fail_together(error)  # every process has written and flushed its files, or all raise
    elif error is not None:
        raise error
    error = None
    if renames:
        try:
            replace_folder(temporary[0], path)
        except FAILURES as raised:
            error = raised
    if shared:
        fail_together(error)  # no process goes on before ``path`` exists
    elif error is not None:
        raise error


def replace_folder(temporary: Path, path: Path) -> None:
    """Rename the flushed folder ``temporary`` to ``path``; an older ``path`` is moved aside first, then removed."""
    for folder in [temporary, *temporary.rglob("*")]:
        if folder.is_dir():
            fsync_dir(folder)
    old = None
    if path.exists():  # the same name again: move the old one out of the way (Windows cannot rename over it)
        old = Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX, dir=path.parent))
        path.rename(old / path.name)
    temporary.rename(path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old)


def remove_folder(path: Path) -> None:
    """Remove the folder ``path``; it is first renamed to a temporary name, so that a kill midway leaves no
    half-removed folder under its name, only a temporary one for ``remove_temporaries``."""
    aside = Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX, dir=path.parent))
    path.rename(aside / path.name)
    shutil.rmtree(aside)


def remove_temporaries(directory: Path) -> None:
    """Remove what writes killed midway left in ``directory``."""
    for stale in directory.glob(TEMPORARY_PREFIX + "*"):
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
