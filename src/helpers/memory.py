"""Predict what each GPU holds during one fine-tuning step: one device, DataParallel, DDP, FSDP2, and the levers.

The prediction traces the step on fake tensors and replays it into a simulated GPU (``helpers.simulated_gpu``):
PyTorch's caching allocator with the GPU's cuBLAS workspaces and kernel buffers. Each GPU's figure is the
moment its allocated bytes are highest (what ``torch.cuda.max_memory_allocated`` reports), split by category.
Checked against 24 settings measured on an H200 (tests/test_memory.py). The closed-form
``activation_formula`` only explains the activations (tests check it against PyTorch's MemTracker).

    python -m helpers.memory --model tohoku-nlp/bert-base-japanese-v3 --batch-size 32 --seq-len 512 \\
        --gpus 2 --strategy ddp --amp bf16 --gpu-memory 16GiB
    python -m helpers.memory --chart docs/img/per_device_memory.png     # the README's chart
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from importlib.resources import files
from pathlib import Path

import torch

from helpers.gpu_facts import GPUS, GpuModel, attention_kernel, parse_memory, this_gpu
from helpers.memtrace import StepMemory, trace_fake
from helpers.simulated_gpu import CATEGORIES

PREDICTED_STRATEGIES = ("single", "dataparallel", "ddp", "fsdp2")
FITS = 0.9  # a peak "fits" when it is at most this share of the GPU's memory: the CUDA context (several hundred
#             MiB) and the allocator's cached, unused blocks take the rest
_steps: dict[tuple, StepMemory] = {}


def default_gpu() -> GpuModel:
    """This machine's GPU 0 (with the attention kernels it picks) when there is one, else the H200 the series was
    measured on."""
    return this_gpu(0) if torch.cuda.is_available() else GPUS["H200"]


def layer_activation_bytes(config, seq_len: int, *, attention: str = "sdpa", mask_bytes: int = 1) -> int:
    """Bytes one encoder layer saves for backward per token, in fp32 (notebook 05's solutions list the terms)."""
    h, heads, inter = config.hidden_size, config.num_attention_heads, config.intermediate_size
    per_token = 16 * h + 4 * h + 8 * h + 8 * inter + 4 * h + 2 * mask_bytes * h + 16
    if attention == "eager":  # the probabilities, the probabilities after dropout, and the dropout mask
        return per_token + (8 + mask_bytes) * heads * seq_len
    return per_token + 4 * heads  # the fused kernel: one fp32 log-sum-exp per query and head


def activation_formula(config, batch_size: int, seq_len: int, *, attention: str = "sdpa",
                       mask_bytes: int = 1) -> int:
    """Bytes saved for backward by ``Net``'s forward in fp32 (what MemTracker files as activations): each layer's
    ``layer_activation_bytes`` for every token (and for the fused kernel 16 bytes of dropout seed and offset per
    layer); outside the layers, per token the embeddings' LayerNorm input and dropout mask, the last layer's
    output kept by the [CLS] slice, and 8 bytes per token, per example, per position and once."""
    h, tokens = config.hidden_size, batch_size * seq_len
    per_layer = tokens * layer_activation_bytes(config, seq_len, attention=attention, mask_bytes=mask_bytes)
    seeds = 0 if attention == "eager" else 16
    outside = tokens * (8 * h + mask_bytes * h + 8) + 8 * batch_size + 8 * seq_len + 8
    return config.num_hidden_layers * (per_layer + seeds) + outside


def parameter_bytes(config, pooler: bool = True) -> int:
    """fp32 bytes of every parameter of ``Net`` (BERT, with its pooler unless ``pooler=False``, plus the 2-class
    head), counted from the config's shapes."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    embeddings = (config.vocab_size + config.max_position_embeddings + config.type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * inter + inter) + (inter * h + h) + 2 * h
    head = 2 * h + 2
    return 4 * (embeddings + layers * layer + (h * h + h if pooler else 0) + head)


def predict_step(config, batch_size: int, seq_len: int, *, gpu: GpuModel | None = None,
                 environ: dict[str, str] | None = None, attention: str = "sdpa", checkpointing: bool = False,
                 amp: bool = False, accumulation: int = 1) -> StepMemory:
    """One device's step with ``batch_size`` examples (``accumulation`` micro-batches), traced and replayed into a
    simulated ``gpu`` (default: ``default_gpu()``) whose workspaces follow ``environ`` (default: this process's
    environment). Results are kept, so a question asked twice costs nothing."""
    gpu = gpu or default_gpu()
    environ = dict(os.environ if environ is None else environ)
    relevant = tuple(sorted((k, v) for k, v in environ.items() if "CUBLAS" in k))
    key = (config.to_json_string(), batch_size, seq_len, gpu, relevant, attention, checkpointing, amp, accumulation)
    if key not in _steps:
        _steps[key] = trace_fake(config, batch_size, seq_len, attention=attention, checkpointing=checkpointing,
                                 amp_dtype=torch.bfloat16 if amp else None, accumulation=accumulation, gpu=gpu,
                                 environ=environ)
    return _steps[key]


def per_device(config, batch_size: int, seq_len: int, *, strategy: str = "single", gpus: int = 1,
               accumulation: int = 1, checkpointing: bool = False, amp: bool = False, attention: str = "sdpa",
               gradient_as_bucket_view: bool = False, gpu: GpuModel | None = None,
               environ: dict[str, str] | None = None) -> list[dict[str, int]]:
    """Peak bytes per GPU of one step with global batch ``batch_size``, by category, one dict per GPU.

    - single: the traced step on one GPU.
    - dataparallel: GPU 0 runs the master model on its B/N share, so it holds what one device holds at B/N
      (weights, gradients reduced onto it, Adam state); every other GPU holds a fresh replica of the weights,
      the activations of its B/N share and, at the end of backward, the replica's gradients, but no Adam state
      and, with accumulation, none of the earlier micro-batches' gradients (they were added into GPU 0's ``.grad``).
      A model of DataParallel's mechanics, not a trace of it.
    - ddp: every GPU runs a full copy at B/N with its own Adam state, plus gradient buckets of the size of the
      parameters DDP reduces (all but the pooler, which the project drops for DDP: ``Net(pooler=False)``); with
      ``gradient_as_bucket_view`` the gradients live in the buckets.
    - fsdp2: ``helpers.fsdp_memory.predict_fsdp`` (FSDPMemTracker on a fake process group), one lever at a time.
    - amp: CUDA autocast's rules with bf16 (``helpers.memtrace.CudaLikeKernels``): weights, gradients and Adam
      state stay fp32; linear layers and attention save bf16 tensors and bf16 copies of their weights, while
      softmax, layer_norm and the loss keep fp32.
    """
    if strategy not in PREDICTED_STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {PREDICTED_STRATEGIES}")
    gpus = 1 if strategy == "single" else gpus
    if batch_size % gpus:
        raise ValueError(f"batch_size={batch_size} does not split evenly over gpus={gpus}")
    if strategy == "fsdp2":
        return _fsdp2(config, batch_size // gpus, seq_len, gpus, accumulation, checkpointing, amp, attention,
                      gpu or default_gpu(), environ)
    step = predict_step(config, batch_size // gpus, seq_len, gpu=gpu, environ=environ, attention=attention,
                        checkpointing=checkpointing, amp=amp, accumulation=accumulation)
    peak = _parts(step.peak)
    if strategy == "single":
        return [_total(peak)]
    if strategy == "dataparallel":
        backward = _parts(step.backward_peak)
        replica_compute = backward | {"optimizer": 0}
        if accumulation > 1:  # earlier micro-batches' gradients went into GPU 0's .grad: a replica holds none of them
            replica_compute["gradients"] = max(0, backward["gradients"] - step.optimizer_peak["gradients"])
        replica_grads = dict.fromkeys(backward, 0) | {"weights": backward["weights"], "workspaces": backward["workspaces"],
                                                      "gradients": step.optimizer_peak["gradients"]}
        replica = max(replica_compute, replica_grads, key=lambda parts: sum(parts.values()))
        return [_total(peak)] + [_total(replica) for _ in range(gpus - 1)]
    rank = peak | {"buckets": parameter_bytes(config, pooler=False)}  # Net(pooler=False): DDP needs every gradient
    if gradient_as_bucket_view:
        rank["gradients"] = 0
    return [_total(rank) for _ in range(gpus)]


def _fsdp2(config, per_rank, seq_len, gpus, accumulation, checkpointing, amp, attention, gpu, environ):
    from helpers.fsdp_memory import predict_fsdp

    if accumulation != 1 or attention != "sdpa" or (amp and checkpointing):
        raise ValueError("strategy='fsdp2' predicts sdpa attention with at most one lever (amp or checkpointing), "
                         "without accumulation")
    lever = "mixed precision" if amp else "checkpointing" if checkpointing else "none"
    rank = predict_fsdp(config, per_rank, seq_len, gpus, lever, gpu=gpu, environ=environ)
    return [dict(rank) for _ in range(gpus)]


def _parts(snapshot: dict[str, int]) -> dict[str, int]:
    return {key: value for key, value in snapshot.items() if key != "total"}


def _total(parts: dict[str, int]) -> dict[str, int]:
    return parts | {"total": sum(parts.values())}


H200_RECORD = Path(str(files("helpers") / "data" / "h200" / "gpu-check.json"))


def h200_steps() -> list[dict]:
    """The 24 single-GPU steps ``make gpu-check`` measured on an NVIDIA H200 (torch 2.11.0+cu130, 2026-12-04): each
    setting, the interval its measured ``max_memory_allocated`` lies in (the printed GiB, rounded to 0.01,
    intersected with the printed gap, rounded to 0.1 %, to the prediction of then) and that prediction: MemTracker's
    peak alone, without workspaces or the allocator's blocks."""
    steps = []
    for entry in json.loads(H200_RECORD.read_text(encoding="utf-8"))["settings"]:
        kernel, dtype, batch, length, gib, gap = re.match(
            r"1 GPU, (\S+), (fp32|bf16), B=(\d+), L=(\d+)\s+predicted\s+[\d.]+ GiB\s+measured\s+([\d.]+) GiB"
            r"\s+gap ([+-][\d.]+)%", entry["line"]).groups()
        then = entry["predicted_then"]
        low = max((float(gib) - 0.005) * 2**30, then * (1 + (float(gap) - 0.05) / 100))
        high = min((float(gib) + 0.005) * 2**30, then * (1 + (float(gap) + 0.05) / 100))
        steps.append(dict(attention="eager" if kernel == "eager" else "sdpa", amp=dtype == "bf16",
                          batch_size=int(batch), seq_len=int(length), low=int(low), high=int(high), then=then))
    return steps


