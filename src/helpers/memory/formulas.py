"""Closed forms from a model's config: the bytes of its parameters, and of the activations a step saves for
backward, in fp32 and under CUDA autocast (notebook 05 teaches them term by term; tests check them against
PyTorch's MemTracker and the simulated GPU)."""

from __future__ import annotations


def layer_activation_bytes(config, seq_len: int, *, attention: str = "sdpa", mask_bytes: int = 1,
                           amp: bool = False) -> int:
    """Bytes one encoder layer saves for backward per token, in fp32 or under autocast (``amp``: bf16 or fp16)."""
    h, heads, inter = config.hidden_size, config.num_attention_heads, config.intermediate_size
    b = 2 if amp else 4  # bytes of what linear layers and attention compute in; LayerNorm stays fp32
    copies = 3 if amp else 1  # autocast casts the layer's input once for each of the Q, K and V linears
    per_token = (copies * b * h  # the layer's input, as the Q, K and V linears keep it
                 + 3 * b * h  # Q, K and V, kept by attention
                 + b * h  # attention's output, kept by the next linear
                 + 4 * h + b * h  # LayerNorm 1's input (fp32), and its output as the next linear keeps it
                 + 2 * b * inter  # GELU's input and output
                 + 4 * h  # LayerNorm 2's input (fp32)
                 + 2 * mask_bytes * h  # two dropout masks
                 + 16)  # mean and 1/std of the two LayerNorms (fp32)
    if attention == "eager":  # softmax's output (fp32), dropout's output as the next matmul keeps it, its mask
        return per_token + (4 + b + mask_bytes) * heads * seq_len
    return per_token + 4 * heads  # the fused kernel: one fp32 log-sum-exp per query and head


def activation_formula(config, batch_size: int, seq_len: int, *, attention: str = "sdpa", mask_bytes: int = 1,
                       amp: bool = False) -> int:
    """Bytes ``Net``'s forward saves for backward (what MemTracker files as activations): each layer's
    ``layer_activation_bytes`` for every token, plus per layer the fused kernel's dropout seed and offset (16 bytes)
    and, under autocast, the 16-bit copies of its linear weights; outside the layers, per token the embeddings'
    LayerNorm input, mean and 1/std and dropout mask, the head's input (in fp32 the [CLS] slice keeps the whole last
    output, under autocast the head keeps a 16-bit copy of the slice and of its weight), and 8 bytes per example
    (the labels), per position and once."""
    h, inter, tokens = config.hidden_size, config.intermediate_size, batch_size * seq_len
    b = 2 if amp else 4
    per_layer = (tokens * layer_activation_bytes(config, seq_len, attention=attention, mask_bytes=mask_bytes, amp=amp)
                 + (0 if attention == "eager" else 16) + (b * (4 * h * h + 2 * h * inter) if amp else 0))
    head = b * h * batch_size + b * 2 * h if amp else 4 * h * tokens
    outside = tokens * (4 * h + 8 + mask_bytes * h) + head + 8 * batch_size + 8 * seq_len + 8
    return config.num_hidden_layers * per_layer + outside


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
