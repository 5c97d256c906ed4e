"""A bag-of-words baseline: logistic regression over MeCab words, to see where a small BERT stands.

Each sentence becomes the set of words MeCab finds in it (the same word splitter as the BERT tokenizer,
before WordPiece); a linear layer on that 0/1 vector is trained to convergence with L-BFGS. The strength
of the L2 penalty is picked on the validation split, so the test split is measured once, as for BERT.
"""

from __future__ import annotations

import torch
from torch import nn

PENALTIES = (1e-4, 1e-3, 1e-2)  # L2 strengths tried, per example


def words_of(texts: list[str], tokenizer) -> list[set[str]]:
    """The MeCab words of each text, as the tokenizer splits them before WordPiece."""
    return [set(tokenizer.word_tokenizer.tokenize(text)) for text in texts]


def bag_of_words(word_sets: list[set[str]], vocabulary: dict[str, int]) -> torch.Tensor:
    """One row per text: 1.0 where a vocabulary word occurs in it; words outside the vocabulary are dropped."""
    rows = torch.zeros(len(word_sets), len(vocabulary))
    for row, words in zip(rows, word_sets):
        row[[vocabulary[word] for word in words if word in vocabulary]] = 1.0
    return rows


def fit_logistic_regression(features: torch.Tensor, labels: torch.Tensor, penalty: float) -> nn.Linear:
    """Minimise cross-entropy + ``penalty`` * squared weights (not the bias) with full-batch L-BFGS."""
    torch.manual_seed(0)
    model = nn.Linear(features.shape[1], 2)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(features), labels) + penalty * model.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return model


def accuracy(model: nn.Linear, features: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(features).argmax(dim=1) == labels).float().mean().item()


def bag_of_words_baseline(train: list, validation: list, test: list, tokenizer) -> dict:
    """Train on ``train``, pick the penalty on ``validation``, measure ``test`` once; examples as load_split gives.

    Returns the vocabulary size, the chosen penalty and the accuracy on each split.
    """
    train_words = words_of([example.text for example in train], tokenizer)
    vocabulary = {word: index for index, word in enumerate(sorted(set().union(*train_words)))}
    splits = {"train": (train, train_words), "validation": (validation, None), "test": (test, None)}
    data = {}
    for name, (examples, word_sets) in splits.items():
        word_sets = word_sets or words_of([example.text for example in examples], tokenizer)
        data[name] = (bag_of_words(word_sets, vocabulary), torch.tensor([example.label for example in examples]))
    models = {penalty: fit_logistic_regression(*data["train"], penalty) for penalty in PENALTIES}
    penalty = max(PENALTIES, key=lambda p: accuracy(models[p], *data["validation"]))
    return {"vocabulary": len(vocabulary), "penalty": penalty,
            **{f"{name}_accuracy": accuracy(models[penalty], *data[name]) for name in splits}}
