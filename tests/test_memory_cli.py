"""``python -m helpers.memory``: helpers.finetune's flags and defaults, the GPU named or refused, the same columns
in every run with a legend, --json with every column, bad input and untraceable models answered in one line naming
the flag or the model type; the README's example output, the memo's setting as one command, and the chart against
fresh ones. Settings are traced on the bundled tiny model where the test allows it (fast)."""

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
from helpers.memory import GPUS, GpuModel, command, largest_batch, memo_prediction
from helpers.memory.categories import ORDER
from helpers.memory.configs import bundled_config
from helpers.memory.tracer import build_model
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


def tables(out: str) -> list[tuple[list[str], list[list[str]]]]:
    """The two tables: each header's column names and its GPU rows' cells."""
    found = []
    for line in out.splitlines():
        if line.startswith(" "):
            found.append((line.split(), []))
        elif re.match(r"GPU\d", line):
            found[-1][1].append(line.split()[1:])
    return found


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
    assert out.splitlines()[1] == ("ddp on 1 x Tesla T4 (this machine's GPU 0; sm75, 40 SMs, 15,095 MiB each), global "
                                   "batch 32 = 32 per GPU x 1 micro-batch, L=64")  # its own total, exactly
    assert out.splitlines()[2].startswith("fp16 autocast with a gradient scaler, attention memory-efficient, ")
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
    # finetune's Adam leaves the implementation to torch, which runs foreach on CUDA, and its zero_grad() frees
    import torch
    from helpers.optim import two_lr_adam

    group = two_lr_adam(build_model(bundled_config())).param_groups[0]
    assert (group["foreach"], group["fused"], ours.optimizer_impl) == (None, None, "foreach")
    assert inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default is ours.set_to_none
    assert ours.cuda_module_loading == "lazy"  # torch sets CUDA_MODULE_LOADING=LAZY from 1.13 on
    choices = {parser.prog: {action.dest: action.choices for action in parser._actions} for parser in parsers}
    finetune_choices, our_choices = choices["python -m helpers.finetune"], choices["python -m helpers.memory"]
    assert set(finetune_choices["strategy"]) <= set(our_choices["strategy"]) and "fsdp2" not in our_choices["strategy"]
    assert set(finetune_choices["amp"]) <= set(our_choices["amp"]) == {"bf16", "fp16"}
    assert ours.seq_len == MAX_LENGTH == inspect.signature(PadToLongest).parameters["max_length"].default == 128


def test_help_shows_every_default_explains_every_column_and_names_every_source():
    text = command.parser().format_help()
    for action in command.parser()._actions:
        if action.dest not in ("help", "json"):
            assert "default" in " ".join(action.help.split()), action.dest
    sections = text.split("\n\n")
    legends = [section.splitlines()[1:] for section in sections
               if section.startswith(("columns, MiB per GPU", "what nvidia-smi will show"))]
    assert [[line.split()[0] for line in legend] for legend in legends] == [[*ORDER, "total"],
                                                                           list(command.NVIDIA_SMI_COLUMNS)]
    assert all(len(line.split()) > 3 for legend in legends for line in legend)
    (gpus,) = [section.splitlines()[1:] for section in sections if section.startswith("GPUs (--gpu)")]
    assert [line.split()[0] for line in gpus] == list(GPUS) and all("github.com" in line or "gpu-runs" in line
                                                                    for line in gpus)


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
        (header, rows), (smi_header, smi_rows) = tables(out)
        assert header == result["columns"] == [*ORDER, "total"], strategy
        assert smi_header == result["nvidia_smi_columns"] == list(command.NVIDIA_SMI_COLUMNS)
        assert len(rows) == len(smi_rows) == len(result["per_gpu"]) == (1 if strategy == "single" else 2)
        for cells, smi, device in zip(rows, smi_rows, result["per_gpu"]):
            assert set(header) | set(smi_header) <= set(device)  # --json carries every column
            assert cells == [f"{device[name] / 2**20:,.0f}" for name in header]
            assert device["total"] == sum(device[name] for name in ORDER) == device["allocated"]
            low, high = device["nvidia-smi"]
            terms = [device["context"], device["nccl"]]
            if strategy == "fsdp":  # not replayed: nothing known above the allocated bytes but the terms' least
                assert device["reserved"] is None and high is None and smi[1] == "?" and device["fits"] != "yes"
                assert low == device["allocated"] + sum(term[0] for term in terms)
            else:
                assert device["reserved"] >= device["allocated"] and smi[1] == f"{device['reserved'] / 2**20:,.0f}"
                assert (low, high) == tuple(device["reserved"] + sum(term[end] for term in terms) for end in (0, 1))
            assert smi[-1] == device["fits"] == ("yes" if high is not None and high <= device["capacity"][0] else
                                                 "NO" if low > device["capacity"][1] else "maybe")
            assert device["capacity"] == [GPUS["A10"].memory] * 2
    assert runs["ddp"][1]["per_gpu"][0]["buckets"] > 0 == runs["single"][1]["per_gpu"][0]["buckets"]
    assert runs["fsdp"][1]["per_gpu"][0]["gathered"] > 0 == runs["ddp"][1]["per_gpu"][0]["gathered"]
    assert runs["ddp"][1]["per_gpu"][0]["nccl"] == [command.nvidia_smi.NCCL.low, command.nvidia_smi.NCCL.high]
    assert runs["single"][1]["per_gpu"][0]["nccl"] == [0, 0]


