"""The files of a checkpoint folder, read and checked without ever running code.

The contract, which helpers.checkpoint keeps for a whole folder: any bad file (damaged, truncated, crafted or from
another model) raises one CheckpointError that names the file and keeps the original exception as its cause, and
reading it changes nothing in the process: no class, function or module.

- ``model.safetensors``: a model's full weights. safetensors holds a JSON header and raw tensor bytes: nothing in
  it can run.
- ``state.pt``: optimizer, scheduler, progress, random states; only read with ``torch.load(weights_only=True)``,
  which builds tensors, numbers, strings, lists and dicts and refuses anything else.
- ``sharded/``: a sharded model's weights and optimizer state, one file per process plus ``.metadata``, written by
  torch.distributed.checkpoint (DCP). Its own reader is not safe: ``FileSystemReader.read_metadata`` unpickles
  ``.metadata`` with ``pickle.load`` (any class, any function: a crafted file runs code), and entries saved as
  bytes are read with ``torch.load(weights_only=False)`` (torch/distributed/checkpoint/filesystem.py and
  default_planner.py, torch 2.13). So ``.metadata`` is unpickled here by ``MetadataUnpickler`` and then checked
  field by field (``check_metadata``), a checkpoint with byte entries is refused, and DCP reads only the tensor
  data, which it loads with ``weights_only=True`` itself.
"""

from __future__ import annotations

import io
import pickle
import re
import reprlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"  # a sharded checkpoint's DCP files: one per process, and .metadata


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded or saved; the message names the file and the cause."""


def missing(file: Path) -> CheckpointError:
    """The error for a file a checkpoint folder should hold, saying what such a folder holds."""
    if file.parent.name == SHARDED_DIR or (file.parent / SHARDED_DIR).is_dir():
        holds = f"a sharded model's checkpoint folder holds {SHARDED_DIR}/ (.metadata and the shards) and {STATE_FILE}"
    else:
        holds = f"a checkpoint folder holds {MODEL_FILE} and {STATE_FILE}"
    return CheckpointError(f"{file}: missing; {holds}")


def reason(error: BaseException) -> str:
    """An exception's message, or its type where it has none (a bare MemoryError)."""
    return str(error) or type(error).__name__


def read_weights(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise missing(file)
    try:
        return load_file(file)
    except Exception as error:  # SafetensorError, OSError, or whatever else a damaged header makes it raise
        raise CheckpointError(
            f"{file}: not a readable safetensors file, it may be truncated or damaged ({reason(error)})") from error


def read_state(file: Path) -> dict:
    if not file.is_file():
        raise missing(file)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"WeightsUnpickler error: (.*?)(?: Please|\n|$)", str(error))  # names what was refused
        cause = found.group(1) if found else str(error)
        if "global" in cause:  # "Unsupported global: GLOBAL exec was not an allowed global by default."
            raise CheckpointError(f"{file}: refused to load: it holds more than tensors and plain data, which could "
                                  f"run code when unpickled ({cause})") from error
        raise CheckpointError(
            f"{file}: not a readable torch.save file, it may be truncated or damaged ({cause})") from error
    except Exception as error:  # RuntimeError from the zip reader, EOFError, OSError, ...
        raise CheckpointError(
            f"{file}: not a readable torch.save file, it may be truncated or damaged ({reason(error)})") from error


# --- sharded/: DCP's files -----------------------------------------------------------------------------------

DTYPES = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
PATHS = {"PosixPath": PurePosixPath, "WindowsPath": PureWindowsPath, "PurePosixPath": PurePosixPath,
         "PureWindowsPath": PureWindowsPath}
"""Where a checkpoint was saved (StorageMeta.checkpoint_id), pickled as the saving OS's Path class: read as a pure
path, which every OS can make (Windows refuses to make a PosixPath, Linux and macOS a WindowsPath)."""
METADATA_CLASSES = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata",
    "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout")}  # looks a torch.layout up by name
BUILDABLE = (Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata, ChunkStorageMetadata,
             BytesStorageMetadata, _StorageInfo)
