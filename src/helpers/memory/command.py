"""Will my setting fit? Each GPU's predicted peak memory in one fine-tuning step, by category, with the flags and
defaults of helpers.finetune; whether it fits the GPU; and the largest global batch that does.

    python -m helpers.memory --gpu T4 --gpus 2 --strategy ddp --global-batch-size 32 --seq-len 128 --amp fp16
    python -m helpers.memory --gpu A100-80GB --gpus 8 --strategy fsdp --model tohoku-nlp/bert-large-japanese-v2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from helpers.data import MAX_LENGTH
from helpers.memory.categories import ORDER
from helpers.memory.formulas import parameter_bytes
from helpers.memory.gpu_facts import GPUS, GpuModel, amp_precision, attention_kernel, parse_memory
from helpers.memory.prediction import FITS, largest_batch, per_device

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
STRATEGIES = {"single": "single", "dataparallel": "dataparallel", "ddp": "ddp", "fsdp": "fsdp2"}
"""--strategy (helpers.finetune's names, and the memo's DataParallel) -> helpers.memory.per_device's strategy."""
COLUMNS = {
    "weights": "the model's parameters and buffers, fp32 (fsdp: this GPU's shard)",
    "gathered": "fsdp: the whole weights FSDP2 all-gathers for the layers at work, and their gather buffers",
    "gradients": "the parameters' .grad (fsdp: this GPU's shard, and the whole ones before reduce-scatter)",
    "optimizer": "Adam's two moments and what optimizer.step() makes; --amp fp16: the gradient scaler's tensors too",
    "activations": "what the forward keeps for backward",
    "temporaries": "tensors backward makes and frees",
    "workspaces": "cuBLAS and cuBLASLt workspaces, taken at the first matrix product and kept",
    "reduction": "a reduction kernel's staging buffer (bias gradients) live at the peak (fsdp: not counted)",
    "batch": "the token ids and labels",
    "allocator": "what the caching allocator's whole blocks add to the bytes asked for (fsdp: not counted)",
    "buckets": "ddp: the gradient buckets DDP all-reduces",
    "total": "the sum: the predicted torch.cuda.max_memory_allocated (fsdp: FSDPMemTracker's bytes and workspaces)",
    "fits": f"yes when total is at most {FITS:.0%} of the GPU's memory (the CUDA context and cached blocks need "
            f"the rest)",
}
"""The table's columns, the same in every run (ORDER, then total and fits), each with its one line of --help."""
PRECISION_WORDS = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast with a gradient scaler"}


class SettingError(ValueError):
    """A setting the command cannot predict; the message is the one line the reader sees."""


def load_config(model: str):
    """A BertConfig for ``model``: a preset name (offline), a local folder with config.json, or a hub name (read
    from the hub or its cache). Raises SettingError naming what is wrong, the loader's error kept as its cause."""
    from transformers import AutoConfig, BertConfig

    name = model.replace("cl-tohoku/", "tohoku-nlp/")
    if name in MODEL_PRESETS:
        return BertConfig(**MODEL_PRESETS[name], max_position_embeddings=512, use_cache=False), "preset"
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise SettingError(f"--model {model}: not a preset ({', '.join(MODEL_PRESETS)}), not a folder with a "
                           f"config.json, and not found on the hub or in its cache ({str(error).splitlines()[0]})"
                           ) from error
    missing = [field for field in BERT_FIELDS if not hasattr(config, field)]
    if config.model_type != "bert" or missing:
        raise SettingError(f"--model {model}: not a BERT config (model_type {config.model_type!r}"
                           + (f", no {', '.join(missing)}" if missing else "")
                           + "); this command predicts BERT encoders")
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
        raise argparse.ArgumentTypeError(str(error)) from error


