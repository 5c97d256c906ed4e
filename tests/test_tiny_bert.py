"""The bundled tiny model: deterministic to build, loadable like a hub model, no [UNK] on the bundled text."""

import filecmp
import subprocess
import sys
from types import SimpleNamespace

import torch

from transformers import BertJapaneseTokenizer, BertModel

from helpers.data import load_split
from helpers.models import bundled_model_dir, load_bert, load_tokenizer
from helpers.build import chive
from helpers.build.tiny_bert import SPECIAL_TOKENS, build_tiny_bert, build_vocab, bundled_alphabet, unidic_lemma, vector_for


class FakeVectors:
    """A stand-in for chiVe: a fixed pseudo-random 300-dimensional vector for every word of one or two characters."""

    def get(self, word):
        import numpy as np

        if len(word) > 2:
            return None
        return np.random.default_rng(int.from_bytes(word.encode("utf-8"), "little")).standard_normal(300)


def test_building_twice_gives_byte_identical_files(tmp_path):
    first = build_tiny_bert(tmp_path / "a", steps=3, vectors=FakeVectors())
    second = build_tiny_bert(tmp_path / "b", steps=3, vectors=FakeVectors())
    assert first == second and len(first[0]) == 3 and first[1]["exact"] > 0
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
    """Drift: the committed vocab.txt against what the builder makes from the bundled sentences now."""
    vocab = (bundled_model_dir() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert vocab == build_vocab([e.text for e in load_split("train")], bundled_alphabet())


def test_whole_word_masking_picks_every_piece_of_a_word_together():
    from helpers.build.tiny_bert import mask_tokens

    # [CLS] w ##x ##y w ##z w [SEP], many rows: a word's pieces are chosen together or not at all.
    ids = torch.tensor([[2, 10, 11, 12, 13, 14, 15, 3]] * 400)
    special = (ids == 2) | (ids == 3)
    continuation = torch.tensor([[False, False, True, True, False, True, False, False]] * 400)
    generator = torch.Generator().manual_seed(0)
    _, labels = mask_tokens(ids, special, 4, 20, generator, continuation=continuation)
    chosen = labels != -100
    assert not chosen[:, [0, 7]].any()
    assert torch.equal(chosen[:, 1], chosen[:, 2]) and torch.equal(chosen[:, 1], chosen[:, 3])
    assert torch.equal(chosen[:, 4], chosen[:, 5])
    assert 0.08 < chosen[:, 1].float().mean() < 0.22  # words, not pieces, are drawn at 15 %
    _, token_level = mask_tokens(ids, special, 4, 20, torch.Generator().manual_seed(0))
    assert not torch.equal(token_level[:, 1] != -100, token_level[:, 2] != -100)


def test_a_broader_corpus_joins_vocabulary_and_pretraining(tmp_path):
    corpus = ["このコマンドはファイルの一覧を表示します。", "設定ファイルを編集してから再起動します。"] * 3
    build_tiny_bert(tmp_path / "m", steps=2, corpus=corpus, whole_words=True, corpus_words=True)
    vocab = (tmp_path / "m" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert "コマンド" in vocab
    assert "コマンド" not in (bundled_model_dir() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    build_tiny_bert(tmp_path / "n", steps=2, corpus=corpus)  # pre-training text only: the vocabulary stays
    assert filecmp.cmp(tmp_path / "n" / "vocab.txt", bundled_model_dir() / "vocab.txt", shallow=False)


def test_max_words_keeps_the_most_frequent_words():
    texts = [e.text for e in load_split("train")]
    full, capped = build_vocab(texts), build_vocab(texts, max_words=100)
    assert capped[:105] == full[:105]
    assert all(len(token.removeprefix("##")) == 1 for token in capped[105:])  # then characters only
    assert any(len(token) > 1 and not token.startswith("##") for token in full[105:])


def test_size_options_keep_bert_base_proportions(tmp_path):
    build_tiny_bert(tmp_path / "m", steps=1, hidden_size=64, layers=1)
    config = BertModel.from_pretrained(tmp_path / "m").config
    assert (config.hidden_size, config.num_hidden_layers) == (64, 1)
    assert (config.num_attention_heads, config.intermediate_size) == (2, 256)


def test_a_width_the_heads_cannot_split_is_refused_before_building(tmp_path):
    result = subprocess.run([sys.executable, "-m", "helpers.build.tiny_bert", str(tmp_path / "m"), "--hidden-size", "100",
                             "--cache", str(tmp_path / "cache")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "--hidden-size 100 is not a multiple of 32" in result.stderr  # before any download or build
    assert not (tmp_path / "m").exists()


def test_model_card_states_the_bundled_model_size():
    """Drift: the figures the model card states against the committed model."""
    card = (bundled_model_dir() / "MODEL_CARD.md").read_text(encoding="utf-8")
    bert, tokenizer = load_bert(), load_tokenizer()
    config = bert.config
    assert f"{config.num_hidden_layers}-layer BERT (hidden size {config.hidden_size}" in card
    assert f"{sum(p.numel() for p in bert.parameters()):,} parameters" in card
    assert f"WordPiece; {len(tokenizer):,} tokens" in card


def test_frozen_word_embeddings_do_not_move_in_pretraining(tmp_path):
    build_tiny_bert(tmp_path / "a", steps=0, vectors=FakeVectors())
    build_tiny_bert(tmp_path / "b", steps=2, vectors=FakeVectors(), embedding_rate=0.0)
    a, b = (BertModel.from_pretrained(tmp_path / name) for name in "ab")
    assert torch.equal(a.embeddings.word_embeddings.weight, b.embeddings.word_embeddings.weight)
    assert not torch.equal(a.encoder.layer[0].attention.self.query.weight, b.encoder.layer[0].attention.self.query.weight)


def test_word_vectors_replace_the_rows_they_cover_at_bert_scale(tmp_path):
    build_tiny_bert(tmp_path / "random", steps=0)
    build_tiny_bert(tmp_path / "vectors", steps=0, vectors=FakeVectors())
    vocab = (tmp_path / "random" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    random, initialised = (BertModel.from_pretrained(tmp_path / name).embeddings.word_embeddings.weight.detach()
                           for name in ("random", "vectors"))
    lemma_of = unidic_lemma()
    covered = torch.tensor([t not in SPECIAL_TOKENS and vector_for(t, FakeVectors(), lemma_of)[0] is not None
                            for t in vocab])
    assert 0 < covered.sum() < len(vocab) - len(SPECIAL_TOKENS)
    assert torch.equal(random[~covered], initialised[~covered])  # special tokens and uncovered words keep theirs
    assert not (random[covered] == initialised[covered]).all(dim=1).any()  # every covered row replaced
    assert abs(initialised[covered].std().item() - 0.02) < 1e-4
    piece, word = vocab.index("##映"), vocab.index("映")  # a piece takes its character's vector
    assert torch.equal(initialised[piece], initialised[word])


def test_vector_fallbacks_in_order():
    import numpy as np

    vectors = {"ａ": None, "a": np.ones(3), "開ける": np.zeros(3)}
    lemmas = {"開け": "開ける"}
    lookup = SimpleNamespace(get=vectors.get)
    assert vector_for("##a", lookup, lemmas.get)[1] == "exact"
    assert vector_for("ａ", lookup, lemmas.get)[1] == "nfkc"
    assert vector_for("A", lookup, lemmas.get)[1] == "lower case"
    assert vector_for("開け", lookup, lemmas.get)[1] == "lemma"
    assert vector_for("閉め", lookup, lemmas.get) == (None, "none")
    assert unidic_lemma()("開け") == "開ける"


def test_committed_word_embeddings_carry_chive_meanings():
    tokenizer = load_tokenizer()
    weights = torch.nn.functional.normalize(load_bert().embeddings.word_embeddings.weight.detach(), dim=1)

    def nearest(word, k=6):
        index = tokenizer.convert_tokens_to_ids(word)
        return set(tokenizer.convert_ids_to_tokens((weights @ weights[index]).topk(k).indices.tolist()))

    assert "おいしい" in nearest("美味しい") and "悪い" in nearest("最悪") and "値段" in nearest("安い")


def test_notice_and_card_credit_chive():
    notice = (bundled_model_dir() / "NOTICE").read_text(encoding="utf-8")
    card = (bundled_model_dir() / "MODEL_CARD.md").read_text(encoding="utf-8")
    for text in (notice, card):
        assert "chiVe" in text and "Apache License, Version 2.0" in text and "ja-ginza==5.3.0" in text
    assert chive.WHEEL_SHA256 in card
