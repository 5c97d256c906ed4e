"""Dynamic padding vs padding every batch to 512 tokens: wall time of one training epoch on the bundled data.

Both sides train the same network (the bundled tiny BERT's architecture, but with 512 positions, as the
bundled one has 128) from the same weights, with the same optimizer, batch size and batch order; only the
collate function differs. A third side adds length bucketing: batches of similar lengths.

Padded to 512, every batch has the same shape (32 x 512), so its epoch time is the number of batches times
the median time of one batch, measured on ``--batches-512`` batches after a warm-up one (a full epoch would
take minutes on 2 cores). The dynamic sides run the whole epoch.
"""

from __future__ import annotations

import argparse
import copy
import random

import common  # noqa: F401  (sets the quiet, offline environment before transformers is imported)
import torch
from torch.utils.data import DataLoader
from transformers import BertConfig, BertModel

from helpers.data import PadToLongest, load_split
from helpers.models import bundled_model_dir, load_tokenizer
from helpers.net import Net
from helpers.optim import two_lr_adam
from helpers.train import train_epoch

BATCH_SIZE = 32


class PadTo512(PadToLongest):
    """Every batch padded to 512 tokens, as with ``padding="max_length", max_length=512``."""

    def __call__(self, examples):
        batch = self.tokenizer([e.text for e in examples], padding="max_length", truncation=True,
                               max_length=512, return_tensors="pt")
        batch["labels"] = torch.tensor([e.label for e in examples])
        return dict(batch)


def bucketed_batches(examples, tokenizer, batch_size: int, seed: int = 0) -> list[list[int]]:
    """Indices sorted by token length, cut into batches, the batches shuffled: little padding per batch."""
    lengths = [len(tokenizer(e.text)["input_ids"]) for e in examples]
    order = sorted(range(len(examples)), key=lambda i: lengths[i])
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    random.Random(seed).shuffle(batches)
    return batches


def network_with_512_positions() -> Net:
    torch.manual_seed(0)
    net = Net()
    config = BertConfig.from_pretrained(bundled_model_dir(), max_position_embeddings=512)
    net.bert = BertModel(config, add_pooling_layer=False)
    return net


def epoch_seconds_512(net: Net, loader, batches: int) -> float:
    """A pad-to-512 epoch: every batch has the same shape, so ``len(loader)`` times the median batch time."""
    optimizer = two_lr_adam(net, body_lr=5e-4, head_lr=1e-3)
    batches_in_order = iter(loader)
    train_epoch(net, [next(batches_in_order)], optimizer)  # warm-up: first-call allocations
    times = []
    for _ in range(batches):
        with common.stopwatch(times):  # collate (tokenize, pad) and train, as in a whole epoch
            train_epoch(net, [next(batches_in_order)], optimizer)
    return common.median(times) * len(loader)


def run(repeats: int = 3, batches_512: int = 5, examples: int | None = None) -> dict:
    """``examples`` trains on the first N training sentences only (a quick check on a busy machine)."""
    tokenizer = load_tokenizer()
    train = load_split("train")[:examples]
    def seeded():  # one generator per side: repetition k draws the same batch order on both
        return torch.Generator().manual_seed(0)

    pad_512 = DataLoader(train, BATCH_SIZE, shuffle=True, generator=seeded(), collate_fn=PadTo512(tokenizer, 512))
    dynamic = {
        "pad to longest": DataLoader(train, BATCH_SIZE, shuffle=True, generator=seeded(),
                                     collate_fn=PadToLongest(tokenizer, 512)),
        "pad to longest + length buckets": DataLoader(
            train, batch_sampler=bucketed_batches(train, tokenizer, BATCH_SIZE), collate_fn=PadToLongest(tokenizer, 512)),
    }
    start = network_with_512_positions()
    times = {"pad to 512": [], **{name: [] for name in dynamic}}
    for _ in range(repeats):  # side by side, interleaved, so a change of load hits every side alike
        times["pad to 512"].append(epoch_seconds_512(copy.deepcopy(start), pad_512, batches_512))
        for name, loader in dynamic.items():
            net = copy.deepcopy(start)
            optimizer = two_lr_adam(net, body_lr=5e-4, head_lr=1e-3)
            with common.stopwatch(times[name]):
                train_epoch(net, loader, optimizer)
        print("  padding:", ", ".join(f"{name} {values[-1]:.1f} s" for name, values in times.items()), flush=True)
    tokens = {"pad to 512": len(train) * 512,
              **{name: sum(batch["attention_mask"].numel() for batch in loader) for name, loader in dynamic.items()}}
    return {"epoch_s": {name: common.median(values) for name, values in times.items()}, "times": times,
            "tokens": tokens, "repeats": repeats, "batches_512": batches_512, "examples": len(train)}


def speedups(result: dict) -> dict[str, list[float]]:
    """Per repetition, pad-to-512 epoch time over each dynamic side's (sides of a repetition ran together)."""
    base = result["times"]["pad to 512"]
    return {name: common.ratios(base, values) for name, values in result["times"].items() if name != "pad to 512"}


def report(result: dict) -> list[str]:
    ratios = speedups(result)
    lines = [f"{name:32s} epoch {seconds:7.2f} s  ({result['tokens'][name]:>9,} token slots)" +
             (f"  speed-up vs 512: {common.median(ratios[name]):5.1f}x ({common.spread(ratios[name], 'x', 1)})"
              if name in ratios else "") for name, seconds in result["epoch_s"].items()]
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches-512", type=int, default=5, help="batches timed per repeat when padding to 512")
    parser.add_argument("--examples", type=int, help="train on the first N sentences only (default: all)")
    args = parser.parse_args()
    print(f"machine: {common.machine()}", flush=True)
    print("\n".join(report(run(args.repeats, args.batches_512, args.examples))))
    print(f"load average at end {common.load_average()}")
