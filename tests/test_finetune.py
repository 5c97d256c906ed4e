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

from torch.utils.data import DataLoader

from helpers.checkpoint import Checkpoints, Progress, load_checkpoint, weights_digest
from helpers.checks.training_checks import EQUIVALENCE_RUN, finetune_command, judge_ddp_equivalence
from helpers.data import PadToLongest, load_split
from helpers.distributed import device_problem
from helpers.finetune import find_problem, parse_args, use_deterministic_algorithms
from helpers.launch import last_json
from helpers.models import load_tokenizer
from helpers.net import Net
from helpers.train import evaluate

TIMEOUT = 300
ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
SMALL = ["--train-examples", "32", "--global-batch-size", "8", "--epochs", "1"]


def torchrun(*args, nproc=2):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One 2-process run under torchrun, with the gradient check make gpu-check runs over NCCL, and its output folder."""
    out = tmp_path_factory.mktemp("two-processes")
    command = finetune_command(2, *EQUIVALENCE_RUN, "--val-examples", "40", "--output-dir", str(out))
    return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=TIMEOUT), out


def test_two_processes_split_the_global_batch_and_end_with_identical_weights(two_processes):
    run, out = two_processes
    assert run.returncode == 0, run.stderr
    assert "batch 4 per rank x 2 = global batch 8" in run.stdout
    assert run.stdout.count("epoch 1:") == 1  # only rank 0 logs
    result = last_json(run.stdout)
    assert (result["world_size"], result["per_rank_batch_size"], result["steps"]) == (2, 4, 4)
    first, second = result["weights_sha256"]
    assert first == second
    # what rank 0 reported is what the trained weights score, measured here again in one plain process
    net = Net(pooler=False)
    load_checkpoint(out / "model", net)
    assert weights_digest(net) == first
    tokenizer = load_tokenizer()
    again = evaluate(net, DataLoader(load_split("validation")[:40], batch_size=64, collate_fn=PadToLongest(tokenizer)))
    assert result["history"][0]["val_accuracy"] == again["accuracy"]
    assert result["history"][0]["val_loss"] == pytest.approx(again["loss"], abs=1e-6)


def test_ddp_gradients_on_two_halves_equal_one_process_on_the_whole_batch(two_processes):
    run, _ = two_processes
    assert run.returncode == 0, run.stderr
    ok, line = judge_ddp_equivalence(run, "DDP 2 processes")
    assert ok and line.startswith("DDP 2 processes over gloo: max |DDP - one process| gradient "), line
    assert line.endswith("weights bitwise equal on all ranks after a step and after training: True")
    check = last_json(run.stdout)["equivalence"]
    assert (check["world_size"], check["per_rank_batch_size"], check["gradient_tensors"]) == (2, 4, 71)
    assert check["parameters_on_this_rank"] == check["parameters"]  # DDP: a full copy on every rank
    assert check["max_abs_grad_diff"] <= 1e-6 and check["max_abs_weight_diff_after_sgd"] <= 1e-6
    assert check["loss_mean_over_ranks"] == pytest.approx(check["loss_one_process"], abs=1e-6)
    assert check["weights_identical_on_all_ranks"]


def test_a_plain_process_trains_and_writes_the_model_it_reports(tmp_path):
    command = [sys.executable, "-m", "helpers.finetune", *SMALL, "--output-dir", str(tmp_path / "out"), "--body-lr", "1e-4"]
    run = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    result = last_json(run.stdout)
    assert (result["world_size"], result["per_rank_batch_size"]) == (1, 8)
    assert "peak learning rates: body 0.0001, head 0.001" in run.stdout  # as given; learning_rates_for's (128 wide)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert len(metrics["history"][0]["batch_losses"]) == 4  # every batch's loss is in the file
    del metrics["history"][0]["batch_losses"]
    assert metrics == result  # and the printed summary is the rest of it
    assert len(run.stdout.strip().splitlines()[-1]) < 600
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


def launch_ranks(args, envs, program=("-m", "helpers.finetune")):
    """Start one process per rank by hand, as torchrun would, so the exit status of every rank can be seen."""
    port = free_port()
    processes = []
    for rank, extra in enumerate(envs):
        env = ENV | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(envs)),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} | extra
        processes.append(subprocess.Popen([sys.executable, *program, *args], env=env,
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
    assert f"error: rank 1 on {socket.gethostname()}: Model '/no/such/model/dir' is not available here" in outputs[0][1]


@pytest.mark.parametrize(("args", "message"), [
    (["--resume"], "--resume needs --checkpoint-dir: where the checkpoints are"),
    (["--save-every", "5"], "--save-every needs --checkpoint-dir: where the checkpoints are"),
    (["--val-examples", "0"], "--val-examples 0: must be at least 1"),
    (["--checkpoint-dir", "{tmp}/ckpt", "--save-every", "-1"],
     "--save-every -1: must be at least 0 (0: save only after each epoch)"),
    (["--checkpoint-dir", "{tmp}/file/ckpt"],
     "--checkpoint-dir {tmp}/file/ckpt: cannot write there (Not a directory)"),
    (["--output-dir", "{tmp}/out", "--checkpoint-dir", "{tmp}/file/ckpt"],  # a good --output-dir checks on
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


def test_last_json_skips_warnings_printed_after_the_summary():
    text = ('1 process(es), backend nccl\n{"world_size": 2, "steps": 4}\n'
            '/x/distributed_c10d.py:5344: UserWarning: barrier(): using the device under current context.\n'
            '  warnings.warn(  # warn only once\n')
    assert last_json(text) == {"world_size": 2, "steps": 4}
    with pytest.raises(ValueError, match=r"no line of this output is a JSON object \(2 lines\).*'\[1, 2\]'"):
        last_json("epoch 1: train loss 0.69\n[1, 2]\n")


@pytest.fixture
def one_gpu(monkeypatch):
    """torch answers as on a machine with one CUDA GPU, for the argument check only (nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize(("env", "device", "expected"), [
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, "auto", None),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "auto",  # rank 0 finds it too, so every process stops
     "2 processes on this machine but torch sees 1 CUDA GPU(s), and each process needs a GPU of its own "
     "(LOCAL_RANK 1 has none): start at most 1 (torchrun --nproc_per_node=1), or add --device cpu to run all 2 "
     "on the CPU over gloo"),
    ({"LOCAL_RANK": "1"}, "cuda", "2 processes on this machine but torch sees 1 CUDA GPU(s)"),
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "cpu", None),
])
def test_more_processes_than_gpus_are_refused_before_anything_starts(one_gpu, monkeypatch, env, device, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    problem = device_problem(parse_args(["--device", device]).device)
    assert problem == expected if expected is None else problem.startswith(expected)


def test_device_cuda_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_problem(parse_args(["--device", "cuda"]).device) == (
        "--device cuda: torch sees no CUDA device on this machine; use --device cpu (or auto)")


def test_deterministic_sets_every_switch(monkeypatch):
    # setenv first, so that monkeypatch restores the variable's absence after the test: a leaked ":4096:8" changes
    # every later memory prediction that reads the environment (the cuBLAS workspaces)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "unset by the test")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    try:
        use_deterministic_algorithms()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


ONE_GPU_MAIN = ("import sys, torch\n"
                "torch.cuda.is_available = lambda: True  # as on a machine with one GPU; the check stops before using it\n"
                "torch.cuda.device_count = lambda: 1\n"
                "from helpers.finetune import main\n"
                "main(sys.argv[1:])\n")


def test_two_processes_on_one_gpu_both_stop_before_joining_with_one_message():
    codes, outputs = launch_ranks(SMALL, [{"LOCAL_WORLD_SIZE": "2"}] * 2, program=("-c", ONE_GPU_MAIN))
    assert codes == [2, 2]
    (_, rank0_err), (_, rank1_err) = outputs
    assert rank0_err.startswith("error: 2 processes on this machine but torch sees 1 CUDA GPU(s)") and rank1_err == ""
