"""Fuzzing helpers.checkpoint's contract on real checkpoints of every layout.

A plain run (one process, resumed with ``Checkpoints.resume``), a DDP run and an FSDP2 run (2 processes under
torchrun, saved by tests/checkpoint_worker.py; loaded here into one process, the FSDP2 one resharded) are saved
once, then mutated case by case: truncated at many offsets, damaged, crafted pickles, files missing or extra, keys
and shapes that do not match; and, one test per kind, the faults that pass the format checks: a state that fails
while loading or at the first step, values this run would never write (another run's settings among them), files
outside the folder, pointers and files that are not regular files, and hooks. Every case must end in one of two
ways: one CheckpointError that names a file of the folder and keeps the exception it comes from as its cause (and
its words), with the model, the optimizer, the scheduler, the random state and every class a pickle may name
unchanged bit for bit; or, where the folder still holds the same checkpoint (an extra file, a byte that does not
matter, a symlink inside the folder), a load that gives the saved weights. The objects loaded into have stepped once
past the checkpoint, so that a load that changed any of them shows.
"""

import io
import os
import pathlib
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties

from helpers import fsdp
from helpers.checkpoint import (MODEL_FILE, STATE_FILE, CheckpointError, Checkpoints, full_weights, load_checkpoint,
                                open_checkpoint, state_dicts_equal)
from helpers.net import Net
from helpers.optim import two_lr_adam

ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
WORKER = Path(__file__).parent / "checkpoint_worker.py"
SHARDED_DIR = "sharded"  # the layout on disk (helpers.checkpoint.SHARDED_DIR); also what the older code reads
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
    loaded: bool = False  # the last case loaded (run_cases then resets the objects)

    @property
    def checkpoint(self) -> Path:
        return self.root / "step-000001"

    def load(self) -> None:
        if self.name == "plain":  # a resume: pointer, per-process states and all
            loader = torch.utils.data.DataLoader(range(8), shuffle=True, generator=torch.Generator())
            Checkpoints(self.root).resume(self.model, self.optimizer, self.scheduler, loader)
        else:
            load_checkpoint(self.checkpoint, self.model, self.optimizer, self.scheduler)

    def reset(self) -> None:
        """A new model, optimizer and scheduler, loaded from the (intact) checkpoint and stepped once: after a load
        took a crafted state (which may break a step), the next case starts from the same objects again."""
        self.model, self.optimizer, self.scheduler = target(self.name)
        self.load()
        self.step()

    def step(self) -> None:
        """One training step, so that the model, the optimizer and the scheduler hold other values than the
        checkpoint: a load that changed any of them shows."""
        input_ids = torch.randint(5, 100, (2, 8), generator=torch.Generator().manual_seed(7))
        logits = self.model(input_ids, torch.ones_like(input_ids))
        torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1])).backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()


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
            layout.step()
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


