"""Write a file or a folder so that it appears complete or not at all, even if the process is killed midway.

Everything is written under a temporary name (``.tmp-...``) beside its final place, flushed to disk with
``fsync``, and then renamed: within one file system a rename has no half-done state. The folder's own entry is
flushed too, so that the rename survives a power cut. A kill leaves at most a ``.tmp-...`` entry behind, which
``remove_temporaries`` clears before the next write.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from helpers.distributed import rank, with_others

TEMPORARY_PREFIX = ".tmp-"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` survive a power cut (the folder's entry is data too)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as file:
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
    """Yield an empty temporary folder beside ``path``; when the block ends, it becomes ``path`` (replacing an
    older one of that name). Whoever writes a file into it flushes it (``fsync_file``) before the block ends.

    ``every_process``: all processes of the group write into the same folder (a collective: call it on every
    process); rank 0 renames it once all have finished. Otherwise only the caller writes. If the block raises,
    nothing is renamed and the temporary folder stays for ``remove_temporaries``.
    """
    shared = every_process and with_others()
    renames = rank() == 0 or not shared
    temporary = [Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX, dir=path.parent)) if renames else None]
    if shared:
        dist.broadcast_object_list(temporary, src=0)
    yield temporary[0]
    if shared:
        dist.barrier()  # every process has written and flushed its files
    if renames:
        replace_folder(temporary[0], path)
    if shared:
        dist.barrier()  # no process goes on before ``path`` exists


def replace_folder(temporary: Path, path: Path) -> None:
    """Rename the flushed folder ``temporary`` to ``path``; an older ``path`` is moved aside first, then removed."""
    for folder in [temporary, *temporary.rglob("*")]:
        if folder.is_dir():
            fsync_dir(folder)
    old = None
    if path.exists():  # the same name again (a run restarted from scratch): move the old one out of the way
        old = Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX, dir=path.parent))
        path.rename(old / path.name)
    temporary.rename(path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old)


def remove_temporaries(directory: Path) -> None:
    """Remove what writes killed midway left in ``directory``."""
    for stale in directory.glob(TEMPORARY_PREFIX + "*"):
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
