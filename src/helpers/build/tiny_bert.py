"""Build the bundled tiny Japanese BERT: a WordPiece vocabulary and word embeddings from chiVe's vectors.

It uses the real classes (BertJapaneseTokenizer with MeCab + unidic-lite, BertModel), so every line of
the series runs unchanged with the full-size model; it is only far smaller and has read far less text.
Building is deterministic: the same inputs, seed and steps give byte-identical files.

    python -m helpers.build.tiny_bert OUT_DIR [--vectors chive|none] [--steps N --corpus FILE ...]

The bundled model (the defaults): vocabulary from the train split, word embeddings from chiVe (``helpers.build.chive``,
the pinned ja-ginza wheel), the other layers random, no masked-LM pre-training; the model card beside it
reports what masked-LM pre-training (``--steps``, with ``--corpus`` from ``python -m helpers.build.corpus``) changed.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import unicodedata
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertJapaneseTokenizer, BertModel
from transformers.models.bert_japanese.tokenization_bert_japanese import MecabTokenizer
from transformers.utils import logging as transformers_logging

from helpers.build import chive
from helpers.data import SPLITS, load_split

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MECAB_DIC = "unidic_lite"
MIN_WORD_COUNT = 2
UNIDIC_LEMMA = 7  # position of the lemma (語彙素) in a UniDic entry's features
REVIEW_SHARE = 0.25  # of the pre-training sentences, when a broader corpus joins the train split


def build_vocab(texts: list[str], alphabet: str = "", mecab_dic: str = MECAB_DIC,
                max_words: int | None = None) -> list[str]:
    """Special tokens, then MeCab words seen at least twice in ``texts`` (most frequent first, at most
    ``max_words``), then every character of ``texts`` and ``alphabet``, word-initial and as a ``##``
    continuation, so that no text made of those characters falls back to [UNK]."""
    mecab = MecabTokenizer(mecab_dic=mecab_dic)
    words = Counter(word for text in texts for word in mecab.tokenize(text))
    frequent = sorted((w for w, n in words.items() if n >= MIN_WORD_COUNT), key=lambda w: (-words[w], w))
    frequent = frequent[:max_words]
    chars = sorted({char for word in words for char in word} | set(alphabet))
    vocab = SPECIAL_TOKENS + frequent
    known = set(vocab)
    vocab += [c for c in chars if c not in known] + [f"##{c}" for c in chars]
    return vocab


def bundled_alphabet() -> str:
    """Every character of the bundled data set, all splits."""
    texts = (unicodedata.normalize("NFKC", example.text) for split in SPLITS for example in load_split(split))
    return "".join(sorted({char for text in texts for char in text}))


def make_tokenizer(vocab: list[str], directory: Path) -> BertJapaneseTokenizer:
    vocab_file = directory / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return BertJapaneseTokenizer(
        str(vocab_file),
        word_tokenizer_type="mecab",
        subword_tokenizer_type="wordpiece",
        mecab_kwargs={"mecab_dic": MECAB_DIC},
        model_max_length=128,
    )


def tiny_config(vocab_size: int, hidden_size: int = 128, layers: int = 4) -> BertConfig:
    """BERT-base's proportions, scaled down: heads of 32 dimensions, a feed-forward layer 4 times as wide."""
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 32,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=128,
    )


def mask_tokens(input_ids, special_mask, mask_id, vocab_size, generator, probability=0.15, continuation=None):
    """BERT's masking: pick 15% of the tokens; replace 80% of those by [MASK], 10% by a random token.

    With ``continuation`` (True where a token is a ``##`` piece), whole-word masking as the Tohoku models
    use: a word's pieces are picked together, by the draw at its first piece.
    """
    labels = input_ids.clone()
    chosen = (torch.rand(input_ids.shape, generator=generator) < probability) & ~special_mask
    if continuation is not None:
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        word_start = torch.where(continuation, 0, positions).cummax(dim=1).values
        chosen = chosen.gather(1, word_start) & ~special_mask
    labels[~chosen] = -100
    inputs = input_ids.clone()
    roll = torch.rand(input_ids.shape, generator=generator)
    inputs[chosen & (roll < 0.8)] = mask_id
    random_tokens = torch.randint(len(SPECIAL_TOKENS), vocab_size, input_ids.shape, generator=generator)
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[swap] = random_tokens[swap]
    return inputs, labels


