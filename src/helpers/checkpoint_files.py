"""The files of a checkpoint folder, read without ever running code; every refusal names the file and the cause.

- ``model.safetensors``: a model's full weights. safetensors holds a JSON header and raw tensor bytes: nothing in
  it can run.
- ``state.pt``: optimizer, scheduler, progress, random states; only read with ``torch.load(weights_only=True)``,
  which builds tensors, numbers, strings, lists and dicts and refuses anything else.
- ``sharded/``: a sharded model's weights and optimizer state, one file per process plus ``.metadata``, written by
  torch.distributed.checkpoint (DCP). Its own reader is not safe: ``FileSystemReader.read_metadata`` unpickles
  ``.metadata`` with ``pickle.load`` (any class, any function: a crafted file runs code), and entries saved as
  bytes are read with ``torch.load(weights_only=False)`` (torch/distributed/checkpoint/filesystem.py and
  default_planner.py, torch 2.13). So ``.metadata`` is unpickled here with an allow-list of DCP's own metadata
  classes, a checkpoint with byte entries is refused, and DCP reads only the tensor data, which it loads with
  ``weights_only=True`` itself.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"  # a sharded checkpoint's DCP files: one per process, and .metadata


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded; the message names the file and the cause."""


def missing(file: Path) -> CheckpointError:
    """The error for a file a checkpoint folder should hold, saying what such a folder holds."""
    if file.parent.name == SHARDED_DIR or (file.parent / SHARDED_DIR).is_dir():
        holds = f"a sharded model's checkpoint folder holds {SHARDED_DIR}/ (.metadata and the shards) and {STATE_FILE}"
    else:
        holds = f"a checkpoint folder holds {MODEL_FILE} and {STATE_FILE}"
    return CheckpointError(f"{file}: missing; {holds}")


def read_weights(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise missing(file)
    try:
        return load_file(file)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(
            f"{file}: not a readable safetensors file, it may be truncated or damaged ({error})") from None


def read_state(file: Path) -> dict:
    if not file.is_file():
        raise missing(file)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"WeightsUnpickler error: (.*?)(?: Please|\n|$)", str(error))  # names what was refused
        cause = found.group(1) if found else str(error)
        raise CheckpointError(f"{file}: refused to load: it holds more than tensors and plain data, which could run "
                              f"code when unpickled ({cause})") from None
    except (EOFError, RuntimeError, OSError) as error:
        raise CheckpointError(
            f"{file}: not a readable torch.save file, it may be truncated or damaged ({error})") from None


# --- sharded/: DCP's files -----------------------------------------------------------------------------------

METADATA_CLASSES = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata",
    "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),  # where it was saved (StorageMeta.checkpoint_id)
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath")}  # the same, pickled by Python 3.13+
DTYPES = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a class or function outside the allow-list."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: only DCP's metadata classes, torch.Size, dtypes and paths may be named.

    Every class or function a pickle uses goes through ``find_class`` (Python's documented way to restrict
    unpickling); these only hold data, so nothing in the file can run.
    """

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_CLASSES or (module == "torch" and name in DTYPES):
            return super().find_class(module, name)
        raise RefusedGlobal(f"global '{module}.{name}' is not one of DCP's metadata types")


# What unpickling damaged bytes raises (the pickle module's documentation names most of them)
DAMAGED_PICKLE = (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, KeyError, TypeError,
                  ValueError)


def read_shard_metadata(folder: Path) -> Metadata:
    """``folder/.metadata``, unpickled safely and checked: tensors only, and every data file it names present
    and long enough. Raises CheckpointError naming the file and the cause."""
    file = folder / ".metadata"
    if not file.is_file():
        raise missing(file)
    try:
        with open(file, "rb") as stream:
            metadata = MetadataUnpickler(stream).load()
    except RefusedGlobal as error:
        raise CheckpointError(f"{file}: refused to load: it names more than DCP's metadata types, which could run "
                              f"code when unpickled ({error})") from None
    except DAMAGED_PICKLE as error:
        raise CheckpointError(
            f"{file}: not a readable DCP metadata file, it may be truncated or damaged ({error})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not DCP's Metadata")
    stored_as_bytes = [key for key, entry in metadata.state_dict_metadata.items()
                       if not isinstance(entry, TensorStorageMetadata)]
    if stored_as_bytes:
        raise CheckpointError(f"{file}: refused to load: {stored_as_bytes[0]!r} is stored as pickled bytes, which DCP "
                              f"unpickles with code allowed; these checkpoints hold tensors only")
    check_shard_files(folder, metadata)
    return metadata


def check_shard_files(folder: Path, metadata: Metadata) -> None:
    """Every data file ``metadata`` names sits in ``folder`` and is long enough for what it should hold."""
    needed: dict[str, int] = {}
    for place in metadata.storage_data.values():
        name = str(place.relative_path)
        if Path(name).name != name:
            raise CheckpointError(f"{folder / '.metadata'}: names the data file {name!r}, which is not in {folder}")
        needed[name] = max(needed.get(name, 0), place.offset + place.length)
    for name, size in sorted(needed.items()):
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name}: missing; {folder / '.metadata'} lists it")
        if (folder / name).stat().st_size < size:
            raise CheckpointError(f"{folder / name}: truncated: {(folder / name).stat().st_size:,} bytes, the "
                                  f"metadata places data up to byte {size:,}")


def saved_tensors(metadata: Metadata, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name -> (full shape, dtype) of every tensor saved under ``prefix`` (e.g. "model.")."""
    return {key.removeprefix(prefix): (entry.size, entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items() if key.startswith(prefix)}


class CheckedShardReader(FileSystemReader):
    """DCP's file reader, handed the metadata ``read_shard_metadata`` read and checked, instead of unpickling
    ``.metadata`` itself with ``pickle.load``. Tensor data it reads with ``torch.load(weights_only=True)``."""

    def __init__(self, folder: Path, metadata: Metadata):
        super().__init__(folder)
        self.checked = metadata

    def read_metadata(self) -> Metadata:
        return self.checked
