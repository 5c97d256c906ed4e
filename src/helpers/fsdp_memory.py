"""Predict what each GPU holds in one FSDP2 training step, with PyTorch's FSDPMemTracker on fake tensors.

``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (private, hence the pinned torch) extends
``MemTracker`` (helpers.memtrace) with FSDP's own categories: sharded and unsharded (all-gathered) weights,
sharded and unsharded gradients, the all-gather and reduce-scatter buffers. A fake process group of N ranks
(``torch.testing._internal.distributed.fake_pg``) lets one process trace what rank 0 of N holds: collectives
return at once, with the right shapes. The model is built on ``meta`` and sharded there, then given fake
storage inside ``FakeTensorMode``; nothing is allocated.

    python -m helpers.fsdp_memory      # recompute the stored table of predictions (a few minutes)
    torchrun --nproc_per_node=2 -m helpers.fsdp_memory --measure   # on 2 GPUs: what check_fsdp() runs

Like helpers.memory (05), the traces keep what CUDA keeps: 1-byte dropout masks and the attention kernel of the
GPU (``helpers.gpu_facts.sdpa_kernel``; default the H200's: memory-efficient in fp32, cuDNN in bf16), on a batch
without padding, whose all-ones attention mask transformers drops on real tensors (so none is passed). To the
tracker's bytes each prediction adds the GPU's cuBLAS workspaces (``helpers.gpu_facts.workspaces``). Unlike
notebook 05's single-GPU prediction, this one is not replayed into the caching allocator: it counts the bytes
tensors ask for, not whole blocks, and FSDPMemTracker's module hooks keep each module's input gradients until
all of them have arrived, which a plain step does not.
"""

from __future__ import annotations

import contextlib
import gc
import json
from importlib.resources import files
from pathlib import Path

import torch
from torch import nn

from helpers.gpu_facts import GPUS, GpuModel, workspaces
from helpers.memtrace import CudaLikeKernels, bert_base_config, build_model

GIB = 2**30
# FSDPMemTracker's categories, in the words notebook 08 uses (05's words, and "gathered" for FSDP's all-gathers).
CATEGORIES = {"Sharded Param": "weights", "Buffer": "weights", "Unsharded Param": "gathered",
              "All Gather": "gathered", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
              "Reduce Scatter": "gradients", "OptState": "optimizer", "Activation": "activations",
              "Temp": "temporaries", "Inputs": "temporaries"}
ORDER = ("weights", "gathered", "gradients", "optimizer", "activations", "temporaries", "workspaces")
HOST_RESIDENT = ("Sharded Param", "Sharded Grad", "OptState")  # what CPUOffloadPolicy keeps in host memory
LEVERS = ("none", "mixed precision", "CPU offload", "checkpointing")
TABLE = Path(str(files("helpers") / "data" / "fsdp_memory" / "predictions.json"))
_traces: dict[tuple, dict[str, int]] = {}


def bert_large_config(num_hidden_layers: int = 24):
    """BERT-large's shape with the v1 vocabulary: hidden 1024, 24 layers, 16 heads (about 336 M parameters)."""
    return bert_base_config(num_hidden_layers, hidden_size=1024, num_attention_heads=16, intermediate_size=4096)


def encoder_1b_config(num_hidden_layers: int = 18):
    """A BERT-shaped encoder of about a billion parameters: hidden 2048, 18 layers, 16 heads."""
    return bert_base_config(num_hidden_layers, hidden_size=2048, num_attention_heads=16, intermediate_size=8192)


