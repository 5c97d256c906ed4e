"""Fuzzing helpers.checkpoint's contract on real checkpoints of every layout.

A plain run (one process, resumed with ``Checkpoints.resume``), a DDP run and an FSDP2 run (2 processes under
torchrun, saved by tests/checkpoint_worker.py; loaded here into one process, the FSDP2 one resharded) are saved
once, then mutated case by case: truncated at many offsets, damaged, crafted pickles, files missing or extra, keys
and shapes that do not match. Every case must end in one of two ways: one CheckpointError that names a file of the
folder and keeps the exception it comes from as its cause, with the model, the optimizer, the scheduler and every
class a pickle may name unchanged; or, where the folder still holds the same checkpoint (an extra file, a byte
that does not matter), a load that gives the saved weights.
"""

import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties

from helpers import fsdp
from helpers.checkpoint import (MODEL_FILE, STATE_FILE, CheckpointError, Checkpoints, full_weights, load_checkpoint,
                                state_dicts_equal)
from helpers.checkpoint import SHARDED_DIR
from helpers.net import Net
from helpers.optim import two_lr_adam

ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
WORKER = Path(__file__).parent / "checkpoint_worker.py"
METADATA = f"{SHARDED_DIR}/.metadata"


# --- the saved runs, the models they load into, and the contract ---------------------------------------------

@dataclass
class Layout:
    """A saved run's folder (``root``, holding ``latest`` and one checkpoint) and what loads it."""

    name: str
    root: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    saved: dict = field(default_factory=dict)  # the weights the checkpoint holds

    @property
    def checkpoint(self) -> Path:
        return Checkpoints(self.root).latest() if (self.root / "latest").exists() else self.root / "step-000001"

    def load(self) -> None:
        if self.name == "plain":  # a resume: pointer, per-process states and all
            loader = torch.utils.data.DataLoader(range(8), shuffle=True, generator=torch.Generator())
            Checkpoints(self.root).resume(self.model, self.optimizer, self.scheduler, loader)
        else:
            load_checkpoint(self.root / "step-000001", self.model, self.optimizer, self.scheduler)


def plain_run(folder: Path) -> None:
    """One process trained for a step and saved by Checkpoints, as ``fit`` saves it."""
    from helpers.checkpoint import Progress, epoch_start_state

    torch.manual_seed(0)
    net = Net(pooler=False)
    optimizer = two_lr_adam(net)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    input_ids = torch.randint(5, 100, (2, 8))
    torch.nn.functional.cross_entropy(net(input_ids, torch.ones_like(input_ids)), torch.tensor([0, 1])).backward()
    optimizer.step()
    scheduler.step()
    loader = torch.utils.data.DataLoader(range(8), shuffle=True, generator=torch.Generator().manual_seed(0))
    progress = Progress(step=1, batch=1, batch_losses=[0.5])
    progress.epoch_start = epoch_start_state(loader)
    Checkpoints(folder).save(net, optimizer, scheduler, progress)


def target(name: str):
    """A fresh model, optimizer and scheduler of the layout ``name``, other weights than saved."""
    torch.manual_seed(1)
    net = Net(pooler=name == "fsdp")
    if name == "fsdp":
        fsdp.shard(net)
    optimizer = two_lr_adam(net)
    return net, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The three saved runs, each loaded once to check it loads and to learn its weights."""
    root = tmp_path_factory.mktemp("layouts")
    start = time.monotonic()
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 str(WORKER), "layouts", str(root)], env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        plain_run(root / "plain")  # meanwhile
        _, errors = torchrun.communicate(timeout=300)
    finally:
        torchrun.kill()
    assert torchrun.returncode == 0, errors[-3000:]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # FSDP2 in this process
    try:
        built = {}
        for name in ("plain", "ddp", "fsdp"):
            layout = Layout(name, root / name, *target(name))
            layout.load()
            layout.saved = {key: value.clone() for key, value in full_weights(layout.model).items()}
            built[name] = layout
        print(f"\nlayouts saved and loaded in {time.monotonic() - start:.1f} s")
        yield built
    finally:
        dist.destroy_process_group()


def class_attributes() -> dict:
    """Every class (and enum member) a checkpoint's pickles may name, with its attributes."""
    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    objects = [pathlib.Path, pathlib.PurePath, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath,
               pathlib.PureWindowsPath, _StorageInfo, torch.Size, metadata._MEM_FORMAT_ENCODING,
               *metadata._MEM_FORMAT_ENCODING, *(getattr(metadata, name) for name in metadata.__all__)]
    return {obj: dict(vars(obj)) for obj in objects}


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of ``tensor`` (all of it, unless it is a DTensor), copied."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def changed_classes(saved: dict) -> list[str]:
    """The attributes that differ from ``saved`` (``class_attributes``), each put back: later cases and tests need
    them, whatever a load did."""
    changed = []
    for obj, attributes in saved.items():
        for name in set(vars(obj)) | set(attributes):
            if vars(obj).get(name, saved) is not attributes.get(name, saved):
                changed.append(f"{getattr(obj, '__name__', obj)}.{name}")
                target = type if isinstance(obj, type) else object
                if name in attributes:
                    target.__setattr__(obj, name, attributes[name])
                else:
                    target.__delattr__(obj, name)
    return changed


