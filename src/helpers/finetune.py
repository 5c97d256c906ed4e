"""Fine-tune Net with DistributedDataParallel (or FSDP2: --strategy fsdp): notebook 02's training, one process per device.

    torchrun --standalone --nproc_per_node=2 -m helpers.finetune     # 2 processes on this machine
    python -m helpers.finetune                                       # one plain process
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 -m helpers.finetune
                                                                     # the same command on each of 2 machines
    python -m helpers.finetune --checkpoint-dir ckpt --save-every 10 --resume   # continue after a kill
    sbatch examples/slurm/finetune.sbatch                            # Slurm: 2 nodes, requeued when preempted
    torchrun --standalone --nproc_per_node=2 -m helpers.finetune --device cpu    # 2 processes on one GPU's machine
    python -m helpers.finetune --train-file F --validation-file G --test-file H --output-dir out  # your own data
    python -m helpers.finetune --grad-accum-steps 4 --amp bf16 --gradient-checkpointing  # the memory levers (09)
    torchrun --standalone --nproc_per_node=2 -m helpers.finetune --amp fp16    # a GPU without bf16: T4, V100

Same model, data, two-learning-rate Adam and warmup/linear schedule as notebook 02, trained by the same
helpers.train.fit. Rank 0 logs, evaluates and writes files. The last JSON line it prints is a short summary
(read it with helpers.launch.last_json); --output-dir also gets metrics.json with every batch's loss.
With --checkpoint-dir, SIGTERM or SIGUSR1 during training (a scheduler's notice) stops every process at the next
step boundary with a checkpoint of that step, exit status 75 (helpers.preemption); --resume continues from it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from transformers import get_linear_schedule_with_warmup, set_seed

from helpers import distributed, fsdp, levers, own_data, preemption
from helpers.checkpoint import CheckpointError, Checkpoints, save_model, weights_digest
from helpers.data import PadToLongest
from helpers.equivalence import compare_with_one_process, print_comparison
from helpers.models import ModelNotAvailableError, load_tokenizer, resolve_model
from helpers.net import Net
from helpers.optim import learning_rates_for, two_lr_adam
from helpers.train import evaluate, fit, say
from helpers.wrapping import is_sharded, unwrap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m helpers.finetune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model name or directory (default: $BERT_MODEL, else the bundled tiny BERT)")
    parser.add_argument("--global-batch-size", type=int, default=32,
                        help="examples per optimizer step over all processes (default 32, as notebook 02); each "
                             "process takes global-batch-size / number-of-processes of them (the per-rank batch)")
    parser.add_argument("--grad-accum-steps", type=int, default=1, metavar="N",
                        help="micro-batches per optimizer step (default 1): each process trains on global-batch-size "
                             "/ (processes x N) examples at a time and adds up the gradients of N of them before each "
                             "step; DDP and FSDP communicate once per step (notebook 09)")
    parser.add_argument("--amp", choices=sorted(levers.AMP_DTYPES),
                        help="mixed precision (default: fp32 throughout): the forward and the loss under autocast, "
                             "weights, gradients and Adam in fp32; with --strategy fsdp also FSDP2's "
                             "MixedPrecisionPolicy (notebook 09). bf16: GPUs of compute capability 8.0 or later, and "
                             "CPUs. fp16: any GPU (the T4, the V100), with a gradient scaler (torch.amp.GradScaler): "
                             "the loss is scaled before backward, the gradients unscaled once per optimizer step, "
                             "and a step whose gradients hold inf or nan is skipped, logged and counted "
                             "(skipped_steps in the summary); checkpoints keep the scaler's state")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute each encoder layer's forward in backward instead of keeping its activations: "
                             "less memory, more compute (notebook 09)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the training data (default 2, as 02)")
    parser.add_argument("--body-lr", type=float,
                        help="peak learning rate of BERT (default: what helpers.optim.learning_rates_for picks for "
                             "the model, as in notebook 02)")
    parser.add_argument("--head-lr", type=float, help="peak learning rate of the head (default: as --body-lr)")
    parser.add_argument("--seed", type=int, default=0,
                        help="model initialization and shuffling; dropout uses seed + rank on each process")
    parser.add_argument("--train-examples", type=int, help="train on the first N training examples only")
    parser.add_argument("--val-examples", type=int, help="evaluate on the first N validation examples only")
    parser.add_argument("--output-dir", type=Path, help="rank 0 writes metrics.json and the trained model (a checkpoint folder, model/) here")
    parser.add_argument("--check-equivalence", action="store_true",
                        help="first compare one step of --strategy (DDP or FSDP) with one process on the first "
                             "global-batch-size training examples (dropout off): gradients, and weights after one SGD "
                             "step (helpers.equivalence)")
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="rank 0 saves a checkpoint here after every epoch (and every --save-every steps)")
    parser.add_argument("--save-every", type=int, default=0, metavar="STEPS",
                        help="also save every STEPS optimizer steps, mid-epoch (default 0: only after each epoch)")
    parser.add_argument("--resume", action="store_true",
                        help="continue exactly from the latest checkpoint in --checkpoint-dir, if there is one "
                             "(same number of processes and options as the interrupted run)")
    parser.add_argument("--strategy", choices=fsdp.FINETUNE_STRATEGIES, default="ddp",
                        help="ddp: a full copy of the model on every process (default); fsdp: each process holds "
                             "1/N of the weights, gradients and Adam state (FSDP2 fully_shard, notebook 08)")
    parser.add_argument("--keep-pooler", action="store_true",
                        help="keep BERT's unused pooler, as the memo's network does: DDP stops on the second step")
    parser.add_argument("--device", choices=distributed.DEVICE_CHOICES, default="auto",
                        help="auto (default): the GPU numbered LOCAL_RANK where torch sees CUDA, else the CPU; cpu: "
                             "the CPU over gloo even where there are GPUs (e.g. 2 processes on a machine with 1 GPU)")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels only (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, "
                             "cuDNN flags): on CUDA, a resumed run then ends bitwise like an uninterrupted one")
    own_data.add_arguments(parser)
    return parser.parse_args(argv)


def find_problem(args: argparse.Namespace, world_size: int, rank: int, train_examples: int) -> str | None:
    """The first reason this process cannot train, or None; checked before any model is loaded.

    Whether the process has a device of its own is checked before, by itself (``distributed.device_problem``):
    a process without one cannot join the group that agrees on the answers of this check.
    """
    if args.global_batch_size < world_size:
        return (f"--global-batch-size {args.global_batch_size} over {world_size} processes leaves a per-rank batch "
                f"of {args.global_batch_size // world_size}; it must be at least 1")
    if args.global_batch_size % world_size:
        return (f"--global-batch-size {args.global_batch_size} does not split evenly over {world_size} processes; "
                f"use a multiple of {world_size}")
    if args.grad_accum_steps < 1:
        return f"--grad-accum-steps {args.grad_accum_steps}: must be at least 1"
    split = world_size * args.grad_accum_steps
    if args.global_batch_size % split:
        return (f"--global-batch-size {args.global_batch_size} does not split into equal micro-batches over "
                f"{world_size} process(es) x {args.grad_accum_steps} accumulation steps; use a multiple of {split}")
    if args.train_examples is not None and args.train_examples < 1:
        return f"--train-examples {args.train_examples}: must be at least 1"
    if args.val_examples is not None and args.val_examples < 1:
        return f"--val-examples {args.val_examples}: must be at least 1"
    if train_examples < world_size:
        return (f"{world_size} processes but only {train_examples} training example(s): every process needs at "
                f"least one (start fewer processes or raise --train-examples)")
    micro_batches = math.ceil(math.ceil(train_examples / world_size) / (args.global_batch_size // split))
    if micro_batches < args.grad_accum_steps:
        return (f"--grad-accum-steps {args.grad_accum_steps}: an epoch has only {micro_batches} micro-batch(es) of "
                f"{args.global_batch_size // split} per process ({train_examples} training examples over {world_size} "
                f"process(es)); use at most {micro_batches}, or more training examples")
    if args.epochs < 1:
        return f"--epochs {args.epochs}: must be at least 1"
    try:
        resolve_model(args.model)
    except ModelNotAvailableError as error:
        return str(error)
    if args.save_every < 0:
        return f"--save-every {args.save_every}: must be at least 0 (0: save only after each epoch)"
    if (args.save_every or args.resume) and args.checkpoint_dir is None:
        return f"{'--resume' if args.resume else '--save-every'} needs --checkpoint-dir: where the checkpoints are"
    for option, path in (("--output-dir", args.output_dir), ("--checkpoint-dir", args.checkpoint_dir)):
        problem = output_dir_problem(path, option) if rank == 0 and path is not None else None
        if problem:
            return problem
    return fsdp.strategy_problem(args.checkpoint_dir, args.strategy) if args.resume else None


def output_dir_problem(path: Path, option: str = "--output-dir") -> str | None:
    """Why rank 0 cannot write into ``path`` (created if missing), or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return f"{option} {path}: cannot write there ({error.strerror or error})"
    return None


