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

from helpers.checkpoint import (MODEL_FILE, STATE_FILE, CheckpointError, Checkpoints, Progress, full_weights,
                                load_checkpoint, rng_state, save_checkpoint, set_rng_state, state_dicts_equal)
from helpers.checkpoint_files import SHARDED_DIR, read_shard_metadata, saved_tensors
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
    progress = Progress(step=7, epoch=1, batch=3, history=[{"epoch": 1, "val_loss": 0.5}])
    save_checkpoint(tmp_path / "checkpoint", model, optimizer, scheduler, progress=progress)
    model2, optimizer2, scheduler2 = trained(seed=1)
    state = load_checkpoint(tmp_path / "checkpoint", model2, optimizer2, scheduler2)
    assert state["progress"] == {"step": 7, "epoch": 1, "batch": 3, "history": [{"epoch": 1, "val_loss": 0.5}]}
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
    with pytest.raises(OSError, match="No space left"):
        checkpoints.save(model, optimizer, scheduler, Progress(step=2))
    monkeypatch.undo()
    assert checkpoints.latest() == tmp_path / "step-000001" and not (tmp_path / "step-000002").exists()
    load_checkpoint(checkpoints.latest(), *trained(seed=1))  # still loads
    assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    checkpoints.save(model, optimizer, scheduler, Progress(step=3))  # the next save clears what the dead one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001", "step-000003"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    for seed in (0, 1):
        model, optimizer, scheduler = trained(seed)
        checkpoints.save(model, optimizer, scheduler, Progress(step=1))
    loaded = trained(seed=2)[0]
    load_checkpoint(checkpoints.latest(), loaded)
    assert state_dicts_equal(loaded.state_dict(), model.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]