def bits(value):
    """``value`` as comparable data, tensors as their bytes: equal bits compare equal (a NaN too), nothing else."""
    if isinstance(value, torch.Tensor):
        value = local(value)
        return "tensor", value.dtype, tuple(value.shape), value.reshape(-1).view(torch.uint8).numpy().tobytes()
    if isinstance(value, dict):
        return "dict", [(repr(key), bits(item)) for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [bits(item) for item in value]
    if isinstance(value, np.ndarray):
        return "array", value.dtype.str, value.shape, value.tobytes()
    return repr(value)


def snapshot(layout: Layout):
    """Everything a load may change, bit for bit: weights, optimizer state and settings, scheduler state, and the
    random generators (a resume sets them)."""
    optimizer = layout.optimizer
    return bits([layout.model.state_dict(), [optimizer.state[p] for group in optimizer.param_groups
                                             for p in group["params"] if p in optimizer.state],
                 [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
                 layout.scheduler.state_dict(), torch.get_rng_state(), random.getstate(), np.random.get_state()])


def outcome(layout: Layout, may_load: bool, caused: bool, names: str | None = None) -> str | None:
    """Load ``layout`` as it now is; None if the contract held, else what broke it. ``caused``: the refusal must
    come from an exception (a parser's, an unpickler's), kept as its cause; ``names``: a text the message holds
    (the setting that differs)."""
    before, classes = snapshot(layout), class_attributes()
    try:
        with time_limit(10):  # a load that waits for a FIFO's writer fails here, instead of hanging the test run
            layout.load()
    except CheckpointError as error:
        if changed_classes(classes):
            return f"changed a class: {error}"
        if not str(error).startswith(str(layout.root)):
            return f"names no file of the folder: {error}"
        if error.__cause__ is not error.__context__ or caused and error.__cause__ is None:
            return f"dropped its cause ({type(error.__context__).__name__}): {error}"
        if str(error).endswith("()"):  # where the cause's message goes, empty
            return f"lost its cause's message: {error}"
        if names is not None and names not in str(error):
            return f"does not name {names}: {error}"
        if snapshot(layout) != before:
            return f"changed the model, optimizer, scheduler or random state: {error}"
        return None
    except BaseException as error:  # the contract: only CheckpointError
        changed_classes(classes)
        return f"raised {type(error).__name__}: {str(error)[:300]}"
    layout.loaded = True  # run_cases resets it
    if changed_classes(classes):
        return "loaded, and changed a class"
    if not may_load:
        return "loaded"
    return None if state_dicts_equal(full_weights(layout.model), layout.saved) else "loaded other weights than saved"


class Hung(BaseException):
    """A load still running after its time: not an OSError (as TimeoutError is), so that no handler takes it for a
    file's problem."""


@contextmanager
def time_limit(seconds: int):
    """Raise Hung in the block after ``seconds`` (SIGALRM: opening a FIFO for reading waits in the kernel)."""
    def expired(signum, frame):
        raise Hung(f"still loading after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class Mutable:
    """The files of a layout's folder, changed for one case and put back afterwards."""

    def __init__(self, layout: Layout):
        self.layout, self.originals, self.replaced = layout, {}, []

    def path(self, relative: str) -> Path:
        return self.layout.root / relative if relative in ("latest", "step-000001") else \
            self.layout.checkpoint / relative

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

    def replace(self, relative: str, make) -> None:
        """Move the file or folder ``relative`` aside and call ``make(path)`` to put something else there."""
        path = self.path(relative)
        aside = path.with_name(f"aside-{path.name}")
        path.rename(aside)
        self.replaced.append((path, aside))
        make(path)

    def restore(self) -> None:
        for path, aside in reversed(self.replaced):
            if path.is_symlink() or not path.is_dir():
                path.unlink(missing_ok=True)
            else:
                shutil.rmtree(path)
            aside.rename(path)
        for relative, data in self.originals.items():  # folders were only removed whole: copy them back
            path = self.path(relative)
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        self.originals, self.replaced = {}, []


def run_cases(layout: Layout, cases: list[tuple], caused: bool = False) -> list[str]:
    """Apply each (name, mutate(files), may_load[, names]) to the layout's folder, check the contract
    (``outcome``), restore the folder."""
    broken = []
    for name, mutate, may_load, *names in cases:
        files, layout.loaded = Mutable(layout), False
        try:
            mutate(files)
            problem = outcome(layout, may_load, caused, *names)
        finally:
            files.restore()
        if layout.loaded:  # a good load gave the checkpoint's values: one step makes them other again
            layout.step() if may_load else layout.reset()
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


# --- after the format checks: all or nothing, complete and in range, files that are what they say ---------------
# One test per kind of fault the issue found (helpers.checkpoint's issue 43), each crafted on the real folders.

ALL = ("plain", "ddp", "fsdp")
FULL = ("plain", "ddp")  # model.safetensors and the optimizer's tensors in state.pt
REAL = ("ddp", "fsdp")  # the real two-process folders; plain (the resume path) takes one case or more of each kind


def group(state, index: int = 0) -> dict:
    return state["optimizer"]["param_groups"][index]


def state_pt_with_pickle(change):
    """A mutation: state.pt's pickle (``data.pkl`` in torch.save's zip) rewritten by ``change(bytes) -> bytes``; for
    what torch.save cannot write (it pickles recursively, so 100,000 levels crash it)."""
    def mutate(files: Mutable) -> None:
        archive = zipfile.ZipFile(io.BytesIO(files.read(STATE_FILE)))
        rewritten = io.BytesIO()
        with zipfile.ZipFile(rewritten, "w", zipfile.ZIP_STORED) as out:
            for entry in archive.infolist():
                data = archive.read(entry.filename)
                out.writestr(entry.filename, change(data) if entry.filename.endswith("/data.pkl") else data)
        files.write(STATE_FILE, rewritten.getvalue())
    return mutate


def a_group_entry_nested(depth: int):
    """A mutation: the first group gets an entry more ("notes"), lists nested ``depth`` deep (the old checks compared
    only the entries this run has)."""
    marker = "nested lists"
    saved = torch_saved(lambda s: group(s).update(notes=marker))
    nested = state_pt_with_pickle(lambda data: data.replace(b"X" + len(marker).to_bytes(4, "little") + marker.encode(),
                                                            b"]" * depth + b"a" * (depth - 1), 1))
    return lambda files: (saved(files), nested(files))


def rechunked(name: str, change):
    """A mutation: every chunk of the DCP entry ``name`` loaded, changed by ``change`` and saved again at the end of its
    data file, the metadata pointing at the new bytes (its dtype and sizes as they were)."""
    def mutate(files: Mutable) -> None:
        metadata = pickle.loads(files.read(METADATA))  # the test wrote it
        for index, place in metadata.storage_data.items():
            if index.fqn == name:
                data_file = f"{SHARDED_DIR}/{place.relative_path}"
                data = files.read(data_file)
                chunk = torch.load(io.BytesIO(data[place.offset:place.offset + place.length]), weights_only=True)
                saved = io.BytesIO()
                torch.save(change(chunk), saved)
                place.offset, place.length = len(data), len(saved.getvalue())
                files.write(data_file, data + saved.getvalue())
        files.write(METADATA, pickle.dumps(metadata))
    return mutate


def cases_for(layout: Layout, table: dict) -> list[tuple]:
    """The cases of ``table`` ({name: (layouts, mutate[, names])}) that apply to ``layout``, none of which may load."""
    return [(name, mutate, False, *names) for name, (layouts, mutate, *names) in table.items()
            if layout.name in layouts]


FAILS_WHILE_LOADING = {
    "exp_avg a meta tensor": (FULL, torch_saved(lambda s: first_state(s).update(exp_avg=first_state(s)["exp_avg"]
                                                                               .to("meta")))),
    "scheduler state {}": (("plain", "fsdp"), torch_saved(lambda s: s.update(scheduler={}))),
    "a group's entry nested 100,000 deep": (REAL, a_group_entry_nested(100_000)),
    "a chunk of exp_avg re-saved as a meta tensor": (("fsdp",), rechunked("optimizer.state.linear.weight.exp_avg",
                                                                          lambda t: t.to("meta"))),
}
"""Old: a raw NotImplementedError, KeyError or RecursionError after part of the state was loaded."""


@pytest.mark.parametrize("name", ALL)
def test_a_state_that_fails_while_loading_changes_nothing(layouts, name):
    layout = layouts[name]
    assert run_cases(layout, cases_for(layout, FAILS_WHILE_LOADING)) == []


FAILS_AT_THE_FIRST_STEP = {
    "amsgrad True": (ALL, torch_saved(lambda s: group(s).update(amsgrad=True)), "'amsgrad'"),
    "a group without lr": (REAL, torch_saved(lambda s: group(s).__delitem__("lr")), "'lr'"),
    "capturable True": (REAL, torch_saved(lambda s: group(s).update(capturable=True)), "'capturable'"),
    "step a meta tensor": (("ddp",), torch_saved(lambda s: first_state(s).update(step=first_state(s)["step"].to("meta")))),
    "exp_avg sparse": (("ddp",), torch_saved(lambda s: first_state(s).update(exp_avg=first_state(s)["exp_avg"]
                                                                        .to_sparse()))),
    "step -1": (("plain",), torch_saved(lambda s: first_state(s).update(step=torch.tensor(-1.0)))),
    "a shard's step -1": (("fsdp",), rechunked("optimizer.state.linear.weight.step", lambda t: t - 2)),
}
"""Old: loaded; the first optimizer step then raises (KeyError, ZeroDivisionError, a sparse or meta tensor)."""


@pytest.mark.parametrize("name", ALL)
def test_a_state_that_fails_at_the_first_step_is_refused(layouts, name):
    layout = layouts[name]
    assert run_cases(layout, cases_for(layout, FAILS_AT_THE_FIRST_STEP)) == []


SILENTLY_WRONG = {
    "maximize True": (ALL, torch_saved(lambda s: group(s).update(maximize=True)), "'maximize'"),
    "betas NaN": (REAL, torch_saved(lambda s: group(s).update(betas=(float("nan"), 0.999))), "'betas'"),
    "weight_decay inf": (REAL, torch_saved(lambda s: group(s).update(weight_decay=float("inf"))), "'weight_decay'"),
    "another run's weight_decay": (REAL, torch_saved(lambda s: group(s).update(weight_decay=0.01)), "'weight_decay'"),
    "another run's eps": (REAL, torch_saved(lambda s: group(s, 1).update(eps=1e-6)), "'eps'"),
    "another run's peak learning rate": (("plain", "fsdp"), torch_saved(lambda s: group(s).update(initial_lr=1.0)), "'initial_lr'"),
    "a learning rate of inf": (REAL, torch_saved(lambda s: group(s).update(lr=float("inf"))), "'lr'"),
    "the scheduler's base_lrs 1e30": (("plain", "fsdp"), torch_saved(lambda s: s["scheduler"].update(base_lrs=[1e30, 1e30])),
                                      "'base_lrs'"),
    "a history row whose val_loss is text": (FULL, torch_saved(lambda s: s["progress"].update(
        epoch=1, history=[{"epoch": 1, "train_loss": 0.7, "val_loss": "0.6"}])), "val_loss"),
    "a chunk of weights re-saved as float64": (("fsdp",), rechunked("model.linear.weight", lambda t: t.double())),
    "a chunk of exp_avg re-saved as int64": (("fsdp",), rechunked("optimizer.state.linear.weight.exp_avg",
                                                                  lambda t: t.long())),
    "a chunk of exp_avg one row larger than its box": (("fsdp",), rechunked(
        "optimizer.state.linear.weight.exp_avg", lambda t: torch.cat([t, t[:1]]))),
}
"""Old: loaded, with values this run would never have written: it trains uphill, with NaN or infinite moves, the
schedule of another run; DCP casts and cuts the chunks it reads; the epoch's end fails on the history."""


@pytest.mark.parametrize("name", ALL)
def test_silently_wrong_values_are_refused_naming_the_setting(layouts, name):
    layout = layouts[name]
    assert run_cases(layout, cases_for(layout, SILENTLY_WRONG)) == []


def elsewhere(files: Mutable, relative: str) -> Path:
    """A copy of the file or folder ``relative`` outside the run's folder."""
    source = files.path(relative)
    copy = files.layout.root.parent / f"elsewhere-{files.layout.name}" / source.name
    if not copy.exists():
        copy.parent.mkdir(exist_ok=True)
        shutil.copytree(source, copy) if source.is_dir() else shutil.copyfile(source, copy)
    return copy


def symlinked_elsewhere(relative: str):
    """A mutation: ``relative`` replaced by a symlink to a copy of itself outside the folder."""
    def mutate(files: Mutable) -> None:
        copy = elsewhere(files, relative)
        files.replace(relative, lambda path: path.symlink_to(copy))
    return mutate


OUTSIDE = {
    "the checkpoint folder a symlink to a copy outside": (("plain",), symlinked_elsewhere("step-000001")),
    "state.pt a symlink to a copy outside": (ALL, symlinked_elsewhere(STATE_FILE)),
    "model.safetensors a symlink to a copy outside": (FULL, symlinked_elsewhere(MODEL_FILE)),
    "sharded/ a symlink to a copy outside": (("fsdp",), symlinked_elsewhere(SHARDED_DIR)),
    ".metadata a symlink to a copy outside": (("fsdp",), symlinked_elsewhere(METADATA)),
    "a shard file a symlink to a copy outside": (("fsdp",), symlinked_elsewhere(f"{SHARDED_DIR}/__1_0.distcp")),
}
"""Old: loaded from wherever the symlink leads."""


@pytest.mark.parametrize("name", ALL)
def test_files_from_outside_the_folder_are_refused(layouts, name):
    layout = layouts[name]
    def symlinked_inside(files: Mutable) -> None:
        files.write("copy.pt", files.read(STATE_FILE))
        files.replace(STATE_FILE, lambda path: path.symlink_to("copy.pt"))

    inside = [("state.pt a symlink to a copy inside the folder", symlinked_inside, True)]
    assert run_cases(layout, cases_for(layout, OUTSIDE) + inside) == []


@contextmanager
def memory_limit(extra: int):
    """This process may map ``extra`` more bytes in the block (RLIMIT_AS): a read of /dev/zero fails with MemoryError
    within them, instead of taking the machine's memory."""
    import resource

    mapped = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    previous = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, previous)


def write_outside(files: Mutable, text: bytes) -> Path:
    outside = files.layout.root.parent / f"elsewhere-{files.layout.name}-pointer"
    outside.write_bytes(text)
    return outside


NOT_REGULAR = {
    "latest a FIFO": (("plain",), lambda f: f.replace("latest", os.mkfifo)),
    "latest a symlink to /dev/zero": (("plain",), lambda f: f.replace("latest", lambda p: p.symlink_to("/dev/zero"))),
    "latest a megabyte of text": (("plain",), lambda f: f.write("latest", b"step-000001\n" * 90_000)),
    "latest a folder": (("plain",), lambda f: f.replace("latest", os.mkdir)),
    "latest a symlink to a file outside": (("plain",), lambda f: f.replace(
        "latest", lambda p: p.symlink_to(write_outside(f, b"step-000001\n")))),
    "latest a symlink to nothing": (("plain",), lambda f: f.replace("latest", lambda p: p.symlink_to(p.with_name("x")))),
    "state.pt a FIFO": (("ddp", "fsdp"), lambda f: f.replace(STATE_FILE, os.mkfifo)),
    "model.safetensors a symlink to /dev/zero": (("ddp",), lambda f: f.replace(
        MODEL_FILE, lambda p: p.symlink_to("/dev/zero"))),
    ".metadata a FIFO": (("fsdp",), lambda f: f.replace(METADATA, os.mkfifo)),
    "a shard file a FIFO": (("fsdp",), lambda f: f.replace(f"{SHARDED_DIR}/__0_0.distcp", os.mkfifo)),
    "sharded/ a regular file": (("fsdp",), lambda f: f.replace(SHARDED_DIR, lambda p: p.write_bytes(b"x"))),
}
"""Old: a FIFO as latest waits for a writer forever (on every rank), /dev/zero is read until memory runs out."""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs and /dev/zero are POSIX's")
@pytest.mark.parametrize("name", ALL)
def test_pointers_and_files_that_are_not_regular_files_are_refused_unread(layouts, name):
    layout = layouts[name]
    with memory_limit(2 * 2**30):
        assert run_cases(layout, cases_for(layout, NOT_REGULAR)) == []


class Hooks:
    """Records every hook of an optimizer (its own and the global step hooks) and a model's forward hook."""

    def __init__(self, layout: Layout):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.fired: list[str] = []
        optimizer = layout.optimizer
        self.handles = [register_optimizer_step_pre_hook(self.record("global step pre")),
                        register_optimizer_step_post_hook(self.record("global step post")),
                        optimizer.register_step_pre_hook(self.record("step pre")),
                        optimizer.register_step_post_hook(self.record("step post")),
                        optimizer.register_state_dict_pre_hook(self.record("state_dict pre")),
                        optimizer.register_load_state_dict_pre_hook(self.record("load_state_dict pre")),
                        layout.model.register_forward_pre_hook(self.record("forward pre"))]

    def record(self, name: str):
        def hook(*args):
            self.fired.append(name)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("name", ALL)
def test_opening_fires_no_hook_and_every_refusal_says_its_cause(layouts, name):
    """Opening reads and checks without touching the caller's objects: no hook runs (the old code stepped the
    optimizer with a learning rate of 0 to learn its state's shapes), no state appears. A successful load runs the
    load hooks only. A refusal's message keeps its cause's words (the old one showed an empty "()")."""
    layout, broken = layouts[name], []
    for case, act, may_fire in (
            ("opening a good checkpoint", lambda: open_checkpoint(layout.checkpoint, layout.model, layout.optimizer,
                                                                  layout.scheduler), ()),
            ("loading a good checkpoint", layout.load, ("load_state_dict pre",))):
        hooks, before = Hooks(layout), snapshot(layout)
        try:
            act()
        finally:
            hooks.remove()
        if set(hooks.fired) - set(may_fire):
            broken.append(f"{name}, {case}: fired {sorted(set(hooks.fired))}")
        if not may_fire and snapshot(layout) != before:
            broken.append(f"{name}, {case}: changed the caller's objects")
    layout.step()
    hooks = Hooks(layout)
    try:
        broken += run_cases(layout, [("amsgrad True, refused", torch_saved(lambda s: group(s).update(amsgrad=True)),
                                      False), ("state.pt's pickle with an opcode nobody knows", state_pt_with_pickle(
                                          lambda data: data.replace(b"X\x04\x00\x00\x00bert", b"\xfe", 1)), False,
                                          "Unsupported operand 254")])
    finally:
        hooks.remove()
    assert broken + [f"{name}, refused loads: fired {sorted(set(hooks.fired))}"] * bool(hooks.fired) == []
