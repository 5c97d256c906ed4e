"""A worker the checkpoint tests start under torchrun (2 processes, gloo):

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/checkpoint_worker.py MODE DIR

- ``failing-save``: saves in which one process fails to write (DDP: rank 0's state.pt; FSDP2: rank 0's state.pt,
  or rank 1's shard inside DCP), then one that succeeds. Each process prints one JSON line per save: what it
  raised, the cause, and how long the save took.
- ``layouts``: the bundled model trained for a step and saved as DDP and as FSDP2 do (``DIR/ddp``, ``DIR/fsdp``),
  for the fuzz test.
"""

import errno
import io
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers.checkpoint import Checkpoints, Progress, epoch_start_state, load_checkpoint, state_dicts_equal, full_weights
from helpers.distributed import leave_process_group


def small(sharded: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    if sharded:
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def stepped(model: nn.Module):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def failing_torch_save(failing_rank: int, only_state: bool):
    """torch.save that fails on ``failing_rank`` as a full disk does, writing state.pt (``only_state``) or any
    file (DCP's shards too); into memory (pickling a tensor for a collective) it still works."""
    real = torch.save

    def save(obj, file, *args, **kwargs):
        to_disk = str(file).endswith("state.pt") if only_state else not isinstance(file, io.BytesIO)
        if dist.get_rank() == failing_rank and to_disk:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, file, *args, **kwargs)
    return save


def failing_save(directory: Path) -> None:
    real = torch.save
    cases = [("ddp", 0, True), ("fsdp", 0, True), ("fsdp", 1, False), ("fsdp", None, False)]
    for strategy, failing_rank, only_state in cases:
        model = small(sharded=strategy == "fsdp")
        optimizer = stepped(model)
        if strategy == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        checkpoints = Checkpoints(directory / strategy)
        torch.save = failing_torch_save(failing_rank, only_state) if failing_rank is not None else real
        start = time.monotonic()
        try:
            checkpoints.save(model, optimizer, None, Progress(step=1))
            outcome, message, cause = "saved", "", None
        except Exception as error:  # what the test checks: CheckpointError on every rank
            outcome, message, cause = type(error).__name__, str(error), type(error.__cause__).__name__
        finally:
            torch.save = real
        seconds = time.monotonic() - start
        if outcome == "saved":  # the processes stayed together: the checkpoint loads into every one
            loaded = small(sharded=strategy == "fsdp")
            load_checkpoint(checkpoints.latest(), loaded, stepped(loaded))
            outcome = "loaded" if state_dicts_equal(full_weights(loaded), full_weights(model)) else "differs"
        report = json.dumps({"rank": dist.get_rank(), "strategy": strategy, "failing_rank": failing_rank,
                             "outcome": outcome, "message": message, "cause": cause, "seconds": seconds})
        sys.stdout.write(report + "\n")  # one write: print's two would interleave with the other rank's unbuffered
        sys.stdout.flush()
        dist.barrier()


def layouts(directory: Path) -> None:
    """The bundled model after one step, saved by Checkpoints as DDP and as FSDP2 runs save it."""
    from helpers import fsdp
    from helpers.net import Net
    from helpers.optim import two_lr_adam

    for strategy in ("ddp", "fsdp"):
        torch.manual_seed(0)
        net = fsdp.prepare(Net(pooler=strategy == "fsdp"), strategy)  # FSDP2 with the unused pooler, as --keep-pooler
        optimizer = two_lr_adam(net)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
        model = fsdp.wrap(net, strategy, torch.device("cpu"))
        input_ids = torch.randint(5, 100, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
        nn.functional.cross_entropy(model(input_ids, torch.ones_like(input_ids)), torch.tensor([0, 1])).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        loader = torch.utils.data.DataLoader(range(8), shuffle=True, generator=torch.Generator().manual_seed(0))
        progress = Progress(step=1, epoch=0, batch=1, batch_losses=[0.5])
        progress.epoch_start = epoch_start_state(loader)
        Checkpoints(directory / strategy).save(model, optimizer, scheduler, progress)


if __name__ == "__main__":
    mode, folder = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a hang fails in a minute, not in 30
    try:
        {"failing-save": failing_save, "layouts": layouts}[mode](folder)
    finally:
        leave_process_group()