def test_the_largest_batch_is_the_searchs_for_certain_and_possible_fits(capsys):
    """The two figures the command prints are largest_batch's (whose answers tests/test_memory_nvidia_smi.py checks
    against tracing every batch)."""
    status, out, err = run_main(capsys, "--model", TINY, "--global-batch-size", "8", "--seq-len", "64", "--gpu",
                                "H100", "--gpu-memory", "1000MiB", "--strategy", "single")
    assert status == 0, err
    best, maybe = map(int, re.match(r"largest global batch that fits: (\d+) .*; up to (\d+) may fit",
                                    out.splitlines()[-2]).groups())
    options = dict(gpu=GPUS["H100"], known=8, module_loading="lazy", attention="sdpa")
    assert (best, maybe) == tuple(largest_batch(bundled_config(), 64, 1000 * 2**20, certain=certain, **options)
                                  for certain in (True, False))
    assert 0 < best < maybe


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
    (["--strategy", "fsdp", "--grad-accum-steps", "2"], "--strategy fsdp is predicted for BERT with sdpa attention, "
                                                        "foreach Adam, zero_grad(set_to_none=True) and at most one of "
                                                        "--amp and --gradient-checkpointing"),
    (["--seq-len", "600"], "--seq-len 600 is longer than the model's 512 positions"),
    (["--gpu", "v100-16gb", "--amp", "bf16"], "--amp bf16: V100-16GB (sm70) has no native bf16 (it needs compute "
                                              "capability 8.0 or later); use --amp fp16"),
    (["--optimizer-impl", "adam8bit"], "argument --optimizer-impl: invalid choice: 'adam8bit'"),
    (["--cuda-module-loading", "lazily"], "argument --cuda-module-loading: invalid choice: 'lazily'"),
    (["--strategy", "fsdp", "--no-set-to-none"], "--strategy fsdp is predicted for BERT with sdpa attention, "
                                                 "foreach Adam, zero_grad(set_to_none=True)"),
    (["--model", "ku-nlp/deberta-v2-base-japanese", "--attention", "sdpa"],
     "--model ku-nlp/deberta-v2-base-japanese: cannot trace a deberta-v2 step with --attention sdpa: ValueError: "
     "DebertaV2ForSequenceClassification does not support an attention implementation through "
     "torch.nn.functional.scaled_dot_product_attention"),
    (["--model", "rinna/japanese-roberta-base", "--seq-len", "512"], "--seq-len 512 is longer than the model's 510 "
                                                                     "positions"),
])
def test_bad_input_is_one_line_naming_the_flag(capsys, args, message):
    status, out, err = run_main(capsys, *(["--gpu", "T4"] if "--gpu" not in args else []), *args)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("python -m helpers.memory: error: ") and message in err


def test_a_config_without_a_classifier_is_refused_naming_its_type_and_a_missing_one_with_its_cause(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2}')
    with pytest.raises(command.SettingError, match=r"no sequence-classification model for model_type 'vit'"):
        command.load_config(str(tmp_path))
    with pytest.raises(command.SettingError) as raised:
        command.load_config(str(tmp_path / "missing"))
    assert isinstance(raised.value.__cause__, (OSError, ValueError))


def test_a_folder_with_any_encoders_config_json_is_predicted_with_its_labels(tmp_path, capsys, no_search):
    """A RoBERTa config.json from a folder: transformers' own classification head, with --num-labels' outputs."""
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="roberta", vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=66, pad_token_id=1)))
    status, out, err = run_main(capsys, "--model", str(tmp_path), "--gpu", "L4", "--seq-len", "64",
                                "--num-labels", "5", "--json")
    assert status == 0, err
    model = json.loads(out)["model"]
    assert (model["source"], model["head"], model["num_labels"]) == ("folder", "RobertaForSequenceClassification", 5)


def readme_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.split("## Per-GPU memory: will my setting fit?")[1].split("\n## ")[0]


def readme_example() -> tuple[list[str], str]:
    """The README's memory command and the output pasted under it."""
    commands, output = re.findall(r"```(?:bash|text)?\n(.*?)```", readme_section(), flags=re.DOTALL)[:2]
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


def test_the_memo_setting_is_one_command_and_the_readme_quotes_its_answer():
    """The memo's setting (torch 1.x's step, eager attention, DataParallel on two GPUs, notebook 05's batch and
    length) is MEMO_ARGS, the command the README shows; memo_prediction() answers it from Python, and the README
    quotes its nvidia-smi figures beside the memo's."""
    section = " ".join(readme_section().split())
    shown = re.search(r"`python -m helpers.memory (--gpu A100-40GB[^`]*)`", section).group(1)
    assert shown.split() == list(command.MEMO_ARGS)
    result = memo_prediction()
    setting = result["setting"]
    assert (setting["strategy"], result["gpu"]["count"], setting["global_batch_size"], setting["seq_len"],
            setting["attention"], setting["optimizer_impl"], setting["set_to_none"],
            setting["cuda_module_loading"]) == ("dataparallel", 2, 64, 512, "eager", "for-loop", False, "eager")
    ranges = [f"{low / 2**20:,.0f}-{high / 2**20:,.0f} MiB" for low, high in
              (device["nvidia-smi"] for device in result["per_gpu"])]
    assert f"{ranges[0]} on GPU 0 and {ranges[1]} on GPU 1" in section
    assert command.MEMO_NVIDIA_SMI_MIB == (39_057, 23_485) and "the memo's 39,057 and 23,485 MiB" in section


def test_the_readme_chart_is_what_the_chart_module_draws_now(tmp_path):
    """Drift: the chart the README shows (docs/img/per_device_memory.png, ``make memory-chart``) against a fresh one,
    byte for byte (matplotlib and its bundled font are pinned)."""
    run = run_module(str(tmp_path / "chart.png"), module="helpers.memory.charts")
    assert run.returncode == 0 and run.stdout == f"wrote {tmp_path / 'chart.png'}\n", run.stderr
    assert (tmp_path / "chart.png").read_bytes() == (ROOT / "docs" / "img" / "per_device_memory.png").read_bytes()