def _gpu(text: str) -> GpuModel:
    known = {name.lower(): gpu for name, gpu in GPUS.items()}
    if text.lower() not in known:
        raise argparse.ArgumentTypeError(f"unknown GPU {text!r}; known: {', '.join(GPUS)}")
    return known[text.lower()]


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    legend = "\n".join(f"  {name:<12} {meaning}" for name, meaning in COLUMNS.items())
    parser = _OneLineParser(
        prog="python -m helpers.memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"columns, MiB per GPU at its predicted peak (--json: bytes):\n{legend}")
    parser.add_argument("--model", default="tohoku-nlp/bert-base-japanese-whole-word-masking",
                        help=f"a preset ({', '.join(MODEL_PRESETS)}), a folder with config.json, or a hub name "
                             f"(default: %(default)s, the memo's model)")
    parser.add_argument("--gpu", type=_gpu, metavar="NAME",
                        help=f"the GPU model: {', '.join(GPUS)} (default: this machine's GPU 0; required where "
                             f"torch sees none)")
    parser.add_argument("--gpus", type=_positive, default=1, metavar="N",
                        help="GPUs, one process each for ddp and fsdp, as torchrun --nproc_per_node (default 1)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp",
                        help="ddp: a full copy on each GPU (default, as helpers.finetune); fsdp: FSDP2, each GPU "
                             "holds 1/N of the weights, gradients and Adam state; dataparallel: nn.DataParallel in "
                             "one process (the memo's); single: the model on one GPU, unwrapped")
    parser.add_argument("--global-batch-size", type=_positive, default=32, metavar="B",
                        help="examples per optimizer step over all GPUs (default 32, as helpers.finetune)")
    parser.add_argument("--seq-len", type=_positive, default=MAX_LENGTH, metavar="L",
                        help=f"tokens per example (default {MAX_LENGTH}: the longest a training batch gets, "
                             f"helpers.data.MAX_LENGTH; batches padded to their longest sentence are shorter)")
    parser.add_argument("--grad-accum-steps", type=_positive, default=1, metavar="N",
                        help="micro-batches per optimizer step (default 1), as helpers.finetune")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute each encoder layer in backward instead of keeping its activations "
                             "(default: off)")
    parser.add_argument("--amp", choices=("bf16", "fp16"),
                        help="bf16 autocast (GPUs of compute capability 8.0 or later), or fp16 autocast with a "
                             "gradient scaler (the T4's and the V100's) (default: fp32, as helpers.finetune)")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                        help="sdpa: the kernel the GPU picks, as transformers' default (default); eager: the L x L "
                             "probabilities kept, as in the memo's era")
    parser.add_argument("--gpu-memory", type=_memory, metavar="SIZE",
                        help="memory of each GPU, e.g. 16GiB, 24GB, 40960MiB (default: the GPU's)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object, in bytes")
    return parser


def check_setting(args, config) -> None:
    if args.strategy == "single" and args.gpus != 1:
        raise SettingError(f"--strategy single runs on one GPU, not --gpus {args.gpus}: use ddp, fsdp or dataparallel")
    per_gpu, rest = divmod(args.global_batch_size, args.gpus * args.grad_accum_steps)
    if rest or not per_gpu:
        raise SettingError(f"--global-batch-size {args.global_batch_size} does not split into --gpus {args.gpus} x "
                           f"--grad-accum-steps {args.grad_accum_steps} equal micro-batches; use a multiple of "
                           f"{args.gpus * args.grad_accum_steps}")
    if args.seq_len > config.max_position_embeddings:
        raise SettingError(f"--seq-len {args.seq_len} is longer than the model's {config.max_position_embeddings} "
                           f"positions")
    if args.strategy == "fsdp":
        used = [flag for flag, on in ((f"--grad-accum-steps {args.grad_accum_steps}", args.grad_accum_steps > 1),
                                      ("--attention eager", args.attention == "eager")) if on]
        if used or (args.amp and args.gradient_checkpointing):
            raise SettingError(f"--strategy fsdp is predicted with sdpa attention and at most one of --amp and "
                               f"--gradient-checkpointing, without --grad-accum-steps; got "
                               + ", ".join(used + (["--amp with --gradient-checkpointing"] if args.amp and
                                                   args.gradient_checkpointing else [])))


def choose_gpu(args) -> tuple[GpuModel, str]:
    """The GPU to predict for, and where it came from: --gpu, else this machine's GPU 0; none is an error."""
    if args.gpu:
        return args.gpu, "--gpu"
    if torch.cuda.is_available():
        from helpers.memory.cuda_step import this_gpu

        return this_gpu(0), "this machine's GPU 0"
    raise SettingError(f"torch sees no GPU here: name the GPU to predict for with --gpu ({', '.join(GPUS)})")


