"""Closed forms from a model's config: the bytes of its parameters, and of the activations a step saves for
backward (notebook 05's solutions list the terms; tests check them against PyTorch's MemTracker)."""

from __future__ import annotations


def layer_activation_bytes(config, seq_len: int, *, attention: str = "sdpa", mask_bytes: int = 1) -> int:
    """Bytes one encoder layer saves for backward per token, in fp32 (notebook 05's solutions list the terms)."""
    h, heads, inter = config.hidden_size, config.num_attention_heads, config.intermediate_size
    per_token = 16 * h + 4 * h + 8 * h + 8 * inter + 4 * h + 2 * mask_bytes * h + 16
    if attention == "eager":  # the probabilities, the probabilities after dropout, and the dropout mask
        return per_token + (8 + mask_bytes) * heads * seq_len
    return per_token + 4 * heads  # the fused kernel: one fp32 log-sum-exp per query and head


def activation_formula(config, batch_size: int, seq_len: int, *, attention: str = "sdpa",
                       mask_bytes: int = 1) -> int:
    """Bytes saved for backward by ``Net``'s forward in fp32 (what MemTracker files as activations): each layer's
    ``layer_activation_bytes`` for every token (and for the fused kernel 16 bytes of dropout seed and offset per
    layer); outside the layers, per token the embeddings' LayerNorm input and dropout mask, the last layer's
    output kept by the [CLS] slice, and 8 bytes per token, per example, per position and once."""
    h, tokens = config.hidden_size, batch_size * seq_len
    per_layer = tokens * layer_activation_bytes(config, seq_len, attention=attention, mask_bytes=mask_bytes)
    seeds = 0 if attention == "eager" else 16
    outside = tokens * (8 * h + mask_bytes * h + 8) + 8 * batch_size + 8 * seq_len + 8
    return config.num_hidden_layers * (per_layer + seeds) + outside


def parameter_bytes(config, pooler: bool = True) -> int:
    """fp32 bytes of every parameter of ``Net`` (BERT, with its pooler unless ``pooler=False``, plus the 2-class
    head), counted from the config's shapes."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    embeddings = (config.vocab_size + config.max_position_embeddings + config.type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * inter + inter) + (inter * h + h) + 2 * h
    head = 2 * h + 2
    return 4 * (embeddings + layers * layer + (h * h + h if pooler else 0) + head)


def parameters(config) -> int:
    """How many parameters ``Net`` has (with its pooler), from the config's shapes."""
    return parameter_bytes(config) // 4
