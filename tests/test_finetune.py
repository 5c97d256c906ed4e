"""helpers.finetune under torchrun, as one plain process, as two loopback "nodes", and with bad input.

Every test starts real processes that talk over gloo; a timeout turns a hang into a failure.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from helpers.checkpoint import Checkpoints, Progress, load_checkpoint
from helpers.ddp_equivalence import weights_digest
from helpers.finetune import find_problem, parse_args
from helpers.net import Net

TIMEOUT = 300
ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
SMALL = ["--train-examples", "32", "--global-batch-size", "8", "--epochs", "1"]


def torchrun(*args, nproc=2):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)


def last_json(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_split_the_global_batch_and_end_with_identical_weights():
    run = torchrun("-m", "helpers.finetune", *SMALL)
    assert run.returncode == 0, run.stderr
    assert "batch 4 per rank x 2 = global batch 8" in run.stdout
    assert run.stdout.count("epoch 1:") == 1  # only rank 0 logs
    result = last_json(run.stdout)
    assert (result["world_size"], result["per_rank_batch_size"], result["steps"]) == (2, 4, 4)
    first, second = result["weights_sha256"]
    assert first == second
    assert 0.0 <= result["history"][0]["val_accuracy"] <= 1.0


def test_ddp_gradients_on_two_halves_equal_one_process_on_the_whole_batch():
    run = torchrun("-m", "helpers.finetune", *SMALL, "--check-equivalence")
    assert run.returncode == 0, run.stderr
    check = last_json(run.stdout)["equivalence"]
    assert (check["world_size"], check["per_rank_batch_size"], check["gradient_tensors"]) == (2, 4, 71)
    assert check["max_abs_grad_diff"] <= 1e-6
    assert check["loss_mean_over_ranks"] == pytest.approx(check["loss_one_process"], abs=1e-6)
    assert check["weights_identical_on_all_ranks"]


def test_a_plain_process_trains_and_writes_the_model_it_reports(tmp_path):
    command = [sys.executable, "-m", "helpers.finetune", *SMALL, "--output-dir", str(tmp_path / "out"), "--body-lr", "1e-4"]
    run = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    result = last_json(run.stdout)
    assert (result["world_size"], result["per_rank_batch_size"]) == (1, 8)
    assert "peak learning rates: body 0.0001, head 0.001" in run.stdout  # as given; learning_rates_for's (128 wide)
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == result
    net = Net(pooler=False)
    load_checkpoint(tmp_path / "out" / "model", net)
    assert weights_digest(net) == result["weights_sha256"][0]


def test_two_nodes_on_loopback_end_with_identical_weights():
    rendezvous = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=loopback-test"]
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "-m", "helpers.finetune", *SMALL]
    nodes = [subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=TIMEOUT) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err for _, err in outputs]
    reports = [out for out, _ in outputs if out.strip()]
    assert len(reports) == 1  # rank 0 runs on one of the two nodes and alone prints
    result = last_json(reports[0])
    assert result["world_size"] == 2
    first, second = result["weights_sha256"]
    assert first == second


def test_the_memos_network_with_its_unused_pooler_stops_ddp_on_the_second_step():
    run = torchrun("-m", "helpers.finetune", *SMALL, "--keep-pooler")
    assert run.returncode != 0
    assert "RuntimeError: Expected to have finished reduction in the prior iteration" in run.stderr
    assert "Parameter indices which did not receive grad for rank 0: 69 70" in run.stderr  # the pooler's two


def launch_ranks(args, envs):
    """Start one process per rank by hand, as torchrun would, so the exit status of every rank can be seen."""
    port = free_port()
    processes = []
    for rank, extra in enumerate(envs):
        env = ENV | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(envs)),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} | extra
        processes.append(subprocess.Popen([sys.executable, "-m", "helpers.finetune", *args], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [process.communicate(timeout=TIMEOUT) for process in processes]  # a hang fails here
    finally:
        for process in processes:
            process.kill()
    return [process.returncode for process in processes], outputs


@pytest.mark.parametrize(("args", "message"), [
    (["--global-batch-size", "1"], "leaves a per-rank batch of 0; it must be at least 1"),
    (["--train-examples", "1"], "2 processes but only 1 training example(s)"),
    (["--model", "no-such-org/no-such-model"], "Model 'no-such-org/no-such-model' is not available here"),
    (["--output-dir", "{file}/out"], "cannot write there"),
])
def test_bad_input_stops_every_rank_with_one_message_from_rank_0(tmp_path, args, message):
    (tmp_path / "file").write_text("a file where a folder should be")
    args = [arg.format(file=tmp_path / "file") for arg in args]
    codes, outputs = launch_ranks(args, [{}, {}])
    assert codes == [2, 2]
    (_, rank0_err), (_, rank1_err) = outputs
    assert message in rank0_err and rank0_err.count("error:") == 1
    assert rank1_err == ""


def test_a_model_missing_on_one_machine_only_stops_all_ranks():
    codes, outputs = launch_ranks(SMALL, [{}, {"BERT_MODEL": "/no/such/model/dir"}])
    assert codes == [2, 2]
    assert "Model '/no/such/model/dir' is not available here" in outputs[0][1]


@pytest.mark.parametrize(("args", "message"), [
    (["--resume"], "--resume needs --checkpoint-dir: where the checkpoints are"),
    (["--save-every", "5"], "--save-every needs --checkpoint-dir: where the checkpoints are"),
    (["--val-examples", "0"], "--val-examples 0: must be at least 1"),
    (["--checkpoint-dir", "{tmp}/ckpt", "--save-every", "-1"],
     "--save-every -1: must be at least 0 (0: save only after each epoch)"),
    (["--checkpoint-dir", "{tmp}/file/ckpt"],
     "--checkpoint-dir {tmp}/file/ckpt: cannot write there (Not a directory)"),
])
def test_bad_checkpoint_options_are_named(tmp_path, args, message):
    (tmp_path / "file").write_text("a file where a folder should be")
    args = parse_args([arg.format(tmp=tmp_path) for arg in args])
    assert find_problem(args, world_size=1, rank=0, train_examples=100) == message.format(tmp=tmp_path)


def test_resuming_from_another_models_checkpoint_stops_with_the_file_and_the_cause(tmp_path):
    Checkpoints(tmp_path).save(torch.nn.Linear(2, 2), None, None, Progress(step=1))
    command = [sys.executable, "-m", "helpers.finetune", *SMALL, "--checkpoint-dir", str(tmp_path), "--resume"]
    run = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 2
    assert run.stderr.startswith(f"error: {tmp_path}/step-000001/model.safetensors: saved from a different model "
                                 f"than Net; missing: bert.embeddings.word_embeddings.weight")
