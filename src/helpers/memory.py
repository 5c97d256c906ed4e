"""Predict what each GPU holds during one fine-tuning step: one device, DataParallel, DDP, and the levers.

The numbers come from PyTorch's tracker (``helpers.memtrace``) run on fake tensors; the closed-form
``activation_formula`` only explains them (tests check that the two agree). Each GPU's figure is the
highest point of its step, split by category.
"""

from __future__ import annotations

import torch

from helpers.memtrace import ORDER, StepMemory, trace_fake

STRATEGIES = ("single", "dataparallel", "ddp")
_traces: dict[tuple, StepMemory] = {}
# trace_fake's defaults, so a question asked with and without them is recognised as the same one
TRACE_DEFAULTS = {"attention": "sdpa", "checkpointing": False, "cuda_dropout": True, "amp_dtype": None,
                  "accumulation": 1, "seed": 0}


def activation_formula(config, batch_size: int, seq_len: int, *, attention: str = "sdpa",
                       mask_bytes: int = 1) -> int:
    """Bytes saved for backward by ``Net``'s forward in fp32 (what MemTracker files as activations).

    Per token and encoder layer (h hidden, I = 4h intermediate, A heads, L tokens, m bytes per dropout mask):
    16h for x, Q, K, V; 4h context; 4h + 4h LayerNorm-1 input and output; 4I + 4I GELU input and output;
    4h LayerNorm-2 input; 2 x m*h hidden-dropout masks; 16 for two LayerNorms' mean and 1/std. Eager attention
    adds 4AL probabilities, 4AL probabilities after dropout and m*AL dropout mask; the fused kernel (sdpa)
    keeps 4A log-sum-exp values instead (plus 16 bytes per layer of dropout seed and offset; a padded batch
    would add its 4L float mask). Outside the layers: the embeddings' LayerNorm input (4h) and dropout mask (m*h), the last
    layer's output kept alive by the [CLS] slice (4h), and 8 bytes per token, per example, per position and once.
    """
    h, heads, inter = config.hidden_size, config.num_attention_heads, config.intermediate_size
    per_token = 16 * h + 4 * h + 8 * h + 8 * inter + 4 * h + 2 * mask_bytes * h + 16
    if attention == "eager":
        per_token += (8 + mask_bytes) * heads * seq_len
        per_layer_extra = 0
    else:
        per_token += 4 * heads
        per_layer_extra = 16
    tokens = batch_size * seq_len
    layers = config.num_hidden_layers * (tokens * per_token + per_layer_extra)
    outside = tokens * (8 * h + mask_bytes * h + 8) + 8 * batch_size + 8 * seq_len + 8
    return layers + outside


def _scale(two: dict[str, int], three: dict[str, int], layers: int) -> dict[str, int]:
    return {key: two[key] + (layers - 2) * (three[key] - two[key]) for key in two}


def trace_by_layers(config, batch_size: int, seq_len: int, **options) -> StepMemory:
    """``trace_fake`` of the full model, computed from traces of the model cut to two and three layers.

    Every encoder layer is the same, so each figure grows by the same bytes per layer, and extrapolating
    gives the full model's trace (tests check it byte for byte) in a fraction of the time. Two and three,
    not one and two: with one layer the first layer is also the last, and the backward peak differs.
    Results are kept, so repeated questions cost nothing.
    """
    options = TRACE_DEFAULTS | options
    key = (config.to_json_string(), batch_size, seq_len, tuple(sorted(options.items())))
    if key not in _traces and config.num_hidden_layers <= 3:
        _traces[key] = trace_fake(config, batch_size, seq_len, **options)
    if key not in _traces:
        two, three = (trace_fake(config.__class__(**(config.to_dict() | {"num_hidden_layers": n})),
                               batch_size, seq_len, **options) for n in (2, 3))
        layers = config.num_hidden_layers
        _traces[key] = StepMemory(*(_scale(getattr(two, moment), getattr(three, moment), layers)
                                    for moment in ("after_forward", "backward_peak", "optimizer_peak")))
    return _traces[key]


