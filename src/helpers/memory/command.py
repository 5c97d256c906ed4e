"""Will my setting fit? Each GPU's predicted memory in one fine-tuning step, by category at its allocated peak, and
what nvidia-smi will show for it (the allocator's reserved segments, the CUDA context, NCCL's buffers) against the
total the GPU reports; with the flags and defaults of helpers.finetune; and the largest global batch that fits.

    python -m helpers.memory --gpu T4 --gpus 2 --strategy ddp --global-batch-size 32 --seq-len 128 --amp fp16
    python -m helpers.memory --gpu A100-80GB --gpus 8 --strategy fsdp --model tohoku-nlp/bert-large-japanese-v2
    python -m helpers.memory --gpu L4 --amp bf16 --model rinna/japanese-roberta-base
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from helpers.data import MAX_LENGTH
from helpers.memory import nvidia_smi
from helpers.memory.categories import ORDER
from helpers.memory.configs import PRESETS, preset_config, preset_name
from helpers.memory.gpu_facts import GPUS, GpuModel, amp_precision, attention_kernel, parse_memory
from helpers.memory.prediction import gpu_memory, largest_batch
from helpers.memory.tracer import OPTIMIZER_IMPLS, build_model, classifier_class, default_attention

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
}
"""The first table's columns, the same in every run (ORDER, then total), each with its one line of --help."""
NVIDIA_SMI_COLUMNS = {
    "allocated": "the first table's total",
    "reserved": "the caching allocator's reserved peak (torch.cuda.max_memory_reserved): the step replayed into it "
                "(ddp: its bucket too; dataparallel: GPU 1 on runs a replica's share); fsdp: not replayed, unknown",
    "context": "the CUDA context and the kernels the libraries load into it, outside the allocator: the recorded "
               "H200's own figure, else the published range (--cuda-module-loading)",
    "nccl": "NCCL's buffers and kernels on each GPU under dataparallel, ddp and fsdp (published range); 0 on one GPU",
    "nvidia-smi": "what nvidia-smi will show for this process on the GPU: reserved + context + nccl; not other "
                  "processes, nor the driver's few MiB",
    "capacity": "the GPU's total as the device reports it (torch's total_memory, nvidia-smi's total): published "
                "figures, a range where they differ (below), or --gpu-memory, or this GPU's own",
    "fits": "yes: nvidia-smi's largest figure within the smallest total; NO: its smallest above the largest; "
            "maybe: between, where the context, NCCL or the total decide",
}
"""The second table's columns, each with its one line of --help."""
PRECISION_WORDS = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast with a gradient scaler"}
LOADING_WORDS = {"lazy": "lazily", "eager": "eagerly"}
MEMO_ARGS = ("--gpu", "A100-40GB", "--gpus", "2", "--strategy", "dataparallel", "--global-batch-size", "64",
             "--seq-len", "512", "--attention", "eager", "--optimizer-impl", "for-loop", "--no-set-to-none",
             "--cuda-module-loading", "eager")
"""The memo's setting as one command: its model (the default), nn.DataParallel on two GPUs, the global batch of 64
and 512 tokens notebook 05 assumes, and torch 1.x's step: eager attention, Adam one tensor at a time, ``zero_grad``
keeping the gradients, every CUDA kernel loaded at start. The memo names no GPU: an A100-40GB, a GPU of its era with
room for its 39,057 MiB."""
MEMO_NVIDIA_SMI_MIB = (39_057, 23_485)
"""The memo's nvidia-smi, GPU 0 and GPU 1 (MiB, quoted)."""


class SettingError(ValueError):
    """A setting the command cannot predict; the message is the one line the reader sees."""


def load_config(model: str, num_labels: int | None = None):
    """The transformers config of ``model``: a preset (offline), a local folder with config.json, or a hub name (read
    from the hub or its cache), with ``num_labels`` where given; and where it came from. Raises SettingError naming
    what is wrong, the loader's error kept as its cause, and for a model type transformers has no
    sequence-classification model for."""
    from transformers import AutoConfig

    name = preset_name(model)
    if name:
        config, source = preset_config(name), "preset"
    else:
        try:
            config = AutoConfig.from_pretrained(model)
        except (OSError, ValueError) as error:
            raise SettingError(f"--model {model}: not a preset ({', '.join(PRESETS)}), not a folder with a "
                               f"config.json, and not found on the hub or in its cache ({str(error).splitlines()[0]})"
                               ) from error
        source = "folder" if Path(model).is_dir() else "hub"
    if config.model_type != "bert" and classifier_class(config) is None:
        raise SettingError(f"--model {model}: transformers has no sequence-classification model for model_type "
                           f"{config.model_type!r} (AutoModelForSequenceClassification); this command predicts "
                           f"fine-tuning one")
    if num_labels:
        config.num_labels = num_labels
    return config, source


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


