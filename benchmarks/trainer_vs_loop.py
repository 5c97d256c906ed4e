"""The project's training loop vs Hugging Face ``Trainer``: samples/s and final validation accuracy.

Same network (``helpers.net.Net`` on the bundled tiny BERT, same initial weights), same data, batch size 32,
same two-learning-rate Adam and linear warmup/decay schedule as notebook 02, no gradient clipping on either
side (Trainer clips at 1.0 by default), 2 epochs. Both are evaluated by the same function on the validation
split. Trainer's time is its ``train()`` call, the way a user runs it.
"""

from __future__ import annotations

import argparse
import tempfile

import common  # noqa: F401  (sets the quiet, offline environment before transformers is imported)
from torch import nn
from transformers import PrinterCallback, Trainer, TrainingArguments, get_linear_schedule_with_warmup, set_seed
from transformers.utils import logging

from helpers.data import PadToLongest, load_split, make_loader
from helpers.models import load_tokenizer
from helpers.net import Net
from helpers.optim import two_lr_adam
from helpers.train import evaluate, train_epoch

BATCH_SIZE, EPOCHS, BODY_LR, HEAD_LR = 32, 2, 5e-4, 1e-3


def optimizer_and_schedule(net: Net, steps_per_epoch: int):
    optimizer = two_lr_adam(net, body_lr=BODY_LR, head_lr=HEAD_LR)
    total = EPOCHS * steps_per_epoch
    return optimizer, get_linear_schedule_with_warmup(optimizer, num_warmup_steps=total // 10,
                                                      num_training_steps=total)


def project_loop(train, tokenizer, times: list[float]) -> Net:
    set_seed(0)
    net = Net()
    loader = make_loader(train, tokenizer, batch_size=BATCH_SIZE, shuffle=True, seed=0)
    optimizer, scheduler = optimizer_and_schedule(net, len(loader))
    with common.stopwatch(times):
        for _ in range(EPOCHS):
            train_epoch(net, loader, optimizer, scheduler)
    return net


def cross_entropy(logits, labels, num_items_in_batch=None):
    return nn.functional.cross_entropy(logits, labels)


def hf_trainer(train, tokenizer, times: list[float]) -> Net:
    set_seed(0)
    net = Net()
    steps_per_epoch = -(-len(train) // BATCH_SIZE)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=BATCH_SIZE, num_train_epochs=EPOCHS, seed=0,
            max_grad_norm=0.0, use_cpu=True, report_to="none", disable_tqdm=True, log_level="error",
            logging_strategy="no", save_strategy="no", eval_strategy="no", remove_unused_columns=False,
            dataloader_pin_memory=False)
        trainer = Trainer(model=net, args=args, train_dataset=train, data_collator=PadToLongest(tokenizer),
                          optimizers=optimizer_and_schedule(net, steps_per_epoch), compute_loss_func=cross_entropy)
        trainer.remove_callback(PrinterCallback)  # with tqdm off it would print the final metrics dict
        with common.stopwatch(times):
            trainer.train()
    return net


def run(repeats: int = 3, examples: int | None = None) -> dict:
    """``examples`` trains on the first N training sentences only (a quick check on a busy machine)."""
    logging.set_verbosity_error()
    tokenizer = load_tokenizer()
    train, validation = load_split("train")[:examples], load_split("validation")
    val_loader = make_loader(validation, tokenizer, batch_size=64)
    sides = {"project loop": project_loop, "HF Trainer": hf_trainer}
    times = {name: [] for name in sides}
    accuracy = {}
    for repeat in range(repeats):  # side by side, interleaved; who goes first alternates (warm-up costs)
        for name, train_fn in list(sides.items())[::1 if repeat % 2 else -1]:
            net = train_fn(train, tokenizer, times[name])
            accuracy[name] = evaluate(net, val_loader)["accuracy"]
            print(f"  {name}: {times[name][-1]:.1f} s, validation accuracy {accuracy[name]:.3f}", flush=True)
    samples = EPOCHS * len(train)
    return {"samples_per_s": {name: samples / common.median(values) for name, values in times.items()},
            "times": times, "val_accuracy": accuracy, "repeats": repeats, "examples": len(train)}


def speed_ratios(result: dict) -> list[float]:
    """Per repetition, the loop's samples/s over Trainer's, i.e. Trainer's time over the loop's."""
    return common.ratios(result["times"]["HF Trainer"], result["times"]["project loop"])


def report(result: dict) -> list[str]:
    speed, acc = result["samples_per_s"], result["val_accuracy"]
    lines = [f"{name:14s} {speed[name]:7.1f} samples/s   validation accuracy {acc[name]:.3f}" for name in speed]
    ratios = speed_ratios(result)
    lines.append(f"project loop / Trainer: {common.median(ratios):.2f}x samples/s ({common.spread(ratios, 'x')})")
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--examples", type=int, help="train on the first N sentences only (default: all)")
    args = parser.parse_args()
    print(f"machine: {common.machine()}", flush=True)
    print("\n".join(report(run(args.repeats, args.examples))))
    print(f"load average at end {common.load_average()}")