def parameter_bytes(config) -> int:
    """fp32 bytes of every parameter of ``Net`` (BERT with its pooler, plus the 2-class head)."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    embeddings = (config.vocab_size + config.max_position_embeddings + config.type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * inter + inter) + (inter * h + h) + 2 * h
    pooler, head = h * h + h, 2 * h + 2
    return 4 * (embeddings + layers * layer + pooler + head)


def per_device(config, batch_size: int, seq_len: int, *, strategy: str = "single", gpus: int = 1,
               accumulation: int = 1, checkpointing: bool = False, amp: bool = False, attention: str = "sdpa",
               gradient_as_bucket_view: bool = False) -> list[dict[str, int]]:
    """Peak bytes per GPU of one step with global batch ``batch_size``, by category, one dict per GPU.

    - single: the traced step.
    - dataparallel: GPU 0 runs the master model on its B/N share, so it holds what one device holds at B/N
      (weights, gradients reduced onto it, Adam state); every other GPU holds a fresh replica of the weights,
      the activations of its B/N share and, at the end of backward, the replica's gradients — no Adam state.
    - ddp: every GPU runs a full copy at B/N with its own Adam state, plus gradient buckets of the trainable
      parameters' size; with ``gradient_as_bucket_view`` the gradients live in the buckets.
    - amp: the step traced under CUDA autocast's rules with bf16 (``helpers.memtrace.CudaLikeKernels``):
      weights, gradients and Adam state stay fp32; linear layers and attention save bf16 tensors and bf16
      copies of their weights, while softmax, layer_norm and the loss keep fp32.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {STRATEGIES}")
    gpus = 1 if strategy == "single" else gpus
    if batch_size % gpus:
        raise ValueError(f"batch_size={batch_size} does not split evenly over gpus={gpus}")
    step = trace_by_layers(config, batch_size // gpus, seq_len, accumulation=accumulation,
                           checkpointing=checkpointing, attention=attention,
                           amp_dtype=torch.bfloat16 if amp else None)
    backward, optimizer = dict(step.backward_peak), dict(step.optimizer_peak)
    if strategy == "single":
        return [_total(max(backward, optimizer, key=_sum))]
    if strategy == "dataparallel":
        master = max(backward, optimizer, key=_sum)
        replica_compute = backward | {"optimizer": 0}
        replica_grads = dict.fromkeys(ORDER, 0) | {"weights": backward["weights"],
                                                    "gradients": optimizer["gradients"]}
        replica = max(replica_compute, replica_grads, key=_sum)
        return [_total(master)] + [_total(replica) for _ in range(gpus - 1)]
    buckets = parameter_bytes(config)  # every parameter requires a gradient, the pooler included
    if gradient_as_bucket_view:
        optimizer["gradients"] = 0
    rank = max(backward, optimizer, key=_sum) | {"buckets": buckets}
    return [_total(rank) for _ in range(gpus)]


def _sum(snapshot: dict[str, int]) -> int:
    return sum(value for key, value in snapshot.items() if key != "total")


def _total(snapshot: dict[str, int]) -> dict[str, int]:
    result = {key: value for key, value in snapshot.items() if key != "total"}
    return result | {"total": sum(result.values())}


COLORS = {"weights": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green", "activations": "tab:red",
          "temporaries": "tab:purple", "buckets": "tab:brown"}


def plot_per_device(panels: dict[str, dict[str, list[dict[str, int]]]], limit_gib: float | None = None):
    """Stacked bars of GiB by category: one panel per key of ``panels``, one bar per (setting, GPU).

    ``panels`` maps a panel title to {setting label: per_device(...) result}. ``limit_gib`` draws a
    dashed line, e.g. a GPU's capacity.
    """
    import matplotlib.pyplot as plt

    widths = [max(4.2, 0.8 * sum(len(devices) for devices in settings.values())) for settings in panels.values()]
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths), 3.8), sharey=True, squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, (title, settings) in zip(axes[0], panels.items()):
        stacked_bars(ax, {f"{setting}\nGPU{gpu}" if len(devices) > 1 else setting: device
                          for setting, devices in settings.items() for gpu, device in enumerate(devices)})
        if limit_gib:
            ax.axhline(limit_gib, color="black", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, rotation=30 if max(map(len, settings)) > 6 else 0)
    axes[0][0].set_ylabel("GiB")
    legend_above(fig, axes[0])
    return fig


def stacked_bars(ax, bars: dict[str, dict[str, int]], colors: dict[str, str] = COLORS) -> list[float]:
    """One bar per entry of ``bars`` (label: bytes by category), stacked by category in GiB; returns the heights."""
    bottom = [0.0] * len(bars)
    for category, color in colors.items():
        heights = [bar.get(category, 0) / 2**30 for bar in bars.values()]
        if any(heights):
            ax.bar(list(bars), heights, bottom=bottom, color=color, label=category)
            bottom = [b + h for b, h in zip(bottom, heights)]
    return bottom


def legend_above(fig, axes) -> None:
    """One legend above all the panels, naming each category once."""
    handles = {}
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(name, handle)
    fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))


def memo_chart(path: str) -> None:
    """Write the README's chart: the memo's setting (BERT-base v1, DataParallel on 2 GPUs, eager attention)."""
    from helpers.memtrace import bert_base_config

    config = bert_base_config()
    panels = {f"predicted: DataParallel, 2 GPUs, eager, L={seq_len}":
              {f"B={batch}": per_device(config, batch, seq_len, strategy="dataparallel", gpus=2, attention="eager")
               for batch in (16, 32, 64)}
              for seq_len in (128, 512)}
    plot_per_device(panels).savefig(path, dpi=100)


if __name__ == "__main__":
    import sys

    memo_chart(sys.argv[1] if len(sys.argv) > 1 else "docs/img/per_device_memory.png")
