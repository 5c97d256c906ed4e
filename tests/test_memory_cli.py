"""``python -m helpers.memory``: helpers.finetune's flags and defaults, the GPU named or refused, the same columns
in every run with a legend, --json, bad input answered in one line naming the flag; the README's example output
and chart against fresh ones. Settings are traced on the bundled tiny model where the test allows it (fast)."""

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import finetune
from helpers.data import MAX_LENGTH, PadToLongest
from helpers.memory import FITS, GPUS, GpuModel, command
from helpers.memory.categories import ORDER
from helpers.memory.configs import bundled_config
from helpers.memory.prediction import peak_per_gpu
from helpers.models import bundled_model_dir

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = os.environ | {"HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
TINY = str(bundled_model_dir())


def run_module(*args: str, module: str = "helpers.memory") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=OFFLINE,
                          timeout=600)


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """The command in this process (no interpreter to start): exit status, stdout, stderr."""
    try:
        status = command.main(list(args))
    except SystemExit as stop:  # argparse's refusals
        status = stop.code
    out, err = capsys.readouterr()
    return status, out, err


def table(out: str) -> tuple[list[str], list[list[str]]]:
    """The header's column names and each GPU row's cells."""
    lines = out.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["weights"])
    return header.split(), [line.split()[1:] for line in lines if re.match(r"GPU\d", line)]


def test_without_a_gpu_or_gpu_it_refuses_in_one_line_naming_gpu_and_the_known_gpus():
    run = run_module("--amp", "fp16")  # conftest hides every GPU from torch
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1
    assert run.stderr.startswith("python -m helpers.memory: error: torch sees no GPU here: name the GPU to predict "
                                 "for with --gpu (")
    assert all(name in run.stderr for name in GPUS)


@pytest.fixture
def no_search(monkeypatch):
    """The largest batch left unsearched (test_the_largest_batch_is_the_boundary_of_what_fits checks it): a few
    traces fewer."""
    monkeypatch.setattr(command, "largest_batch", lambda *args, **options: 0)


def test_with_a_gpu_it_predicts_for_that_gpu_and_names_it(capsys, monkeypatch, no_search):
    import torch

    from helpers.memory import cuda_step

    seen = GpuModel("Tesla T4", (7, 5), 40, 1024, 15_828_320_256)  # as torch describes Colab's T4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_step, "this_gpu", lambda device=0: seen)
    status, out, _ = run_main(capsys, "--model", TINY, "--seq-len", "64", "--amp", "fp16")
    assert status == 0
    assert out.splitlines()[1] == ("ddp on 1 x Tesla T4 (this machine's GPU 0; sm75, 40 SMs, 14.7 GiB each), global "
                                   "batch 32 = 32 per GPU x 1 micro-batch, L=64")
    assert out.splitlines()[2].startswith("fp16 autocast with a gradient scaler, attention memory-efficient; ")
    status, out, err = run_main(capsys, "--model", TINY, "--amp", "bf16")
    assert status == 2 and out == "" and "--amp bf16: Tesla T4 (sm75) has no native bf16" in err


def test_the_flags_and_defaults_are_helpers_finetunes(monkeypatch):
    """Compared with helpers.finetune's own parser: the shared flags' names and defaults, its strategies and amp
    types among ours; --seq-len defaults to the length the training's batches are cut at."""
    import argparse

    parsers = []
    original = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, args=None, namespace=None: parsers.append(self) or original(self, args, namespace))
    theirs = finetune.parse_args([])
    ours = command.parser().parse_args([])
    for name in ("model", "global_batch_size", "grad_accum_steps", "gradient_checkpointing", "amp", "strategy"):
        assert hasattr(ours, name), name
        if name != "model":  # finetune's default is the bundled tiny model; ours, the memo's
            assert getattr(ours, name) == getattr(theirs, name), name
    choices = {parser.prog: {action.dest: action.choices for action in parser._actions} for parser in parsers}
    finetune_choices, our_choices = choices["python -m helpers.finetune"], choices["python -m helpers.memory"]
    assert set(finetune_choices["strategy"]) <= set(our_choices["strategy"]) and "fsdp2" not in our_choices["strategy"]
    assert set(finetune_choices["amp"]) <= set(our_choices["amp"]) == {"bf16", "fp16"}
    assert ours.seq_len == MAX_LENGTH == inspect.signature(PadToLongest).parameters["max_length"].default == 128


def test_help_shows_every_default_and_explains_every_column_in_one_line():
    text = command.parser().format_help()
    for action in command.parser()._actions:
        if action.dest not in ("help", "json"):
            assert "default" in " ".join(action.help.split()), action.dest
    legend = text.split("columns, MiB per GPU at its predicted peak (--json: bytes):\n")[1].splitlines()
    assert [line.split()[0] for line in legend] == [*ORDER, "total", "fits"]
    assert all(len(line.split()) > 3 for line in legend)