def snapshot(layout: Layout):
    """Copies of what a load may change: weights, optimizer state and settings, scheduler state."""
    optimizer = layout.optimizer
    moments = [{name: local(value) for name, value in optimizer.state[p].items()}
               for group in optimizer.param_groups for p in group["params"] if p in optimizer.state]
    return ({key: local(value) for key, value in layout.model.state_dict().items()}, moments,
            repr([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]),
            repr(layout.scheduler.state_dict()))


def unchanged(before, after) -> bool:
    return (state_dicts_equal(before[0], after[0]) and len(before[1]) == len(after[1])
            and all(state_dicts_equal(a, b) for a, b in zip(before[1], after[1])) and before[2:] == after[2:])


def outcome(layout: Layout, may_load: bool, caused: bool) -> str | None:
    """Load ``layout`` as it now is; None if the contract held, else what broke it. ``caused``: the refusal must
    come from an exception (a parser's, an unpickler's), kept as its cause."""
    before, classes = snapshot(layout), class_attributes()
    try:
        layout.load()
    except CheckpointError as error:
        if changed_classes(classes):
            return f"changed a class: {error}"
        if not str(error).startswith(str(layout.root)):
            return f"names no file of the folder: {error}"
        if error.__cause__ is not error.__context__ or caused and error.__cause__ is None:
            return f"dropped its cause ({type(error.__context__).__name__}): {error}"
        if not unchanged(before, snapshot(layout)):
            return f"changed the model, optimizer or scheduler: {error}"
        return None
    except BaseException as error:  # the contract: only CheckpointError
        changed_classes(classes)
        return f"raised {type(error).__name__}: {str(error)[:300]}"
    if changed_classes(classes):
        return "loaded, and changed a class"
    if not may_load:
        return "loaded"
    if not state_dicts_equal(full_weights(layout.model), layout.saved):
        return "loaded other weights than saved"
    return None


class Mutable:
    """The files of a layout's folder, changed for one case and put back afterwards."""

    def __init__(self, layout: Layout):
        self.layout, self.originals = layout, {}

    def path(self, relative: str) -> Path:
        return self.layout.checkpoint / relative if relative != "latest" else self.layout.root / "latest"

    def keep(self, relative: str) -> Path:
        path = self.path(relative)
        if relative not in self.originals:
            self.originals[relative] = path.read_bytes() if path.exists() else None
        return path

    def read(self, relative: str) -> bytes:
        return self.path(relative).read_bytes()

    def write(self, relative: str, data: bytes) -> None:
        self.keep(relative).write_bytes(data)

    def remove(self, relative: str) -> None:
        path = self.keep(relative)
        shutil.rmtree(path) if path.is_dir() else path.unlink()

    def restore(self) -> None:
        for relative, data in self.originals.items():  # folders were only removed whole: copy them back
            path = self.path(relative)
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        self.originals = {}


def run_cases(layout: Layout, cases: list[tuple[str, object, bool]], caused: bool = False) -> list[str]:
    """Apply each (name, mutate(files), may_load) to the layout's folder, check the contract (``outcome``),
    restore the folder."""
    broken = []
    for name, mutate, may_load in cases:
        files = Mutable(layout)
        try:
            mutate(files)
            problem = outcome(layout, may_load, caused)
        finally:
            files.restore()
        if problem:
            broken.append(f"{layout.name}, {name}: {problem}")
    return broken


def files_of(layout: Layout) -> list[str]:
    checkpoint = layout.checkpoint
    files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
    return files + (["latest"] if layout.name == "plain" else [])