def use_deterministic_algorithms() -> None:
    """Deterministic kernels only; an operation that has none raises instead of running.

    On the CPU our training is deterministic anyway (same weights with and without it). On CUDA some kernels
    add partial sums in the order they finish (SDPA's memory-efficient backward), and cuBLAS needs a fixed
    workspace, set before its first use. The switch is global: it stays on in the calling process.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def summary(result: dict) -> dict:
    """``result`` without the per-batch losses: what rank 0 prints as its last line."""
    return result | {"history": [{k: v for k, v in row.items() if k != "batch_losses"} for row in result["history"]]}


def micro_batch_size(args: argparse.Namespace, world_size: int) -> int:
    """Examples per forward on each process: the global batch over processes and accumulation steps."""
    return args.global_batch_size // (world_size * args.grad_accum_steps)


def describe(args: argparse.Namespace, world_size: int, device: torch.device) -> str:
    """The run's first line: processes, device, how the global batch splits, and the levers in use."""
    per_rank, steps = args.global_batch_size // world_size, args.grad_accum_steps
    batch = f"batch {per_rank} per rank" + (f" ({steps} micro-batches of {per_rank // steps})" if steps > 1 else "")
    return (f"{world_size} process(es), backend {dist.get_backend()}, device {device.type}; {batch} x {world_size} = "
            f"global batch {args.global_batch_size}" + (f"; {args.amp} autocast" if args.amp else "")
            + (" with a gradient scaler" if args.amp == "fp16" else "")
            + ("; activation checkpointing" if args.gradient_checkpointing else "")
            + ("; deterministic algorithms only" if args.deterministic else ""))