def predict(args) -> dict:
    """The result of the command for ``args`` (parsed): the setting, each GPU's peak bytes by category, the
    largest batch that fits. Raises SettingError naming the flag at fault."""
    gpu, source = choose_gpu(args)
    config, model_source = load_config(args.model)
    check_setting(args, config)
    try:
        precision = amp_precision(gpu, args.amp)  # --amp bf16 refused where helpers.finetune refuses it
    except ValueError as error:
        raise SettingError(str(error)) from error
    capacity = args.gpu_memory or gpu.memory
    options = dict(strategy=STRATEGIES[args.strategy], gpus=args.gpus, accumulation=args.grad_accum_steps,
                   checkpointing=args.gradient_checkpointing, amp=args.amp, attention=args.attention, gpu=gpu)
    devices = per_device(config, args.global_batch_size, args.seq_len, **options)
    best = largest_batch(config, args.seq_len, capacity, known=args.global_batch_size, **options)
    count = parameter_bytes(config) // 4
    return {
        "model": {"name": args.model, "source": model_source, "parameters": count, "hidden_size": config.hidden_size,
                  "layers": config.num_hidden_layers, "vocab_size": config.vocab_size},
        "gpu": {"name": gpu.name, "source": source, "sm": gpu.sm, "sm_count": gpu.sm_count,
                "memory_bytes": capacity, "count": args.gpus},
        "setting": {"strategy": args.strategy, "global_batch_size": args.global_batch_size,
                    "micro_batch_size": args.global_batch_size // args.gpus // args.grad_accum_steps,
                    "grad_accum_steps": args.grad_accum_steps, "seq_len": args.seq_len, "amp": precision,
                    "gradient_checkpointing": args.gradient_checkpointing, "attention": args.attention,
                    "attention_kernel": attention_kernel(gpu, precision) if args.attention == "sdpa" else "eager"},
        "columns": list(COLUMNS),
        "per_gpu": [{name: device.get(name, 0) for name in (*ORDER, "total")}
                    | {"fits": device["total"] <= FITS * capacity} for device in devices],
        "fits_limit_bytes": int(FITS * capacity),
        "largest_global_batch": best,
        "accelerate_estimate_bytes": 16 * count,
    }


def report(result: dict) -> list[str]:
    """The command's lines for a reader: the model, the GPU, the setting, one row per GPU, the largest batch."""
    model, gpu, setting = result["model"], result["gpu"], result["setting"]
    micro, steps = setting["micro_batch_size"], setting["grad_accum_steps"]
    widths = {name: max(len(name), 7) for name in result["columns"]}
    lines = [f"model {model['name']} ({model['source']}): {model['parameters'] / 1e6:,.1f} M parameters, hidden "
             f"{model['hidden_size']}, {model['layers']} layers, vocab {model['vocab_size']}",
             f"{setting['strategy']} on {gpu['count']} x {gpu['name']} ({gpu['source']}; {gpu['sm']}, "
             f"{gpu['sm_count']} SMs, {gpu['memory_bytes'] / 2**30:.1f} GiB each), global batch "
             f"{setting['global_batch_size']} = {micro} per GPU x {_count(steps, 'micro-batch')}, L={setting['seq_len']}",
             f"{PRECISION_WORDS[setting['amp']]}, attention {setting['attention_kernel']}"
             + (", gradient checkpointing" if setting["gradient_checkpointing"] else "")
             + "; predicted peak per GPU in MiB (--help: each column):",
             f"{'':5}" + " ".join(f"{name:>{width}}" for name, width in widths.items())]
    for index, device in enumerate(result["per_gpu"]):
        cells = [f"{device[name] / 2**20:>{widths[name]},.0f}" for name in (*ORDER, "total")]
        lines.append(f"GPU{index:<2}" + " ".join(cells) + f" {'yes' if device['fits'] else 'NO':>{widths['fits']}}")
    best, unit = result["largest_global_batch"], gpu["count"] * steps
    lines.append(f"largest global batch that fits: {best} ({best // unit} per GPU per micro-batch)" if best else
                 "largest global batch that fits: none, even 1 example per GPU does not fit")
    lines.append(f"accelerate estimate-memory's count (weights, gradients, Adam; 16 bytes per parameter in fp32): "
                 f"{result['accelerate_estimate_bytes'] / 2**20:,.0f} MiB")
    return lines


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "es" if noun.endswith("ch") else "s")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        result = predict(args)
    except SettingError as error:
        print(f"python -m helpers.memory: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else "\n".join(report(result)), flush=True)
    return 0