# --- truncation and damage ------------------------------------------------------------------------------------

def offsets(size: int) -> list[int]:
    """Where to cut a file of ``size`` bytes: in its first bytes (headers), at two places further in (past the
    header every cut is alike), and just before its end."""
    return sorted({0, 1, 8, 64, size // 3, 2 * size // 3, size - 1} & set(range(size)))


@pytest.mark.parametrize("name", ["plain", "ddp", "fsdp"])
def test_truncated_at_any_offset(layouts, name):
    layout = layouts[name]
    cases = {parsed: [(f"{relative} cut at {offset:,}", lambda f, r=relative, o=offset: f.write(r, f.read(r)[:o]),
                       relative == "latest")  # "step-000001" without its newline still names the checkpoint
                      for relative in files_of(layout) if (relative in (MODEL_FILE, STATE_FILE, METADATA)) == parsed
                      for offset in offsets(Mutable(layout).path(relative).stat().st_size)]
             for parsed in (True, False)}  # parsed: the refusal comes from the parser's exception
    assert len(cases[True]) + len(cases[False]) >= 14
    assert run_cases(layout, cases[True], caused=True) + run_cases(layout, cases[False]) == []


def flipped(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x5A]) + data[offset + 1:]


@pytest.mark.parametrize("name", ["plain", "fsdp"])
def test_damaged_headers_and_pickles(layouts, name):
    """A changed byte in a pickle or a header: refused, or (a byte that does not matter) the same checkpoint.
    Bytes of tensor data are left alone: nothing in these formats can tell a changed weight."""
    layout = layouts[name]
    if name == "plain":
        header = 8 + int.from_bytes(Mutable(layout).read(MODEL_FILE)[:8], "little")  # safetensors' JSON header
        targets = [(MODEL_FILE, header)]
    else:
        targets = [(METADATA, len(Mutable(layout).read(METADATA)))]
    cases = [(f"{relative} byte {offset:,} changed", lambda f, r=relative, o=offset: f.write(r, flipped(f.read(r), o)),
              True) for relative, end in targets for offset in range(0, end, max(1, end // 16))]
    assert run_cases(layout, cases) == []


# --- crafted pickles --------------------------------------------------------------------------------------------

LENGTH = (2**62).to_bytes(8, "little")
CRAFTED_METADATA = {
    "BUILD on a path class": b"\x80\x04cpathlib\nPosixPath\nN}\x8c\x06existsNs\x86b.",
    "BUILD on a metadata class": b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\nN}\x8c\x07versionNs\x86b.",
    "BUILD on an enum member": pickle.dumps(type("R", (), {"__reduce__": lambda self: (
        __import__("torch.distributed.checkpoint.metadata", fromlist=["x"])._MEM_FORMAT_ENCODING, (0,),
        {"_value_": 7})})(), protocol=4),
    "BUILD on a list": b"\x80\x04]}\x8c\x01aNsb.",
    "SETITEM on a class": b"\x80\x04ctorch\nSize\n\x8c\x01aNs.",
    "APPEND on a class": b"\x80\x04ctorch\nSize\nNa.",
    "BINBYTES8 of 2**62 bytes": b"\x80\x04\x8e" + LENGTH + b".",
    "BINUNICODE8 of 2**62 bytes": b"\x80\x04\x8d" + LENGTH + b".",
    "FRAME of 2**62 bytes": b"\x80\x04\x95" + LENGTH + b"N.",
    "BYTEARRAY8 of 2**62 bytes": b"\x80\x05\x96" + LENGTH + b".",
    "LONG4 of 2**31 bytes": b"\x80\x02\x8b" + (2**31 - 1).to_bytes(4, "little") + b".",
    "global builtins.eval": b"\x80\x04cbuiltins\neval\n\x8c\x011\x85R.",
    "global os.system": b"\x80\x04cos\nsystem\n\x8c\x04true\x85R.",
    "global torch.load": b"\x80\x04ctorch\nload\n.",
    "global pathlib.Path": b"\x80\x04cpathlib\nPath\n\x8c\x01x\x85R.",
    "torch.Size of a string": b"\x80\x04ctorch\nSize\n\x8c\x03abc\x85R.",
    "NEWOBJ on a dtype": b"\x80\x04ctorch\nfloat32\n)\x81.",
    "an unknown layout": b"\x80\x04ctorch.serialization\n_get_layout\n\x8c\x02no\x85R.",
    "a missing memo entry": b"\x80\x04h\x05.",
    "STOP on an empty stack": b"\x80\x04.",
}
"""Pickles the unpickler refuses, or fails on: the refusal keeps that exception as its cause."""
NOT_METADATA = {
    "a list instead of Metadata": b"\x80\x04].",
    "lists nested 100,000 deep": b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b".",
}
"""Pickles that unpickle, into something else than DCP's Metadata."""


def rewritten_metadata(change):
    """A mutation: unpickle the real .metadata (the test wrote it), apply ``change``, pickle it back."""
    def mutate(files: Mutable) -> None:
        metadata = pickle.loads(files.read(METADATA))
        change(metadata)
        files.write(METADATA, pickle.dumps(metadata))
    return mutate


class Reduce:
    """Pickles as ``function(*arguments)``, then BUILD with ``state`` if given."""

    def __init__(self, function, arguments=(), state=None):
        self.reduced = (function, arguments) if state is None else (function, arguments, state)

    def __reduce__(self):
        return self.reduced


def entry(metadata, prefix: str):
    """The first entry of ``metadata`` whose name starts with ``prefix``: (name, TensorStorageMetadata)."""
    return next((key, value) for key, value in metadata.state_dict_metadata.items() if key.startswith(prefix))


def place(metadata, prefix: str):
    return next(value for key, value in metadata.storage_data.items() if key.fqn.startswith(prefix))


WRONG_FIELDS = {
    "offset as text": lambda m: setattr(place(m, "model."), "offset", "0"),
    "relative path outside the folder": lambda m: setattr(place(m, "model."), "relative_path", "../state.pt"),
    "length negative": lambda m: setattr(place(m, "model."), "length", -1),
    "through an extension": lambda m: setattr(place(m, "model."), "transform_descriptors", ["zstd"]),
    "properties None": lambda m: setattr(entry(m, "model.")[1], "properties", None),
    "dtype a string": lambda m: setattr(entry(m, "model.")[1].properties, "dtype", "float32"),
    "memory format unknown": lambda m: setattr(entry(m, "model.")[1], "properties", Reduce(
        TensorProperties, (), (torch.float32, torch.strided, False, "no such code", False))),
    "size a list": lambda m: setattr(entry(m, "model.")[1], "size", [4, 3]),
    "size negative": lambda m: setattr(entry(m, "model.")[1], "size", torch.Size([-1])),
    "chunks a tuple": lambda m: setattr(entry(m, "model.")[1], "chunks", tuple(entry(m, "model.")[1].chunks)),
    "chunk of another rank": lambda m: entry(m, "model.")[1].chunks[0].__dict__.update(
        offsets=torch.Size([1] * len(entry(m, "model.")[1].size))),
    "chunk dropped": lambda m: entry(m, "model.")[1].chunks.pop(),
    "chunk twice": lambda m: entry(m, "model.")[1].chunks.append(entry(m, "model.")[1].chunks[0]),
    "entries a list": lambda m: setattr(m, "state_dict_metadata", list(m.state_dict_metadata)),
    "places a list": lambda m: setattr(m, "storage_data", list(m.storage_data.values())),
    "place keys strings": lambda m: setattr(m, "storage_data", {k.fqn: v for k, v in m.storage_data.items()}),
    "place missing": lambda m: m.storage_data.pop(next(iter(m.storage_data))),
    "version a number": lambda m: setattr(m, "version", 3),
    "storage_meta a string": lambda m: setattr(m, "storage_meta", "x"),
    "planner_data a list": lambda m: setattr(m, "planner_data", [1]),
    "an entry of bytes": lambda m: m.state_dict_metadata.update(
        {"model.note": __import__("torch.distributed.checkpoint.metadata", fromlist=["x"]).BytesStorageMetadata()}),
}


def torch_saved(change):
    """A mutation: load state.pt (the test wrote it), apply ``change`` (which may return a replacement), save."""
    def mutate(files: Mutable) -> None:
        import io
        state = torch.load(io.BytesIO(files.read(STATE_FILE)), weights_only=True)
        state = change(state) or state
        buffer = io.BytesIO()
        torch.save(state, buffer)
        files.write(STATE_FILE, buffer.getvalue())
    return mutate


class Payload:
    """Unpickling this would run code."""

    def __reduce__(self):
        return exec, ("raise SystemExit('code ran')",)


def first_rng(state):
    return state["per_process"][0]["rng"]


CRAFTED_STATE = {
    "a list": lambda s: [1, 2],
    "a part missing": lambda s: s.__delitem__("progress"),
    "a part more": lambda s: s.update(scaler={}),
    "code in it": lambda s: s.update(optimizer=Payload()),
    "optimizer a list": lambda s: s.update(optimizer=[1]),
    "param_groups text": lambda s: s["optimizer"].update(param_groups="x"),
    "a group without params": lambda s: s["optimizer"]["param_groups"][0].__delitem__("params"),
    "a setting of another kind": lambda s: s["optimizer"]["param_groups"][0].update(betas=0.9),
    "scheduler a list": lambda s: s.update(scheduler=[1]),
    "a scheduler setting more": lambda s: s["scheduler"].update(optimizer=None),
    "a scheduler setting of another kind": lambda s: s["scheduler"].update(base_lrs="x"),
    "step as text": lambda s: s["progress"].update(step="1"),
    "history text": lambda s: s["progress"].update(history="x"),
    "per_process a dict": lambda s: s.update(per_process={}),
    "per_process without rng": lambda s: s["per_process"][0].__delitem__("rng"),
    "torch's random state short": lambda s: first_rng(s).update(torch=first_rng(s)["torch"][:10]),
    "python's random state text": lambda s: first_rng(s).update(python="x"),
    "numpy's key short": lambda s: first_rng(s)["numpy"].update(key=first_rng(s)["numpy"]["key"][:5]),
    "the loader's random state of floats": lambda s: s["per_process"][0]["epoch_start"].update(loader=torch.zeros(8)),
    "losses text": lambda s: s["per_process"][0].update(batch_losses="x"),
}


@pytest.mark.parametrize("name", ["plain", "fsdp"])  # DDP's state.pt is the plain one's, saved by 2 processes
def test_crafted_pickles(layouts, name):
    layout = layouts[name]
    cases = [(f"state.pt: {label}", torch_saved(change), False) for label, change in CRAFTED_STATE.items()]
    cases += [(f".metadata: {label}", rewritten_metadata(change), False) for label, change in WRONG_FIELDS.items()
              if name == "fsdp"]
    cases += [(f".metadata: {label}", lambda f, d=data: f.write(METADATA, d), False)
              for label, data in NOT_METADATA.items() if name == "fsdp"]
    unpickled = [(f".metadata: {label}", lambda f, d=data: f.write(METADATA, d), False)
                 for label, data in CRAFTED_METADATA.items() if name == "fsdp"]
    assert run_cases(layout, cases) + run_cases(layout, unpickled, caused=True) == []


# --- missing and extra files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["plain", "ddp", "fsdp"])
def test_missing_and_extra_files(layouts, name):
    layout = layouts[name]
    cases = [(f"{relative} missing", lambda f, r=relative: f.remove(r), False)
             for relative in files_of(layout) if relative != "latest"]
    cases += [("an extra file", lambda f: f.write("notes.txt", b"hello"), True)]
    if name == "fsdp":
        cases += [("sharded/ missing", lambda f: [f.remove(r) for r in files_of(layout)], False),
                  ("an extra shard file", lambda f: f.write(f"{SHARDED_DIR}/__2_0.distcp", b"\0" * 64), True),
                  ("full weights beside the shards", lambda f: f.write(MODEL_FILE, b"not read"), True)]
    if name == "plain":
        cases += [("latest naming nothing", lambda f: f.write("latest", b"step-000009\n"), False),
                  ("latest not text", lambda f: f.write("latest", b"\xff\xfe\0"), False),
                  ("latest naming a folder outside", lambda f: f.write("latest", b"../plain\n"), False)]
    assert run_cases(layout, cases) == []


# --- keys and shapes that do not match --------------------------------------------------------------------------

def resaved_weights(change):
    """A mutation: model.safetensors with ``change`` applied to its tensors."""
    def mutate(files: Mutable) -> None:
        tensors = load_file(files.path(MODEL_FILE))
        change(tensors)
        scratch = files.path(MODEL_FILE).with_suffix(".scratch")
        save_file(tensors, scratch)
        data = scratch.read_bytes()
        scratch.unlink()
        files.write(MODEL_FILE, data)
    return mutate


def renamed(tensors: dict, old: str, new: str) -> None:
    tensors[new] = tensors.pop(old)


WEIGHT_CHANGES = {
    "a key renamed": lambda t: renamed(t, "linear.bias", "linear.bias_"),
    "a key missing": lambda t: t.pop("linear.bias"),
    "a key more": lambda t: t.update(extra=torch.zeros(2)),
    "a shape transposed": lambda t: t.update({"linear.weight": t["linear.weight"].T.contiguous()}),
    "a dtype float64": lambda t: t.update({"linear.weight": t["linear.weight"].double()}),
}


def first_state(state):
    """The optimizer state of its first parameter, in state.pt."""
    return next(iter(state["optimizer"]["state"].values()))


OPTIMIZER_CHANGES = {
    "a parameter renamed": lambda s: renamed(s["optimizer"]["state"], "linear.weight", "linear.weight_"),
    "a moment of another shape": lambda s: first_state(s).update(exp_avg=first_state(s)["exp_avg"][:1]),
    "a moment missing": lambda s: first_state(s).__delitem__("exp_avg_sq"),
    "a moment more": lambda s: first_state(s).update(max_exp_avg_sq=first_state(s)["exp_avg"]),
    "a group without its last parameter": lambda s: s["optimizer"]["param_groups"][0]["params"].__delitem__(-1),
    "two parameters swapped": lambda s: s["optimizer"]["param_groups"][0]["params"].reverse(),
    "the groups swapped": lambda s: s["optimizer"]["param_groups"].reverse(),
}


def metadata_entry_renamed(metadata, old: str, new: str) -> None:
    metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
    for index in [index for index in metadata.storage_data if index.fqn == old]:
        metadata.storage_data[MetadataIndex(new, index.offset)] = metadata.storage_data.pop(index)


def resized(metadata, name: str) -> None:
    """``name`` one row longer, its chunks too: the metadata is consistent, the model is not."""
    saved = metadata.state_dict_metadata[name]
    saved.size = torch.Size([saved.size[0] + 1, *saved.size[1:]])
    last = max(saved.chunks, key=lambda chunk: chunk.offsets[0])
    last.sizes = torch.Size([last.sizes[0] + 1, *last.sizes[1:]])


SHARD_CHANGES = {
    "a weight renamed": lambda m: metadata_entry_renamed(m, "model.linear.bias", "model.linear.bias_"),
    "a weight missing": lambda m: m.state_dict_metadata.pop("model.linear.bias"),
    "a weight one row longer": lambda m: resized(m, "model.linear.weight"),
    "a weight of dtype float64": lambda m: setattr(m.state_dict_metadata["model.linear.weight"].properties, "dtype",
                                                   torch.float64),
    "a moment of dtype float16": lambda m: setattr(
        m.state_dict_metadata["optimizer.state.linear.weight.exp_avg"].properties, "dtype", torch.float16),
    "a moment one row longer": lambda m: resized(m, "optimizer.state.linear.weight.exp_avg"),
    "a moment missing": lambda m: m.state_dict_metadata.pop("optimizer.state.linear.weight.exp_avg_sq"),
    "moments of a parameter that is not there": lambda m: metadata_entry_renamed(
        m, "optimizer.state.linear.bias.exp_avg", "optimizer.state.nothing.exp_avg"),
    "an entry that is neither": lambda m: metadata_entry_renamed(m, "model.linear.bias", "other.linear.bias"),
    "a chunk place of another entry": lambda m: m.storage_data.update(
        {MetadataIndex("model.linear.bias", torch.Size([0])): place(m, "model.linear.weight")}),
}


@pytest.mark.parametrize("name", ["plain", "fsdp"])  # DDP's files are the plain one's
def test_keys_and_shapes_that_do_not_match(layouts, name):
    layout = layouts[name]
    if name == "fsdp":
        cases = [(f"sharded: {label}", rewritten_metadata(change), False) for label, change in SHARD_CHANGES.items()]
        cases += [(f"state.pt: {label}", torch_saved(change), False) for label, change in OPTIMIZER_CHANGES.items()
                  if "group" in label or "swapped" in label]
    else:
        cases = [(f"{MODEL_FILE}: {label}", resaved_weights(change), False) for label, change in WEIGHT_CHANGES.items()]
        cases += [(f"state.pt: {label}", torch_saved(change), False) for label, change in OPTIMIZER_CHANGES.items()]
    assert run_cases(layout, cases) == []