def make_loaders(args: argparse.Namespace, data: own_data.DataFiles, train_examples: list, tokenizer):
    """Training micro-batches of global-batch-size / (processes x accumulation steps) per process, each process its
    own share of a shuffle that changes each epoch (DistributedSampler); validation batches of 64."""
    sampler = DistributedSampler(train_examples, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                 shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_examples, batch_size=micro_batch_size(args, dist.get_world_size()),
                              sampler=sampler, collate_fn=PadToLongest(tokenizer))
    val_loader = DataLoader(data.validation[:args.val_examples], batch_size=64, collate_fn=PadToLongest(tokenizer))
    return train_loader, val_loader


def settings(args: argparse.Namespace, world_size: int, micro_batches: int) -> dict:
    """What the summary and metrics.json record about the run's shape: processes, batches, levers, and the
    optimizer steps of all epochs (``micro_batches`` per epoch, ``--grad-accum-steps`` of them per step)."""
    return {"world_size": world_size, "per_rank_batch_size": args.global_batch_size // world_size,
            "global_batch_size": args.global_batch_size, "grad_accum_steps": args.grad_accum_steps,
            "micro_batch_size": micro_batch_size(args, world_size), "amp": args.amp,
            "gradient_checkpointing": args.gradient_checkpointing, "strategy": args.strategy,
            "steps": args.epochs * math.ceil(micro_batches / args.grad_accum_steps)}


def build_training(args: argparse.Namespace, labels: int, device: torch.device, total_steps: int):
    """Net, two-learning-rate Adam and warmup/linear schedule as in notebook 02, wrapped for ``--strategy``."""
    set_seed(args.seed)  # the same initial weights everywhere (DDP also copies rank 0's weights to all ranks)
    net = Net(args.model, num_labels=labels, pooler=args.keep_pooler).to(device)
    if args.gradient_checkpointing:
        levers.enable_checkpointing(net)
    net = fsdp.prepare(net, args.strategy, **levers.fsdp_mixed_precision(args.amp))  # before the optimizer is built
    rule_body_lr, rule_head_lr = learning_rates_for(net.bert.config)
    body_lr = rule_body_lr if args.body_lr is None else args.body_lr
    head_lr = rule_head_lr if args.head_lr is None else args.head_lr
    optimizer = two_lr_adam(net, body_lr=body_lr, head_lr=head_lr)  # built on the plain model
    say(f"peak learning rates: body {body_lr:g}, head {head_lr:g}")
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=total_steps // 10,
                                                num_training_steps=total_steps)
    return fsdp.wrap(net, args.strategy, device), optimizer, scheduler


