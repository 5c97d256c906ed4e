"""A worker for test_memory's DDP check. It lives in an importable module because torch.multiprocessing
starts fresh interpreters that import the function by name."""

import torch
import torch.distributed as dist
from torch import nn

from helpers.distributed import leave_process_group
from helpers.memory.configs import bundled_config
from helpers.torch_private import mem_tracker
from helpers.memory.tracer import NetFromConfig


def held(tracker) -> int:
    return sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("current").values())


def measure_ddp(rank: int, world_size: int, rendezvous: str, results) -> None:
    """For both settings of gradient_as_bucket_view, the bytes DDP allocates when it wraps the tiny model
    (its gradient buckets) and the bytes a backward adds on top (the gradients), measured with MemTracker."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    wrapped = []
    try:
        config = bundled_config()
        for bucket_view in (False, True):
            torch.manual_seed(0)
            model = NetFromConfig(config)
            model.bert.pooler = None  # Net does not use the pooler; DDP stops on parameters without a gradient
            tracker = mem_tracker()()
            tracker.track_external(model)
            before = held(tracker)
            with tracker:
                ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
                wrapped.append(ddp)
                buckets = held(tracker) - before
                input_ids = torch.randint(0, config.vocab_size, (2, 16))
                nn.functional.cross_entropy(ddp(input_ids), torch.tensor([0, 1])).backward()
                gradients = held(tracker) - before - buckets
            results[(rank, bucket_view)] = (buckets, gradients, sum(p.numel() * 4 for p in model.parameters()))
    finally:
        leave_process_group(*wrapped)
