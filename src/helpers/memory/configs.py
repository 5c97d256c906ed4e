"""The BERT shapes the predictions are made for, as ``BertConfig`` objects (no weights, no download)."""

from __future__ import annotations


def bert_base_config(num_hidden_layers: int = 12, **overrides):
    """The memo's model, ``bert-base-japanese-whole-word-masking`` (v1): hidden 768, 12 layers, vocab 32000."""
    from transformers import BertConfig

    settings = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=num_hidden_layers, num_attention_heads=12,
                    intermediate_size=3072, max_position_embeddings=512, use_cache=False)
    return BertConfig(**(settings | overrides))


def bert_large_config(num_hidden_layers: int = 24):
    """BERT-large's shape with the v1 vocabulary: hidden 1024, 24 layers, 16 heads (about 336 M parameters)."""
    return bert_base_config(num_hidden_layers, hidden_size=1024, num_attention_heads=16, intermediate_size=4096)


def encoder_1b_config(num_hidden_layers: int = 18):
    """A BERT-shaped encoder of about a billion parameters: hidden 2048, 18 layers, 16 heads."""
    return bert_base_config(num_hidden_layers, hidden_size=2048, num_attention_heads=16, intermediate_size=8192)


MODELS = {"BERT-base": bert_base_config, "BERT-large": bert_large_config, "1B encoder": encoder_1b_config}
"""The models notebook 08 compares under DDP and FSDP2."""


def bundled_config():
    """The bundled tiny model's config (4 layers, hidden 128): small enough to trace on real tensors too."""
    from transformers import BertConfig

    from helpers.models import bundled_model_dir

    return BertConfig.from_pretrained(bundled_model_dir())
