"""Charts of predicted memory: stacked bars of GiB by category, one bar per GPU (notebooks 05 and 08, the
README's chart). Matplotlib is imported when a chart is drawn, not with the package.

    python -m helpers.memory.charts docs/img/per_device_memory.png    # the README's chart (make memory-chart)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from helpers.memory.configs import bert_base_config
from helpers.memory.gpu_facts import GIB, GPUS
from helpers.memory.prediction import per_device

COLORS = {"weights": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green", "activations": "tab:red",
          "temporaries": "tab:purple", "buckets": "tab:brown", "gathered": "tab:cyan", "workspaces": "tab:gray",
          "reduction": "tab:olive", "allocator": "tab:pink", "batch": "black"}
"""Each category's color, in the order the bars stack (bottom first)."""


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
        heights = [bar.get(category, 0) / GIB for bar in bars.values()]
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
    fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=min(len(handles), 6), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.88))


def memo_chart(path: str) -> None:
    """Write the README's chart: the memo's setting (BERT-base v1, DataParallel on 2 GPUs, eager attention)."""
    config = bert_base_config()
    panels = {f"predicted: DataParallel, 2 x H200, eager, L={seq_len}":
              {f"B={batch}": per_device(config, batch, seq_len, strategy="dataparallel", gpus=2, attention="eager",
                                        gpu=GPUS["H200"], environ={})
               for batch in (16, 32, 64)}
              for seq_len in (128, 512)}
    plot_per_device(panels).savefig(path, dpi=100)


def plot_per_rank(table: dict, cards_gib=(16, 24, 40, 80)):
    """One panel per model: DDP and FSDP on each GPU count, stacked by category (GiB), cards as dashed lines."""
    import matplotlib.pyplot as plt

    models = table["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, (name, entry) in zip(axes[0], models.items()):
        bars = {"DDP": entry["ddp"]} | {f"FSDP\n{n} GPUs": value for n, value in entry["fsdp"].items()}
        heights = stacked_bars(ax, bars)
        for card in cards_gib:
            if card < 1.15 * max(heights):
                ax.axhline(card, color="black", linestyle="--", linewidth=0.8)
                ax.text(len(bars) - 0.5, card, f"{card} GiB", fontsize=7, va="bottom", ha="right")
        ax.set_title(f"{name} ({entry['parameters'] / 1e6:,.0f} M parameters)", fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    axes[0][0].set_ylabel("GiB per GPU (predicted)")
    legend_above(fig, axes[0])
    return fig


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m helpers.memory.charts", description=memo_chart.__doc__)
    parser.add_argument("png", type=Path, help="the file to write, e.g. docs/img/per_device_memory.png")
    path = parser.parse_args().png
    path.parent.mkdir(parents=True, exist_ok=True)
    memo_chart(str(path))
    print(f"wrote {path}")
