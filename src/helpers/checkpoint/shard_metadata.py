"""A sharded checkpoint's ``sharded/.metadata``, unpickled without running code and checked field by field.

torch.distributed.checkpoint (DCP) writes ``.metadata`` with ``pickle`` and reads it back with ``pickle.load``
(``FileSystemReader.read_metadata``, torch/distributed/checkpoint/filesystem.py, torch 2.13): any class, any function,
so a crafted file runs code. Here it is unpickled by ``MetadataUnpickler``, which makes only DCP's metadata classes,
and then checked (``check_metadata``) so that DCP and the checks that follow meet only what DCP itself writes.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from helpers.checkpoint.files import CheckpointError, read_capped, reason, status_of
from helpers.checkpoint.validation import problems_in, require, shown
from helpers.torch_private import PATH_MODULES, HookedUnpickler, dcp_chunk_place, dcp_private_globals

METADATA_FILE = ".metadata"
METADATA_BYTES = 256 * 2**20
"""The largest ``.metadata`` read: about a kilobyte per chunk, so room for some 200,000 chunks."""
CHUNK_OVERHEAD = 64 * 2**10
"""What torch.save adds to a chunk's bytes (its zip records: about 1.6 KB), with room to spare."""
DTYPES = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
PATHS = {"PosixPath": PurePosixPath, "WindowsPath": PureWindowsPath, "PurePosixPath": PurePosixPath,
         "PureWindowsPath": PureWindowsPath}
"""Where a checkpoint was saved (StorageMeta.checkpoint_id), pickled as the saving OS's Path class: read as a pure
path, which every OS can make (Windows refuses to make a PosixPath, Linux and macOS a WindowsPath)."""
PUBLIC_CLASSES = (Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
                  ChunkStorageMetadata, BytesStorageMetadata)


def metadata_globals() -> dict[tuple[str, str], object]:
    """Every (module, name) a pickle of DCP's metadata may name, and what it stands for."""
    return {(cls.__module__, cls.__name__): cls for cls in PUBLIC_CLASSES} | {("torch", "Size"): torch.Size} \
        | dcp_private_globals()


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


class MetadataUnpickler(HookedUnpickler):
    """Unpickles DCP's ``.metadata``; a file that does more than describe a checkpoint is refused.

    - Only DCP's metadata classes, torch.Size, dtypes and paths may be named: every class or function a pickle uses
      goes through ``find_class`` (Python's documented way to restrict unpickling), and these only hold data.
    - BUILD (which sets attributes) applies only to an instance of those classes that this pickle made. Pickle
      applies it to any object: on an allowed *class* it would set an attribute for the whole process
      (``PosixPath.exists = None``), on an enum member for every user of it.
    - Items are added only to the lists, dicts and sets the pickle made.
    - No length field may claim more bytes than the file holds (``BoundedBytes``), and no bytearray is made: a
      crafted size would otherwise allocate memory before the short read is noticed.
    """

    def __init__(self, data: bytes):
        super().__init__(BoundedBytes(data))
        self.allowed = metadata_globals()
        self.buildable = (*PUBLIC_CLASSES, dcp_chunk_place())
        self.instances: dict[int, object] = {}  # id -> an instance of a buildable class this pickle made (kept alive)

    def find_class(self, module: str, name: str):
        if module in PATH_MODULES and name in PATHS:
            return PATHS[name]
        if (module, name) in self.allowed or (module == "torch" and name in DTYPES):
            return super().find_class(module, name)
        raise RefusedGlobal(f"global '{module}.{name}' is not one of DCP's metadata types")

    def made(self, obj) -> None:
        if type(obj) in self.buildable:
            self.instances[id(obj)] = obj

    def building(self, target, state) -> None:
        if isinstance(target, type):
            raise RefusedOperation(f"it sets attributes of the class {target.__module__}.{target.__qualname__} "
                                   f"(BUILD), which would change it for the whole process")
        if self.instances.get(id(target)) is not target:  # an enum member, say, is shared by the whole process too
            raise RefusedOperation(f"it sets attributes of a {type(target).__name__} (BUILD), which is not an "
                                   f"instance of DCP's metadata classes that this file made")
        odd = [name for name in attribute_names(state) if not isinstance(name, str) or name.startswith("__")]
        if odd:
            raise RefusedOperation(f"it sets the attribute {odd[0]!r} of a {type(target).__name__} (BUILD)")

    def adding_items(self, target) -> None:
        if type(target) not in (list, dict, set):
            raise RefusedOperation(f"it adds items to a {type(target).__name__}, not to a list, dict or set it made")

    def making_bytearray(self) -> None:
        raise RefusedOperation("it holds a bytearray, which DCP's metadata never does")


def read_shard_metadata(folder: Path) -> Metadata:
    """``folder/.metadata``, unpickled safely and checked: tensors only, every field of the type DCP gives it, every
    chunk in place, and every data file it names a regular file in ``folder``, long enough. Raises CheckpointError
    naming the file and the cause."""
    file = folder / METADATA_FILE
    data = read_capped(file, folder, METADATA_BYTES)
    try:
        metadata = MetadataUnpickler(data).load()
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


