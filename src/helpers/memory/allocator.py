"""PyTorch's CUDA caching allocator, replayed in Python: which block each request gets, and what it counts.

``torch.cuda.max_memory_allocated`` counts whole *blocks*, not the bytes code asked for
(``memory_stats()["requested_bytes.all.peak"]``). A block is at least the request rounded up to 512 bytes, and
more when a cached free block is reused without being split. A prediction of the allocated peak therefore
needs the allocator's rules and the order of every allocation and free of the step. The rules, as read in
c10/cuda/CUDACachingAllocator.cpp (``DeviceCachingAllocator::malloc``, ``get_free_block``, ``should_split``,
``free_block``, ``round_size``, ``get_allocation_size``), default settings (no ``PYTORCH_CUDA_ALLOC_CONF``),
one stream:

- a request is rounded up to a multiple of 512 bytes (512 at least);
- up to 1 MiB it is served from the small pool, above from the large pool;
- the smallest cached free block of that pool that is large enough is taken (the lowest address among equals);
- without one, a new segment is reserved (cudaMalloc): 2 MiB for small requests, 20 MiB for requests under
  10 MiB, else the request rounded up to 2 MiB;
- the block is split when the rest would be at least 512 bytes (small pool) or more than 1 MiB (large pool);
  otherwise the whole block is handed out and counted;
- a freed block merges with free neighbours of its segment and stays cached (reserved) until ``empty_cache``.

Tests replay the allocations of a real CUDA step (the H200 memory snapshot in tests/fixtures) and check that
every request lands at the address the real allocator gave it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512               # kMinBlockSize
SMALL_SIZE = 1 << 20          # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20        # kSmallBuffer: a small-pool segment
MIN_LARGE_ALLOC = 10 << 20    # kMinLargeAlloc: below this a large request gets a 20 MiB segment
LARGE_BUFFER = 20 << 20       # kLargeBuffer
ROUND_LARGE = 2 << 20         # kRoundLarge


def round_size(size: int) -> int:
    """The bytes a request of ``size`` bytes asks the pools for (``round_size``)."""
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * -(-size // MIN_BLOCK)


def segment_size(size: int) -> int:
    """The bytes reserved from the GPU when no cached block fits a rounded request (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


@dataclass(eq=False)
class Block:
    address: int
    size: int
    small: bool
    free: bool = True
    requested: int = 0
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class CachingAllocator:
    """One device's caching allocator. ``malloc(key, size)`` and ``free(key)`` follow the rules above and keep
    the counters ``memory_stats()`` keeps: ``allocated`` (blocks), ``requested`` (asked-for bytes), ``reserved``
    (segments), each with its peak.

    ``new_segment(size)`` returns the address of a new segment; by default segments are laid out one after
    another, with a gap, which is what matters here (the address only breaks ties between equal free blocks).
    """

    def __init__(self, new_segment=None):
        self._pools = {True: [], False: []}  # small?: sorted [(size, address, Block)] of free blocks
        self._live: dict[object, Block] = {}
        self._next_address = 1 << 40
        self._new_segment = new_segment or self._bump
        self.allocated = self.requested = self.reserved = 0
        self.peak_allocated = self.peak_requested = self.peak_reserved = 0

    def _bump(self, size: int) -> int:
        address, self._next_address = self._next_address, self._next_address + size + (1 << 30)
        return address

    def _insert(self, block: Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.address, block))

    def _remove(self, block: Block) -> None:
        pool = self._pools[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address))]

    def add_segment(self, address: int, size: int, small: bool, held=()) -> None:
        """A segment that exists already, e.g. in a memory snapshot, with the blocks it holds: ``held`` is
        ``(key, address, size, requested)`` for each, the rest of the segment is free. The blocks are linked as
        ``malloc`` links them, so a freed one merges with its free neighbours."""
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = Block(address, size, small)  # the part of the segment after the blocks placed so far
        for key, start, length, requested in sorted(held, key=lambda entry: entry[1]):
            if rest is None or not rest.address <= start < start + length <= rest.address + rest.size:
                raise ValueError(f"held block at {start:#x} ({length} bytes) overlaps another or lies outside the "
                                 f"segment at {address:#x} ({size} bytes)")
            if start > rest.address:  # a free block before it
                before = Block(rest.address, start - rest.address, small, prev=rest.prev, next=rest)
                if rest.prev:
                    rest.prev.next = before
                rest.prev, rest.address, rest.size = before, start, rest.size - before.size
                self._insert(before)
            block, rest = rest, None
            if length < block.size:
                rest = Block(start + length, block.size - length, small, prev=block)
                block.next, block.size = rest, length
            block.free, block.requested = False, requested
            self._live[key] = block
            self.allocated += length
            self.requested += requested
        if rest is not None:
            self._insert(rest)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)

    def malloc(self, key, size: int) -> Block | None:
        """Serve a request of ``size`` bytes, remembered under ``key`` (its tensor); None for 0 bytes."""
        if size == 0:
            return None
        rounded = round_size(size)
        small = rounded <= SMALL_SIZE
        pool = self._pools[small]
        index = bisect.bisect_left(pool, (rounded, -1))
        if index < len(pool):
            block = pool.pop(index)[2]
        else:
            length = segment_size(rounded)
            block = Block(self._new_segment(length), length, small)
            self.reserved += length
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - rounded
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = Block(block.address + rounded, remaining, small, prev=block, next=block.next)
            if block.next:
                block.next.prev = rest
            block.next, block.size = rest, rounded
            self._insert(rest)
        block.free, block.requested = False, size
        self._live[key] = block
        self.allocated += block.size
        self.requested += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        return block

    def size_of(self, key) -> int:
        """The requested bytes of ``key``'s live allocation."""
        return self._live[key].requested

    def free(self, key) -> None:
        """Return ``key``'s block to its pool, merged with free neighbours of the same segment."""
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        self.requested -= block.requested
        block.free, block.requested = True, 0
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                if neighbour is block.prev:
                    block.address, block.prev = neighbour.address, neighbour.prev
                    if neighbour.prev:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next:
                        neighbour.next.prev = block
                block.size += neighbour.size
        self._insert(block)

    def reset_peaks(self) -> None:
        """As ``torch.cuda.reset_peak_memory_stats``: every peak starts again from the current value."""
        self.peak_allocated, self.peak_requested, self.peak_reserved = self.allocated, self.requested, self.reserved
