"""torch.distributed.checkpoint's reading of a sharded folder's data files, through a reader that checks each chunk.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load`` and, for each chunk, loads the tensor it
finds, cuts it to the size the metadata asks for and copies it into the model with a cast: a chunk re-saved as
float64 or int64, or larger than its box, loads without a word (torch/distributed/checkpoint/filesystem.py,
``read_data``, torch 2.13). ``ShardReader`` implements DCP's public ``StorageReader`` instead: its metadata is the one
``read_shard_metadata`` checked, and each chunk is read from a regular file of the folder and must be a plain tensor
of exactly the dtype and size the metadata gives it, which the checks before made the model's.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from helpers.checkpoint.files import CheckpointError, open_regular, unpickling_problem
from helpers.checkpoint.shard_metadata import chunk_sizes
from helpers.checkpoint.validation import plain_tensor_problem


class ShardReader(StorageReader):
    """Reads the checked ``metadata``'s chunks from the data files in ``folder`` (see the module's docstring)."""

    def __init__(self, folder: Path, metadata: Metadata):
        super().__init__()
        self.folder, self.metadata = folder, metadata

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # only ever handed over as storage_reader, never found by a checkpoint_id

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.metadata.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in sorted(by_file.items()):
            with open_regular(self.folder / name, self.folder) as file:
                for item in items:
                    part = self.read_chunk(file, self.folder / name, item)
                    for dimension, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        part = part.narrow(dimension, offset, length)
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(part)  # of the same dtype and size: the checks before compared them
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def read_chunk(self, file: BinaryIO, path: Path, item: ReadItem) -> torch.Tensor:
        """The whole chunk ``item`` reads from, checked against the metadata."""
        index = item.storage_index
        where = f"{path}: the chunk of {index.fqn} at {tuple(index.offset)}"
        if item.type != LoadItemType.TENSOR:
            raise CheckpointError(f"{where}: asked for as bytes; these checkpoints hold tensors only")
        place = self.metadata.storage_data[index]
        file.seek(place.offset)
        data = file.read(place.length)
        if len(data) != place.length:
            raise CheckpointError(f"{where}: the file ends {place.length - len(data):,} bytes short of it")
        try:
            chunk = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as error:
            raise CheckpointError(f"{where}: not a readable torch.save tensor, it may be damaged "
                                  f"({unpickling_problem(error)})") from error
        dtype, sizes = self.metadata.state_dict_metadata[index.fqn].properties.dtype, chunk_sizes(self.metadata, index)
        problem = plain_tensor_problem(chunk)
        if problem is None and (chunk.dtype, chunk.shape) != (dtype, sizes):
            problem = f"{tuple(chunk.shape)} {chunk.dtype}, where the metadata and the model have {tuple(sizes)} {dtype}"
        if problem is not None:
            raise CheckpointError(f"{where}: saved as {problem}")
        return chunk
