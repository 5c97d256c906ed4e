"""Build the bundled tiny Japanese BERT: a WordPiece vocabulary and a short masked-LM pre-training.

It uses the real classes (BertJapaneseTokenizer with MeCab + unidic-lite, BertModel), so every line of
the series runs unchanged with the full-size model; it is only far smaller and has read far less text.
Building is deterministic: the same corpus, seed and steps give byte-identical files.

    python -m helpers.tiny_bert OUT_DIR [--steps N]

The bundled model reads the train split only. ``--corpus FILE`` (one sentence per line, e.g. from
``python -m helpers.corpus``) adds broader text to the vocabulary and to pre-training; the model card beside
the bundled model reports what that changed.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import unicodedata
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertJapaneseTokenizer, BertModel
from transformers.models.bert_japanese.tokenization_bert_japanese import MecabTokenizer
from transformers.utils import logging as transformers_logging

from helpers.data import SPLITS, load_split

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MECAB_DIC = "unidic_lite"
MIN_WORD_COUNT = 2
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
             whole_words: bool = False):
    """Masked-LM training on ``texts`` with AdamW and a linear warmup/decay; returns the loss per step."""
    generator = torch.Generator().manual_seed(seed)
    encoded = tokenizer(texts, truncation=True, max_length=64)["input_ids"]
    pieces = torch.tensor([token.startswith("##") for token in tokenizer.convert_ids_to_tokens(range(len(tokenizer)))])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
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


def body_only(model: BertForMaskedLM) -> BertModel:
    """The pre-trained encoder as a BertModel with a (seeded, untrained) pooler, like a hub checkpoint's body,
    so that ``BertModel.from_pretrained`` finds every weight it expects."""
    body = BertModel(model.config)
    missing, unexpected = body.load_state_dict(model.bert.state_dict(), strict=False)
    assert not unexpected and all(key.startswith("pooler.") for key in missing), (missing, unexpected)
    return body


def build_tiny_bert(out_dir: str | Path, steps: int = 400, seed: int = 0, corpus: list[str] = (),
                    whole_words: bool = False, max_words: int | None = None, batch_size: int = 32,
                    hidden_size: int = 128, layers: int = 4) -> list[float]:
    """Write tokenizer and BertModel weights to ``out_dir``.

    Words and pre-training come from the train split only; the characters of the validation and test
    splits join the alphabet (no labels are read), as a real vocabulary covers far more characters.
    ``corpus`` sentences join both; the train split is repeated so that it stays about a quarter of what
    pre-training reads.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    reviews = [example.text for example in load_split("train")]
    repeats = max(1, round(REVIEW_SHARE * len(corpus) / ((1 - REVIEW_SHARE) * len(reviews))))
    texts = reviews * repeats + list(corpus)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = make_tokenizer(build_vocab(reviews + list(corpus), bundled_alphabet(), max_words=max_words),
                                   Path(scratch))
        model = BertForMaskedLM(tiny_config(len(tokenizer), hidden_size, layers))
        losses = pretrain(model, tokenizer, texts, steps, seed, batch_size, whole_words)
    tokenizer.save_pretrained(out_dir)
    body_only(model).save_pretrained(out_dir)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", type=Path, help="more pre-training text, one sentence per line")
    parser.add_argument("--whole-word-masking", action="store_true")
    parser.add_argument("--max-words", type=int, help="cap on the vocabulary's whole words")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: pre-training needs at least one step")
    if args.hidden_size % 32:
        parser.error(f"--hidden-size {args.hidden_size} is not a multiple of 32 (each attention head has 32)")
    transformers_logging.disable_progress_bar()
    corpus = args.corpus.read_text(encoding="utf-8").splitlines() if args.corpus else []
    losses = build_tiny_bert(args.out_dir, args.steps, args.seed, corpus, args.whole_word_masking, args.max_words,
                             args.batch_size, args.hidden_size, args.layers)
    first, last = (sum(part) / len(part) for part in (losses[:50], losses[-50:]))
    print(f"masked-LM loss {first:.2f} -> {last:.2f} over {args.steps} steps "
          f"(perplexity {math.exp(first):.0f} -> {math.exp(last):.0f})")


if __name__ == "__main__":
    main()