"""The classes whose fresh instances a pickle may fill in (BUILD)."""


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a class or function outside the allow-list."""


class RefusedOperation(pickle.UnpicklingError):
    """A pickle would change an object it did not make, or make what DCP's metadata never holds."""


class BoundedBytes(io.BytesIO):
    """A file's bytes; a read of more than remain fails (EOFError: a truncated file, or a crafted length)."""

    def read(self, size: int | None = -1) -> bytes:
        left = len(self.getbuffer()) - self.tell()
        if size is not None and size > left:
            raise EOFError(f"a length field at byte {self.tell():,} claims {size:,} bytes; {left:,} remain")
        return super().read(size)


def attribute_names(state) -> list:
    """The names BUILD would set from ``state``: a dict's keys, or those of a (dict, slots dict) pair."""
    parts = [state] if isinstance(state, dict) else [*state] if isinstance(state, tuple) and len(state) == 2 else []
    return [name for part in parts if isinstance(part, dict) for name in part]


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP's ``.metadata``; a file that does more than describe a checkpoint is refused.

    - Only DCP's metadata classes, torch.Size, dtypes and paths may be named: every class or function a pickle
      uses goes through ``find_class`` (Python's documented way to restrict unpickling), and these only hold data.
    - BUILD (which sets attributes) applies only to an instance of those classes that this pickle made. Pickle
      applies it to any object: on an allowed *class* it would set an attribute for the whole process
      (``PosixPath.exists = None``). The pure-Python unpickler is used because only its opcodes can be replaced.
    - Items are added only to the lists, dicts and sets the pickle made.
    - No length field may claim more bytes than the file holds (``BoundedBytes``), and no bytearray is made:
      a crafted size would otherwise allocate memory before the short read is noticed.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes):
        super().__init__(BoundedBytes(data))
        self.made: dict[int, object] = {}  # id -> an instance of a BUILDABLE class this pickle made (kept alive)

    def find_class(self, module: str, name: str):
        if module in ("pathlib", "pathlib._local") and name in PATHS:  # pathlib._local: pickled by Python 3.13+
            return PATHS[name]
        if (module, name) in METADATA_CLASSES or (module == "torch" and name in DTYPES):
            return super().find_class(module, name)
        raise RefusedGlobal(f"global '{module}.{name}' is not one of DCP's metadata types")

    def note_made(self) -> None:
        """After an opcode that makes an object: note it if it is an instance of a BUILDABLE class."""
        if type(self.stack[-1]) in BUILDABLE:
            self.made[id(self.stack[-1])] = self.stack[-1]

    def load_build(self):
        target, state = self.stack[-2], self.stack[-1]
        if isinstance(target, type):
            raise RefusedOperation(f"it sets attributes of the class {target.__module__}.{target.__qualname__} "
                                   f"(BUILD), which would change it for the whole process")
        if self.made.get(id(target)) is not target:  # an enum member, say, is shared by the whole process too
            raise RefusedOperation(f"it sets attributes of a {type(target).__name__} (BUILD), which is not an "
                                   f"instance of DCP's metadata classes that this file made")
        odd = [name for name in attribute_names(state) if not isinstance(name, str) or name.startswith("__")]
        if odd:
            raise RefusedOperation(f"it sets the attribute {odd[0]!r} of a {type(target).__name__} (BUILD)")
        pickle._Unpickler.load_build(self)

    def into(self, kind: type):
        """The object that takes the new items: one of the containers of type ``kind`` the pickle made."""
        target = self.stack[-1]
        if type(target) is not kind:
            raise RefusedOperation(f"it adds items to a {type(target).__name__}, not to a {kind.__name__} it made")
        return target

    def load_append(self):
        value = self.stack.pop()
        self.into(list).append(value)

    def load_appends(self):
        items = self.pop_mark()
        self.into(list).extend(items)

    def load_setitem(self):
        value, key = self.stack.pop(), self.stack.pop()
        self.into(dict)[key] = value

    def load_setitems(self):
        items = self.pop_mark()
        target = self.into(dict)
        for key, value in zip(items[::2], items[1::2], strict=True):
            target[key] = value

    def load_additems(self):
        items = self.pop_mark()
        self.into(set).update(items)

    def load_bytearray8(self):
        raise RefusedOperation("it holds a bytearray, which DCP's metadata never does")