MODELS = {"BERT-base": bert_base_config, "BERT-large": bert_large_config, "1B encoder": encoder_1b_config}


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """A process group of ``world_size`` ranks that exists only in this process (this one is rank 0), and a
    device mesh over it. The mesh is made here, outside FakeTensorMode: inside, it would fail on ``.tolist()``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a process group already exists in this process; destroy it first")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def trace_fsdp(config, batch_size: int, seq_len: int, world_size: int, *, mixed_precision: bool = False,
               checkpointing: bool = False, gpu: GpuModel = GPUS["H200"], seed: int = 0) -> dict[str, int]:
    """Peak bytes of rank 0 of ``world_size`` over one Adam step, by FSDPMemTracker's own categories.

    ``batch_size`` is the per-rank batch. ``Net`` is sharded as helpers.fsdp.shard does (each BertLayer, then
    the root); ``mixed_precision`` computes in bfloat16 (``MixedPrecisionPolicy``; fp32 weights, gradients
    reduced in fp32). Attention is traced as the CUDA SDPA kernel, as in helpers.memory's default; the
    recomputation of ``checkpointing`` runs under the same kernels. A warm-up step on a small batch creates
    Adam's state first. FakeTensorMode's dispatch cache is shared by the whole process, and a 2-layer
    checkpointed model held one more hidden state at its peak when traced with it empty than after another
    trace; it is emptied first, so that a trace does not depend on what the process traced before.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from helpers.fsdp import shard

    key = (config.to_json_string(), batch_size, seq_len, world_size, mixed_precision, checkpointing, gpu, seed)
    if key in _traces:
        return _traces[key]
    options = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)} if mixed_precision else {}
    generator = torch.Generator().manual_seed(seed)
    FakeTensorMode.cache_clear()
    with fake_process_group(world_size) as mesh:
        model = shard(build_model(config, "sdpa", checkpointing), mesh, **options)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)

            def step(size, length):
                input_ids = torch.randint(0, config.vocab_size, (size, length), generator=generator)
                labels = torch.randint(0, 2, (size,), generator=generator)
                with CudaLikeKernels(fused_attention=True, gpu=gpu):
                    loss = nn.functional.cross_entropy(model(input_ids), labels)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()

            step(1, 8)
            tracker = FSDPMemTracker(model, optimizer)
            gc.collect()
            with tracker:
                step(batch_size, seq_len)
            (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    _traces[key] = {getattr(kind, "value", kind): nbytes for kind, nbytes in snapshot.items() if kind != "Total"}
    return _traces[key]


def trace_fsdp_by_layers(config, batch_size: int, seq_len: int, world_size: int, **options) -> dict[str, int]:
    """``trace_fsdp`` of the full model from traces of the model cut to three and four layers.

    Every encoder layer is the same, so from the third layer on each category grows by the same bytes per
    layer (with two layers the peak falls elsewhere; notebook 08 checks the extrapolation against a trace).
    """
    if config.num_hidden_layers <= 4:
        return trace_fsdp(config, batch_size, seq_len, world_size, **options)
    three, four = (trace_fsdp(config.__class__(**(config.to_dict() | {"num_hidden_layers": n})), batch_size,
                              seq_len, world_size, **options) for n in (3, 4))
    return {kind: three[kind] + (config.num_hidden_layers - 3) * (four[kind] - three[kind]) for kind in three}


def fsdp_categories(peak: dict[str, int], offload: bool = False, held: int = 0) -> dict[str, int]:
    """A trace in ORDER's words, with ``held`` bytes of workspaces, plus 'total'. ``offload`` leaves out what
    CPUOffloadPolicy keeps in host memory (sharded weights, sharded gradients, Adam's state), a prediction by
    subtraction, not a trace."""
    result = dict.fromkeys(ORDER, 0) | {"workspaces": held}
    for kind, nbytes in peak.items():
        if not (offload and kind in HOST_RESIDENT):
            result[CATEGORIES[kind]] += nbytes
    return result | {"total": sum(result.values())}


def predict_fsdp(config, batch_size: int, seq_len: int, gpus: int, lever: str = "none", *,
                 gpu: GpuModel = GPUS["H200"], environ: dict[str, str] | None = None) -> dict[str, int]:
    """Rank 0's predicted peak bytes by category, for FSDP over ``gpus`` with a per-rank batch of ``batch_size``,
    on ``gpu`` (its attention kernel and its workspaces under ``environ``, default: none of the variables set)."""
    if lever not in LEVERS:
        raise ValueError(f"lever={lever!r}: expected one of {LEVERS}")
    options = {"mixed_precision": lever == "mixed precision", "checkpointing": lever == "checkpointing", "gpu": gpu}
    held = sum(workspaces(gpu.capability, environ or {}).values())
    return fsdp_categories(trace_fsdp_by_layers(config, batch_size, seq_len, gpus, **options),
                           offload=lever == "CPU offload", held=held)


def predict_ddp(config, batch_size: int, seq_len: int) -> dict[str, int]:
    """Each DDP rank's predicted peak at a per-rank batch of ``batch_size`` on an H200 (helpers.memory, notebook 05:
    replayed into the simulated allocator)."""
    from helpers.memory import per_device

    return per_device(config, 2 * batch_size, seq_len, strategy="ddp", gpus=2, gpu=GPUS["H200"], environ={})[0]


def parameters(config) -> int:
    from helpers.memory import parameter_bytes

    return parameter_bytes(config) // 4


def build_table(batch_size: int = 8, seq_len: int = 512, gpus=(2, 4, 8), lever_model: str = "BERT-large",
                lever_gpus: int = 8) -> dict:
    """Every prediction notebook 08 charts: three models under DDP and FSDP on ``gpus``, and the levers."""
    table = {"batch_size": batch_size, "seq_len": seq_len, "models": {}, "levers": {}}
    for name, make in MODELS.items():
        config = make()
        table["models"][name] = {"parameters": parameters(config), "ddp": predict_ddp(config, batch_size, seq_len),
                                 "fsdp": {str(n): predict_fsdp(config, batch_size, seq_len, n) for n in gpus}}
    config = MODELS[lever_model]()
    table["levers"] = {"model": lever_model, "gpus": lever_gpus,
                       "fsdp": {lever: predict_fsdp(config, batch_size, seq_len, lever_gpus, lever) for lever in LEVERS}}
    return table


def load_table(path: Path = TABLE) -> dict:
    """The stored predictions (``python -m helpers.fsdp_memory`` writes them)."""
    return json.loads(path.read_text(encoding="utf-8"))


def plot_per_rank(table: dict, cards_gib=(16, 24, 40, 80)):
    """One panel per model: DDP and FSDP on each GPU count, stacked by category (GiB), cards as dashed lines."""
    import matplotlib.pyplot as plt

    from helpers.memory import COLORS, legend_above, stacked_bars

    models = table["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, (name, entry) in zip(axes[0], models.items()):
        bars = {"DDP": entry["ddp"]} | {f"FSDP\n{n} GPUs": value for n, value in entry["fsdp"].items()}
        heights = stacked_bars(ax, bars, COLORS | {"gathered": "tab:cyan"})
        for card in cards_gib:
            if card < 1.15 * max(heights):
                ax.axhline(card, color="black", linestyle="--", linewidth=0.8)
                ax.text(len(bars) - 0.5, card, f"{card} GiB", fontsize=7, va="bottom", ha="right")
        ax.set_title(f"{name} ({entry['parameters'] / 1e6:,.0f} M parameters)", fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    axes[0][0].set_ylabel("GiB per GPU (predicted)")
    legend_above(fig, axes[0])
    return fig


# --- on GPUs: measured against predicted ------------------------------------------------------------------

CHECK = {"batch_size": 8, "seq_len": 512, "gpus": 2}  # BERT-base; the prediction is the table's
FSDP_TOLERANCE = 0.05


def measure_cuda_rank() -> None:
    """One rank of ``torchrun -m helpers.fsdp_memory --measure``: an Adam step of BERT-base-shaped ``Net`` (random
    weights) sharded over NCCL; rank 0 prints every rank's ``torch.cuda.max_memory_allocated`` as JSON."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from helpers import distributed
    from helpers.fsdp import shard

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    distributed.init_process_group(device)  # NCCL, bound to this GPU
    config, size, length = bert_base_config(), CHECK["batch_size"], CHECK["seq_len"]
    torch.manual_seed(0)
    model = shard(build_model(config, device="cpu").to(device), init_device_mesh("cuda", (dist.get_world_size(),)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)

    def step(batch, tokens):
        input_ids = torch.randint(0, config.vocab_size, (batch, tokens), device=device)
        labels = torch.randint(0, 2, (batch,), device=device)
        nn.functional.cross_entropy(model(input_ids), labels).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(1, 8)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(size, length)
    torch.cuda.synchronize(device)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(device))
    if dist.get_rank() == 0:
        print(json.dumps({"backend": dist.get_backend(), "peaks": peaks}), flush=True)
    distributed.leave_process_group()


def check_fsdp() -> list[tuple[bool, str]]:
    """``make gpu-check``'s FSDP lines: on 2 CUDA GPUs over NCCL, each rank's measured peak against the prediction.

    Skips, with the reason, where there are fewer than 2 GPUs or no NCCL.
    """
    import subprocess
    import sys

    import torch.distributed as dist

    from helpers.finetune import last_json

    gpus = CHECK["gpus"]
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [(True, f"skip FSDP check: needs {gpus} CUDA GPUs, this machine has {count}")]
    if not dist.is_nccl_available():
        return [(True, "skip FSDP check: this torch build has no NCCL")]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                          "-m", "helpers.fsdp_memory", "--measure"], capture_output=True, text=True, timeout=900)
    try:
        measured = last_json(run.stdout)
    except ValueError:
        measured = None
    if run.returncode != 0 or measured is None:
        return [(False, f"FAIL FSDP run on {gpus} GPUs (exit {run.returncode}): {run.stderr.strip()[-500:]}")]
    predicted = load_table()["models"]["BERT-base"]["fsdp"][str(gpus)]["total"]
    results = [(measured["backend"] == "nccl", f"{'ok  ' if measured['backend'] == 'nccl' else 'FAIL'} FSDP "
                                                f"backend {measured['backend']}")]
    for rank, peak in enumerate(measured["peaks"]):
        gap = (peak - predicted) / predicted
        ok = abs(gap) <= FSDP_TOLERANCE
        results.append((ok, f"{'ok  ' if ok else 'FAIL'} FSDP rank {rank}, BERT-base, {gpus} GPUs, "
                            f"B={CHECK['batch_size']}/rank, L={CHECK['seq_len']}  predicted {predicted / GIB:7.2f} GiB"
                            f"  measured {peak / GIB:7.2f} GiB  gap {gap:+.1%}"))
    return results


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--measure"]:
        measure_cuda_rank()
    else:
        TABLE.parent.mkdir(parents=True, exist_ok=True)
        TABLE.write_text(json.dumps(build_table(), indent=1) + "\n", encoding="utf-8")
        print(f"wrote {TABLE}")
