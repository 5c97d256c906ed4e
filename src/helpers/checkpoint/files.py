"""The files of a checkpoint folder, opened only once they are known to be what they say, and read without running code.

Every file is first looked at with ``os.stat``: it must be a regular file inside its folder (a symlink that leads
out of the folder is refused), and no larger than what it can hold (a cap the caller derives from the model). A FIFO
is never opened for reading (that waits for a writer forever), nor a device (``/dev/zero`` never ends). The file is
then opened without waiting (``O_NONBLOCK``) and checked again through its descriptor, so that a file swapped in
between is refused too.

- ``model.safetensors``: a model's full weights. safetensors holds a JSON header and raw tensor bytes: nothing in it
  can run.
- ``state.pt``: optimizer, scheduler, progress, random states; read only with ``torch.load(weights_only=True)``,
  which builds tensors, numbers, strings, lists and dicts and refuses anything else.
- ``sharded/``: a sharded model's files, written by torch.distributed.checkpoint (``shard_metadata``, ``shard_reader``).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import load_file

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"  # a sharded checkpoint's DCP files: one per process, and .metadata


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded or saved; the message names the file and the cause."""


def reason(error: BaseException) -> str:
    """An exception's message, or its type where it has none (a bare MemoryError)."""
    return str(error) or type(error).__name__


def caused(error: CheckpointError, cause: BaseException) -> CheckpointError:
    """``error`` with ``cause`` as its cause, as ``raise error from cause`` would make it: for an error raised later,
    outside the handler that caught ``cause`` (a collective first tells the other processes)."""
    error.__cause__ = error.__context__ = cause
    return error


def missing(file: Path) -> CheckpointError:
    """The error for a file a checkpoint folder should hold, saying what such a folder holds."""
    if file.parent.name == SHARDED_DIR or (file.parent / SHARDED_DIR).is_dir():
        holds = f"a sharded model's checkpoint folder holds {SHARDED_DIR}/ (.metadata and the shards) and {STATE_FILE}"
    else:
        holds = f"a checkpoint folder holds {MODEL_FILE} and {STATE_FILE}"
    return CheckpointError(f"{file}: missing; {holds}")


FILE_KINDS = ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"),
              (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISREG, "regular file"))


def kind_of_file(mode: int) -> str:
    return next((name for test, name in FILE_KINDS if test(mode)), "special file")


def inside(path: Path, folder: Path) -> bool:
    """Whether ``path``, every symlink followed, lies in ``folder`` (itself followed) or is it."""
    real, boundary = os.path.realpath(path), os.path.realpath(folder)
    return real == boundary or real.startswith(boundary.rstrip(os.sep) + os.sep)


def status_of(path: Path, folder: Path, expected: str) -> os.stat_result:
    """``os.stat(path)``, once ``path`` is known to lie inside ``folder`` and to be a folder or a regular file as
    ``expected`` ("folder" or "regular file"); CheckpointError naming ``path`` otherwise, a missing one included."""
    try:
        status = os.stat(path)
    except FileNotFoundError as error:
        if os.path.islink(path):
            problem = CheckpointError(f"{path}: a symlink to nothing ({reason(error)})")
        elif expected == "regular file":
            problem = missing(path)
        else:
            problem = CheckpointError(f"{path}: no such checkpoint folder")
        raise problem from error
    except OSError as error:
        raise CheckpointError(f"{path}: not readable ({reason(error)})") from error
    if not inside(path, folder):
        raise CheckpointError(f"{path}: leads out of {folder} (a symlink); a checkpoint's files lie inside its folder")
    found = kind_of_file(status.st_mode)
    if found != expected:
        raise CheckpointError(f"{path}: a {found}, not a {expected}; refused without reading it")
    return status