def pretrain(model: BertForMaskedLM, tokenizer, texts: list[str], steps: int, seed: int, batch_size: int = 32,
             whole_words: bool = False, embedding_rate: float = 1.0):
    """Masked-LM training on ``texts`` with AdamW and a linear warmup/decay; returns the loss per step.

    ``embedding_rate`` scales the word embeddings' rate (0 freezes them; they are tied to the output layer)."""
    generator = torch.Generator().manual_seed(seed)
    encoded = tokenizer(texts, truncation=True, max_length=64)["input_ids"]
    pieces = torch.tensor([token.startswith("##") for token in tokenizer.convert_ids_to_tokens(range(len(tokenizer)))])
    words = model.bert.embeddings.word_embeddings.weight
    rest = [parameter for parameter in model.parameters() if parameter is not words]
    optimizer = torch.optim.AdamW([{"params": rest, "lr": 1e-3}, {"params": [words], "lr": 1e-3 * embedding_rate}],
                                  weight_decay=0.01)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, max(0.0, (steps - step) / max(1, steps - warmup))))
    model.train()
    losses = []
    for _ in range(steps):
        picks = torch.randint(len(encoded), (batch_size,), generator=generator).tolist()
        batch = tokenizer.pad({"input_ids": [encoded[i] for i in picks]}, return_tensors="pt")
        special = torch.isin(batch["input_ids"], torch.tensor(tokenizer.all_special_ids))
        continuation = pieces[batch["input_ids"]] if whole_words else None
        inputs, labels = mask_tokens(batch["input_ids"], special, tokenizer.mask_token_id, len(tokenizer), generator,
                                     continuation=continuation)
        hidden = model.bert(input_ids=inputs, attention_mask=batch["attention_mask"]).last_hidden_state
        chosen = labels != -100  # predict only the chosen tokens: the full-vocabulary head is the costly part
        loss = nn.functional.cross_entropy(model.cls(hidden[chosen]), labels[chosen])
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def vector_for(token: str, vectors, lemma_of) -> tuple[np.ndarray | None, str]:
    """A vocabulary entry's word vector and where it came from: the word itself (a ``##x`` piece takes x's),
    its NFKC form, its lower case, then the UniDic lemma MeCab gives it (開け → 開ける); else none."""
    word = token.removeprefix("##")
    nfkc = unicodedata.normalize("NFKC", word)
    for source, candidate in (("exact", word), ("nfkc", nfkc), ("lower case", nfkc.lower()),
                              ("lemma", lemma_of(word))):
        vector = vectors.get(candidate) if candidate else None
        if vector is not None:
            return vector, source
    return None, "none"


def unidic_lemma(mecab_dic: str = MECAB_DIC):
    """word -> its UniDic lemma when MeCab reads it as one word (else None), with the tokenizer's dictionary."""
    tagger = MecabTokenizer(mecab_dic=mecab_dic).mecab  # fugashi's GenericTagger: features as a plain tuple

    def lemma_of(word: str) -> str | None:
        words = tagger(word)
        features = words[0].feature if len(words) == 1 else ()
        return features[UNIDIC_LEMMA] if len(features) > UNIDIC_LEMMA else None

    return lemma_of


def project(found: np.ndarray, width: int, std: float = 0.02) -> np.ndarray:
    """Principal components: the ``width`` directions of largest variance of the centred vectors (sign fixed so
    each direction's largest coordinate is positive), scaled to BERT's initial standard deviation."""
    centred = found.astype(np.float64) - found.mean(axis=0, dtype=np.float64)
    _, _, directions = np.linalg.svd(centred, full_matrices=False)
    directions = directions[:width]
    directions *= np.sign(directions[np.arange(width), np.abs(directions).argmax(axis=1)])[:, None]
    projected = centred @ directions.T
    return (projected * (std / projected.std())).astype(np.float32)


def initialise_word_embeddings(model: BertForMaskedLM, vocab: list[str], vectors, lemma_of) -> Counter:
    """Overwrite the word-embedding rows of the vocabulary entries that have a word vector with those vectors,
    projected to the hidden size; special tokens and entries without one keep their random initial rows.
    Returns how many entries each source covered."""
    sources, rows, found = Counter(), [], []
    for row, token in enumerate(vocab):
        vector, source = (None, "special") if token in SPECIAL_TOKENS else vector_for(token, vectors, lemma_of)
        sources[source] += 1
        if vector is not None:
            rows.append(row)
            found.append(vector)
    embeddings = model.bert.embeddings.word_embeddings.weight
    with torch.no_grad():
        embeddings[rows] = torch.from_numpy(project(np.stack(found), embeddings.shape[1]))
    return sources


