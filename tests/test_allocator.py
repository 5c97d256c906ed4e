"""The caching allocator replayed in Python (helpers.memory.allocator) against its rules and against a real CUDA step:
every allocation of the H200 snapshot lands at the address the real allocator gave it."""

import gzip
import pickle
from pathlib import Path

from helpers.memory.allocator import MIN_BLOCK, CachingAllocator, round_size, segment_size

SNAPSHOT = Path(__file__).parent / "fixtures" / "h200-snapshot-b8-l512-fp32.pickle.gz"
MIB = 2**20


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, 3072)] == [512, 512, 1024, 3072]
    assert segment_size(MIB) == 2 * MIB and segment_size(MIB + 512) == 20 * MIB
    assert segment_size(12 * MIB + 1) == 14 * MIB


def test_a_large_block_is_split_only_when_more_than_1_mib_would_remain():
    allocator = CachingAllocator()
    allocator.malloc("a", 12 * MIB)   # a 12 MiB segment, all of it
    allocator.free("a")
    allocator.malloc("b", 11 * MIB + 512)  # would leave 1 MiB - 512: the whole 12 MiB block is handed out
    assert (allocator.allocated, allocator.requested) == (12 * MIB, 11 * MIB + 512)
    allocator.free("b")
    allocator.malloc("c", 5 * MIB)   # leaves 7 MiB: split
    assert allocator.allocated == 5 * MIB and allocator.reserved == 12 * MIB


def test_small_requests_share_2_mib_segments_and_freed_blocks_merge():
    allocator = CachingAllocator()
    for key in range(4):
        allocator.malloc(key, 100)
    assert allocator.allocated == 4 * MIN_BLOCK and allocator.reserved == 2 * MIB
    for key in range(4):
        allocator.free(key)
    allocator.malloc("big", 2 * MIB - 1)  # the merged segment serves a request of its whole size
    assert allocator.reserved == 2 * MIB + 20 * MIB  # too big for the small pool: a large segment


def test_a_freed_block_of_an_existing_segment_merges_with_its_free_neighbours():
    """A segment rebuilt from a snapshot, 20 MiB with two held blocks: freeing them joins the free parts around
    them, until the whole segment is one block again that serves a 20 MiB request without a new segment."""
    allocator = CachingAllocator(new_segment=lambda size: 0)  # address 0: a new segment would be seen
    base = 1 << 40
    allocator.add_segment(base, 20 * MIB, small=False, held=[("a", base + 2 * MIB, 4 * MIB, 4 * MIB - 100),
                                                              ("b", base + 6 * MIB, 3 * MIB, 3 * MIB)])
    assert (allocator.allocated, allocator.requested, allocator.reserved) == (7 * MIB, 7 * MIB - 100, 20 * MIB)
    assert allocator.malloc("c", 11 * MIB).address == base + 9 * MIB  # the free part after "b", taken whole
    allocator.free("c")
    allocator.free("a")  # joins the 2 MiB before it, not "b"
    assert allocator.malloc("d", 6 * MIB).address == base
    allocator.free("d")
    allocator.free("b")  # now every part is free: one block of the whole segment
    whole = allocator.malloc("e", 20 * MIB)
    assert (whole.address, whole.size, allocator.reserved) == (base, 20 * MIB, 20 * MIB)


def replay_snapshot():
    """Rebuild the allocator's state when recording began (segments, and the blocks still held at the end that
    were allocated before), then replay every allocation and free of the recording."""
    with gzip.open(SNAPSHOT) as file:
        data = pickle.load(file)
    trace = data["device_traces"][0]
    created = {event["addr"] for event in trace if event["action"] == "segment_alloc"}
    initial = {event["addr"]: (event["size"], []) for event in trace
               if event["action"] == "segment_free" and event["addr"] not in created}
    for segment in data["segments"]:
        if segment["address"] not in created:
            initial[segment["address"]] = (segment["total_size"], [
                (block["address"], block["address"], block["size"], block["requested_size"])
                for block in segment["blocks"] if block["state"] == "active_allocated" and not block["frames"]])
    new_segments = [(event["addr"], event["size"]) for event in trace if event["action"] == "segment_alloc"]

    def new_segment(size):
        address, recorded = new_segments.pop(0)
        assert recorded == size
        return address

    allocator = CachingAllocator(new_segment)
    for address, (size, held) in initial.items():
        allocator.add_segment(address, size, small=size == 2 * MIB, held=held)
    measured_step = data["external_annotations"][3]["time_us"]
    misplaced, reset = 0, False
    for event in trace:
        if not reset and event["time_us"] > measured_step:
            allocator.reset_peaks()  # measure_cuda_step's reset_peak_memory_stats
            reset = True
        if event["action"] == "alloc":
            misplaced += allocator.malloc(event["addr"], event["size"]).address != event["addr"]
        elif event["action"] == "free_completed":
            allocator.free(event["addr"])
    return allocator, misplaced, new_segments


def test_every_allocation_of_the_h200_step_lands_where_cuda_put_it():
    allocator, misplaced, unused_segments = replay_snapshot()
    assert misplaced == 0 and unused_segments == []
    # the cell printed "peak allocated 3,831 MiB"; memory_summary: allocated 3830 MiB, requested 3827 MiB, and
    # reserved 4400 MiB (its segments only grow until the cell's last empty_cache, which the replay does not run)
    assert 3830.5 * MIB <= allocator.peak_allocated < 3831 * MIB
    assert 3827 * MIB <= allocator.peak_requested < 3828 * MIB
    assert allocator.peak_reserved == 4400 * MIB
