"""unwrap() finds the model inside DataParallel, DDP, torch.compile and any nesting of them."""

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from helpers.distributed import leave_process_group
from helpers.wrapping import unwrap

SRC = Path(__file__).resolve().parents[1] / "src"


def test_plain_model_is_returned_as_is():
    net = nn.Linear(2, 2)
    assert unwrap(net) is net


def test_data_parallel_and_compile_in_any_nesting():
    net = nn.Linear(2, 2)
    assert unwrap(nn.DataParallel(net)) is net
    assert unwrap(torch.compile(net)) is net
    assert unwrap(nn.DataParallel(torch.compile(nn.DataParallel(net)))) is net


def test_a_wrapper_that_forwards_attributes_is_not_skipped():
    """Only a direct child named _orig_mod counts: torch.compile's wrapper answers every attribute lookup it lacks
    from the model inside, and so may any wrapper of one; unwrap stops at a wrapper it does not know."""

    class Forwarding(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

    net = nn.Linear(2, 2)
    outer = Forwarding(torch.compile(net))
    assert outer._orig_mod is net  # the lookup is forwarded
    assert unwrap(outer) is outer
    assert unwrap(nn.DataParallel(outer)) is outer


def test_a_model_with_an_orig_mod_attribute_that_is_no_module_is_returned_as_is():
    net = nn.Linear(2, 2)
    net._orig_mod = "not a module"
    assert unwrap(net) is net


def test_unwrap_imports_no_private_torch_module():
    """torch._dynamo (where torch.compile's wrapper class lives) is private and slow to import: unwrapping models
    that torch.compile never touched leaves it unimported."""
    code = ("import sys\n"
            "from torch import nn\n"
            "from helpers.wrapping import unwrap\n"
            "net = nn.Linear(2, 2)\n"
            "assert unwrap(nn.DataParallel(nn.DataParallel(net))) is net and unwrap(net) is net\n"
            "print(sorted(name for name in sys.modules if name.startswith('torch._dynamo')))\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_distributed_data_parallel(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        net = nn.Linear(2, 2)
        assert unwrap(DistributedDataParallel(net)) is net
        assert unwrap(torch.compile(DistributedDataParallel(net))) is net
    finally:
        leave_process_group()
