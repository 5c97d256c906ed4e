"""Batches are padded to their longest sentence, with an attention mask that marks the padding."""

from helpers.data import Example, PadToLongest, load_split, make_loader
from helpers.models import load_tokenizer


def test_padding_to_the_longest_in_the_batch():
    tokenizer = load_tokenizer()
    short, long = Example("最高。", 1), Example("値段は高いけれど、料理も接客も素晴らしくて大満足でした。", 1)
    batch = PadToLongest(tokenizer)([short, long])
    n_long = len(tokenizer(long.text)["input_ids"])
    n_short = len(tokenizer(short.text)["input_ids"])
    assert batch["input_ids"].shape == (2, n_long) and n_long < 512
    assert batch["attention_mask"].tolist() == [[1] * n_short + [0] * (n_long - n_short), [1] * n_long]
    assert (batch["input_ids"][0, n_short:] == tokenizer.pad_token_id).all()
    assert batch["labels"].tolist() == [1, 1]
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]


def test_long_text_is_truncated_to_max_length():
    batch = PadToLongest(load_tokenizer(), max_length=16)([Example("とても良い。" * 40, 1)])
    assert batch["input_ids"].shape == (1, 16)


def test_shuffled_loader_is_fixed_by_its_seed():
    tokenizer, examples = load_tokenizer(), load_split("validation")[:40]
    first = [b["input_ids"].tolist() for b in make_loader(examples, tokenizer, 8, shuffle=True, seed=3)]
    again = [b["input_ids"].tolist() for b in make_loader(examples, tokenizer, 8, shuffle=True, seed=3)]
    other = [b["input_ids"].tolist() for b in make_loader(examples, tokenizer, 8, shuffle=True, seed=4)]
    assert first == again and first != other
    widths = [len(b[0]) for b in first]
    assert len(set(widths)) > 1  # each batch has its own width
