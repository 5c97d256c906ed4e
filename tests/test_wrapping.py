"""unwrap() finds the model inside DataParallel, DDP, torch.compile and any nesting of them."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from helpers.distributed import leave_process_group
from helpers.wrapping import unwrap


def test_plain_model_is_returned_as_is():
    net = nn.Linear(2, 2)
    assert unwrap(net) is net


def test_data_parallel_and_compile_in_any_nesting():
    net = nn.Linear(2, 2)
    assert unwrap(nn.DataParallel(net)) is net
    assert unwrap(torch.compile(net)) is net
    assert unwrap(nn.DataParallel(torch.compile(nn.DataParallel(net)))) is net


def test_distributed_data_parallel(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        net = nn.Linear(2, 2)
        assert unwrap(DistributedDataParallel(net)) is net
        assert unwrap(torch.compile(DistributedDataParallel(net))) is net
    finally:
        leave_process_group()
