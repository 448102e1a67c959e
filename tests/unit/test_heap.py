"""Large blocks freed by the frontend go back to the system (glibc's malloc, as on the test
machines), however large the blocks freed before them; the garbage collector's settings."""

from __future__ import annotations

import subprocess
import sys

from mmserver.ops import heap

# Frees two blocks of 8 MiB, one after the other, and prints how much of them is still resident.
# glibc maps the first on its own and, once it is freed, raises its threshold to 8 MiB: the
# second then comes from the heap and stays resident when freed, unless the threshold is fixed.
_FREE_TWICE = """
import sys
from mmserver.ops import heap

def resident_mib():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20

if sys.argv[1] == "fixed":
    assert heap.fix_mmap_threshold()
before = resident_mib()
for _ in range(2):
    block = bytearray(8 << 20)
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    del block
print(round(resident_mib() - before, 1))
"""


def _kept_mib(mode: str) -> float:
    result = subprocess.run(
        [sys.executable, "-c", _FREE_TWICE, mode], capture_output=True, text=True, check=True
    )
    return float(result.stdout)


def test_with_the_threshold_fixed_a_freed_large_block_leaves_nothing_resident() -> None:
    assert _kept_mib("fixed") < 1.0


def test_without_it_the_second_block_stays_resident() -> None:
    # What the fix is for: shown here so the test above cannot pass for another reason.
    assert _kept_mib("default") >= 7.0


# Tunes the collector in a fresh interpreter and prints its settings, how many objects were
# frozen, and whether a reference cycle made afterwards is still collected.
_TUNE = """
import gc, weakref
from mmserver.ops import heap

class Node:
    pass

frozen = heap.tune_collector()
node = Node()
node.self = node
alive = weakref.ref(node)
del node
gc.collect()
print(*gc.get_threshold(), frozen, gc.get_freeze_count(), alive() is None)
"""


def test_tuned_collector_collects_young_objects_less_often_and_freezes_what_exists() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _TUNE], capture_output=True, text=True, check=True
    )
    young, middle, oldest, frozen, still_frozen, collected = result.stdout.split()
    assert (int(young), int(middle)) == (heap.YOUNG_OBJECTS, heap.MIDDLE_COLLECTIONS)
    assert int(oldest) == 10  # CPython's own rule for full collections
    assert int(frozen) > 1000 and int(still_frozen) == int(frozen)
    assert collected == "True"  # garbage made after the freeze is collected as before
