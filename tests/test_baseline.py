import torch

from helpers.baseline import PENALTIES, accuracy, bag_of_words, bag_of_words_baseline, fit_logistic_regression
from helpers.data import Example


class SpaceSplitter:
    """Stands in for BertJapaneseTokenizer: its word_tokenizer splits on spaces."""

    class word_tokenizer:
        @staticmethod
        def tokenize(text):
            return text.split()


def test_bag_of_words_marks_each_known_word_once_and_drops_unknown_ones():
    rows = bag_of_words([{"a", "c"}, {"b", "unknown"}, set()], {"a": 0, "b": 1, "c": 2})
    assert rows.tolist() == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_logistic_regression_separates_separable_data():
    features = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    labels = torch.tensor([1, 1, 0, 0])
    assert accuracy(fit_logistic_regression(features, labels, 1e-3), features, labels) == 1.0


def test_a_larger_penalty_shrinks_the_weights():
    features = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    labels = torch.tensor([1, 1, 0, 0])
    small, large = (fit_logistic_regression(features, labels, p).weight.norm() for p in (1e-4, 1e-1))
    assert large < small


def test_baseline_learns_the_sentiment_words_and_reports_each_split():
    def examples(texts_and_labels):
        return [Example(text, label) for text, label in texts_and_labels]

    train = examples([("good food", 1), ("good room", 1), ("bad food", 0), ("bad room", 0)] * 3)
    validation = examples([("good view", 1), ("bad view", 0)])
    test = examples([("good service", 1), ("bad service", 0), ("good", 1), ("bad", 0)])
    result = bag_of_words_baseline(train, validation, test, SpaceSplitter())
    assert result["vocabulary"] == 4  # good, bad, food, room: words only in validation or test are not features
    assert result["penalty"] in PENALTIES
    assert (result["train_accuracy"], result["validation_accuracy"], result["test_accuracy"]) == (1.0, 1.0, 1.0)
