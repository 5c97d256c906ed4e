"""Checkpoints: exact round trips between wrappings (FSDP2 included), atomic saves, and clear errors for bad files."""

import itertools
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers.checkpoint import (MODEL_FILE, STATE_FILE, CheckpointError, Checkpoints, Progress, epoch_start_state,
                                full_weights, load_checkpoint, rng_state, save_checkpoint, set_rng_state,
                                state_dicts_equal)
from helpers.checkpoint.files import SHARDED_DIR
from helpers.checkpoint.shard_metadata import read_shard_metadata, saved_tensors
from helpers.wrapping import unwrap


def _state_dict(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)).state_dict()


def test_a_copy_is_equal():
    a = _state_dict()
    b = {key: value.clone() for key, value in a.items()}
    assert state_dicts_equal(a, b)
    assert state_dicts_equal(a, a)


def test_key_order_does_not_matter():
    a = _state_dict()
    assert state_dicts_equal(a, dict(reversed(list(a.items()))))


def test_one_changed_value_is_not_equal():
    a = _state_dict()
    b = {key: value.clone() for key, value in a.items()}
    b["0.weight"][1, 2] += 1e-6
    assert not state_dicts_equal(a, b)
    assert not state_dicts_equal(_state_dict(0), _state_dict(1))


def test_different_keys_are_not_equal():
    a = _state_dict()
    assert not state_dicts_equal(a, {f"module.{key}": value for key, value in a.items()})
    assert not state_dicts_equal(a, {key: value for key, value in a.items() if key != "1.bias"})
    assert not state_dicts_equal({key: value for key, value in a.items() if key != "1.bias"}, a)


def test_different_dtype_is_not_equal():
    a = _state_dict()
    b = dict(a, **{"0.bias": a["0.bias"].double()})
    assert not state_dicts_equal(a, b)
    ints = {"x": torch.tensor([1, 2])}
    assert not state_dicts_equal(ints, {"x": torch.tensor([1.0, 2.0])})


def test_different_shape_is_not_equal():
    ones = {"x": torch.ones(2, 3)}
    assert not state_dicts_equal(ones, {"x": torch.ones(3, 2)})
    assert not state_dicts_equal(ones, {"x": torch.ones(6)})
    assert not state_dicts_equal({"x": torch.ones(1)}, {"x": torch.ones(())})