def _then_note_made(load):
    def load_and_note(unpickler: MetadataUnpickler) -> None:
        load(unpickler)
        unpickler.note_made()
    return load_and_note


for _opcode in (pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.REDUCE, pickle.OBJ, pickle.INST):
    MetadataUnpickler.dispatch[_opcode[0]] = _then_note_made(pickle._Unpickler.dispatch[_opcode[0]])
for _opcode, _load in ((pickle.BUILD, "load_build"), (pickle.APPEND, "load_append"), (pickle.APPENDS, "load_appends"),
                       (pickle.SETITEM, "load_setitem"), (pickle.SETITEMS, "load_setitems"),
                       (pickle.ADDITEMS, "load_additems"), (pickle.BYTEARRAY8, "load_bytearray8")):
    MetadataUnpickler.dispatch[_opcode[0]] = getattr(MetadataUnpickler, _load)


def read_shard_metadata(folder: Path) -> Metadata:
    """``folder/.metadata``, unpickled safely and checked: tensors only, every field of the type DCP gives it, and
    every data file it names present and long enough. Raises CheckpointError naming the file and the cause."""
    file = folder / ".metadata"
    if not file.is_file():
        raise missing(file)
    try:
        metadata = MetadataUnpickler(file.read_bytes()).load()
    except RefusedGlobal as error:
        raise CheckpointError(f"{file}: refused to load: it names more than DCP's metadata types, which could run "
                              f"code when unpickled ({error})") from error
    except RefusedOperation as error:
        raise CheckpointError(f"{file}: refused to load: {error}") from error
    except Exception as error:  # a damaged pickle raises almost anything (MemoryError, RuntimeError, KeyError, ...)
        raise CheckpointError(
            f"{file}: not a readable DCP metadata file, it may be truncated or damaged ({reason(error)})") from error
    check_metadata(file, metadata)
    check_shard_files(folder, metadata)
    return metadata


class NotDcpMetadata(Exception):
    """What ``check_metadata`` found wrong; it becomes a CheckpointError naming the file."""


def need(condition: bool, problem: Callable[[], str]) -> None:
    """Raise NotDcpMetadata(``problem()``) unless ``condition``; the message is made only on failure."""
    if not condition:
        raise NotDcpMetadata(problem())


def shown(value) -> str:
    """``value``'s repr, shortened; its type where the repr fails (a crafted instance may lack its fields)."""
    try:
        return reprlib.repr(value)
    except Exception:
        return f"a {type(value).__name__}"


def check_metadata(file: Path, metadata) -> None:
    """Raise CheckpointError unless every field of ``metadata`` has the type DCP gives it, every tensor is split into
    chunks that cover it exactly once, and every chunk has a place in a data file.

    A crafted file can put any allowed object in any field; once checked here, it cannot make DCP or the checks
    that follow fail with another exception, nor leave part of a tensor unread (DCP does not check coverage).
    """
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not DCP's Metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    stored_as_bytes = [key for key, entry in entries.items() if isinstance(entry, BytesStorageMetadata)] \
        if type(entries) is dict else []
    if stored_as_bytes:
        raise CheckpointError(f"{file}: refused to load: {stored_as_bytes[0]!r} is stored as pickled bytes, which DCP "
                              f"unpickles with code allowed; these checkpoints hold tensors only")
    try:
        need(type(entries) is dict and all(type(key) is str for key in entries),
             lambda: "state_dict_metadata is not a dict of names")
        places = getattr(metadata, "storage_data", None)
        need(type(places) is dict, lambda: f"storage_data is {shown(places)}, not a dict")
        for key, place in places.items():
            check_place(key, place)
        for name, entry in entries.items():
            check_entry(name, entry, places)
        for field, kind in (("planner_data", dict), ("storage_meta", StorageMeta), ("version", str)):
            value = getattr(metadata, field, None)
            need(value is None or type(value) is kind, lambda: f"{field} is a {type(value).__name__}")
    except NotDcpMetadata as error:
        raise CheckpointError(f"{file}: not DCP metadata as torch.distributed.checkpoint writes it: {error}") from error


