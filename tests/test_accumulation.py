"""Gradient accumulation: N micro-batches give the gradients of one batch of all of them, in one process, under
2-process DDP and under 2-process FSDP2; the collectives are counted for real (once per optimizer step with the
communication paused, N times without); activation checkpointing changes no gradient; the training loop counts
optimizer steps and refuses to resume mid-step.

The two-process checks share one torchrun launch of ``helpers.lever_checks`` (both strategies, both checks).
"""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers import get_linear_schedule_with_warmup, set_seed

from helpers import distributed
from helpers.accumulation import CollectiveCounter, accumulate_naively, compare_accumulation
from helpers.checkpoint import CheckpointError, Progress
from helpers.data import PadToLongest, load_split, make_loader
from helpers.equivalence import EQUIVALENCE_TOLERANCE
from helpers.launch import last_json
from helpers.lever_checks import compare_checkpointing
from helpers.models import load_tokenizer
from helpers.net import Net
from helpers.optim import two_lr_adam
from helpers.step import train_step
from helpers.train import check_steps, train_epoch

ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


@pytest.fixture(scope="module")
def collate():
    return PadToLongest(load_tokenizer())


@pytest.fixture
def group_of_one():
    """This process alone as a process group (gloo, in memory), as a plain ``python -m helpers.finetune`` has it."""
    distributed.init_process_group(torch.device("cpu"))
    yield
    distributed.leave_process_group()


def gradients(net):
    return {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}


def largest_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.mark.parametrize("sizes", [(4, 4, 4, 4), (5, 5, 5, 1)], ids=["equal", "a short last micro-batch"])
def test_micro_batches_give_the_gradients_and_loss_of_one_batch(collate, sizes):
    examples = load_split("train")[:sum(sizes)]
    set_seed(0)
    net = Net(pooler=False).eval()  # no dropout: both sides compute the same function
    loss, _ = train_step(net, [collate(examples)])
    whole = gradients(net)
    net.zero_grad(set_to_none=True)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    mean, _ = train_step(net, [collate(examples[start:start + size]) for start, size in zip(starts, sizes)])
    assert largest_difference(gradients(net), whole) <= EQUIVALENCE_TOLERANCE
    assert mean == pytest.approx(loss, abs=1e-6)


def test_the_naive_loop_is_right_only_for_equal_micro_batches(collate):
    examples = load_split("train")[:16]
    set_seed(0)
    net = Net(pooler=False).eval()
    train_step(net, [collate(examples)])
    whole = gradients(net)
    for sizes, right in (((4, 4, 4, 4), True), ((5, 5, 5, 1), False)):
        net.zero_grad(set_to_none=True)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        accumulate_naively(net, [collate(examples[start:start + size]) for start, size in zip(starts, sizes)])
        assert (largest_difference(gradients(net), whole) <= EQUIVALENCE_TOLERANCE) is right


def test_one_process_ddp_all_reduces_once_per_step_with_the_pause_and_n_times_without(collate, group_of_one):
    result = compare_accumulation(None, load_split("train")[:16], collate, torch.device("cpu"), "ddp", 4)
    gradient_bytes = 4 * result["parameters"]
    for loop, rounds in (("no_gradient_sync", 1), ("naive", 4)):
        row = result[loop]
        assert row["max_abs_grad_diff"] <= EQUIVALENCE_TOLERANCE, loop
        assert list(row["collectives"]) == ["all-reduce"]
        assert row["collectives"]["all-reduce"]["bytes"] == rounds * gradient_bytes, loop
    assert result["naive"]["collectives"]["all-reduce"]["calls"] == 4 * result["no_gradient_sync"]["collectives"][
        "all-reduce"]["calls"]


def test_one_process_fsdp_accumulates_the_same_gradients_and_skips_its_collectives(collate, group_of_one):
    result = compare_accumulation(None, load_split("train")[:16], collate, torch.device("cpu"), "fsdp", 4)
    for loop in ("no_gradient_sync", "naive"):
        assert result[loop]["max_abs_grad_diff"] <= EQUIVALENCE_TOLERANCE
        assert result[loop]["collectives"] == {}  # FSDP2 in a group of one copies instead of communicating


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_process_checkpointing_changes_no_gradient(collate, group_of_one, strategy):
    result = compare_checkpointing(None, load_split("train")[:8], collate, torch.device("cpu"), strategy)
    assert result["max_abs_grad_diff"] <= EQUIVALENCE_TOLERANCE


