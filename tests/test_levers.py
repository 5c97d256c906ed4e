"""The memory levers in helpers.finetune: --grad-accum-steps, --amp (fp16 with its gradient scaler) and
--gradient-checkpointing train, are recorded, and resume bitwise after a kill between two micro-batches' optimizer
steps, in one process and under 2-process FSDP2; bad input is named in one line; each lever's
tracked memory on a real step is what helpers.memory predicts for it.

Each kill-and-resume applies all three levers at once: one killed run, its resumption and an uninterrupted run
per strategy (the one-process runs after the kill run in this process, which saves two interpreter starts). The
precision is fp16, whose gradient scaler is one more part of the checkpoints (bf16 adds none to fp32's).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import distributed, levers
from helpers.checkpoint import STATE_FILE, Checkpoints, read_state
from helpers.checks.training_checks import finetune_command, kill_and_resume
from helpers.finetune import find_problem, main, parse_args
from helpers.lever_memory import LEVERS, random_batches, tracked_step
from helpers.memory import predict_cpu_step
from helpers.memory.configs import bundled_config
from helpers.net import Net

ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
LEVER_ARGS = ["--grad-accum-steps", "2", "--amp", "fp16", "--gradient-checkpointing"]
RUN = ["--train-examples", "64", "--val-examples", "16", "--global-batch-size", "8", "--epochs", "2", *LEVER_ARGS]
MICRO_BATCHES_PER_EPOCH, STEPS = 16, 16  # 64 examples in micro-batches of 8 / (processes x 2); 8 steps per epoch


@pytest.mark.parametrize(("argv", "world_size", "examples", "message"), [
    (["--grad-accum-steps", "0"], 1, 100, "--grad-accum-steps 0: must be at least 1"),
    (["--global-batch-size", "12", "--grad-accum-steps", "4"], 2, 100,
     "--global-batch-size 12 does not split into equal micro-batches over 2 process(es) x 4 accumulation steps; "
     "use a multiple of 8"),
    (["--global-batch-size", "16", "--grad-accum-steps", "4"], 2, 12,
     "--grad-accum-steps 4: an epoch has only 3 micro-batch(es) of 2 per process (12 training examples over 2 "
     "process(es)); use at most 3, or more training examples"),
])
def test_bad_accumulation_is_named_in_one_line(argv, world_size, examples, message):
    assert find_problem(parse_args(argv), world_size=world_size, rank=0, train_examples=examples) == message


def test_accumulation_that_fits_is_accepted():
    args = parse_args(["--global-batch-size", "16", "--grad-accum-steps", "4"])
    assert find_problem(args, world_size=2, rank=0, train_examples=13) is None  # 7 examples: micro-batches 2,2,2,1


@pytest.mark.parametrize(("name", "capability"), [("Tesla V100-SXM2-16GB", (7, 0)), ("Tesla T4", (7, 5))])
def test_bf16_is_refused_on_a_gpu_without_it_naming_fp16_and_accepted_on_the_cpu(monkeypatch, name, capability):
    """What a V100 and a T4 answer: bf16 only emulated (is_bf16_supported() is True with emulation, the default)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    assert levers.amp_problem("bf16", torch.device("cuda", 0)) == (
        f"--amp bf16: {name} (compute capability {capability[0]}.{capability[1]}) has no native bf16; use --amp fp16 "
        f"(fp16 autocast with a gradient scaler), train in fp32 (leave out --amp), or use a GPU of compute "
        f"capability 8.0 or later")
    assert levers.amp_problem("fp16", torch.device("cuda", 0)) is None
    assert levers.amp_problem("bf16", torch.device("cpu")) is None
    assert levers.amp_problem(None, torch.device("cuda", 0)) is None


