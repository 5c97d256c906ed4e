"""Checkpoints: exact round trips between wrappings, atomic saves, and clear errors for bad files."""

import itertools
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from helpers.checkpoint import (MODEL_FILE, STATE_FILE, CheckpointError, Checkpoints, Progress, load_checkpoint,
                                rng_state, save_checkpoint, set_rng_state, state_dicts_equal)
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


def trained(seed=0, width=4):
    """A Tiny model, its Adam optimizer and LambdaLR schedule after two steps, so every state is non-trivial."""
    torch.manual_seed(seed)
    model = Tiny(width)
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
    """A real process group of this one process (gloo), so that DDP can wrap a model."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('rdzv')}/file", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


WRAPPINGS = {
    "plain": lambda model: model,
    "DataParallel": nn.DataParallel,
    "DDP": nn.parallel.DistributedDataParallel,
    "compiled": torch.compile,
}


@pytest.mark.parametrize(("saved_from", "loaded_into"), list(itertools.product(WRAPPINGS, repeat=2)))
def test_round_trip_between_wrappings(saved_from, loaded_into, process_group, tmp_path):
    source = WRAPPINGS[saved_from](trained(seed=0)[0])
    target = WRAPPINGS[loaded_into](trained(seed=1)[0])
    assert not state_dicts_equal(unwrap(target).state_dict(), unwrap(source).state_dict())
    save_checkpoint(tmp_path / "checkpoint", source)
    assert load_file(tmp_path / "checkpoint" / MODEL_FILE).keys() == Tiny().state_dict().keys()  # no prefixes
    load_checkpoint(tmp_path / "checkpoint", target)
    assert state_dicts_equal(unwrap(target).state_dict(), unwrap(source).state_dict())


def test_optimizer_scheduler_and_progress_round_trip(tmp_path):
    model, optimizer, scheduler = trained(seed=0)
    progress = Progress(step=7, epoch=1, batch=3, history=[{"epoch": 1, "val_loss": 0.5}])
    save_checkpoint(tmp_path / "checkpoint", model, optimizer, scheduler, progress=progress)
    model2, optimizer2, scheduler2 = trained(seed=1)
    state = load_checkpoint(tmp_path / "checkpoint", model2, optimizer2, scheduler2)
    assert state["progress"] == {"step": 7, "epoch": 1, "batch": 3, "history": [{"epoch": 1, "val_loss": 0.5}]}
    assert state_dicts_equal(model2.state_dict(), model.state_dict())
    for mine, theirs in zip(optimizer2.state.values(), optimizer.state.values()):
        assert state_dicts_equal(mine, theirs)
    assert scheduler2.state_dict() == scheduler.state_dict() and scheduler2.last_epoch == 2


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
    load_checkpoint(checkpoints.latest(), trained(seed=1)[0], *trained(seed=1)[1:])  # still loads
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
