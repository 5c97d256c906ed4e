import torch
from torch import nn

from helpers.checkpoint import state_dicts_equal


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