def check_place(key, place) -> None:
    """One entry of ``storage_data``: which chunk (MetadataIndex), and where its bytes are (_StorageInfo)."""
    need(type(key) is MetadataIndex and type(getattr(key, "fqn", None)) is str
         and type(getattr(key, "offset", None)) is torch.Size, lambda: f"storage_data has the key {shown(key)}")
    fields = [getattr(place, name, None) for name in ("relative_path", "offset", "length")]
    need(type(place) is _StorageInfo and [type(value) for value in fields] == [str, int, int]
         and fields[1] >= 0 and fields[2] >= 0, lambda: f"{key.fqn}: its place in a data file is {shown(fields)}")
    descriptors = getattr(place, "transform_descriptors", None)
    need(not descriptors, lambda: f"{key.fqn}: stored through DCP's extensions {shown(descriptors)}, which these "
                                  f"helpers never use")


def check_entry(name: str, entry, places: dict) -> None:
    """One tensor's entry: dtype, shape, and chunks that tile it exactly, each with a place in a data file."""
    need(type(entry) is TensorStorageMetadata, lambda: f"{name}: holds a {type(entry).__name__}, not a tensor's")
    properties, size, chunks = (getattr(entry, field, None) for field in ("properties", "size", "chunks"))
    need(type(properties) is TensorProperties and isinstance(getattr(properties, "dtype", None), torch.dtype),
         lambda: f"{name}: its properties are not a TensorProperties with a dtype")
    need(type(size) is torch.Size and all(n >= 0 for n in size), lambda: f"{name}: its shape is {shown(size)}")
    need(type(chunks) is list and all(type(chunk) is ChunkStorageMetadata for chunk in chunks),
         lambda: f"{name}: its chunks are not a list of ChunkStorageMetadata")
    boxes = []
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        need(type(offsets) is torch.Size and type(sizes) is torch.Size and len(offsets) == len(sizes) == len(size)
             and all(0 <= o and 0 <= n and o + n <= d for o, n, d in zip(offsets, sizes, size)),
             lambda: f"{name}: a chunk at {shown(offsets)} of size {shown(sizes)} does not lie in its shape "
                     f"{tuple(size)}")
        need(MetadataIndex(name, offsets) in places,
             lambda: f"{name}: the chunk at {tuple(offsets)} has no place in a data file")
        boxes.append((offsets, sizes))
    covered = sum(sizes.numel() for _, sizes in boxes)
    need(covered == size.numel(), lambda: f"{name}: its chunks hold {covered:,} of its {size.numel():,} values")
    overlap = overlapping(boxes)
    need(overlap is None, lambda: f"{name}: the chunks at {overlap[0]} and {overlap[1]} overlap")


def overlapping(boxes: list[tuple[torch.Size, torch.Size]]) -> tuple | None:
    """The offsets of two boxes (offsets, sizes) that share a point, or None. Swept along the first dimension:
    a sharded tensor's chunks follow one another there, so each is compared with few others."""
    if not boxes or not boxes[0][0]:
        return (tuple(boxes[0][0]), tuple(boxes[1][0])) if len(boxes) > 1 else None  # 0-d: any two overlap
    open_boxes: list[tuple[torch.Size, torch.Size]] = []
    comparisons = 0
    for offsets, sizes in sorted(boxes, key=lambda box: tuple(box[0])):
        open_boxes = [box for box in open_boxes if box[0][0] + box[1][0] > offsets[0]]
        for other, other_sizes in open_boxes:
            if sizes.numel() and other_sizes.numel() and all(
                    a < b + m and b < a + n for a, n, b, m in zip(offsets, sizes, other, other_sizes)):
                return tuple(other), tuple(offsets)
        comparisons += len(open_boxes)
        need(comparisons <= 10**6, lambda: f"more chunks side by side than can be checked ({len(boxes):,})")
        open_boxes.append((offsets, sizes))
    return None


def check_shard_files(folder: Path, metadata: Metadata) -> None:
    """Every data file ``metadata`` names sits in ``folder`` and is long enough for what it should hold."""
    needed: dict[str, int] = {}
    for place in metadata.storage_data.values():
        name = place.relative_path
        if Path(name).name != name or name in ("", ".", ".."):
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
