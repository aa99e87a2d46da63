"""Which parts of the zygote's memory are offered to the kernel as huge pages."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent.zygote.hugepages import heap_ranges

MIB = 1 << 20
MAPS = """\
55d0c0000000-55d0c0600000 rw-p 00000000 00:00 0                          [heap]
7f0000100000-7f0000900000 rw-p 00000000 00:00 0
7f0001000000-7f0001400000 rw-p 00012000 08:01 1234                       /usr/lib/libfoo.so
7f0002000000-7f0002400000 r--p 00000000 00:00 0
7f0003000000-7f0003400000 rw-s 00000000 00:05 99                         /dev/shm/x
7ffc00000000-7ffc00400000 rw-p 00000000 00:00 0                          [stack]
7f0004000000-7f0004100000 rw-p 00000000 00:00 0
"""


def test_only_whole_aligned_ranges_of_private_anonymous_memory_and_the_heap_are_offered() -> None:
    ranges = heap_ranges(MAPS, 2 * MIB)
    heap = [(0x55D0C0000000 + offset, 0x55D0C0000000 + offset + 2 * MIB) for offset in (0, 2 * MIB, 4 * MIB)]
    # 0x7f0000100000-0x7f0000900000 holds three aligned 2 MiB ranges: 2-4, 4-6, 6-8 MiB.
    anonymous = [(0x7F0000000000 + start * MIB, 0x7F0000000000 + (start + 2) * MIB) for start in (2, 4, 6)]
    assert ranges == heap + anonymous  # not files, read-only, shared, the stack, or a mapping under 2 MiB


def test_nothing_is_offered_from_a_malformed_line() -> None:
    assert heap_ranges("garbage\n\n7f00-7f01 rw-p\n", 2 * MIB) == []


def test_ranges_that_meet_a_mapping_shared_with_the_lean_zygote_are_not_offered() -> None:
    # Collapsing copies a range into a new huge page: the lean zygote, forked off when the heap was
    # 0-3 MiB of [heap] and the first 2 MiB of the anonymous mapping (1-3 MiB), would keep the old pages.
    shared = """\
55d0c0000000-55d0c0300000 rw-p 00000000 00:00 0                          [heap]
7f0000100000-7f0000300000 rw-p 00000000 00:00 0
7f0001000000-7f0001400000 rw-p 00012000 08:01 1234                       /usr/lib/libfoo.so
"""
    ranges = heap_ranges(MAPS, 2 * MIB, shared=shared)
    heap = [(0x55D0C0000000 + 4 * MIB, 0x55D0C0000000 + 6 * MIB)]  # 0-2 and 2-4 MiB meet the old heap
    anonymous = [(0x7F0000000000 + start * MIB, 0x7F0000000000 + (start + 2) * MIB) for start in (4, 6)]
    assert ranges == heap + anonymous  # its 2-4 MiB range met the old 1-3 MiB


def test_a_range_that_only_touches_a_shared_mapping_is_offered() -> None:
    shared = "55d0c0000000-55d0c0200000 rw-p 00000000 00:00 0   [heap]\n"  # ends where the second range begins
    assert heap_ranges(MAPS, 2 * MIB, shared=shared)[:2] == [
        (0x55D0C0000000 + 2 * MIB, 0x55D0C0000000 + 4 * MIB),
        (0x55D0C0000000 + 4 * MIB, 0x55D0C0000000 + 6 * MIB),
    ]


def test_a_range_that_a_shared_mapping_begins_inside_is_not_offered() -> None:
    # A mapping made after the fork merges into the one below it: the range meets the shared 3-5 MiB.
    maps = "7f0000000000-7f0000800000 rw-p 00000000 00:00 0\n"
    shared = "7f0000300000-7f0000500000 rw-p 00000000 00:00 0\n"
    base = 0x7F0000000000
    assert heap_ranges(maps, 2 * MIB, shared=shared) == [(base, base + 2 * MIB), (base + 6 * MIB, base + 8 * MIB)]
