"""An offline stand-in for the memo's model: its shape, none of its knowledge (random weights).

``cl-tohoku/bert-base-japanese-whole-word-masking`` (v1) has hidden size 768, 12 heads, 12 layers, a
WordPiece vocabulary of 32000 over IPAdic words, and a tokenizer_config.json that names no MeCab
dictionary. The stand-in copies all of that (with fewer layers on request): its vocabulary holds the
bundled sentences' IPAdic words and characters, padded with placeholder tokens to 32000. It shows what
changes in the series with the real model, and what a step costs, without the hub.

    python -m helpers.build.memo_shape OUT_DIR [--layers N]
    BERT_MODEL=OUT_DIR make lab
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import BertConfig, BertModel
from transformers.utils import logging as transformers_logging

from helpers.data import load_split
from helpers.build.tiny_bert import build_vocab, bundled_alphabet

VOCAB_SIZE = 32000
TOKENIZER_CONFIG = {  # as the v1 models were saved, before transformers 4.46: no dictionary named
    "tokenizer_class": "BertJapaneseTokenizer",
    "word_tokenizer_type": "mecab",
    "subword_tokenizer_type": "wordpiece",
    "do_lower_case": False,
    "model_max_length": 512,
}


def memo_shaped_config(num_layers: int = 12, intermediate_size: int = 3072, vocab_size: int = VOCAB_SIZE) -> BertConfig:
    """BERT-base's configuration with the v1 vocabulary size; fewer layers or a narrower feed-forward part
    (``intermediate_size``, seen nowhere outside the layers) make it cheaper."""
    return BertConfig(vocab_size=vocab_size, hidden_size=768, num_hidden_layers=num_layers, num_attention_heads=12,
                      intermediate_size=intermediate_size, max_position_embeddings=512,
                      tokenizer_class=TOKENIZER_CONFIG["tokenizer_class"])


def build_memo_shaped_bert(out_dir: str | Path, num_layers: int = 12, intermediate_size: int = 3072,
                           seed: int = 0, pad_vocab: bool = True) -> Path:
    """Write vocab.txt, tokenizer_config.json and a randomly initialised BertModel to ``out_dir``.

    ``pad_vocab=False`` keeps only the bundled data's tokens: the placeholders are never seen in text,
    but their embeddings and Adam state cost memory and time at every step.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_vocab([example.text for example in load_split("train")], bundled_alphabet(), mecab_dic="ipadic")
    if len(vocab) > VOCAB_SIZE:
        raise ValueError(f"the bundled data gives {len(vocab)} tokens, more than the v1 vocabulary's {VOCAB_SIZE}")
    if pad_vocab:
        vocab += [f"[unused{i}]" for i in range(VOCAB_SIZE - len(vocab))]
    (out_dir / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n", encoding="utf-8")
    torch.manual_seed(seed)
    BertModel(memo_shaped_config(num_layers, intermediate_size, len(vocab))).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=12, help="encoder layers (the real model has 12)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()
    build_memo_shaped_bert(args.out_dir, args.layers, seed=args.seed)
    print(f"wrote a {args.layers}-layer, memo-shaped random BERT to {args.out_dir}")


if __name__ == "__main__":
    main()
