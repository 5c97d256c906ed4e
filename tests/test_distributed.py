"""Leaving the process group (helpers.distributed.leave_process_group) stops gloo's threads while Python is alive.

Issue 39: helpers.lever_checks aborted after printing all its results ("terminate called without an active
exception"): DDP reducers, kept alive by a communication hook that refers back to its model, and FSDP2's device
meshes held the process group past destroy_process_group, so gloo's worker threads ran on into interpreter exit.
The threads are counted by name, as the kernel lists them (Linux).
"""

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers import distributed
from helpers.lever_checks import main as lever_checks

TASKS = Path("/proc/self/task")
pytestmark = pytest.mark.skipif(not TASKS.is_dir(), reason="counts threads by their names in /proc (Linux)")


def gloo_threads() -> int:
    """Threads of this process that belong to a gloo process group: its workers and its TCP loop."""
    count = 0
    for task in TASKS.iterdir():
        try:
            count += "gloo" in (task / "comm").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return count


def live_reducers() -> int:
    return sum(issubclass(type(obj), nn.parallel.DistributedDataParallel) and hasattr(obj, "reducer")
               for obj in gc.get_objects())


class HookState:
    """A communication hook's state that refers back to its model, as a counter of the model's traffic does."""

    def __init__(self, model):
        self.model = model


def all_reduce_mean(state, bucket):
    tensor = bucket.buffer() / dist.get_world_size()
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda future: future.value()[0])


def train_a_step_with_a_hooked_ddp_model():
    """A DDP model whose hook state points back at it: a cycle through DDP's C++ reducer, which gc cannot free."""
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    model.register_comm_hook(HookState(model), all_reduce_mean)
    nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1])).backward()


def train_a_step_with_a_sharded_model():
    """FSDP2: its DTensors leave the device mesh, which holds the group, in torch's caches of sharding plans."""
    model = fully_shard(nn.Linear(8, 2), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1])).backward()


@pytest.fixture
def baseline():
    """gloo threads before the test: those of groups that other tests' objects still hold (none of ours)."""
    distributed.release_group()
    return gloo_threads()


@pytest.mark.parametrize("train", [train_a_step_with_a_hooked_ddp_model, train_a_step_with_a_sharded_model],
                         ids=["ddp with a hook", "fsdp2"])
def test_destroying_the_group_alone_leaves_its_threads_running(baseline, train):
    """The fault, shown: what holds the group outlives it, and so do the group's threads."""
    distributed.init_process_group(torch.device("cpu"))
    train()
    dist.destroy_process_group()
    gc.collect()
    assert gloo_threads() > baseline
    distributed.release_group()  # the group is idle: its last owner joins its threads here
    assert gloo_threads() == baseline


def test_leaving_the_group_stops_its_threads_every_time(baseline):
    for _ in range(3):
        distributed.init_process_group(torch.device("cpu"))
        train_a_step_with_a_hooked_ddp_model()
        train_a_step_with_a_sharded_model()
        distributed.leave_process_group()
        assert not dist.is_initialized()
        assert live_reducers() == 0
        assert gloo_threads() == baseline


def test_lever_checks_leaves_no_group_behind(baseline, capsys):
    """09's two-process checks, here as one plain process: DDP's traffic counted with a hook, FSDP2's with a tracker."""
    result = lever_checks(["--device", "cpu", "--examples", "8", "--grad-accum-steps", "2"])
    assert [check["strategy"] for check in result["accumulation"]] == ["ddp", "fsdp"]
    assert live_reducers() == 0
    assert gloo_threads() == baseline
