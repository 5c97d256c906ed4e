"""``python -m helpers.memory``: a reader's own setting, offline (bundled presets, a local folder), and bad input
answered in one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.memory import FITS, GPUS
from helpers.memory.configs import bundled_config
from helpers.memory.prediction import peak_per_gpu
from helpers.models import bundled_model_dir

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = os.environ | {"HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


def command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helpers.memory", *args], capture_output=True, text=True,
                          env=OFFLINE, timeout=300)


def test_a_preset_answers_offline_per_gpu_with_the_largest_batch():
    run = command("--model", "cl-tohoku/bert-base-japanese-whole-word-masking", "--batch-size", "16", "--seq-len", "128",
                  "--gpus", "2", "--strategy", "dataparallel", "--gpu", "A100-40GB", "--gpu-memory", "8GiB")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == ("model cl-tohoku/bert-base-japanese-whole-word-masking (preset): 110.6 M parameters, "
                        "hidden 768, 12 layers, vocab 32000")
    assert lines[1].startswith("dataparallel on 2 x A100-40GB (sm80, 8.0 GiB each), batch 16 = 8 per GPU")
    gpu0, gpu1 = (line.split() for line in lines if line.startswith("GPU"))
    assert gpu0[-1] == gpu1[-1] == "yes" and int(gpu0[-2].replace(",", "")) > int(gpu1[-2].replace(",", ""))
    assert lines[-2].startswith("largest global batch that fits: ")
    assert lines[-1].endswith(f"{16 * 110_618_882 / 2**20:,.0f} MiB")  # accelerate's count: 16 bytes a parameter


def test_a_local_folder_is_read_and_the_largest_batch_is_the_boundary():
    config = bundled_config()
    run = command("--model", str(bundled_model_dir()), "--batch-size", "8", "--seq-len", "64", "--gpu", "H100",
                  "--gpu-memory", "300MiB")
    assert run.returncode == 0, run.stderr
    best = int(run.stdout.splitlines()[-2].split(": ")[1].split()[0])
    options = dict(gpu=GPUS["H100"], environ={})
    assert peak_per_gpu(config, best, 64, **options) <= FITS * 300 * 2**20 < peak_per_gpu(config, best + 1, 64, **options)


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "someone/not-a-model"], "unknown model 'someone/not-a-model': not a preset"),
    (["--batch-size", "0"], "argument --batch-size: must be a whole number of at least 1, not '0'"),
    (["--gpu-memory", "16gigs"], "argument --gpu-memory: cannot read '16gigs' as a memory size"),
    (["--batch-size", "9", "--gpus", "2", "--strategy", "ddp"], "--batch-size 9 does not split into --gpus 2"),
])
def test_bad_input_is_one_line(args, message):
    run = command(*args)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and message in run.stderr


def test_a_config_that_is_not_bert_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2}')
    run = command("--model", str(tmp_path))
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "is not a BERT config (model_type 'gpt2'" in run.stderr


def test_the_readme_chart_is_what_the_subcommand_draws_now(tmp_path):
    """Drift: the chart the README shows (docs/img/per_device_memory.png, ``make memory-chart``) against a fresh one,
    byte for byte (matplotlib and its bundled font are pinned)."""
    run = command("--chart", str(tmp_path / "chart.png"))
    assert run.returncode == 0 and run.stdout == f"wrote {tmp_path / 'chart.png'}\n", run.stderr
    assert (tmp_path / "chart.png").read_bytes() == (ROOT / "docs" / "img" / "per_device_memory.png").read_bytes()