def report(args: argparse.Namespace, data: own_data.DataFiles, model, result: dict, tokenizer) -> dict:
    """Add every rank's weights digest and the test scores to ``result``; rank 0 writes --output-dir and prints
    the summary. Call it on every process (a sharded model's weights and forward need them all)."""
    result["weights_sha256"] = distributed.gather(weights_digest(model))
    if args.train_file:
        result["labels"] = list(data.labels)
    if data.test and (dist.get_rank() == 0 or is_sharded(model)):  # as for validation (helpers.train.fit)
        test = evaluate(unwrap(model), DataLoader(data.test, batch_size=64, collate_fn=PadToLongest(tokenizer)))
        result |= {"test_loss": test["loss"], "test_accuracy": test["accuracy"]}
        say(f"test: loss {test['loss']:.2f}  accuracy {test['accuracy']:.2f}")
    if args.output_dir is not None:  # load with helpers.predict.load_classifier (labels too) or load_checkpoint
        save_model(args.output_dir / "model", model, labels=data.labels)
        if dist.get_rank() == 0:
            (args.output_dir / "metrics.json").write_text(json.dumps(result, indent=1) + "\n")
    say(json.dumps(summary(result)))  # short; metrics.json has every batch's loss
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.deterministic:
        use_deterministic_algorithms()  # before anything runs on a GPU
    problem = distributed.device_problem(args.device)
    if problem:  # no device of its own: this process cannot join the group, and neither do the others
        distributed.stop_before_joining(problem)
    data, problem = own_data.load(args)  # the bundled data, or --train-file and friends
    train_examples = data.train[:args.train_examples] if data else []
    problem = problem or find_problem(args, distributed.world_size(), distributed.rank(), len(train_examples))
    device = distributed.device_for_this_process(args.device)
    distributed.init_process_group(device)
    problem = distributed.agree_on_problem(problem or levers.amp_problem(args.amp, device))
    if problem:
        distributed.stop_everywhere(problem)

    world_size = dist.get_world_size()
    say(describe(args, world_size, device))
    tokenizer = load_tokenizer(args.model)
    train_loader, val_loader = make_loaders(args, data, train_examples, tokenizer)
    if args.train_file:
        say(own_data.describe(data, tokenizer))
    result = settings(args, world_size, len(train_loader))
    if args.check_equivalence:
        result["equivalence"] = compare_with_one_process(args.model, train_examples[:args.global_batch_size],
                                                         PadToLongest(tokenizer), device, args.strategy, args.seed,
                                                         accumulation=args.grad_accum_steps)
        print_comparison(result["equivalence"])
    model, optimizer, scheduler = build_training(args, len(data.labels), device, result["steps"])
    checkpoints = Checkpoints(args.checkpoint_dir, args.save_every, labels=data.labels) if args.checkpoint_dir else None
    scaler = levers.gradient_scaler(args.amp, device)
    stop = preemption.StopAtStepBoundary(checkpoints, model, optimizer, scheduler, train_loader, device, scaler) \
        if checkpoints else None
    torch.manual_seed(args.seed + dist.get_rank())  # a different dropout mask on each rank
    try:  # a resumed run gets each rank's own random state back from the checkpoint
        with stop or nullcontext():  # while it trains, SIGTERM and SIGUSR1 stop every rank at the next step, saved
            result["history"] = fit(model, train_loader, val_loader, optimizer, scheduler, args.epochs, checkpoints,
                                    resume=args.resume, timed=True, accumulation=args.grad_accum_steps,
                                    amp=levers.amp_dtype(args.amp), scaler=scaler, on_step=stop)
    except CheckpointError as error:  # raised on every rank alike (Checkpoints.resume)
        distributed.stop_everywhere(str(error), model)
    except preemption.Preempted as stopped:  # every rank saved the same step
        say(str(stopped))
        distributed.leave_process_group(model)
        sys.exit(preemption.EXIT_STATUS)
    if args.amp == "fp16":
        result["skipped_steps"] = sum(row["skipped_steps"] for row in result["history"])
    report(args, data, model, result, tokenizer)
    distributed.leave_process_group(model)  # its barrier: no rank leaves before rank 0 has written its files
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