def body_only(model: BertForMaskedLM) -> BertModel:
    """The pre-trained encoder as a BertModel with a (seeded, untrained) pooler, like a hub checkpoint's body,
    so that ``BertModel.from_pretrained`` finds every weight it expects."""
    body = BertModel(model.config)
    missing, unexpected = body.load_state_dict(model.bert.state_dict(), strict=False)
    if unexpected or not all(key.startswith("pooler.") for key in missing):
        raise RuntimeError(f"body_only: the masked-LM body does not fit BertModel beyond its pooler: missing "
                           f"{missing}, unexpected {unexpected}")
    return body


def build_tiny_bert(out_dir: str | Path, steps: int = 400, seed: int = 0, corpus: list[str] = (),
                    whole_words: bool = False, max_words: int | None = None, batch_size: int = 32,
                    hidden_size: int = 128, layers: int = 4, vectors=None, embedding_rate: float = 1.0,
                    corpus_words: bool = False) -> tuple[list[float], Counter]:
    """Write tokenizer and BertModel weights to ``out_dir``; return the masked-LM loss per step and how many
    vocabulary entries each source of word vectors covered (empty without ``vectors``).

    Words and pre-training come from the train split; the characters of the validation and test splits join
    the alphabet (no labels are read), as a real vocabulary covers far more characters. ``vectors`` (e.g.
    ``helpers.build.chive.Vectors``) initialise the word embeddings before pre-training. ``corpus`` sentences join
    pre-training (and, with ``corpus_words``, the vocabulary); the train split is repeated so that it stays
    about a quarter of what pre-training reads. ``steps=0`` skips pre-training.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    reviews = [example.text for example in load_split("train")]
    repeats = max(1, round(REVIEW_SHARE * len(corpus) / ((1 - REVIEW_SHARE) * len(reviews))))
    texts = reviews * repeats + list(corpus)
    vocab = build_vocab(reviews + list(corpus) if corpus_words else reviews, bundled_alphabet(), max_words=max_words)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = make_tokenizer(vocab, Path(scratch))
        model = BertForMaskedLM(tiny_config(len(tokenizer), hidden_size, layers))
        sources = Counter() if vectors is None else initialise_word_embeddings(model, vocab, vectors, unidic_lemma())
        losses = pretrain(model, tokenizer, texts, steps, seed, batch_size, whole_words, embedding_rate) if steps else []
    tokenizer.save_pretrained(out_dir)
    body_only(model).save_pretrained(out_dir)
    return losses, sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--vectors", choices=("chive", "none"), default="chive",
                        help="initial word embeddings: chiVe's (from the pinned ja-ginza wheel) or random")
    parser.add_argument("--cache", type=Path, default=chive.CACHE, help="where the ja-ginza wheel is downloaded")
    parser.add_argument("--steps", type=int, default=0, help="masked-LM steps after the embeddings (0: none)")
    parser.add_argument("--embedding-rate", type=float, default=1.0,
                        help="the word embeddings' pre-training rate as a multiple of the body's (0 freezes them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", type=Path, help="more pre-training text, one sentence per line")
    parser.add_argument("--corpus-words", action="store_true", help="add the corpus's words to the vocabulary")
    parser.add_argument("--whole-word-masking", action="store_true")
    parser.add_argument("--max-words", type=int, help="cap on the vocabulary's whole words")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if args.steps < 0:
        parser.error(f"--steps {args.steps}: the number of pre-training steps cannot be negative")
    if args.hidden_size % 32:
        parser.error(f"--hidden-size {args.hidden_size} is not a multiple of 32 (each attention head has 32)")
    transformers_logging.disable_progress_bar()
    vectors = chive.Vectors.from_wheel(chive.fetch_wheel(args.cache)) if args.vectors == "chive" else None
    corpus = args.corpus.read_text(encoding="utf-8").splitlines() if args.corpus else []
    losses, sources = build_tiny_bert(args.out_dir, args.steps, args.seed, corpus, args.whole_word_masking,
                                      args.max_words, args.batch_size, args.hidden_size, args.layers, vectors,
                                      args.embedding_rate, args.corpus_words)
    if sources:
        print("word vectors per vocabulary entry: " + ", ".join(f"{name} {n:,}" for name, n in sources.most_common()))
    if losses:
        first, last = (sum(part) / len(part) for part in (losses[:50], losses[-50:]))
        print(f"masked-LM loss {first:.2f} -> {last:.2f} over {args.steps} steps "
              f"(perplexity {math.exp(first):.0f} -> {math.exp(last):.0f})")


if __name__ == "__main__":
    main()
