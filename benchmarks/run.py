"""`make bench`: every benchmark in one run, side by side. Prints the machine and its load, medians, and
each ratio with its range over the repetitions; writes benchmarks/results.md and the same table into
CONTRIBUTING.md (between the bench markers, under "Benchmarks"). A target counts as met only when the worst repetition clears it.

Repetitions are options, so a loaded machine can do a quick pass and a quiet one a careful pass; the load
average is recorded at the start and at the end, so a reader can tell which it was.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

import common
import grad_accumulation
import memory_prediction
import notebooks
import padding
import trainer_vs_loop

HERE = Path(__file__).resolve().parent
TABLE_FILE = HERE.parent / "CONTRIBUTING.md"  # the maintainers' page; the README links to it
DDP_SCRIPT = HERE / "ddp_scaling.py"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def ddp_scaling(rounds: int) -> str:
    """The DDP benchmark's own printout (1 vs 2 processes, and 1 process x 2 threads)."""
    done = subprocess.run([sys.executable, str(DDP_SCRIPT), "--rounds", str(rounds)], capture_output=True, text=True,
                          cwd=HERE.parent)
    return done.stdout.strip() + (f"\n(exit {done.returncode}: {done.stderr.strip()[-500:]})" if done.returncode else "")


def verdict(ok: bool) -> str:
    return "yes" if ok else "**no**"


def ratio_row(label: str, before: str, ratios: list[float], target: float, digits: int) -> str:
    """A table row: the median ratio, its range over repetitions, and 'met' only if the worst one clears the target."""
    return (f"| {label} | {before}: **{common.median(ratios):.{digits}f}×** ({common.spread(ratios, digits=digits)}) | "
            f"≥ {target:.1f}× | {verdict(min(ratios) >= target)} |")


def markdown(machine: str, end_load: str, args, pad: dict | None, hf: dict | None, nbs: dict | None,
             ddp: str | None, mem: dict | None = None,
             accum: dict | None = None) -> str:
    lines = [f"Measured on {machine}, at end {end_load}; {datetime.date.today().isoformat()}; medians of "
             f"{args.repeats} repetitions" + ("" if "notebooks" in args.skip else f" (notebooks: {args.notebook_repeats})") +
             f", each ratio with its range over the "
             f"repetitions; a target is met only when the worst repetition clears it" +
             (f"; training on the first {args.examples} sentences only" if args.examples else "") +
             (f"; not run this time: {', '.join(args.skip)}" if args.skip else "") + ".", "",
             "| benchmark | measured | target | met |", "|---|---|---|---|"]
    if pad:
        seconds, ratios = pad["epoch_s"], padding.speedups(pad)
        for name in ("pad to longest", "pad to longest + length buckets"):
            lines.append(ratio_row(f"epoch time, pad to 512 → {name}",
                                   f"{seconds['pad to 512']:.1f} s → {seconds[name]:.1f} s", ratios[name], 10, 1))
    if hf:
        speed, acc = hf["samples_per_s"], hf["val_accuracy"]
        lines.append(ratio_row("training samples/s, project loop vs HF Trainer",
                               f"{speed['project loop']:.0f} vs {speed['HF Trainer']:.0f}",
                               trainer_vs_loop.speed_ratios(hf), 1.0, 2))
        lines.append(f"| validation accuracy after {trainer_vs_loop.EPOCHS} epochs, loop vs Trainer | "
                     f"{acc['project loop']:.3f} vs {acc['HF Trainer']:.3f} | side by side | |")
    if mem:
        seconds, ratios = mem["seconds"], memory_prediction.ratios(mem)
        lines.append(f"| `python -m helpers.memory`: {memory_prediction.LABEL} (per-GPU peaks, nvidia-smi and the "
                     f"largest batch) against importing torch and transformers' BertModel | "
                     f"{common.median(seconds['command']):.1f} s vs {common.median(seconds['import']):.1f} s: "
                     f"**{common.median(ratios):.2f}×** ({common.spread(ratios)}) | ≤ {memory_prediction.TARGET:.1f}× | "
                     f"{verdict(max(ratios) <= memory_prediction.TARGET)} |")
    if accum:
        seconds, traffic = accum["seconds"], accum["traffic"]
        lines.append(f"| 2-process DDP, 4 micro-batches per step: s per optimizer step, naive loop → `no_sync` | "
                     f"{common.median(seconds['naive']):.3f} s → {common.median(seconds['no_sync']):.3f} s: "
                     f"**{common.median(grad_accumulation.ratios(accum)):.2f}×** "
                     f"({common.spread(grad_accumulation.ratios(accum))}) | side by side | |")
        lines.append(f"| all-reduce per optimizer step, naive loop vs `no_sync` | "
                     f"{traffic['naive']['bytes'] / 2**20:.2f} MiB vs {traffic['no_sync']['bytes'] / 2**20:.2f} MiB "
                     f"({traffic['naive']['bytes'] / accum['gradient_bytes']:.1f}× vs "
                     f"{traffic['no_sync']['bytes'] / accum['gradient_bytes']:.1f}× the gradients) | side by side | |")
    if nbs:
        cells = nbs["cells"]
        slowest = max(cells, key=cells.get)
        lines.append(f"| slowest notebook under nbval, its cells | `{Path(slowest).stem}` {cells[slowest]:.1f} s "
                     f"(worst {nbs['worst'][slowest]:.1f} s) | ≤ 30 s | {verdict(max(nbs['worst'].values()) <= 30)} |")
        lines.append(f"| all {len(cells)} notebooks under nbval: cells, whole pytest runs | {nbs['total']:.1f} s, "
                     f"{nbs['wall_total']:.1f} s | side by side | |")
        lines += ["", "| notebook | its cells under nbval (s) | the whole pytest run (s) |", "|---|---|---|"]
        lines += [f"| `{name}` | {s:.1f}{' (failed)' if name in nbs['failed'] else ''} | {nbs['wall'][name]:.1f} |"
                  for name, s in cells.items()]
    if pad:
        lines += ["", f"Padding to 512: median time of {pad['batches_512']} batches × batches per epoch (every "
                  f"batch has the same shape). Token slots per epoch: " +
                  ", ".join(f"{name} {count:,}" for name, count in pad["tokens"].items()) + "."]
    if ddp:
        lines += ["", "DDP, 1 vs 2 processes and 1 process × 2 threads (`benchmarks/ddp_scaling.py`):", "",
                  "```", ddp, "```"]
    return "\n".join(lines) + "\n"