def peak_per_gpu(config, batch_size: int, seq_len: int, **options) -> int:
    """The highest predicted peak over the GPUs of a setting (``per_device``'s options)."""
    return max(device["total"] for device in per_device(config, batch_size, seq_len, **options))


def largest_batch(config, seq_len: int, capacity: int, *, known: int | None = None, **options) -> int:
    """The largest global batch (a multiple of gpus x accumulation) whose predicted peak fits FITS x ``capacity``
    on every GPU, or 0. What grows with the batch (activations, temporaries, buffers) grows almost linearly, so
    the batch ``known`` (already predicted; default 2 micro-batches per GPU) gives a first guess, and a few
    traces around it settle the boundary."""
    gpus = options.get("gpus", 1) if options.get("strategy", "single") != "single" else 1
    unit = gpus * options.get("accumulation", 1)
    limit = FITS * capacity
    traced: dict[int, int] = {}

    def peak(count: int) -> int:  # count micro-batches of ``unit`` examples
        if count not in traced:
            traced[count] = peak_per_gpu(config, count * unit, seq_len, **options)
        return traced[count]

    count = max(1, (known or 2 * unit) // unit)
    device = max(per_device(config, count * unit, seq_len, **options), key=lambda d: d["total"])
    fixed = sum(device.get(name, 0) for name in ("weights", "gradients", "optimizer", "workspaces", "buckets"))
    slope = max(device["total"] - fixed, 1) / count
    fits, fails = 0, None  # the largest count known to fit, the smallest known not to
    count = max(1, int((limit - fixed) // slope))
    while fails is None or fails > fits + 1:
        if peak(count) <= limit:
            fits = max(fits, count)
        else:
            fails = count if fails is None else min(fails, count)
        if fails == 1:
            return 0
        if fits and fails:    # a line through the two points around the limit
            slope = (peak(fails) - peak(fits)) / (fails - fits)
        base = fits or fails
        guess = base + int((limit - peak(base)) // max(slope, 1))
        count = max(fits + 1, min(guess, fails - 1 if fails else guess))
        if count in traced:
            count = (fits + fails) // 2 if fails else count + 1
    return fits * unit


# --- the chart --------------------------------------------------------------------------------------------------

COLORS = {"weights": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green", "activations": "tab:red",
          "temporaries": "tab:purple", "buckets": "tab:brown", "gathered": "tab:cyan", "workspaces": "tab:gray",
          "reduction": "tab:olive", "allocator": "tab:pink", "batch": "black"}


def plot_per_device(panels: dict[str, dict[str, list[dict[str, int]]]], limit_gib: float | None = None):
    """Stacked bars of GiB by category: one panel per key of ``panels``, one bar per (setting, GPU).

    ``panels`` maps a panel title to {setting label: per_device(...) result}. ``limit_gib`` draws a
    dashed line, e.g. a GPU's capacity.
    """
    import matplotlib.pyplot as plt

    widths = [max(4.2, 0.8 * sum(len(devices) for devices in settings.values())) for settings in panels.values()]
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths), 3.8), sharey=True, squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, (title, settings) in zip(axes[0], panels.items()):
        stacked_bars(ax, {f"{setting}\nGPU{gpu}" if len(devices) > 1 else setting: device
                          for setting, devices in settings.items() for gpu, device in enumerate(devices)})
        if limit_gib:
            ax.axhline(limit_gib, color="black", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, rotation=30 if max(map(len, settings)) > 6 else 0)
    axes[0][0].set_ylabel("GiB")
    legend_above(fig, axes[0])
    return fig


def stacked_bars(ax, bars: dict[str, dict[str, int]], colors: dict[str, str] = COLORS) -> list[float]:
    """One bar per entry of ``bars`` (label: bytes by category), stacked by category in GiB; returns the heights."""
    bottom = [0.0] * len(bars)
    for category, color in colors.items():
        heights = [bar.get(category, 0) / 2**30 for bar in bars.values()]
        if any(heights):
            ax.bar(list(bars), heights, bottom=bottom, color=color, label=category)
            bottom = [b + h for b, h in zip(bottom, heights)]
    return bottom


def legend_above(fig, axes) -> None:
    """One legend above all the panels, naming each category once."""
    handles = {}
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(name, handle)
    fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=min(len(handles), 6), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.88))


def memo_chart(path: str) -> None:
    """Write the README's chart: the memo's setting (BERT-base v1, DataParallel on 2 GPUs, eager attention)."""
    from helpers.memtrace import bert_base_config

    config = bert_base_config()
    panels = {f"predicted: DataParallel, 2 x H200, eager, L={seq_len}":
              {f"B={batch}": per_device(config, batch, seq_len, strategy="dataparallel", gpus=2, attention="eager",
                                        gpu=GPUS["H200"], environ={})
               for batch in (16, 32, 64)}
              for seq_len in (128, 512)}
    plot_per_device(panels).savefig(path, dpi=100)


# --- the command ------------------------------------------------------------------------------------------------

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
    names = [name for name in CATEGORIES + ("buckets", "gathered") if any(d.get(name, 0) >= 2**19 for d in devices)]
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


if __name__ == "__main__":
    raise SystemExit(main())