def _mib(low: int, high: int | None = None) -> str:
    """MiB as the tables print them: one figure, or low-high."""
    if high is None or high == low:
        return f"{low / 2**20:,.0f}"
    return f"{low / 2**20:,.0f}-{high / 2**20:,.0f}"


def parser() -> argparse.ArgumentParser:
    legend = "\n".join(f"  {name:<12} {meaning}" for name, meaning in COLUMNS.items())
    legend_smi = "\n".join(f"  {name:<12} {meaning}" for name, meaning in NVIDIA_SMI_COLUMNS.items())
    totals = "\n".join(f"  {gpu.name:<10} {_mib(*gpu.capacity):>15} MiB: {gpu.memory_source}" for gpu in GPUS.values())
    terms = "\n".join(f"  {term.name} ({_mib(term.low, term.high)} MiB): {term.source}"
                      for term in (nvidia_smi.H200, nvidia_smi.LAZY, nvidia_smi.EAGER, nvidia_smi.NCCL))
    parser = _OneLineParser(
        prog="python -m helpers.memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"columns, MiB per GPU at its predicted allocated peak (--json: bytes):\n{legend}\n\n"
               f"what nvidia-smi will show, MiB per GPU (--json: bytes):\n{legend_smi}\n\n"
               f"GPUs (--gpu), the total each reports, and where the figure comes from:\n{totals}\n\n"
               f"the terms nvidia-smi adds to the reserved peak, and where the figures come from:\n{terms}")
    parser.add_argument("--model", default="tohoku-nlp/bert-base-japanese-whole-word-masking",
                        help=f"a preset ({', '.join(PRESETS)}), a folder with config.json, or a hub name; BERT trains "
                             f"as the project's Net, any other encoder as transformers' sequence-classification "
                             f"model (default: %(default)s, the memo's model)")
    parser.add_argument("--num-labels", type=_positive, metavar="N",
                        help="classes the head predicts (default: the config's num_labels, 2 for the presets)")
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
    parser.add_argument("--attention", choices=("sdpa", "eager"),
                        help="sdpa: the kernel the GPU picks; eager: the L x L probabilities kept, as in the memo's "
                             "era (default: transformers' own for the model: sdpa where it has it, else eager)")
    parser.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default="foreach",
                        help="how Adam runs, torch.optim.Adam's foreach=True, fused=True or foreach=False: foreach "
                             "(default, as helpers.finetune on CUDA), fused, or for-loop (torch 1.x's)")
    parser.add_argument("--set-to-none", action=argparse.BooleanOptionalAction, default=True,
                        help="optimizer.zero_grad(set_to_none=...): --set-to-none frees the gradients (default, "
                             "torch 2.x); --no-set-to-none zeroes them and keeps them through the next step (torch 1.x)")
    parser.add_argument("--cuda-module-loading", choices=nvidia_smi.MODULE_LOADINGS, default="lazy",
                        help="CUDA_MODULE_LOADING, which sizes the CUDA context: lazy (default, torch 1.13 or later "
                             "sets it), or eager (every kernel loaded at start: older torch or CUDA)")
    parser.add_argument("--gpu-memory", type=_memory, metavar="SIZE",
                        help="the total of each GPU, e.g. 16GiB, 24GB, 40960MiB (default: what the GPU reports, "
                             "below)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object, in bytes")
    return parser


def _usable_positions(config) -> int:
    """The longest sequence ``config``'s position embeddings take: RoBERTa's count from the padding id on."""
    if config.model_type in ("roberta", "xlm-roberta", "camembert"):
        return config.max_position_embeddings - config.pad_token_id - 1
    return config.max_position_embeddings


