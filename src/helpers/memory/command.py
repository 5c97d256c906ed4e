"""Predict what each GPU holds during one fine-tuning step: one device, DataParallel, DDP, FSDP2, and the levers.

The command for a reader's own setting: each GPU's predicted peak by category, whether it fits, and the largest
batch that does.

    python -m helpers.memory --model tohoku-nlp/bert-base-japanese-v3 --batch-size 32 --seq-len 512 \\
        --gpus 2 --strategy ddp --amp bf16 --gpu-memory 16GiB
    python -m helpers.memory --chart docs/img/per_device_memory.png     # the README's chart
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from helpers.memory.categories import ORDER
from helpers.memory.charts import memo_chart
from helpers.memory.formulas import parameter_bytes
from helpers.memory.gpu_facts import GPUS, GpuModel, attention_kernel, parse_memory
from helpers.memory.prediction import FITS, PREDICTED_STRATEGIES, default_gpu, largest_batch, per_device

MODEL_PRESETS = {
    # The fields of each model's config.json on the Hugging Face hub that decide its memory (BertConfig's
    # defaults for the rest: type_vocab_size 2, dropout 0.1). cl-tohoku/... is the same model as tohoku-nlp/...
    "tohoku-nlp/bert-base-japanese-whole-word-masking": dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12,
                                                             num_attention_heads=12, intermediate_size=3072),
    "tohoku-nlp/bert-base-japanese-v3": dict(vocab_size=32768, hidden_size=768, num_hidden_layers=12,
                                             num_attention_heads=12, intermediate_size=3072),
    "tohoku-nlp/bert-large-japanese-v2": dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=24,
                                              num_attention_heads=16, intermediate_size=4096),
}
BERT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "max_position_embeddings")


class SettingError(ValueError):
    """A setting the command cannot predict; the message is the one line the reader sees."""


def load_config(model: str):
    """A BertConfig for ``model``: a preset name (offline), a local folder with config.json, or a hub name (read
    from the hub or its cache). Raises SettingError naming what is wrong."""
    from transformers import AutoConfig, BertConfig

    name = model.replace("cl-tohoku/", "tohoku-nlp/")
    if name in MODEL_PRESETS:
        return BertConfig(**MODEL_PRESETS[name], max_position_embeddings=512, use_cache=False), "preset"
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise SettingError(f"unknown model {model!r}: not a preset ({', '.join(MODEL_PRESETS)}), not a folder with a "
                           f"config.json, and not found on the hub or in its cache ({str(error).splitlines()[0]})")
    missing = [field for field in BERT_FIELDS if not hasattr(config, field)]
    if config.model_type != "bert" or missing:
        raise SettingError(f"{model!r} is not a BERT config (model_type {config.model_type!r}"
                           + (f", no {', '.join(missing)}" if missing else "") + "): this command predicts BERT encoders")
    return BertConfig(**{field: getattr(config, field) for field in BERT_FIELDS}, use_cache=False), (
        "folder" if Path(model).is_dir() else "hub")


def _positive(text: str) -> int:
    if not text.strip().lstrip("-").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return int(text)


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m helpers.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tohoku-nlp/bert-base-japanese-whole-word-masking",
                        help=f"a preset ({', '.join(MODEL_PRESETS)}), a folder with config.json, or a hub name")
    parser.add_argument("--batch-size", type=_positive, default=32, help="global batch (all GPUs together)")
    parser.add_argument("--seq-len", type=_positive, default=512, help="tokens per example")
    parser.add_argument("--gpus", type=_positive, default=1)
    parser.add_argument("--strategy", choices=PREDICTED_STRATEGIES, default="single")
    parser.add_argument("--amp", choices=("none", "bf16"), default="none", help="bf16 autocast")
    parser.add_argument("--accumulation", type=_positive, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of each layer")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--gpu", choices=sorted(GPUS), help="the GPU model (default: this machine's, else H200)")
    parser.add_argument("--gpu-memory", type=_memory, help="memory of each GPU, e.g. 16GiB, 24GB, 40960MiB "
                                                            "(default: the GPU model's)")
    parser.add_argument("--chart", type=Path, metavar="PNG", help="only write the README's chart to PNG")
    return parser


def check_setting(args, config) -> None:
    if args.strategy == "single" and args.gpus != 1:
        raise SettingError(f"--strategy single runs on one GPU; got --gpus {args.gpus} (use ddp, dataparallel or fsdp2)")
    per_gpu, rest = divmod(args.batch_size, args.gpus * args.accumulation)
    if rest or not per_gpu:
        raise SettingError(f"--batch-size {args.batch_size} does not split into --gpus {args.gpus} x --accumulation "
                           f"{args.accumulation} equal micro-batches")
    if args.seq_len > config.max_position_embeddings:
        raise SettingError(f"--seq-len {args.seq_len} is longer than the model's {config.max_position_embeddings} "
                           f"positions")


def report(args, config, source: str, gpu: GpuModel, capacity: int, assumed: str = "") -> list[str]:
    """The command's lines: the setting, then each GPU's predicted peak by category, fits or not, the largest batch."""
    options = dict(strategy=args.strategy, gpus=args.gpus, accumulation=args.accumulation, amp=args.amp == "bf16",
                   checkpointing=args.checkpointing, attention=args.attention, gpu=gpu)
    devices = per_device(config, args.batch_size, args.seq_len, **options)
    count = parameter_bytes(config) // 4
    kernel = attention_kernel(gpu, args.amp == "bf16") if args.attention == "sdpa" else "eager"
    micro = args.batch_size // args.gpus // args.accumulation
    amp_words = "fp32" if args.amp == "none" else (  # helpers.finetune --strategy fsdp --amp bf16 runs autocast too
        "bf16 mixed precision (MixedPrecisionPolicy only, without autocast)" if args.strategy == "fsdp2"
        else "bf16 autocast")
    lines = [f"model {args.model} ({source}): {count / 1e6:,.1f} M parameters, hidden {config.hidden_size}, "
             f"{config.num_hidden_layers} layers, vocab {config.vocab_size}",
             f"{args.strategy} on {args.gpus} x {gpu.name}{assumed} ({gpu.sm}, {capacity / 2**30:.1f} GiB each), batch "
             f"{args.batch_size} = {micro} per GPU x {args.accumulation} accumulation, L={args.seq_len}, "
             f"{amp_words}, attention {kernel}" + (", checkpointing" if args.checkpointing else ""),
             "predicted peak per GPU (MiB), " + ("FSDPMemTracker's requested bytes plus the workspaces:"
                                                 if args.strategy == "fsdp2" else
                                                 "at the moment torch.cuda.max_memory_allocated is highest:")]
    names = [name for name in ORDER if any(d.get(name, 0) >= 2**19 for d in devices)]
    lines.append(f"{'':6}" + "".join(f"{name:>12}" for name in names) + f"{'total':>9}  fits {FITS:.0%}?")
    for index, device in enumerate(devices):
        lines.append(f"GPU{index:<3}" + "".join(f"{device.get(name, 0) / 2**20:>12,.0f}" for name in names)
                     + f"{device['total'] / 2**20:>9,.0f}  {'yes' if device['total'] <= FITS * capacity else 'NO'}")
    best = largest_batch(config, args.seq_len, capacity, known=args.batch_size, **options)
    unit = args.gpus * args.accumulation
    lines.append(f"largest global batch that fits: {best} ({best // unit} per GPU per micro-batch)" if best else
                 "largest global batch that fits: none, even 1 example per GPU does not fit")
    lines.append(f"accelerate estimate-memory's count (weights, gradients, Adam; 16 bytes per parameter in fp32): "
                 f"{16 * count / 2**20:,.0f} MiB")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.chart:
        args.chart.parent.mkdir(parents=True, exist_ok=True)
        memo_chart(str(args.chart))
        print(f"wrote {args.chart}")
        return 0
    try:
        config, source = load_config(args.model)
        check_setting(args, config)
        gpu = GPUS[args.gpu] if args.gpu else default_gpu()
        assumed = "" if args.gpu or torch.cuda.is_available() else " (assumed; --gpu to choose)"
        if args.amp == "bf16" and gpu.capability < (8, 0):
            raise SettingError(f"--amp bf16 needs a GPU of compute capability 8.0 or later; {gpu.name} is {gpu.sm}")
        for line in report(args, config, source, gpu, args.gpu_memory or gpu.memory, assumed):
            print(line, flush=True)
    except SettingError as error:
        print(f"python -m helpers.memory: error: {error}", file=sys.stderr)
        return 2
    return 0
