"""Leaving the process group (helpers.distributed.leave_process_group) stops gloo's threads while Python is alive,
and touches only what the caller owns.

Issue 39: helpers.lever_checks aborted after printing all its results ("terminate called without an active
exception"): DDP reducers, kept alive by a communication hook that refers back to its model, and FSDP2's device
meshes held the process group past destroy_process_group, so gloo's worker threads ran on into interpreter exit.
Issue 47: leaving then stripped every DDP model of the process, the caller's other ones too. The threads are counted
by name, as the kernel lists them (Linux).
"""

import copy
import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers import distributed, torch_private
from helpers.accumulation import CollectiveCounter
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
    """A communication hook's state that refers back to its model: a cycle through DDP's C++ reducer, which garbage
    collection cannot see (helpers.accumulation.CollectiveCounter keeps no model for that reason)."""

    def __init__(self, model):
        self.model = model


def all_reduce_mean(state, bucket):
    tensor = bucket.buffer() / dist.get_world_size()
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda future: future.value()[0])


def train_a_step(model: nn.Module) -> nn.Module:
    nn.functional.cross_entropy(model(INPUT), LABELS).backward()
    return model


INPUT, LABELS = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 0, 1])


def train_a_step_with_a_hooked_ddp_model() -> nn.Module:
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    model.register_comm_hook(HookState(model), all_reduce_mean)
    return train_a_step(model)


def train_a_step_with_a_sharded_model() -> nn.Module:
    """FSDP2: its DTensors leave the device mesh, which holds the group, in torch's caches of sharding plans."""
    return train_a_step(fully_shard(nn.Linear(8, 2), mesh=init_device_mesh("cpu", (dist.get_world_size(),))))


@pytest.fixture
def baseline():
    """gloo threads before the test: those of groups that other tests' objects still hold (none of ours)."""
    gc.collect()
    return gloo_threads()


@pytest.mark.parametrize("train", [train_a_step_with_a_hooked_ddp_model, train_a_step_with_a_sharded_model],
                         ids=["ddp with a hook", "fsdp2"])
def test_destroying_the_group_alone_leaves_its_threads_running(baseline, train):
    """The fault, shown: what holds the group outlives it, and so do the group's threads."""
    distributed.init_process_group(torch.device("cpu"))
    group = dist.group.WORLD
    model = train()
    dist.destroy_process_group()
    gc.collect()
    assert gloo_threads() > baseline
    distributed.release(model)  # the group is idle: its last owner joins its threads here
    torch_private.release_meshes([group])
    del group
    gc.collect()
    assert gloo_threads() == baseline


def test_leaving_the_group_stops_its_threads_every_time(baseline):
    for _ in range(3):
        distributed.init_process_group(torch.device("cpu"))
        hooked = train_a_step_with_a_hooked_ddp_model()
        train_a_step_with_a_sharded_model()  # dropped: only torch's caches keep its mesh
        distributed.leave_process_group(hooked)
        assert not dist.is_initialized()
        assert live_reducers() == 0
        assert gloo_threads() == baseline


def test_a_ddp_model_not_handed_over_still_trains_after_another_runs_group_is_left(baseline):
    """Leaving releases the models it is handed and the group's meshes, never a DDP model of another run."""
    distributed.init_process_group(torch.device("cpu"))
    kept = train_a_step(nn.parallel.DistributedDataParallel(nn.Linear(8, 2)))
    distributed.leave_process_group()  # the first run ends; its model stays with the caller
    distributed.init_process_group(torch.device("cpu"))
    other = train_a_step_with_a_hooked_ddp_model()
    train_a_step_with_a_sharded_model()
    distributed.leave_process_group(other)
    assert not hasattr(other, "reducer")

    kept.zero_grad()
    train_a_step(kept)  # its reducer all-reduces over the first run's group, which it still holds
    plain = copy.deepcopy(kept.module)
    plain.zero_grad()
    train_a_step(plain)
    assert torch.equal(kept.module.weight.grad, plain.weight.grad)
    distributed.release(kept)  # the group is idle: its last owner joins its threads here
    assert gloo_threads() == baseline


def test_a_collective_counter_keeps_no_model_alive(baseline):
    """The hook state of 09's counter holds no model, so a DDP model with its hook is freed by ``del``."""
    distributed.init_process_group(torch.device("cpu"))
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    counter = CollectiveCounter(model)
    with counter:
        train_a_step(model)
    assert counter.summary()["all-reduce"]["calls"] == 1
    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None
    distributed.leave_process_group()
    assert gloo_threads() == baseline


def test_lever_checks_leaves_no_group_behind(baseline, capsys):
    """09's two-process checks, here as one plain process: DDP's traffic counted with a hook, FSDP2's with a tracker."""
    result = lever_checks(["--device", "cpu", "--examples", "8", "--grad-accum-steps", "2"])
    assert [check["strategy"] for check in result["accumulation"]] == ["ddp", "fsdp"]
    assert live_reducers() == 0
    assert gloo_threads() == baseline