def check_setting(args, config) -> None:
    if args.strategy == "single" and args.gpus != 1:
        raise SettingError(f"--strategy single runs on one GPU, not --gpus {args.gpus}: use ddp, fsdp or dataparallel")
    per_gpu, rest = divmod(args.global_batch_size, args.gpus * args.grad_accum_steps)
    if rest or not per_gpu:
        raise SettingError(f"--global-batch-size {args.global_batch_size} does not split into --gpus {args.gpus} x "
                           f"--grad-accum-steps {args.grad_accum_steps} equal micro-batches; use a multiple of "
                           f"{args.gpus * args.grad_accum_steps}")
    if args.seq_len > _usable_positions(config):
        raise SettingError(f"--seq-len {args.seq_len} is longer than the model's {_usable_positions(config)} "
                           f"positions")
    if args.strategy == "fsdp":
        used = [flag for flag, on in ((f"--grad-accum-steps {args.grad_accum_steps}", args.grad_accum_steps > 1),
                                      ("--attention eager", args.attention == "eager"),
                                      (f"--optimizer-impl {args.optimizer_impl}", args.optimizer_impl != "foreach"),
                                      ("--no-set-to-none", not args.set_to_none),
                                      (f"a {config.model_type} model", config.model_type != "bert")) if on]
        if used or (args.amp and args.gradient_checkpointing):
            raise SettingError(f"--strategy fsdp is predicted for BERT with sdpa attention, foreach Adam, "
                               f"zero_grad(set_to_none=True) and at most one of --amp and --gradient-checkpointing, "
                               f"without --grad-accum-steps; got "
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
    """The result of the command for ``args`` (parsed): the setting, each GPU's peak bytes by category and what
    nvidia-smi will show, the largest batch that fits. Raises SettingError naming the flag at fault, or the model
    type where its step cannot be traced."""
    gpu, source = choose_gpu(args)
    config, model_source = load_config(args.model, args.num_labels)
    attention = args.attention or default_attention(config)
    check_setting(argparse.Namespace(**(vars(args) | {"attention": attention})), config)
    try:
        precision = amp_precision(gpu, args.amp)  # --amp bf16 refused where helpers.finetune refuses it
    except ValueError as error:
        raise SettingError(str(error)) from error
    capacity = (args.gpu_memory, args.gpu_memory) if args.gpu_memory else gpu.capacity
    capacity_source = "--gpu-memory" if args.gpu_memory else gpu.memory_source
    options = dict(strategy=STRATEGIES[args.strategy], gpus=args.gpus, accumulation=args.grad_accum_steps,
                   checkpointing=args.gradient_checkpointing, amp=args.amp, attention=attention, gpu=gpu,
                   optimizer_impl=args.optimizer_impl, set_to_none=args.set_to_none, num_labels=args.num_labels)
    try:
        model = build_model(config, attention, num_labels=args.num_labels)
        count = sum(parameter.numel() for parameter in model.parameters())
        best = {certain: largest_batch(config, args.seq_len, capacity, known=args.global_batch_size, certain=certain,
                                       module_loading=args.cuda_module_loading, **options)
                for certain in (True, False)}  # first: it traces the asked batch with another, after one warm-up
        devices = gpu_memory(config, args.global_batch_size, args.seq_len,
                             module_loading=args.cuda_module_loading, **options)
    except Exception as error:  # transformers' own refusals, and operators a trace on meta tensors cannot run
        raise SettingError(f"--model {args.model}: cannot trace a {config.model_type} step with "
                           f"--attention {attention}: {type(error).__name__}: {str(error).splitlines()[0]}"
                           ) from error
    context, communication = devices[0].context, devices[0].communication
    return {
        "model": {"name": args.model, "source": model_source, "model_type": config.model_type,
                  "head": "Net" if config.model_type == "bert" else type(model.encoder).__name__,
                  "num_labels": args.num_labels or (2 if config.model_type == "bert" else config.num_labels),
                  "parameters": count, "hidden_size": config.hidden_size, "layers": config.num_hidden_layers,
                  "vocab_size": config.vocab_size},
        "gpu": {"name": gpu.name, "source": source, "sm": gpu.sm, "sm_count": gpu.sm_count, "count": args.gpus,
                "capacity": {"low": capacity[0], "high": capacity[1], "source": capacity_source}},
        "setting": {"strategy": args.strategy, "global_batch_size": args.global_batch_size,
                    "micro_batch_size": args.global_batch_size // args.gpus // args.grad_accum_steps,
                    "grad_accum_steps": args.grad_accum_steps, "seq_len": args.seq_len, "amp": precision,
                    "gradient_checkpointing": args.gradient_checkpointing, "attention": attention,
                    "attention_kernel": attention_kernel(gpu, precision) if attention == "sdpa" else "eager",
                    "optimizer_impl": args.optimizer_impl, "set_to_none": args.set_to_none,
                    "cuda_module_loading": args.cuda_module_loading},
        "columns": list(COLUMNS),
        "nvidia_smi_columns": list(NVIDIA_SMI_COLUMNS),
        "terms": {"context": vars(context), "nccl": vars(communication)},
        "per_gpu": [{name: device.parts.get(name, 0) for name in (*ORDER, "total")}
                    | {"allocated": device.allocated, "reserved": device.reserved,
                       "context": [device.context.low, device.context.high],
                       "nccl": [device.communication.low, device.communication.high],
                       "nvidia-smi": list(device.nvidia_smi), "capacity": list(capacity),
                       "fits": device.fits(capacity)} for device in devices],
        "largest_global_batch": best[True],
        "largest_global_batch_maybe": best[False],
        "accelerate_estimate_bytes": 16 * count,
    }


def report(result: dict) -> list[str]:
    """The command's lines for a reader: the model, the GPU, the setting, the two tables, the largest batch."""
    model, gpu, setting = result["model"], result["gpu"], result["setting"]
    micro, steps = setting["micro_batch_size"], setting["grad_accum_steps"]
    capacity = gpu["capacity"]
    lines = [f"model {model['name']} ({model['source']}; {model['head']}, {model['num_labels']} labels): "
             f"{model['parameters'] / 1e6:,.1f} M parameters, hidden {model['hidden_size']}, {model['layers']} layers, "
             f"vocab {model['vocab_size']}",
             f"{setting['strategy']} on {gpu['count']} x {gpu['name']} ({gpu['source']}; {gpu['sm']}, "
             f"{gpu['sm_count']} SMs, {_mib(capacity['low'], capacity['high'])} MiB each), global batch "
             f"{setting['global_batch_size']} = {micro} per GPU x {_count(steps, 'micro-batch')}, L={setting['seq_len']}",
             f"{PRECISION_WORDS[setting['amp']]}, attention {setting['attention_kernel']}"
             + (", gradient checkpointing" if setting["gradient_checkpointing"] else "")
             + f", Adam {setting['optimizer_impl']}, zero_grad(set_to_none={setting['set_to_none']}), CUDA modules "
               f"loaded {LOADING_WORDS[setting['cuda_module_loading']]}",
             "at the allocated peak, MiB per GPU (--help: each column):"]
    lines += _table(result["columns"], [[_mib(device[name]) for name in result["columns"]]
                                        for device in result["per_gpu"]])
    lines.append("what nvidia-smi will show, MiB per GPU (--help: each column and source):")
    lines += _table(result["nvidia_smi_columns"],
                    [[_mib(device["allocated"]), "?" if device["reserved"] is None else _mib(device["reserved"]),
                      _mib(*device["context"]), _mib(*device["nccl"]),
                      f"{_mib(device['nvidia-smi'][0])}-?" if device["nvidia-smi"][1] is None
                      else _mib(*device["nvidia-smi"]),
                      _mib(*device["capacity"]), device["fits"]] for device in result["per_gpu"]])
    best, maybe, unit = result["largest_global_batch"], result["largest_global_batch_maybe"], gpu["count"] * steps
    sure = f"{best} ({best // unit} per GPU per micro-batch)" if best else "none for certain"
    lines.append(f"largest global batch that fits: {sure}" + (f"; up to {maybe} may fit" if maybe > best else ""))
    lines.append(f"accelerate estimate-memory's count (weights, gradients, Adam; 16 bytes per parameter in fp32): "
                 f"{result['accelerate_estimate_bytes'] / 2**20:,.0f} MiB")
    return lines


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(name), 7, *(len(row[index]) for row in rows)) for index, name in enumerate(columns)]
    lines = [f"{'':5}" + " ".join(f"{name:>{width}}" for name, width in zip(columns, widths))]
    lines += [f"GPU{index:<2}" + " ".join(f"{cell:>{width}}" for cell, width in zip(row, widths))
              for index, row in enumerate(rows)]
    return lines


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "es" if noun.endswith("ch") else "s")


def memo_prediction() -> dict:
    """The command's answer for the memo's setting (``MEMO_ARGS``, which says what it assumes): the dict ``--json``
    prints, in bytes. ``result["per_gpu"][i]["nvidia-smi"]`` is [low, high] of GPU i's process line in nvidia-smi
    (``reserved``, ``context`` and ``nccl`` its terms), to set beside the memo's own, ``MEMO_NVIDIA_SMI_MIB``."""
    return predict(parser().parse_args(list(MEMO_ARGS)))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        result = predict(args)
    except SettingError as error:
        print(f"python -m helpers.memory: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else "\n".join(report(result)), flush=True)
    return 0
