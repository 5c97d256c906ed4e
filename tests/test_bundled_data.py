"""The bundled data set: large enough, balanced, and no sentence leaks across splits, exactly or nearly."""

import itertools
import re
import unicodedata

import pytest

from helpers.data import LABELS, SPLITS, bundled_data_dir, load_split

NEAR = 0.5  # Jaccard similarity of character bigrams above which two sentences count as near duplicates


def bigrams(text):
    text = "".join(c for c in unicodedata.normalize("NFKC", text) if c not in "。、!?,. ")
    return frozenset(text[i:i + 2] for i in range(len(text) - 1)) or frozenset([text])


def test_size_and_balance():
    sizes = {split: len(load_split(split)) for split in SPLITS}
    assert sum(sizes.values()) >= 1000
    for split in SPLITS:
        counts = [sum(e.label == i for e in load_split(split)) for i in range(len(LABELS))]
        assert counts[0] == counts[1], (split, counts)


def test_no_exact_duplicates_anywhere():
    texts = [unicodedata.normalize("NFKC", e.text) for split in SPLITS for e in load_split(split)]
    assert len(texts) == len(set(texts))


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(SPLITS, 2)))
def test_no_near_duplicates_across_splits(a, b):
    grams_b = [(e.text, bigrams(e.text)) for e in load_split(b)]
    for example in load_split(a):
        mine = bigrams(example.text)
        for text, other in grams_b:
            assert len(mine & other) / len(mine | other) < NEAR, (example.text, text)


def test_data_card_states_the_sizes():
    card = (bundled_data_dir() / "DATA_CARD.md").read_text(encoding="utf-8")
    for split in SPLITS:
        assert f"| {split} | {len(load_split(split))} |" in card


def test_max_examples_takes_the_first_n_of_each_split(monkeypatch):
    full = {split: load_split(split) for split in SPLITS}
    monkeypatch.setenv("HELPERS_MAX_EXAMPLES", "5")
    assert all(load_split(split) == full[split][:5] for split in SPLITS)
    monkeypatch.setenv("HELPERS_MAX_EXAMPLES", str(10**6))
    assert all(load_split(split) == full[split] for split in SPLITS)
    for bad in ("0", "-3", "ten", "2.5"):
        monkeypatch.setenv("HELPERS_MAX_EXAMPLES", bad)
        with pytest.raises(ValueError, match=rf"^HELPERS_MAX_EXAMPLES='{re.escape(bad)}': expected a whole number"):
            load_split("train")
