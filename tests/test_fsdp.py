"""FSDP2 through helpers.fsdp and ``helpers.finetune --strategy fsdp``: the same gradients and SGD step as one
process, sharded checkpoints that load under another number of processes and into a plain Net, a run killed
(SIGKILL, under torchrun) and resumed to bitwise the same weights, and bad input refused with a clear message.

Three torchrun runs are shared by the tests: an uninterrupted run (with the equivalence check and the plain weights
written by ``--output-dir``), one killed after its first checkpoint (``kill_and_resume``) and its resumption.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from helpers import distributed, fsdp
from helpers.checkpoint import CheckpointError, Checkpoints, full_weights, load_checkpoint, state_dicts_equal
from helpers.checkpoint import SHARDED_DIR
from helpers.checks.training_checks import kill_and_resume
from helpers.equivalence import EQUIVALENCE_TOLERANCE
from helpers.finetune import main, parse_args
from helpers.launch import last_json
from helpers.net import Net
from helpers.optim import ParamGroupError, audit_param_groups, two_lr_adam

EPOCHS, BATCHES_PER_EPOCH = 2, 6
ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
ARGS = ["--strategy", "fsdp", "--train-examples", str(8 * BATCHES_PER_EPOCH), "--val-examples", "16",
        "--global-batch-size", "8", "--epochs", str(EPOCHS)]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "helpers.finetune", *ARGS]


def torchrun(*args) -> dict:
    run = subprocess.run([*TORCHRUN, *args], env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return last_json(run.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run (with the equivalence check), then one killed after its first checkpoint (torchrun and
    both workers, as when a machine dies) and its resumption, and their folders."""
    root = tmp_path_factory.mktemp("fsdp")
    uninterrupted = torchrun("--check-equivalence", "--checkpoint-dir", str(root / "uninterrupted"),
                             "--output-dir", str(root / "out"))
    result = kill_and_resume([*TORCHRUN, "--output-dir", str(root / "out-resumed")], root / "killed",
                             root / "killed.log", uninterrupted=uninterrupted)
    return result | {"root": root,
                     "metrics": [json.loads((root / out / "metrics.json").read_text()) for out in ("out-resumed", "out")]}


def test_sharded_gradients_and_sgd_step_equal_one_process(runs):
    result = runs["uninterrupted"]["equivalence"]
    assert result["world_size"] == 2 and result["per_rank_batch_size"] == 4
    assert result["max_abs_grad_diff"] <= EQUIVALENCE_TOLERANCE
    assert result["max_abs_weight_diff_after_sgd"] <= EQUIVALENCE_TOLERANCE
    assert "weights_identical_on_all_ranks" not in result  # no rank holds a full copy to compare
    # each tensor's rows split in two, rank 0 taking the larger half of an odd count (torch.chunk's sizes)
    shapes = [p.shape for p in Net(pooler=False).parameters()]
    assert result["parameters"] == sum(shape.numel() for shape in shapes)
    assert result["parameters_on_this_rank"] == sum(-(-shape[0] // 2) * shape[1:].numel() for shape in shapes)


def test_killed_under_torchrun_and_resumed_ends_bitwise_like_an_uninterrupted_run(runs):
    assert 0 < runs["stopped_at"]["batch"] < BATCHES_PER_EPOCH, runs["stopped_at"]  # killed mid-epoch
    assert runs["resumed_from"] == runs["stopped_at"]["step"] and runs["processes_saved"] == 2
    resumed, uninterrupted = runs["resumed"], runs["uninterrupted"]
    assert resumed["weights_sha256"] == uninterrupted["weights_sha256"]
    assert len(set(resumed["weights_sha256"])) == 1
    losses = [[row["batch_losses"] for row in metrics["history"]] for metrics in runs["metrics"]]  # metrics.json
    assert losses[0] == losses[1] and len(losses[0][0]) == BATCHES_PER_EPOCH


def test_sharded_checkpoint_of_two_processes_loads_into_a_plain_net_and_into_one_process(runs):
    latest = Checkpoints(runs["root"] / "uninterrupted").latest()
    assert sorted(p.name for p in (latest / SHARDED_DIR).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    full = load_file(runs["root"] / "out" / "model" / "model.safetensors")  # gathered by the run itself

    torch.manual_seed(1)
    plain = Net(pooler=False)
    load_checkpoint(latest, plain)  # no process group
    assert state_dicts_equal(plain.state_dict(), full)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(1)
        one = fsdp.shard(Net(pooler=False))
        optimizer = two_lr_adam(one)
        load_checkpoint(latest, one, optimizer)  # resharded: 2 shards saved, 1 loaded
        assert state_dicts_equal(full_weights(one), full)
        assert len(optimizer.state) == len(list(one.parameters()))  # Adam's moments came back too
        with pytest.raises(CheckpointError, match="saved by 2 process.*resumed with 1"):
            Checkpoints(runs["root"] / "uninterrupted").resume(one, optimizer, None, None)
    finally:
        distributed.leave_process_group()


def test_resuming_across_strategies_is_refused_with_the_reason(runs, tmp_path, capsys):
    ddp_dir = tmp_path / "ddp"
    main(["--train-examples", "8", "--val-examples", "8", "--global-batch-size", "8", "--epochs", "1",
          "--checkpoint-dir", str(ddp_dir)])
    for directory, strategy, saved in ((ddp_dir, "fsdp", "ddp"), (runs["root"] / "uninterrupted", "ddp", "fsdp")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            main(["--strategy", strategy, "--checkpoint-dir", str(directory), "--resume"])
        assert stop.value.code == 2
        assert f"saved by a --strategy {saved} run" in capsys.readouterr().err
    torch.manual_seed(1)
    plain = Net(pooler=False)
    with pytest.raises(CheckpointError, match="saved from a sharded model, loaded with its optimizer into an "):
        load_checkpoint(Checkpoints(runs["root"] / "uninterrupted").latest(), plain, two_lr_adam(plain))


def test_unknown_strategy_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(["--strategy", "zero3"])
    assert stop.value.code == 2
    assert "argument --strategy: invalid choice: 'zero3'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected one of ddp, fsdp"):
        fsdp.prepare(Net(pooler=False), "zero3")


def test_an_optimizer_built_before_sharding_trains_nothing_and_the_audit_says_so():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = Net(pooler=False)
        optimizer = two_lr_adam(net)  # the mistake: before fully_shard
        fsdp.shard(net)
        before = {key: value.clone() for key, value in full_weights(net).items()}
        ids = torch.randint(5, 100, (4, 12))
        torch.nn.functional.cross_entropy(net(ids, torch.ones_like(ids)), torch.tensor([0, 1, 0, 1])).backward()
        optimizer.step()
        assert state_dicts_equal(full_weights(net), before)  # silently unchanged
        assert all(p.grad is not None for p in net.parameters())  # the gradients went to the new DTensors
        with pytest.raises(ParamGroupError, match="not in any group.*not parameters of FSDPNet"):
            audit_param_groups(net, optimizer)
    finally:
        distributed.leave_process_group()