def check_metadata(file: Path, metadata) -> None:
    """Raise CheckpointError unless every field of ``metadata`` has the type DCP gives it, every tensor is split into
    chunks that cover it exactly once, and every chunk has a place in a data file no larger than its values need.

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
    with problems_in(file, "not DCP metadata as torch.distributed.checkpoint writes it"):
        require(type(entries) is dict and all(type(key) is str for key in entries),
                "state_dict_metadata is not a dict of names")
        places = getattr(metadata, "storage_data", None)
        require(type(places) is dict, lambda: f"storage_data is {shown(places)}, not a dict")
        for key, place in places.items():
            check_place(key, place)
        for name, entry in entries.items():
            check_entry(name, entry, places)
        for field, kind in (("planner_data", dict), ("storage_meta", StorageMeta), ("version", str)):
            value = getattr(metadata, field, None)
            require(value is None or type(value) is kind, lambda: f"{field} is a {type(value).__name__}")


def check_place(key, place) -> None:
    """One entry of ``storage_data``: which chunk (MetadataIndex), and where its bytes are."""
    require(type(key) is MetadataIndex and type(getattr(key, "fqn", None)) is str
            and type(getattr(key, "offset", None)) is torch.Size, lambda: f"storage_data has the key {shown(key)}")
    fields = [getattr(place, name, None) for name in ("relative_path", "offset", "length")]
    require(type(place) is dcp_chunk_place() and [type(value) for value in fields] == [str, int, int]
            and fields[1] >= 0 and fields[2] >= 0, lambda: f"{key.fqn}: its place in a data file is {shown(fields)}")
    descriptors = getattr(place, "transform_descriptors", None)
    require(not descriptors, lambda: f"{key.fqn}: stored through DCP's extensions {shown(descriptors)}, which these "
                                     f"helpers never use")


def check_entry(name: str, entry, places: dict) -> None:
    """One tensor's entry: dtype, shape, and chunks that tile it exactly, each with a place in a data file that holds
    no more than its values and torch.save's records."""
    require(type(entry) is TensorStorageMetadata, lambda: f"{name}: holds a {type(entry).__name__}, not a tensor's")
    properties, size, chunks = (getattr(entry, field, None) for field in ("properties", "size", "chunks"))
    require(type(properties) is TensorProperties and isinstance(getattr(properties, "dtype", None), torch.dtype),
            lambda: f"{name}: its properties are not a TensorProperties with a dtype")
    require(type(size) is torch.Size and all(n >= 0 for n in size), lambda: f"{name}: its shape is {shown(size)}")
    require(type(chunks) is list and all(type(chunk) is ChunkStorageMetadata for chunk in chunks),
            lambda: f"{name}: its chunks are not a list of ChunkStorageMetadata")
    boxes = []
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        require(type(offsets) is torch.Size and type(sizes) is torch.Size and len(offsets) == len(sizes) == len(size)
                and all(0 <= o and 0 <= n and o + n <= d for o, n, d in zip(offsets, sizes, size)),
                lambda: f"{name}: a chunk at {shown(offsets)} of size {shown(sizes)} does not lie in its shape "
                        f"{tuple(size)}")
        place = places.get(MetadataIndex(name, offsets))
        require(place is not None, lambda: f"{name}: the chunk at {tuple(offsets)} has no place in a data file")
        values = sizes.numel() * properties.dtype.itemsize
        require(place.length <= values + CHUNK_OVERHEAD,
                lambda: f"{name}: the chunk at {tuple(offsets)} takes {place.length:,} bytes in its data file, more "
                        f"than its {sizes.numel():,} {properties.dtype} values ({values:,} bytes) and torch.save's "
                        f"records")
        boxes.append((offsets, sizes))
    covered = sum(sizes.numel() for _, sizes in boxes)
    require(covered == size.numel(), lambda: f"{name}: its chunks hold {covered:,} of its {size.numel():,} values")
    overlap = overlapping(boxes)
    require(overlap is None, lambda: f"{name}: the chunks at {overlap[0]} and {overlap[1]} overlap")


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
        require(comparisons <= 10**6, lambda: f"more chunks side by side than can be checked ({len(boxes):,})")
        open_boxes.append((offsets, sizes))
    return None


def check_shard_files(folder: Path, metadata: Metadata) -> None:
    """Every data file ``metadata`` names is a regular file in ``folder``, long enough for what it should hold."""
    needed: dict[str, int] = {}
    for place in metadata.storage_data.values():
        name = place.relative_path
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{folder / METADATA_FILE}: names the data file {name!r}, which is not in {folder}")
        needed[name] = max(needed.get(name, 0), place.offset + place.length)
    for name, size in sorted(needed.items()):
        if not os.path.lexists(folder / name):
            raise CheckpointError(f"{folder / name}: missing; {folder / METADATA_FILE} lists it")
        found = status_of(folder / name, folder, "regular file").st_size
        if found < size:
            raise CheckpointError(f"{folder / name}: truncated: {found:,} bytes, the metadata places data up to byte "
                                  f"{size:,}")


def saved_tensors(metadata: Metadata, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name -> (full shape, dtype) of every tensor saved under ``prefix`` (e.g. "model.")."""
    return {key.removeprefix(prefix): (entry.size, entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items() if key.startswith(prefix)}


def chunk_sizes(metadata: Metadata, index: MetadataIndex) -> torch.Size:
    """The size of the chunk ``index`` names (its tensor and offsets), as the metadata gives it."""
    entry = metadata.state_dict_metadata[index.fqn]
    return next(chunk.sizes for chunk in entry.chunks if chunk.offsets == index.offset)
