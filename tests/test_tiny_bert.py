"""The bundled tiny model: deterministic to build, loadable like a hub model, no [UNK] on the bundled text."""

import filecmp

from transformers import BertJapaneseTokenizer, BertModel

from helpers.data import load_split
from helpers.models import bundled_model_dir, load_bert, load_tokenizer
from helpers.tiny_bert import build_tiny_bert, build_vocab, bundled_alphabet


def test_building_twice_gives_byte_identical_files(tmp_path):
    first = build_tiny_bert(tmp_path / "a", steps=3)
    second = build_tiny_bert(tmp_path / "b", steps=3)
    assert first == second
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer_config.json", "vocab.txt"]
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", names, shallow=False)
    assert (mismatch, errors) == ([], [])


def test_other_seed_gives_other_weights(tmp_path):
    build_tiny_bert(tmp_path / "a", steps=3, seed=0)
    build_tiny_bert(tmp_path / "b", steps=3, seed=1)
    assert filecmp.cmp(tmp_path / "a" / "vocab.txt", tmp_path / "b" / "vocab.txt", shallow=False)
    assert not filecmp.cmp(tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors", shallow=False)


def test_bundled_model_loads_with_the_real_classes():
    tokenizer, bert = load_tokenizer(), load_bert()
    assert isinstance(tokenizer, BertJapaneseTokenizer) and isinstance(bert, BertModel)
    assert bert.config.hidden_size <= 128 and bert.pooler is not None
    assert bert.config.vocab_size == len(tokenizer) == len(build_vocab([e.text for e in load_split("train")], bundled_alphabet()))


def test_vocabulary_covers_every_bundled_sentence():
    tokenizer = load_tokenizer()
    for split in ("train", "validation", "test"):
        for example in load_split(split):
            assert tokenizer.unk_token not in tokenizer.tokenize(example.text), example.text


def test_bundled_vocab_file_matches_the_builder():
    vocab = (bundled_model_dir() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert vocab == build_vocab([e.text for e in load_split("train")], bundled_alphabet())