def open_regular(path: Path, folder: Path, cap: int | None = None) -> BinaryIO:
    """``path`` opened for reading, once known to be a regular file inside ``folder`` of at most ``cap`` bytes."""
    status = status_of(path, folder, "regular file")
    if cap is not None and status.st_size > cap:
        raise CheckpointError(f"{path}: {status.st_size:,} bytes, more than such a file holds here ({cap:,}); "
                              f"refused without reading it")
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as error:
        raise CheckpointError(f"{path}: not readable ({reason(error)})") from error
    opened = os.fstat(descriptor)
    if (opened.st_dev, opened.st_ino) != (status.st_dev, status.st_ino) or not stat.S_ISREG(opened.st_mode):
        os.close(descriptor)
        raise CheckpointError(f"{path}: replaced while it was being opened")
    return os.fdopen(descriptor, "rb")


def read_capped(path: Path, folder: Path, cap: int) -> bytes:
    """The bytes of the regular file ``path`` inside ``folder``, at most ``cap`` of them (it may grow meanwhile)."""
    with open_regular(path, folder, cap) as file:
        data = file.read(cap + 1)
    if len(data) > cap:
        raise CheckpointError(f"{path}: grew past {cap:,} bytes while it was being read")
    return data


def unpickling_problem(error: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, out of its long message: the line after "WeightsUnpickler
    error:" ("Unsupported global: GLOBAL exec was not an allowed global by default."); else ``reason(error)``."""
    found = re.search(r"WeightsUnpickler error:\s*(.*?)\s*(?: Please|\n\s*Check the documentation|$)", str(error),
                      re.DOTALL)
    return " ".join(found.group(1).split()) if found and found.group(1).strip() else reason(error)


def read_weights(file: Path, folder: Path | None = None, cap: int | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, ``file`` checked first as ``open_regular`` does (safetensors opens it by
    its name, so a swap after the check is not seen: its header says how much it reads)."""
    open_regular(file, folder or file.parent, cap).close()
    try:
        return load_file(file)
    except Exception as error:  # SafetensorError, OSError, or whatever else a damaged header makes it raise
        raise CheckpointError(
            f"{file}: not a readable safetensors file, it may be truncated or damaged ({reason(error)})") from error


def read_state(file: Path, folder: Path | None = None, cap: int | None = None) -> dict:
    """The contents of a ``state.pt``, unpickled with ``torch.load(weights_only=True)``: tensors and plain data only.
    ``folder`` (default: the file's) must hold it; ``cap``: its largest size in bytes."""
    with open_regular(file, folder or file.parent, cap) as opened:
        try:
            return torch.load(opened, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            cause = unpickling_problem(error)
            if "global" in cause:  # "Unsupported global: GLOBAL exec was not an allowed global by default."
                raise CheckpointError(f"{file}: refused to load: it holds more than tensors and plain data, which could "
                                      f"run code when unpickled ({cause})") from error
            raise CheckpointError(
                f"{file}: not a readable torch.save file, it may be truncated or damaged ({cause})") from error
        except Exception as error:  # RuntimeError from the zip reader, EOFError, OSError, ...
            raise CheckpointError(
                f"{file}: not a readable torch.save file, it may be truncated or damaged ({reason(error)})") from error


def read_labels(path: str | Path) -> tuple[str, ...] | None:
    """The label names saved with the model in checkpoint folder ``path``, or None if it was saved without
    them (as every checkpoint from before names were saved: those models use the bundled labels)."""
    file = Path(path) / MODEL_FILE
    read_weights(file)  # a missing or damaged file: its CheckpointError
    with safe_open(file, "pt") as weights:
        saved = (weights.metadata() or {}).get("labels")
    if saved is None:
        return None
    try:
        labels = json.loads(saved)
    except json.JSONDecodeError:
        labels = None
    if not isinstance(labels, list) or not all(isinstance(name, str) for name in labels):
        raise CheckpointError(f"{file}: its \"labels\" metadata is not a JSON list of names: {saved[:80]!r}")
    return tuple(labels)
