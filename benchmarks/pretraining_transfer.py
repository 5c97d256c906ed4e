"""Does a model's pre-training help? Notebook 02's recipe on each model, side by side in one run.

For each model: the pre-trained body with the two learning rates of ``learning_rates_for``, the same
architecture and vocabulary from random initialisation, the pre-trained body with one shared rate (the
head's), and with a body rate five times smaller (what protects a well pre-trained body); beside the
bag-of-words baseline (helpers.baseline; exercise 3 of notebook 02), alone and with the mean of the model's
input word embeddings over the sentence's tokens (standardised) appended: for a model whose embeddings are word
vectors, the fair baseline.
Validation and test accuracy after 2 epochs, median (and range) over
seeds: the seed sets the head's and the random body's initial weights and the batch order, and moves accuracy
by a few points on these 522-sentence splits.

    python benchmarks/pretraining_transfer.py [MODEL_DIR ...] [--seeds 3]    (default: the bundled model)

The model card beside the bundled model quotes its printout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
from pathlib import Path

import torch

import common  # noqa: F401  (sets the quiet, offline environment before transformers is imported)
from transformers import BertModel, get_linear_schedule_with_warmup, set_seed

from helpers.baseline import PENALTIES, accuracy, bag_of_words, bag_of_words_baseline, fit_logistic_regression, words_of
from helpers.data import load_split, make_loader
from helpers.models import bundled_model_dir, load_tokenizer
from helpers.net import Net
from helpers.optim import learning_rates_for, two_lr_adam
from helpers.train import evaluate, fit

EPOCHS = 2
RUNS = (  # (label, initialise the body from random weights, body rate as a multiple of learning_rates_for's)
    ("pre-trained, two rates", False, 1.0),
    ("random init, two rates", True, 1.0),
    ("pre-trained, one shared rate", False, 2.0),
    ("pre-trained, body rate / 5", False, 0.2),
)


def fine_tune(model: str, tokenizer, from_scratch: bool, body_factor: float, seed: int) -> dict:
    train = make_loader(load_split("train"), tokenizer, batch_size=32, shuffle=True, seed=seed)
    val = make_loader(load_split("validation"), tokenizer, batch_size=64)
    test = make_loader(load_split("test"), tokenizer, batch_size=64)
    set_seed(seed)
    net = Net(model)
    if from_scratch:
        net.bert = BertModel(net.bert.config)
    body_lr, head_lr = learning_rates_for(net.bert.config)
    body_lr *= body_factor
    optimizer = two_lr_adam(net, body_lr, head_lr)
    total = EPOCHS * len(train)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=total // 10, num_training_steps=total)
    with contextlib.redirect_stdout(io.StringIO()):  # fit's per-epoch lines; the table says it all
        history = fit(net, train, val, optimizer, scheduler, epochs=EPOCHS)
    return {"body_lr": body_lr, "head_lr": head_lr, "validation": history[-1]["val_accuracy"],
            "test": evaluate(net, test)["accuracy"]}


def bag_of_words_and_mean_embedding(model: str, tokenizer) -> dict:
    """Logistic regression on [bag of words | mean word embedding of the sentence's tokens, standardised on train];
    the penalty picked on validation, test measured once, as ``bag_of_words_baseline`` does."""
    embeddings = BertModel.from_pretrained(model).embeddings.word_embeddings.weight.detach()
    splits = {name: load_split(name) for name in ("train", "validation", "test")}
    words = {name: words_of([example.text for example in examples], tokenizer) for name, examples in splits.items()}
    vocabulary = {word: index for index, word in enumerate(sorted(set().union(*words["train"])))}
    means = {name: torch.stack([embeddings[tokenizer(example.text, add_special_tokens=False)["input_ids"]].mean(0)
                                for example in examples]) for name, examples in splits.items()}
    centre, scale = means["train"].mean(0), means["train"].std(0)
    data = {name: (torch.cat([bag_of_words(words[name], vocabulary), (means[name] - centre) / scale], dim=1),
                   torch.tensor([example.label for example in examples])) for name, examples in splits.items()}
    models = {penalty: fit_logistic_regression(*data["train"], penalty) for penalty in PENALTIES}
    best = max(PENALTIES, key=lambda penalty: accuracy(models[penalty], *data["validation"]))
    return {name: accuracy(models[best], *data[name]) for name in ("validation", "test")}


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=[str(bundled_model_dir())])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for model in args.models:
        tokenizer = load_tokenizer(model)
        for label, from_scratch, body_factor in RUNS:
            results = [fine_tune(model, tokenizer, from_scratch, body_factor, seed) for seed in range(args.seeds)]
            rates = f"body {results[0]['body_lr']:g}, head {results[0]['head_lr']:g}"
            rows.append((Path(model).name, f"{label} ({rates})", summary([r["validation"] for r in results]),
                         summary([r["test"] for r in results])))
    baseline = bag_of_words_baseline(load_split("train"), load_split("validation"), load_split("test"), tokenizer)
    rows.append(("-", "bag of words, logistic regression", f"{baseline['validation_accuracy']:.3f}",
                 f"{baseline['test_accuracy']:.3f}"))
    for model in args.models:
        stronger = bag_of_words_and_mean_embedding(model, load_tokenizer(model))
        rows.append((Path(model).name, "bag of words + mean word embedding", f"{stronger['validation']:.3f}",
                     f"{stronger['test']:.3f}"))
    width = max(len(row[1]) for row in rows)
    print(f"notebook 02's recipe: {EPOCHS} epochs, batch 32, linear warm-up and decay; "
          f"median (min-max) of {args.seeds} seeds")
    print(f"{'':<{width}}  {'validation':<19}  {'test':<19}  model")
    for model, label, validation, test in rows:
        print(f"{label:<{width}}  {validation:<19}  {test:<19}  {model}")


if __name__ == "__main__":
    main()