class Tiny(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.linear = nn.Linear(3, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(self.linear(x))


def trained(seed=0, width=4, sharded=False):
    """A Tiny model, its Adam optimizer and LambdaLR schedule after two steps, so every state is non-trivial.

    ``sharded``: FSDP2's fully_shard before the optimizer is built (needs the process group)."""
    torch.manual_seed(seed)
    model = Tiny(width)
    if sharded:
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    for _ in range(2):
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer, scheduler


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A real process group of this one process (gloo), so that DDP can wrap a model and FSDP2 shard one."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('rdzv')}/file", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


WRAPPINGS = {
    "plain": lambda model: model,
    "DataParallel": nn.DataParallel,
    "DDP": nn.parallel.DistributedDataParallel,
    "compiled": torch.compile,
    "sharded": lambda model: model,  # fully_shard happens in trained(), before the optimizer is built
}


def wrapped(name, seed):
    """A trained Tiny in wrapping ``name``, with its optimizer and scheduler."""
    model, optimizer, scheduler = trained(seed, sharded=name == "sharded")
    return WRAPPINGS[name](model), optimizer, scheduler


def optimizer_state(model, optimizer):
    """The optimizer's state by parameter name, full tensors (gathered where sharded)."""
    return get_optimizer_state_dict(unwrap(model), optimizer, options=StateDictOptions(full_state_dict=True))["state"]


@pytest.mark.parametrize(("saved_from", "loaded_into"), list(itertools.product(WRAPPINGS, repeat=2)))
def test_round_trip_between_wrappings(saved_from, loaded_into, process_group, tmp_path):
    """Weights go from any wrapping to any other; optimizer and scheduler too where both are sharded or neither."""
    source, source_optimizer, source_scheduler = wrapped(saved_from, seed=0)
    target, target_optimizer, target_scheduler = wrapped(loaded_into, seed=1)
    assert not state_dicts_equal(full_weights(target), full_weights(source))
    save_checkpoint(tmp_path / "checkpoint", source, source_optimizer, source_scheduler)
    if saved_from == "sharded":  # no prefixes in the names, whatever the wrapping
        names = saved_tensors(read_shard_metadata(tmp_path / "checkpoint" / SHARDED_DIR), "model.").keys()
    else:
        names = load_file(tmp_path / "checkpoint" / MODEL_FILE).keys()
    assert sorted(names) == sorted(Tiny().state_dict())
    if (saved_from == "sharded") == (loaded_into == "sharded"):
        load_checkpoint(tmp_path / "checkpoint", target, target_optimizer, target_scheduler)
        saved_state, loaded_state = optimizer_state(source, source_optimizer), optimizer_state(target, target_optimizer)
        assert saved_state.keys() == loaded_state.keys() == Tiny().state_dict().keys()
        assert all(state_dicts_equal(loaded_state[name], saved_state[name]) for name in saved_state)
        assert target_scheduler.state_dict() == source_scheduler.state_dict()
    else:
        load_checkpoint(tmp_path / "checkpoint", target)
    assert state_dicts_equal(full_weights(target), full_weights(source))


def test_optimizer_scheduler_and_progress_round_trip(tmp_path):
    model, optimizer, scheduler = trained(seed=0)
    progress = Progress(step=7, epoch=1, batch=3, skipped_steps=2, history=[{"epoch": 1, "val_loss": 0.5}])
    save_checkpoint(tmp_path / "checkpoint", model, optimizer, scheduler, progress=progress)
    model2, optimizer2, scheduler2 = trained(seed=1)
    state = load_checkpoint(tmp_path / "checkpoint", model2, optimizer2, scheduler2)
    assert state["progress"] == {"step": 7, "epoch": 1, "batch": 3, "skipped_steps": 2,
                                 "history": [{"epoch": 1, "val_loss": 0.5}]}
    assert state_dicts_equal(model2.state_dict(), model.state_dict())
    for mine, theirs in zip(optimizer2.state.values(), optimizer.state.values(), strict=True):
        assert state_dicts_equal(mine, theirs)
    assert scheduler2.state_dict() == scheduler.state_dict() and scheduler2.last_epoch == 2


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_saving_before_the_first_step_leaves_adam_without_moments(sharded, process_group, tmp_path):
    """Saving must not start Adam's state: its first real step would then count as the second."""
    torch.manual_seed(0)
    model = Tiny()
    if sharded:
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.Adam(model.parameters())
    save_checkpoint(tmp_path / "checkpoint", model, optimizer)
    assert len(optimizer.state) == 0
    load_checkpoint(tmp_path / "checkpoint", model, optimizer)
    assert len(optimizer.state) == 0
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    assert all(state["step"] == 1 for state in optimizer.state.values())


def test_parameters_without_optimizer_state_load_as_saved(tmp_path):
    """Adam keeps no state for a parameter that never had a gradient (as Net's unused pooler): none comes back."""
    def model_and_adam(seed):
        torch.manual_seed(seed)
        model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
        optimizer = torch.optim.Adam(model.parameters())
        model["used"](torch.randn(4, 3)).sum().backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = model_and_adam(seed=0)
    save_checkpoint(tmp_path / "checkpoint", model, optimizer)
    target, target_optimizer = model_and_adam(seed=1)
    load_checkpoint(tmp_path / "checkpoint", target, target_optimizer)
    assert len(target_optimizer.state) == len(optimizer.state) == 2  # used.weight, used.bias
    for mine, theirs in zip(target_optimizer.state.values(), optimizer.state.values(), strict=True):
        assert state_dicts_equal(mine, theirs)


def test_rng_state_restores_torch_python_and_numpy():
    import random

    import numpy as np

    state = rng_state()
    first = (torch.rand(3), random.random(), np.random.rand())
    set_rng_state(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


# --- bad checkpoints: a clear error naming the file, and nothing changed ------------------------------------

@pytest.fixture
def saved(tmp_path):
    model, optimizer, scheduler = trained(seed=0)
    return save_checkpoint(tmp_path / "checkpoint", model, optimizer, scheduler, progress=Progress(step=2))


def assert_refused(path, match, model=None):
    """Loading ``path`` raises CheckpointError matching ``match`` and leaves model and optimizer unchanged."""
    model, optimizer, scheduler = (model, None, None) if model is not None else trained(seed=1)
    optimizer = optimizer or torch.optim.Adam(model.parameters())
    before = {key: value.clone() for key, value in model.state_dict().items()}
    optimizer_before = pickle.dumps(optimizer.state_dict())
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, model, optimizer, scheduler)
    assert state_dicts_equal(model.state_dict(), before)
    assert pickle.dumps(optimizer.state_dict()) == optimizer_before


def test_truncated_weights_are_refused(saved):
    file = saved / MODEL_FILE
    file.write_bytes(file.read_bytes()[:200])
    assert_refused(saved, f"^{file}: not a readable safetensors file, it may be truncated or damaged")


def test_truncated_state_is_refused(saved):
    file = saved / STATE_FILE
    file.write_bytes(file.read_bytes()[:300])
    assert_refused(saved, f"^{file}: not a readable torch.save file, it may be truncated or damaged")


def test_weights_of_another_model_are_refused(saved):
    file = saved / MODEL_FILE
    assert_refused(saved, rf"^{file}: saved from a different model than Tiny; different shape or dtype: "
                          rf"linear.weight \(4, 3\) torch.float32 \(the model has \(5, 3\) torch.float32\)",
                   model=Tiny(width=5))
    other = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    assert_refused(saved, f"^{file}: saved from a different model than Sequential; missing: 0.weight, 0.bias, "
                          f"1.weight ... and 1 more; unexpected: linear.bias, linear.weight, norm.bias ... and 1 more",
                   model=other)


class Payload:
    """Unpickling this runs code: it creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_a_pickle_with_code_is_refused_without_running_it(saved, tmp_path):
    marker = tmp_path / "code-ran"
    file = saved / STATE_FILE
    torch.save({"optimizer": Payload(marker)}, file)
    assert_refused(saved, f"^{file}: refused to load: it holds more than tensors and plain data, which could run "
                          r"code when unpickled \(Unsupported global: GLOBAL exec was not an allowed global by "
                          r"default.\)$")
    assert not marker.exists()
    pickle.loads(pickle.dumps(Payload(marker)))  # the payload is live: plain unpickling runs it
    assert marker.exists()


def test_missing_files_are_named(saved, tmp_path):
    (saved / STATE_FILE).unlink()
    assert_refused(saved, f"^{saved / STATE_FILE}: missing; a checkpoint folder holds model.safetensors and state.pt")
    (saved / MODEL_FILE).unlink()
    assert_refused(saved, f"^{saved / MODEL_FILE}: missing")
    assert_refused(tmp_path / "nowhere", f"^{tmp_path / 'nowhere'}: no such checkpoint folder")


def test_an_optimizer_with_other_groups_is_refused(saved):
    model = trained(seed=1)[0]
    two_groups = torch.optim.Adam([{"params": model.linear.parameters()}, {"params": model.norm.parameters()}])
    with pytest.raises(CheckpointError, match=rf"^{saved / STATE_FILE}: the optimizer's parameter groups differ: "
                                              r"saved \[4\] tensors per group, this optimizer has \[2, 2\]"):
        load_checkpoint(saved, model, two_groups)


# --- bad sharded checkpoints (FSDP2): DCP's files, read without unpickling code ------------------------------

@pytest.fixture
def sharded_saved(process_group, tmp_path):
    model, optimizer, scheduler = trained(seed=0, sharded=True)
    return save_checkpoint(tmp_path / "sharded-checkpoint", model, optimizer, scheduler, progress=Progress(step=2))


def test_sharded_metadata_with_code_is_refused_without_running_it(sharded_saved, tmp_path):
    marker = tmp_path / "code-ran"
    folder = sharded_saved / SHARDED_DIR
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    assert_refused(sharded_saved, f"^{folder / '.metadata'}: refused to load: it names more than DCP's metadata "
                                  r"types, which could run code when unpickled \(global 'builtins.exec' is not one of "
                                  r"DCP's metadata types\)$", model=Tiny())
    assert not marker.exists()
    with pytest.raises(AttributeError):  # the payload is live: DCP's own reader runs it (pickle.load), then fails
        FileSystemReader(folder).read_metadata()
    assert marker.exists()


def test_entries_stored_as_pickled_bytes_are_refused(sharded_saved):
    file = sharded_saved / SHARDED_DIR / ".metadata"
    metadata = pickle.loads(file.read_bytes())  # written by this test: safe to unpickle here
    metadata.state_dict_metadata["model.note"] = BytesStorageMetadata()  # DCP reads these with weights_only=False
    file.write_bytes(pickle.dumps(metadata))
    assert_refused(sharded_saved, f"^{file}: refused to load: 'model.note' is stored as pickled bytes, which DCP "
                                  f"unpickles with code allowed; these checkpoints hold tensors only$", model=Tiny())


def test_damaged_or_missing_shard_files_are_named(sharded_saved):
    folder = sharded_saved / SHARDED_DIR
    data, metadata = folder / "__0_0.distcp", folder / ".metadata"
    data.write_bytes(data.read_bytes()[:100])
    assert_refused(sharded_saved, rf"^{data}: truncated: 100 bytes, the metadata places data up to byte [\d,]+$",
                   model=Tiny())
    data.unlink()
    assert_refused(sharded_saved, f"^{data}: missing; {metadata} lists it$", model=Tiny())
    metadata.write_bytes(metadata.read_bytes()[:50])
    assert_refused(sharded_saved, f"^{metadata}: not a readable DCP metadata file, it may be truncated or damaged",
                   model=Tiny())
    metadata.unlink()
    assert_refused(sharded_saved, f"^{metadata}: missing; a sharded model's checkpoint folder holds sharded/ "
                                  rf"\(.metadata and the shards\) and state.pt$", model=Tiny())


def test_shards_of_another_model_are_refused(sharded_saved):
    assert_refused(sharded_saved, rf"^{sharded_saved / SHARDED_DIR}: saved from a different model than Tiny; different "
                                  rf"shape or dtype: linear.weight \(4, 3\) torch.float32 \(the model has \(5, 3\) "
                                  rf"torch.float32\)", model=Tiny(width=5))


def test_resuming_across_layouts_is_refused_and_weights_alone_load(saved, sharded_saved):
    """Optimizer state saved sharded does not go into an unsharded run, nor the other way round."""
    assert_refused(sharded_saved, f"^{sharded_saved}: saved from a sharded model, loaded with its optimizer into an "
                                  f"unsharded one; training continues exactly only as it was saved")
    model, optimizer, _ = trained(seed=1, sharded=True)
    before = {key: value.clone() for key, value in full_weights(model).items()}
    with pytest.raises(CheckpointError, match=f"^{saved}: saved from an unsharded model, loaded with its optimizer "
                                              f"into a sharded one"):
        load_checkpoint(saved, model, optimizer)
    assert state_dicts_equal(full_weights(model), before)
    load_checkpoint(saved, model)  # the weights alone
    assert state_dicts_equal(full_weights(model), load_file(saved / MODEL_FILE))


# --- a folder of checkpoints: latest, best, keep, atomic ----------------------------------------------------

def test_latest_best_and_keep(tmp_path):
    model, optimizer, scheduler = trained()
    checkpoints = Checkpoints(tmp_path, keep=2)
    assert checkpoints.latest() is None and checkpoints.best() is None
    for step in range(1, 6):
        checkpoints.save(model, optimizer, scheduler, Progress(step=step), best=step == 2)
    assert checkpoints.latest() == tmp_path / "step-000005"
    assert checkpoints.best() == tmp_path / "step-000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "latest", "step-000002", "step-000004",
                                                          "step-000005"]


def test_a_broken_pointer_is_named(tmp_path):
    (tmp_path / "latest").write_text("step-000009\n")
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'latest'}: names 'step-000009', which is not in"):
        Checkpoints(tmp_path).latest()
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match="expected the name of a checkpoint folder like 'step-000012'"):
        Checkpoints(tmp_path).latest()


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer, scheduler = trained()
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save(model, optimizer, scheduler, Progress(step=1))
    real_save = torch.save

    def save_half_then_fail(obj, path):
        real_save(obj, path)
        Path(path).write_bytes(Path(path).read_bytes()[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'step-000002'}: not saved \(OSError: \[Errno 28\] No "
                                              r"space left on device\)$") as refused:
        checkpoints.save(model, optimizer, scheduler, Progress(step=2))
    assert isinstance(refused.value.__cause__, OSError)
    monkeypatch.undo()
    assert checkpoints.latest() == tmp_path / "step-000001" and not (tmp_path / "step-000002").exists()
    load_checkpoint(checkpoints.latest(), *trained(seed=1))  # still loads
    assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    checkpoints.save(model, optimizer, scheduler, Progress(step=3))  # the next save clears what the dead one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001", "step-000003"]


def test_saving_the_same_step_again_replaces_it_under_a_new_name(tmp_path):
    """The old folder goes only once ``latest`` names the new one: a kill in between leaves one that loads."""
    checkpoints = Checkpoints(tmp_path)
    for seed in (0, 1, 2):
        model, optimizer, scheduler = trained(seed)
        checkpoints.save(model, optimizer, scheduler, Progress(step=1))
    loaded = trained(seed=3)[0]
    load_checkpoint(checkpoints.latest(), loaded)
    assert state_dicts_equal(loaded.state_dict(), model.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001-3"]


# --- the contract, case by case: one CheckpointError naming the file, the cause kept, nothing changed -----------

def refused(path, match, model, optimizer=None, scheduler=None, resume_with=None, check=None, scaler=None):
    """Loading ``path`` (or resuming from its folder, ``resume_with`` a loader, ``check`` as fit's) raises one
    CheckpointError matching
    ``match``, whose cause is the exception it comes from, if any; model, optimizer, scheduler, gradient scaler and
    the classes a checkpoint's pickles name are unchanged. Returns the error."""
    before, classes = snapshot(model, optimizer, scheduler), class_attributes()
    scaler_before = None if scaler is None else scaler.state_dict()
    try:
        with pytest.raises(CheckpointError, match=match) as caught:
            if resume_with is None:
                load_checkpoint(path, model, optimizer, scheduler, scaler)
            else:
                Checkpoints(path).resume(model, optimizer, scheduler, resume_with, scaler=scaler,
                                         **({} if check is None else {"check": check}))
    finally:
        changed = restore_class_attributes(classes)  # the rest of the session needs them, whatever happened
    assert not changed, f"classes changed by loading: {changed}"
    assert caught.value.__cause__ is caught.value.__context__, "the cause was dropped or replaced"
    after = snapshot(model, optimizer, scheduler)
    assert state_dicts_equal(after[0], before[0]) and after[1].keys() == before[1].keys()
    assert all(state_dicts_equal(after[1][key], before[1][key]) for key in before[1])
    assert after[2:] == before[2:]
    assert scaler is None or scaler.state_dict() == scaler_before
    return caught.value


def snapshot(model, optimizer, scheduler):
    """Copies of everything loading may change: full weights, optimizer state (local tensors) and settings,
    scheduler state."""
    weights = {key: value.clone() for key, value in full_weights(model).items()}
    state = {} if optimizer is None else {
        index: {name: (value.to_local() if hasattr(value, "to_local") else value).clone()
                for name, value in optimizer.state[p].items()}
        for index, p in enumerate(p for group in optimizer.param_groups for p in group["params"])
        if p in optimizer.state}
    groups = None if optimizer is None else repr([{k: v for k, v in g.items() if k != "params"}
                                                  for g in optimizer.param_groups])
    return weights, state, groups, None if scheduler is None else repr(scheduler.state_dict())


def class_attributes() -> dict:
    """The attributes of every class (and enum member) a checkpoint's pickles may name, by object."""
    import pathlib

    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    objects = [pathlib.Path, pathlib.PurePath, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath,
               pathlib.PureWindowsPath, _StorageInfo, torch.Size, *(getattr(metadata, name) for name in (
                   "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                   "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
               *metadata._MEM_FORMAT_ENCODING]
    return {obj: dict(vars(obj)) for obj in objects}


def restore_class_attributes(saved: dict) -> list[str]:
    """Put back every attribute ``class_attributes`` saw; the names of those that had changed."""
    changed = []
    for obj, attributes in saved.items():
        for name in set(vars(obj)) | set(attributes):
            if vars(obj).get(name, saved) is not attributes.get(name, saved):
                changed.append(f"{getattr(obj, '__name__', obj)}.{name}")
                if name in attributes:
                    type.__setattr__(obj, name, attributes[name]) if isinstance(obj, type) else \
                        obj.__dict__.__setitem__(name, attributes[name])
                else:
                    type.__delattr__(obj, name) if isinstance(obj, type) else obj.__dict__.pop(name)
    return changed


def rewrite_metadata(checkpoint, change) -> Path:
    """Apply ``change`` to the checkpoint's DCP metadata (unpickled here: the test wrote it) and write it back."""
    file = checkpoint / SHARDED_DIR / ".metadata"
    metadata = pickle.loads(file.read_bytes())
    change(metadata)
    file.write_bytes(pickle.dumps(metadata))
    return file


class Reduce:
    """Pickles as ``function(*arguments)``, then BUILD with ``state`` if given: a way to craft a pickle."""

    def __init__(self, function, arguments=(), state=None):
        self.reduced = (function, arguments) if state is None else (function, arguments, state)

    def __reduce__(self):
        return self.reduced


@pytest.mark.parametrize("build", ["path class", "metadata class", "enum member"])
def test_a_pickle_that_sets_attributes_of_a_shared_object_is_refused_and_changes_nothing(sharded_saved, build):
    """Pickle's BUILD sets attributes of any object: of an allowed class (PosixPath.exists = None, for every
    later caller in the process), or of an enum member it looked up. Only fresh instances may be built."""
    file = sharded_saved / SHARDED_DIR / ".metadata"
    if build == "path class":  # GLOBAL pathlib.PosixPath; state (None, {"exists": None}); BUILD
        file.write_bytes(b"\x80\x04cpathlib\nPosixPath\nN}\x8c\x06existsNs\x86b.")
        what = "the class pathlib.PurePosixPath"  # what PosixPath is read as (checkpoint_files.PATHS)
    elif build == "metadata class":
        file.write_bytes(b"\x80\x04ctorch.distributed.checkpoint.metadata\nTensorStorageMetadata\n"
                         b"N}\x8c\x06__eq__Ns\x86b.")
        what = "the class torch.distributed.checkpoint.metadata.TensorStorageMetadata"
    else:  # _MEM_FORMAT_ENCODING(0), the member TORCH_CONTIGUOUS_FORMAT; BUILD {"_value_": 7}
        from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
        file.write_bytes(pickle.dumps(Reduce(_MEM_FORMAT_ENCODING, (0,), {"_value_": 7}), protocol=4))
        what = "a _MEM_FORMAT_ENCODING"
    assert len(file.read_bytes()) < 120
    error = refused(sharded_saved, rf"^{file}: refused to load: it sets attributes of {what} \(BUILD\), which ", Tiny())
    assert "BUILD" in str(error.__cause__)


def test_a_length_field_larger_than_the_file_is_refused_before_memory_is_allocated(sharded_saved):
    file = sharded_saved / SHARDED_DIR / ".metadata"
    file.write_bytes(b"\x80\x04\x8e" + (2**62).to_bytes(8, "little") + b"x.")  # BINBYTES8 of 2**62 bytes
    error = refused(sharded_saved, rf"^{file}: not a readable DCP metadata file, it may be truncated or damaged \(a "
                                   r"length field at byte 11 claims 4,611,686,018,427,387,904 bytes; 2 remain\)$",
                    Tiny())
    assert isinstance(error.__cause__, EOFError)


def test_an_error_raised_while_unpickling_is_one_checkpoint_error(sharded_saved):
    """TensorProperties.__setstate__ raises RuntimeError for a memory-format code it does not know."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    def bad_properties(metadata):
        metadata.state_dict_metadata["model.linear.weight"].properties = Reduce(
            TensorProperties, (), (torch.float32, torch.strided, False, "no such code", False))

    file = rewrite_metadata(sharded_saved, bad_properties)
    error = refused(sharded_saved, rf"^{file}: not a readable DCP metadata file, it may be truncated or damaged "
                                   r"\(Invalid torch.memory_format encoding: no such code\)$", Tiny())
    assert isinstance(error.__cause__, RuntimeError)


def overlapping_chunks(metadata, name):
    """Two chunks of ``name`` (4 values) that hold 4 values together but overlap, each with its place."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    place = next(place for index, place in metadata.storage_data.items() if index.fqn == name)
    metadata.state_dict_metadata[name].chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([2])),
                                                 ChunkStorageMetadata(torch.Size([1]), torch.Size([2]))]
    metadata.storage_data[MetadataIndex(name, (1,))] = place


@pytest.mark.parametrize(("change", "problem"), [
    (lambda m: setattr(next(iter(m.storage_data.values())), "offset", "0"),
     r"model.linear.weight: its place in a data file is \['__0_0.distcp', '0', \d+\]"),
    (lambda m: setattr(m.state_dict_metadata["model.linear.weight"], "properties", None),
     "model.linear.weight: its properties are not a TensorProperties with a dtype"),
    (lambda m: setattr(m, "state_dict_metadata", [1, 2]), "state_dict_metadata is not a dict of names"),
    (lambda m: m.state_dict_metadata["model.linear.weight"].chunks[0].__dict__.update(sizes=torch.Size([2, 3])),
     "model.linear.weight: its chunks hold 6 of its 12 values"),
    (lambda m: overlapping_chunks(m, "model.norm.bias"), r"model.norm.bias: the chunks at \(0,\) and \(1,\) overlap"),
], ids=["offset-as-text", "properties-none", "entries-a-list", "chunks-short", "chunks-overlap"])
def test_fields_of_the_wrong_type_or_size_are_refused(sharded_saved, change, problem):
    """Checked field by field: otherwise AttributeError or TypeError in the checks, or (chunks that cover only part
    of a tensor) DCP reads half of it and the rest keeps the values the model had."""
    file = rewrite_metadata(sharded_saved, change)
    refused(sharded_saved, rf"^{file}: not DCP metadata as torch.distributed.checkpoint writes it: {problem}$", Tiny())


def test_a_checkpoint_saved_on_windows_reads_on_linux(sharded_saved, tmp_path):
    """DCP records where it saved as the OS's Path class; each OS refuses to make the other's (Linux a
    WindowsPath, Windows a PosixPath). Read as pure paths, the metadata loads on every OS."""
    import pathlib

    def saved_on_windows(metadata):
        metadata.storage_meta.checkpoint_id = Reduce(pathlib.WindowsPath, ("C:\\runs", "step-000002", "sharded"))

    rewrite_metadata(sharded_saved, saved_on_windows)
    metadata = read_shard_metadata(sharded_saved / SHARDED_DIR)
    assert metadata.storage_meta.checkpoint_id == pathlib.PureWindowsPath(r"C:\runs\step-000002\sharded")
    model, optimizer, scheduler = trained(seed=1, sharded=True)
    load_checkpoint(sharded_saved, model, optimizer, scheduler)
    assert state_dicts_equal(full_weights(model), full_weights(trained(seed=0, sharded=True)[0]))


def test_a_shard_dcp_cannot_read_is_one_checkpoint_error_and_changes_nothing(sharded_saved):
    """DCP's failures are CheckpointException, a BaseException that `except Exception` misses; the model and the
    optimizer take nothing from a load that failed halfway. The message is the reader's, naming the chunk."""
    data = sharded_saved / SHARDED_DIR / "__0_0.distcp"
    metadata = read_shard_metadata(sharded_saved / SHARDED_DIR)
    last = max(metadata.storage_data.values(), key=lambda place: place.offset)  # read after the others
    damaged = bytearray(data.read_bytes())
    damaged[last.offset:last.offset + 4] = b"\0\0\0\0"  # the zip header of torch.save's bytes for that entry
    data.write_bytes(bytes(damaged))
    model, optimizer, scheduler = trained(seed=1, sharded=True)
    error = refused(sharded_saved, rf"^{data}: the chunk of [\w.]+ at \(\d+,\): not a readable torch.save tensor, it "
                                   r"may be damaged \(Unsupported operand 0\)$", model, optimizer, scheduler)
    assert type(error.__cause__).__name__ == "CheckpointException"  # DCP's, holding the reader's error


@pytest.mark.parametrize(("change", "problem"), [
    (lambda m: setattr(m.state_dict_metadata["optimizer.state.linear.weight.exp_avg"].properties, "dtype",
                       torch.float64),
     r"linear.weight: saved exp_avg \(4, 3\) torch.float64, exp_avg_sq \(4, 3\) torch.float32, step \(\) "
     r"torch.float32, this optimizer keeps exp_avg \(4, 3\) torch.float32"),
    (lambda m: m.state_dict_metadata.pop("optimizer.state.norm.bias.exp_avg_sq"),
     r"norm.bias: saved exp_avg \(4,\) torch.float32, step \(\) torch.float32, this optimizer keeps exp_avg "),
], ids=["dtype", "missing-moment"])
def test_optimizer_entries_are_checked_against_the_optimizer_before_dcp_reads_them(sharded_saved, change, problem):
    """Otherwise DCP casts a float64 moment silently, or fails on a missing one with CheckpointException."""
    file = rewrite_metadata(sharded_saved, change)
    model, optimizer, scheduler = trained(seed=1, sharded=True)
    refused(sharded_saved, rf"^{file}: the optimizer state saved does not fit this optimizer: {problem}", model,
            optimizer, scheduler)


class WithUnused(nn.Module):
    """Tiny with a layer that forward never uses, as Net with --keep-pooler: Adam makes no state for it."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = Tiny(), nn.Linear(3, 3)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_a_parameter_without_optimizer_state_resumes_exactly(sharded, process_group, tmp_path):
    """FSDP2 with --keep-pooler died on resume: 'Missing key in checkpoint state_dict:
    optimizer.state.bert.pooler.dense.weight.step' (the fresh optimizer asked for the pooler's state)."""
    def start(seed):
        torch.manual_seed(seed)
        model = WithUnused()
        if sharded:
            fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(model, optimizer):
        model(torch.randn(5, 3, generator=torch.Generator().manual_seed(len(optimizer.state) + 7))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = start(seed=0)
    step(model, optimizer)
    save_checkpoint(tmp_path / "checkpoint", model, optimizer)
    resumed, resumed_optimizer = start(seed=1)
    load_checkpoint(tmp_path / "checkpoint", resumed, resumed_optimizer)
    assert len(resumed_optimizer.state) == len(optimizer.state) == 4  # used.linear and used.norm, not unused
    step(model, optimizer)
    step(resumed, resumed_optimizer)
    assert state_dicts_equal(full_weights(resumed), full_weights(model))


@pytest.mark.parametrize(("file_name", "damage", "cause"), [
    (MODEL_FILE, lambda data: data[:200], "SafetensorError"),
    (STATE_FILE, lambda data: data[:300], "RuntimeError"),
    (STATE_FILE, None, "UnpicklingError"),
])
def test_every_refusal_keeps_the_exception_it_comes_from_as_its_cause(saved, file_name, damage, cause):
    file = saved / file_name
    if damage is None:
        torch.save({"optimizer": Payload(saved / "marker")}, file)
    else:
        file.write_bytes(damage(file.read_bytes()))
    model, optimizer, scheduler = trained(seed=1)
    error = refused(saved, f"^{file}: ", model, optimizer, scheduler)
    assert type(error.__cause__).__name__ == cause


def with_state(checkpoint, change) -> Path:
    """Apply ``change`` to the checkpoint's state.pt (loaded here: the test wrote it) and save it back."""
    file = checkpoint / STATE_FILE
    state = torch.load(file, weights_only=True)
    change(state)
    torch.save(state, file)
    return file


@pytest.mark.parametrize(("change", "problem"), [
    (lambda s: s["scheduler"].update(last_epoch="2"), "the scheduler state differs from this LambdaLR's: "
                                                      r"'last_epoch' saved as '2', it has 0"),
    (lambda s: s["scheduler"].update(optimizer=None), "the scheduler state differs from this LambdaLR's: "
                                                      "'optimizer' saved, which it does not have"),
    (lambda s: s["optimizer"]["param_groups"][0].update(lr="0.1"),
     r"the optimizer's settings differ in group 0: 'lr' saved as '0.1', it has [\d.]+$"),
    (lambda s: s["progress"].update(steps=1), r"not a checkpoint's state as save_checkpoint writes it: progress: "
                                              r"holds \['step', 'epoch', 'batch', 'skipped_steps', 'history', "
                                              r"'steps'\]"),
], ids=["scheduler-type", "scheduler-extra", "optimizer-setting", "progress-extra"])
def test_state_of_the_wrong_kind_is_refused_before_loading(saved, change, problem):
    """Otherwise load_state_dict sets a text where a number belongs (the scheduler even takes any key as an
    attribute), and the run fails later, far from the file."""
    file = with_state(saved, change)
    model, optimizer, scheduler = trained(seed=1)
    scheduler.last_epoch = 0
    refused(saved, rf"^{file}: {problem}", model, optimizer, scheduler)


def saved_run(directory, **progress):
    """A Checkpoints folder with one checkpoint of ``trained()`` as fit saves it (random and data order states)."""
    model, optimizer, scheduler = trained(seed=0)
    loader = torch.utils.data.DataLoader(range(8), shuffle=True, generator=torch.Generator().manual_seed(0))
    progress = Progress(**{"step": 2, "epoch": 0, "batch": 2} | progress)
    progress.epoch_start = epoch_start_state(loader)
    Checkpoints(directory).save(model, optimizer, scheduler, progress)
    return Checkpoints(directory).latest(), loader


@pytest.mark.parametrize(("change", "problem"), [
    (lambda s: s["per_process"][0]["rng"].update(torch=torch.zeros(3, dtype=torch.uint8)),
     r"per_process\[0\]: rng: Expected a CPUGeneratorImplState of size 5056 but found the input RNG state size "
     r"to be 3$"),
    (lambda s: s["per_process"][0]["epoch_start"].update(loader=torch.zeros(3)),
     r"per_process\[0\]: epoch_start: loader: "),
    (lambda s: s["progress"].update(step=-1), "progress: step, epoch, batch and skipped_steps are not counts"),
], ids=["rng", "loader-rng", "negative-step"])
def test_resuming_checks_random_states_and_progress_before_loading(tmp_path, change, problem):
    """Otherwise they fail after the weights were loaded, halfway through a resume."""
    path, loader = saved_run(tmp_path)
    file = with_state(path, change)
    model, optimizer, scheduler = trained(seed=1)
    refused(tmp_path, rf"^{file}: not a checkpoint's state as save_checkpoint writes it: {problem}", model,
            optimizer, scheduler, resume_with=loader)


def test_a_checkpoint_of_another_batch_size_is_refused_before_loading(tmp_path):
    """fit's check that the run can stand where the checkpoint does (check_steps) runs before anything is loaded."""
    from helpers.train import check_steps

    path, loader = saved_run(tmp_path, step=3, batch=3)
    model, optimizer, scheduler = trained(seed=1)
    refused(tmp_path, rf"^{path / STATE_FILE}: the checkpoint stands at optimizer step 3 \(epoch 1, batch 3\), where a "
                      "run of 8 batches per epoch and 2 per optimizer step never stands", model, optimizer, scheduler,
            resume_with=loader, check=lambda progress: check_steps(progress, batches=8, accumulation=2))


# --- the gradient scaler of fp16 training: one more part of state.pt -----------------------------------------

SCALER = {"scale": 512.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 7, "_growth_tracker": 3}
"""A GradScaler's state after a few skipped steps and 3 good ones, with factors of its own: no default in it."""


def scaler(state=None, **settings):
    """A GradScaler with SCALER's settings (or ``settings``), a new one's scale, or ``state``."""
    scaler = torch.amp.GradScaler("cpu", **({"growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 7}
                                            | settings))
    if state is not None:
        scaler.load_state_dict(state)
    return scaler


@pytest.fixture
def saved_with_scaler(tmp_path):
    model, optimizer, scheduler = trained(seed=0)
    return save_checkpoint(tmp_path / "checkpoint", model, optimizer, scheduler, scaler=scaler(SCALER),
                           progress=Progress(step=2, skipped_steps=1))


def test_a_gradient_scalers_state_round_trips(saved_with_scaler):
    assert torch.load(saved_with_scaler / STATE_FILE, weights_only=True)["scaler"] == SCALER
    model, optimizer, scheduler = trained(seed=1)
    fresh = scaler()
    state = load_checkpoint(saved_with_scaler, model, optimizer, scheduler, fresh)
    assert fresh.state_dict() == SCALER and state["progress"]["skipped_steps"] == 1
    scaled = fresh.scale(torch.ones(()))  # the scale it goes on with is the saved one, not a new scaler's 65536
    assert scaled.item() == SCALER["scale"]


def test_a_scaler_with_other_settings_is_refused_naming_the_setting(saved_with_scaler):
    """A checkpoint another run wrote: its scale and count would go on under other growth rules."""
    refused(saved_with_scaler, rf"^{saved_with_scaler / STATE_FILE}: the gradient scaler's state differs from this "
            r"GradScaler's: 'growth_interval' saved as 7, it has 2000$", *trained(seed=1),
            scaler=scaler(growth_interval=2000))


def test_resuming_without_the_scaler_a_checkpoint_was_saved_with_is_refused(saved_with_scaler):
    model, optimizer, scheduler = trained(seed=1)
    refused(saved_with_scaler, rf"^{saved_with_scaler / STATE_FILE}: saved with a gradient scaler \(fp16 mixed "
            r"precision, --amp fp16\), resumed without one; resume with one to continue exactly", model, optimizer,
            scheduler)
    load_checkpoint(saved_with_scaler, model)  # its weights alone load anywhere
    assert state_dicts_equal(model.state_dict(), trained(seed=0)[0].state_dict())


def test_resuming_with_a_scaler_from_a_checkpoint_saved_without_one_is_refused(saved):
    model, optimizer, scheduler = trained(seed=1)
    refused(saved, rf"^{saved / STATE_FILE}: saved without a gradient scaler \(in fp32 or bf16\), resumed with one "
            r"\(fp16 mixed precision, --amp fp16\); resume with the precision it was saved with$", model, optimizer,
            scheduler, scaler=scaler(SCALER))


def test_a_state_saved_before_the_scaler_was_a_part_loads_as_one_without_a_scaler(saved):
    """Checkpoints written before fp16 training lack the part "scaler" and progress's skipped_steps: that run had
    no scaler and skipped no step."""
    file = with_state(saved, lambda s: (s.pop("scaler"), s["progress"].pop("skipped_steps")))
    assert "scaler" not in torch.load(file, weights_only=True)
    model, optimizer, scheduler = trained(seed=1)
    state = load_checkpoint(saved, model, optimizer, scheduler)
    assert state["scaler"] is None and state["progress"]["skipped_steps"] == 0
    refused(saved, r"saved without a gradient scaler", *trained(seed=1), scaler=scaler())


@pytest.mark.parametrize(("change", "problem"), [
    (lambda s: s["scaler"].pop("_growth_tracker"), r"scaler: holds \['scale', 'growth_factor', 'backoff_factor', "
                                                   r"'growth_interval'\], not a GradScaler's \['scale', "),
    (lambda s: s["scaler"].update(scale="512"), r"scaler: not a GradScaler's scale, factors and counts: "),
    (lambda s: s["scaler"].update(scale=float("inf")), r"scaler: not a GradScaler's scale, factors and counts: "),
    (lambda s: s["scaler"].update(growth_interval=7.0), r"scaler: not a GradScaler's scale, factors and counts: "),
    (lambda s: s["progress"].update(skipped_steps=-1), r"progress: step, epoch, batch and skipped_steps are not "),
], ids=["entry-missing", "scale-text", "scale-inf", "interval-float", "negative-skipped"])
def test_a_damaged_scaler_part_is_refused_before_loading(saved_with_scaler, change, problem):
    file = with_state(saved_with_scaler, change)
    refused(saved_with_scaler, rf"^{file}: not a checkpoint's state as save_checkpoint writes it: {problem}",
            *trained(seed=1), scaler=scaler())


# --- all or nothing: a failure while loading puts everything back; opening touches nothing ----------------------

def test_a_failure_while_loading_puts_back_everything_already_loaded(saved):
    """The model and the optimizer are loaded when the optimizer's load hook raises: both go back, bit for bit."""
    model, optimizer, scheduler = trained(seed=1)

    def failing(optimizer):
        raise RuntimeError("a load hook failed")

    optimizer.register_load_state_dict_post_hook(failing)
    error = refused(saved, rf"^{saved}: not loaded, and everything is as it was \(RuntimeError: a load hook "
                           r"failed\)$", model, optimizer, scheduler)
    assert isinstance(error.__cause__, RuntimeError)


def test_a_resume_that_fails_while_loading_puts_back_the_random_state_too(tmp_path):
    path, loader = saved_run(tmp_path)
    model, optimizer, scheduler = trained(seed=1)
    model.norm.register_load_state_dict_post_hook(lambda module, keys: 1 / 0)  # after the weights were copied
    torch.manual_seed(5)
    random_state = torch.get_rng_state()
    refused(tmp_path, rf"^{path}: not loaded, and everything is as it was \(ZeroDivisionError: division by zero\)$",
            model, optimizer, scheduler, resume_with=loader)
    assert torch.equal(torch.get_rng_state(), random_state)


def test_opening_fires_no_hook_and_makes_no_state_on_an_optimizer_that_has_not_stepped(saved):
    """The old way learnt the state's shapes with a step of learning rate 0 on the caller's optimizer."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from helpers.checkpoint import open_checkpoint

    model, optimizer, scheduler = trained(seed=1)
    fresh = torch.optim.Adam(model.parameters(), lr=1e-2)
    fired = []
    handles = [register_optimizer_step_pre_hook(lambda *args: fired.append("global step")),
               fresh.register_step_pre_hook(lambda *args: fired.append("step")),
               fresh.register_state_dict_pre_hook(lambda *args: fired.append("state_dict"))]
    try:
        scheduler = torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 1 / (1 + step))
        open_checkpoint(saved, model, fresh, scheduler)
        assert len(fresh.state) == 0 and all(p.grad is None for p in model.parameters())
        load_checkpoint(saved, model, fresh, scheduler)
    finally:
        for handle in handles:
            handle.remove()
    assert fired == [] and len(fresh.state) == 4