def test_every_run_has_the_same_columns_and_json_has_the_tables_bytes(capsys, no_search):
    runs = {}
    for strategy in ("single", "ddp", "dataparallel", "fsdp"):
        gpus = "1" if strategy == "single" else "2"
        flags = ("--model", TINY, "--gpu", "A10", "--global-batch-size", "8", "--seq-len", "64", "--strategy",
                 strategy, "--gpus", gpus)
        status, out, err = run_main(capsys, *flags)
        assert status == 0, err
        status, as_json, err = run_main(capsys, *flags, "--json")
        assert status == 0, err
        runs[strategy] = out, json.loads(as_json)
    for strategy, (out, result) in runs.items():
        header, rows = table(out)
        assert header == result["columns"] == [*ORDER, "total", "fits"], strategy
        assert len(rows) == len(result["per_gpu"]) == (1 if strategy == "single" else 2)
        for cells, device in zip(rows, result["per_gpu"]):
            assert cells[:-1] == [f"{device[name] / 2**20:,.0f}" for name in header[:-1]]
            assert cells[-1] == ("yes" if device["fits"] else "NO")
            assert device["total"] == sum(device[name] for name in ORDER)
    assert runs["ddp"][1]["per_gpu"][0]["buckets"] > 0 == runs["single"][1]["per_gpu"][0]["buckets"]
    assert runs["fsdp"][1]["per_gpu"][0]["gathered"] > 0 == runs["ddp"][1]["per_gpu"][0]["gathered"]


def test_the_largest_batch_is_the_boundary_of_what_fits(capsys):
    status, out, err = run_main(capsys, "--model", TINY, "--global-batch-size", "8", "--seq-len", "64", "--gpu",
                                "H100", "--gpu-memory", "300MiB", "--strategy", "single")
    assert status == 0, err
    best = int(out.splitlines()[-2].split(": ")[1].split()[0])
    options = dict(gpu=GPUS["H100"], environ={})
    assert peak_per_gpu(bundled_config(), best, 64, **options) <= FITS * 300 * 2**20 < peak_per_gpu(
        bundled_config(), best + 1, 64, **options)


@pytest.mark.parametrize(("args", "message"), [
    (["--global-batch-size", "0"], "argument --global-batch-size: must be a whole number of at least 1, not '0'"),
    (["--gpu", "T5"], "argument --gpu: unknown GPU 'T5'; known: H200, H100,"),
    (["--gpu-memory", "16gigs"], "argument --gpu-memory: cannot read '16gigs' as a memory size"),
    (["--strategy", "fsdp2"], "argument --strategy: invalid choice: 'fsdp2'"),
    (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
    (["--model", "someone/not-a-model"], "--model someone/not-a-model: not a preset"),
    (["--global-batch-size", "9", "--gpus", "2"], "--global-batch-size 9 does not split into --gpus 2 x "
                                                  "--grad-accum-steps 1 equal micro-batches; use a multiple of 2"),
    (["--strategy", "single", "--gpus", "2"], "--strategy single runs on one GPU, not --gpus 2"),
    (["--strategy", "fsdp", "--grad-accum-steps", "2"], "--strategy fsdp is predicted with sdpa attention and at "
                                                        "most one of --amp and --gradient-checkpointing"),
    (["--seq-len", "600"], "--seq-len 600 is longer than the model's 512 positions"),
    (["--gpu", "v100", "--amp", "bf16"], "--amp bf16: V100 (sm70) has no native bf16 (it needs compute capability "
                                         "8.0 or later); use --amp fp16"),
])
def test_bad_input_is_one_line_naming_the_flag(capsys, args, message):
    status, out, err = run_main(capsys, *(["--gpu", "T4"] if "--gpu" not in args else []), *args)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("python -m helpers.memory: error: ") and message in err


def test_a_config_that_is_not_bert_is_refused_with_its_cause(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2}')
    with pytest.raises(command.SettingError, match=r"not a BERT config \(model_type 'gpt2'"):
        command.load_config(str(tmp_path))
    with pytest.raises(command.SettingError) as raised:
        command.load_config(str(tmp_path / "missing"))
    assert isinstance(raised.value.__cause__, (OSError, ValueError))


def readme_example() -> tuple[list[str], str]:
    """The README's memory command and the output pasted under it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Per-GPU memory: will my setting fit?")[1]
    commands, output = re.findall(r"```(?:bash|text)?\n(.*?)```", section, flags=re.DOTALL)[:2]
    words = commands.split()
    return words[words.index("helpers.memory") + 1:], output


def test_the_readme_example_uses_a_t4_in_fp16_and_shows_what_the_command_prints_now(monkeypatch):
    args, shown = readme_example()
    assert args[args.index("--gpu") + 1] == "T4" and args[args.index("--amp") + 1] == "fp16"
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import memory_prediction

    assert memory_prediction.COMMAND == args  # make bench times the README's example
    run = run_module(*args)
    assert run.returncode == 0, run.stderr
    assert run.stdout == shown


def test_the_readme_chart_is_what_the_chart_module_draws_now(tmp_path):
    """Drift: the chart the README shows (docs/img/per_device_memory.png, ``make memory-chart``) against a fresh one,
    byte for byte (matplotlib and its bundled font are pinned)."""
    run = run_module(str(tmp_path / "chart.png"), module="helpers.memory.charts")
    assert run.returncode == 0 and run.stdout == f"wrote {tmp_path / 'chart.png'}\n", run.stderr
    assert (tmp_path / "chart.png").read_bytes() == (ROOT / "docs" / "img" / "per_device_memory.png").read_bytes()