def test_the_refusal_stops_the_run_before_the_model_loads(monkeypatch, capsys):
    """main's own path on a T4, simulated: the process takes cuda:0, meets the group (over gloo here), is refused."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (7, 5))
    monkeypatch.setattr(distributed, "device_problem", lambda choice: None)
    monkeypatch.setattr(distributed, "device_for_this_process", lambda choice: torch.device("cuda", 0))
    join = distributed.init_process_group
    monkeypatch.setattr(distributed, "init_process_group", lambda device: join(torch.device("cpu")))
    monkeypatch.setattr("helpers.finetune.Net", None)  # never reached: a model load would fail here
    with pytest.raises(SystemExit) as stop:
        main(["--amp", "bf16", "--train-examples", "8"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("error: --amp bf16: Tesla T4 (compute capability 7.5) has no native bf16; use "
                                       "--amp fp16 (fp16 autocast with a gradient scaler), train in fp32 (leave out "
                                       "--amp), or use a GPU of compute capability 8.0 or later\n")


def test_amp_offers_bf16_and_fp16_and_refuses_another_type_in_the_parser(capsys):
    assert (parse_args(["--amp", "fp16"]).amp, parse_args(["--amp", "bf16"]).amp) == ("fp16", "bf16")
    with pytest.raises(SystemExit):
        parse_args(["--amp", "fp8"])
    assert "argument --amp: invalid choice: 'fp8' (choose from 'bf16', 'fp16')" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "fp16: any GPU (the T4, the V100), with a gradient scaler (torch.amp.GradScaler)" in " ".join(
        capsys.readouterr().out.split())


def test_checkpointing_is_switched_on_in_every_layer():
    net = levers.enable_checkpointing(Net(pooler=False))
    assert all(layer.gradient_checkpointing for layer in net.bert.encoder.layer)
    assert net.bert.config.use_cache is False


def check_resumed(result, processes):
    stopped = result["stopped_at"]
    assert stopped["batch"] == 2 * stopped["step"], stopped  # saved between two optimizer steps
    assert 0 < stopped["batch"] < MICRO_BATCHES_PER_EPOCH, stopped  # in the middle of an epoch
    assert result["processes_saved"] == processes
    resumed, uninterrupted = result["resumed"], result["uninterrupted"]
    assert result["bitwise"], (resumed["weights_sha256"], uninterrupted["weights_sha256"])
    for mine, theirs in zip(resumed["history"], uninterrupted["history"], strict=True):
        assert (mine["train_loss"], mine["val_loss"], mine["skipped_steps"]) == (
            theirs["train_loss"], theirs["val_loss"], theirs["skipped_steps"])
    assert resumed["skipped_steps"] == uninterrupted["skipped_steps"] == sum(
        row["skipped_steps"] for row in uninterrupted["history"])
    assert {key: uninterrupted[key] for key in ("grad_accum_steps", "micro_batch_size", "amp", "gradient_checkpointing",
                                                "steps")} == {"grad_accum_steps": 2, "micro_batch_size": 4 // processes,
                                                              "amp": "fp16", "gradient_checkpointing": True,
                                                              "steps": STEPS}


def test_two_fsdp2_processes_with_every_lever_and_the_unused_pooler_killed_mid_epoch_resume_bitwise(tmp_path):
    """FSDP2 saves the most parts (sharded weights and Adam state, the scaler); --keep-pooler adds a parameter that
    gets no gradient, so Adam keeps no state for it: resuming once died on both ranks with 'Missing key in
    checkpoint state_dict: optimizer.state.bert.pooler.dense.weight.step'. DDP's kill-and-resume is test_resume's,
    through the same checkpoint code; the levers' parts of it are the one-process run's below."""
    result = kill_and_resume(finetune_command(2, *RUN, "--strategy", "fsdp", "--keep-pooler", "--device", "cpu"),
                             tmp_path / "checkpoints", tmp_path / "killed.log")
    check_resumed(result, processes=2)
    assert result["resumed_from"] == result["stopped_at"]["step"]  # and trained every step after it
    assert result["uninterrupted"]["strategy"] == "fsdp"


def test_one_process_with_every_lever_killed_mid_epoch_resumes_bitwise_and_records_the_levers(tmp_path, capsys):
    directory, saving = tmp_path / "checkpoints", ["--save-every", "3"]
    command = [sys.executable, "-m", "helpers.finetune", *RUN, "--checkpoint-dir", str(directory), *saving]
    with open(tmp_path / "killed.log", "w") as log:
        child = subprocess.Popen(command, env=ENV, stdout=log, stderr=log)
        deadline = time.monotonic() + 300
        while not (directory / "latest").exists():
            assert child.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
    stopped = read_state(Checkpoints(directory).latest() / STATE_FILE)["progress"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the killed run (OMP_NUM_THREADS=1): another number of threads adds up otherwise
    try:
        resumed = main([*RUN, "--checkpoint-dir", str(directory), *saving, "--resume",
                        "--output-dir", str(tmp_path / "out")])
        uninterrupted = main(RUN)
    finally:
        torch.set_num_threads(threads)
    check_resumed({"stopped_at": stopped, "processes_saved": 1, "resumed": resumed, "uninterrupted": uninterrupted,
                   "bitwise": resumed["weights_sha256"] == uninterrupted["weights_sha256"]}, processes=1)
    out = capsys.readouterr().out
    assert "1 process(es), backend gloo, device cpu; batch 8 per rank (2 micro-batches of 4) x 1 = global batch 8; " \
           "fp16 autocast with a gradient scaler; activation checkpointing" in out
    assert f"resumed at step {stopped['step']}: epoch 1, batch {stopped['batch']}" in out
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (metrics["grad_accum_steps"], metrics["micro_batch_size"], metrics["amp"]) == (2, 4, "fp16")
    # every skipped step is printed: by the uninterrupted run, and by the resumed one after where it was killed
    assert out.count("update skipped") == 2 * metrics["skipped_steps"] - stopped["skipped_steps"]
    assert [len(row["batch_losses"]) for row in metrics["history"]] == [8, 8]  # one loss per optimizer step


@pytest.fixture(scope="module")
def memory():
    """Each lever's predicted and tracked peak for the bundled model, global batch 16 of 64 tokens."""
    config, rows = bundled_config(), {}
    for name, options in LEVERS.items():
        accumulation = options.get("accumulation", 1)
        torch.manual_seed(0)
        net = Net(pooler=False)
        if options.get("checkpointing"):
            levers.enable_checkpointing(net)
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-4, foreach=True)
        rows[name] = {"predicted": predict_cpu_step(config, 16, 64, accumulation=accumulation,
                                                    checkpointing=bool(options.get("checkpointing")),
                                                    amp=options.get("amp")),
                      "tracked": tracked_step(net, optimizer, random_batches(config.vocab_size, 16, 64, accumulation),
                                              options.get("amp"))}
    return rows


@pytest.mark.parametrize("lever", list(LEVERS))
def test_each_levers_tracked_peak_and_saving_are_predicted_within_5_percent(memory, lever):
    predicted, tracked = memory[lever]["predicted"]["total"], memory[lever]["tracked"]["total"]
    assert tracked == pytest.approx(predicted, rel=0.05)
    if lever != "none":
        saving = {side: 1 - memory[lever][side]["total"] / memory["none"][side]["total"] for side in memory[lever]}
        assert saving["tracked"] > 0.1
        assert saving["tracked"] == pytest.approx(saving["predicted"], rel=0.05)


def test_accumulation_divides_the_activations_and_keeps_gradients_and_adam_state(memory):
    none, accumulation = memory["none"]["tracked"], memory["accumulation"]["tracked"]
    micro_batches = LEVERS["accumulation"]["accumulation"]
    assert accumulation["activations"] == pytest.approx(none["activations"] / micro_batches, rel=0.01)
    assert accumulation["optimizer"] == none["optimizer"]  # Adam's two moments, whatever the batch
    assert accumulation["gradients"] == 4 * sum(p.numel() for p in Net(pooler=False).parameters())  # all of them,
    # held from the first micro-batch's backward to the optimizer step
