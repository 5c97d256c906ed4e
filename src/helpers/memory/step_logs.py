"""A traced step's events (``StepMemory.log``, helpers.memory.simulated_gpu), re-run with changes, so that one trace
answers more than its own setting:

- ``with_buckets``: DDP's gradient bucket allocated after the weights, as DDP's constructor allocates it;
- ``replica``: what a DataParallel replica does of the step: no optimizer, and its gradients handed over to GPU 0 (and
  freed) when each backward ends;
- ``BatchLine``: two traces of one setting at two batch sizes give the step at any batch size. A step runs the same
  operators in the same order at every batch size, and the bytes of each allocation are a linear function of the
  batch (a reduction's rows too, sized when it runs), so two aligned logs give every other: same events, same keys,
  each size on the line through its two sizes. Where the two logs do not align, or a size is not on a line of whole
  bytes, there is no ``BatchLine`` and the batch must be traced.
"""

from __future__ import annotations

from dataclasses import dataclass

from helpers.memory.gpu_facts import GpuModel
from helpers.memory.simulated_gpu import Event, SimulatedGpu
from helpers.memory.tracer import StepMemory, memory_of_log


def step_memory(gpu: GpuModel, log: list[Event]) -> StepMemory:
    """The readings of ``log`` run on a fresh simulated ``gpu``: what the trace that made the log returned."""
    return memory_of_log(gpu, log)


def reserved(gpu: GpuModel, log: list[Event]) -> int:
    """The bytes reserved once ``log`` has run: its reserved peak, as nothing empties the cache."""
    return SimulatedGpu.run(gpu, log).allocator.reserved


def gradient_bytes(log: list[Event]) -> int:
    """The bytes of the gradients the step's first backward made (every parameter that gets one), from its log."""
    sizes, filed = {}, set()
    for event in log:
        if event[0] == "phase" and event[1] == "optimizer":
            break
        if event[0] == "malloc":
            sizes[event[1]] = event[2]
        elif event[0] == "file" and event[2] == "gradients":
            filed.add(event[1])
    return sum(sizes[key] for key in filed)


def with_buckets(log: list[Event], nbytes: int) -> list[Event]:
    """``log`` with DDP's gradient bucket of ``nbytes`` allocated once the weights are: torch 2.x's DDP puts every
    parameter in one bucket at construction (``compute_bucket_size_limits``: no static graph, no unused parameters) and
    rebuilds the buckets in backward's order after the first step, freeing the one it made first; the rebuilt buckets
    (1 MiB, then up to 25 MiB) add up to the same bytes and take their blocks from that freed segment."""
    start = next(index for index, event in enumerate(log) if event[0] == "phase" and event[1] != "weights")
    return [*log[:start], ("malloc", "DDP bucket", nbytes, "buckets"), *log[start:]]


def replica(log: list[Event]) -> list[Event]:
    """What a DataParallel replica does of a one-device step: it holds the weights, its share of the batch, its
    activations and temporaries, and its gradients until backward ends, when DataParallel reduces them onto GPU 0; it
    holds no optimizer state and runs no optimizer step (nor the GradScaler's). The log must come from a step whose
    ``zero_grad`` frees the gradients (``set_to_none=True``): a replica's gradients are new at every backward."""
    dropped, gradients, out = set(), [], []
    phase, backward = "weights", False
    for event in log:
        kind = event[0]
        if kind == "phase":
            if backward and not event[2]:  # a backward ended: the gradients go to GPU 0's reduction
                out += [("free", key) for key in gradients]
                gradients.clear()
            backward = event[2]
            phase = event[1]
        elif kind == "malloc" and (event[3] == "optimizer" or phase in ("optimizer", "scaler")):
            dropped.add(event[1])
            continue
        elif kind in ("free", "file") and event[1] in dropped:
            continue
        elif kind == "file" and event[2] == "gradients":
            gradients.append(event[1])
        elif kind == "free" and event[1] in gradients:
            gradients.remove(event[1])
        out.append(event)
    return out


def _normal(log: list[Event]) -> list[Event]:
    """``log`` with its allocation keys numbered in the order they first appear, so that logs of two traces compare."""
    names: dict = {}

    def name(key):
        return names.setdefault(key, len(names)) if isinstance(key, int) else key

    return [(kind, name(event[0]), *event[1:]) if kind in ("malloc", "free", "file") else (kind, *event)
            for kind, *event in log]


@dataclass(frozen=True)
class BatchLine:
    """A step's log at any count of examples per micro-batch, from logs traced at two counts (``at``)."""

    first: tuple[int, list[Event]]
    second: tuple[int, list[Event]]

    @classmethod
    def through(cls, first: tuple[int, list[Event]], second: tuple[int, list[Event]]) -> BatchLine | None:
        """The line through two (count, log) pairs of one setting, or None where the logs do not align on one."""
        (a, log_a), (b, log_b) = first, second
        if a == b or len(log_a) != len(log_b):
            return None
        line = cls((a, _normal(log_a)), (b, _normal(log_b)))
        for event_a, event_b in zip(line.first[1], line.second[1]):
            if event_a[0] != event_b[0] or len(event_a) != len(event_b):
                return None
            varying = {"malloc": 2, "reduce": 1}.get(event_a[0])
            if any(x != y for index, (x, y) in enumerate(zip(event_a, event_b)) if index != varying):
                return None
            if varying and (event_b[varying] - event_a[varying]) % (b - a):
                return None
        return line

    def at(self, count: int) -> list[Event]:
        """The log of the step with ``count`` examples per micro-batch; ValueError where a size would be negative."""
        (a, log_a), (b, log_b) = self.first, self.second
        log = []
        for event_a, event_b in zip(log_a, log_b):
            varying = {"malloc": 2, "reduce": 1}.get(event_a[0])
            if varying is None:
                log.append(event_a)
                continue
            size = event_a[varying] + (event_b[varying] - event_a[varying]) // (b - a) * (count - a)
            if size < 0:
                raise ValueError(f"count={count}: {event_a} would take {size} bytes on the line through {a} and {b}")
            log.append((*event_a[:varying], size, *event_a[varying + 1:]))
        return log


def same(log_a: list[Event], log_b: list[Event]) -> bool:
    """Whether two logs are the same events, allocation keys aside."""
    return _normal(log_a) == _normal(log_b)