def test_a_counter_counts_only_inside_its_block(collate, group_of_one):
    set_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net(pooler=False))
    counter = CollectiveCounter(ddp)
    batch = collate(load_split("train")[:4])
    train_step(ddp, [batch])
    assert counter.summary() == {}
    with counter:
        train_step(ddp, [batch])
    assert counter.summary()["all-reduce"]["bytes"] == 4 * sum(p.numel() for p in ddp.parameters())


def test_two_processes_ddp_and_fsdp_accumulate_one_batch_and_communicate_once_per_step():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "helpers.lever_checks", "--device", "cpu"]
    run = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = last_json(run.stdout)
    ddp, fsdp = result["accumulation"]
    assert (ddp["strategy"], fsdp["strategy"], ddp["world_size"], ddp["micro_batches"]) == ("ddp", "fsdp", 2, 4)
    gradient_bytes = 4 * ddp["parameters"]
    for check in (ddp, fsdp):
        for loop in ("no_gradient_sync", "naive"):
            assert check[loop]["max_abs_grad_diff"] <= EQUIVALENCE_TOLERANCE, (check["strategy"], loop)
    # DDP: one round of bucket all-reduces per optimizer step with the pause, one per micro-batch without
    paused, naive = (ddp[loop]["collectives"]["all-reduce"] for loop in ("no_gradient_sync", "naive"))
    assert (paused["bytes"], naive["bytes"]) == (gradient_bytes, 4 * gradient_bytes)
    assert naive["calls"] == 4 * paused["calls"]
    # FSDP2: one reduce-scatter per unit and step with the pause, one per unit and micro-batch without; the
    # all-gathers of the weights do not change; the pause holds the unsharded gradients, twice the shard's bytes.
    # (FSDP2 pads a tensor of an odd number of rows by one row to split it in two: a few hundred bytes more)
    paused, naive = (fsdp[loop]["collectives"] for loop in ("no_gradient_sync", "naive"))
    assert paused["reduce-scatter"]["bytes"] == pytest.approx(gradient_bytes, rel=1e-3)
    assert naive["reduce-scatter"]["bytes"] == 4 * paused["reduce-scatter"]["bytes"]
    assert naive["reduce-scatter"]["calls"] == 4 * paused["reduce-scatter"]["calls"] == 4 * 5  # 4 layers + the root
    assert paused["all-gather"] == naive["all-gather"]
    assert fsdp["no_gradient_sync"]["between_micro_batches"]["gradients"] == gradient_bytes
    assert 2 * fsdp["naive"]["between_micro_batches"]["gradients"] == pytest.approx(gradient_bytes, rel=1e-3)
    for check in result["checkpointing"]:
        assert check["max_abs_grad_diff"] <= EQUIVALENCE_TOLERANCE, check["strategy"]
    assert "FSDP: 2 process(es) x 4 micro-batches of 4 = global batch 32, one optimizer step" in run.stdout


def test_train_epoch_steps_once_per_group_and_the_schedule_counts_optimizer_steps():
    tokenizer = load_tokenizer()
    loader = make_loader(load_split("train")[:36], tokenizer, batch_size=4)  # 9 micro-batches
    set_seed(0)
    net = Net(pooler=False)
    optimizer = two_lr_adam(net, 1e-3, 1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, 10)
    trained = []
    losses = train_epoch(net, loader, optimizer, scheduler, accumulation=4,
                         after_step=lambda loss, batches, updated: trained.append(batches))
    assert trained == [4, 8, 9] and len(losses) == 3  # the last step takes the one micro-batch left
    assert scheduler.last_epoch == 3


def test_resuming_inside_an_optimizer_step_is_refused():
    tokenizer = load_tokenizer()
    net = Net(pooler=False)
    loader = make_loader(load_split("train")[:16], tokenizer, batch_size=4)
    with pytest.raises(ValueError, match="skip=2 batches is not a whole number of optimizer steps of accumulation=4"):
        train_epoch(net, loader, two_lr_adam(net), progress=Progress(batch=2), accumulation=4)


def test_a_checkpoint_of_another_accumulation_is_refused_before_training():
    check_steps(Progress(step=7, epoch=1, batch=4), batches=10, accumulation=2)  # 5 steps per epoch + 2
    with pytest.raises(CheckpointError, match=r"optimizer step 7 \(epoch 2, batch 4\), where a run of 10 batches per "
                                              r"epoch and 4 per optimizer step never stands"):
        check_steps(Progress(step=7, epoch=1, batch=4), batches=10, accumulation=4)