def update_table(table: str) -> None:
    text = TABLE_FILE.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"{TABLE_FILE}: the markers {START} and {END} are missing")
    head, rest = text.split(START, 1)
    TABLE_FILE.write_text(f"{head}{START}\n{table}{END}{rest.split(END, 1)[1]}", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3,
                        help="repetitions of the padding and Trainer benchmarks, and rounds of the DDP one (default 3)")
    parser.add_argument("--batches-512", type=int, default=5,
                        help="batches timed per repetition when padding to 512 (default 5)")
    parser.add_argument("--examples", type=int, help="train on the first N sentences only (a quick check)")
    parser.add_argument("--threads", type=int, help="torch threads for the padding and Trainer benchmarks "
                        "(default: torch's choice, one per core)")
    parser.add_argument("--notebook-repeats", type=int, default=1,
                        help="runs of every notebook under nbval (default 1)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["padding", "trainer", "ddp", "memory", "accumulation",
                                                              "notebooks"],
                        help="benchmarks to leave out of this run")
    parser.add_argument("--no-table", action="store_true", help="leave CONTRIBUTING.md as it is")
    args = parser.parse_args()

    common.set_threads(args.threads)
    machine = common.machine()
    print(f"machine: {machine}")
    pad = hf = nbs = ddp = mem = accum = None
    if "padding" not in args.skip:
        pad = padding.run(args.repeats, args.batches_512, args.examples)
        print("\n".join(["", "== padding: one training epoch"] + padding.report(pad)), flush=True)
    if "trainer" not in args.skip:
        hf = trainer_vs_loop.run(args.repeats, args.examples)
        print("\n".join(["", "== project loop vs Hugging Face Trainer"] + trainer_vs_loop.report(hf)), flush=True)
    if "ddp" not in args.skip:
        ddp = ddp_scaling(args.repeats)
        print("\n".join(["", "== DDP scaling", ddp]), flush=True)
    if "memory" not in args.skip:
        mem = memory_prediction.run(args.repeats)
        print("\n".join(["", "== the memory command"] + memory_prediction.report(mem)), flush=True)
    if "accumulation" not in args.skip:
        accum = grad_accumulation.run(args.repeats)
        print("\n".join(["", "== gradient accumulation under DDP"] + grad_accumulation.report(accum)), flush=True)
    if "notebooks" not in args.skip:
        nbs = notebooks.run(args.notebook_repeats)
        print("\n".join(["", "== notebooks under nbval"] + notebooks.report(nbs)), flush=True)
    end_load = common.load_average()
    print(f"\nload average at end {end_load}")

    table = markdown(machine, end_load, args, pad, hf, nbs, ddp, mem, accum)
    (HERE / "results.md").write_text("# Benchmark results (`make bench`)\n\n" + table, encoding="utf-8")
    if not args.no_table:
        update_table(table)
    print(f"\nwrote {HERE / 'results.md'}" + ("" if args.no_table else f" and the table in {TABLE_FILE}"))

if __name__ == "__main__":
    main()
