"""The heap of a process holding thousands of models: large freed blocks go back to the system,
and the cyclic garbage collector does not stall the server.

Freed blocks
------------
A server whose models are loaded and evicted without end (a store far larger than
``max_loaded_models``) frees as much as it allocates, yet its resident memory rose in steps of
~2 MiB (+5 to +8 MiB per 100,000 loads, and on after the first 100,000): tracemalloc found no live
Python object growing. The steps were large blocks freed in one thread's malloc arena and
allocated anew in another's, e.g. the interpreter's table of interned strings (~1.9 MB with this
server's imports), which is rebuilt whenever loads have interned and freed enough path names.
glibc's malloc raises its mmap threshold to the size of any mapped block freed (up to 32 MiB), so
after the first such table every later one came from an arena's heap, and each arena kept its
freed copy resident (its trim threshold rises with it). Capping the arenas (``M_ARENA_MAX``) did
not flatten it; trimming every 10 s (``malloc_trim``) took it down to +2.3 MiB per 85,000 loads.

:func:`fix_mmap_threshold` sets the threshold once, at start: a block of :data:`MMAP_THRESHOLD`
or more is mapped on its own and unmapped when freed, and the thresholds stay where they are.
Measured with the bench's churn (100,000 models, room for 1,000; ``scripts/bench --only scale
--churn-seconds 330``): 87.5 MiB after 26,000 loads, 87.9 after 160,000 (+0.2 after the first
100,000), where it had risen by 5 MiB between 107,000 and 198,000 loads with the trims alone.
Blocks this large are rare on the request path (a request's bodies and batches are far smaller).
Where the C library has no ``mallopt`` (musl, macOS) nothing is done.

The garbage collector
---------------------
CPython collects its youngest generation every 700 net allocations of container objects, and
whatever survives two young collections is promoted to the oldest generation, which is collected
whole once it has grown by a quarter. A server loading models promotes two kinds of objects there:
the loaded models' own (a record, a pool, workers and metric series in the frontend; the
estimators in a backend), which live long, and the objects of loads and requests in flight
(tasks, futures, frames and buffers), which live tens of milliseconds, yet outlive 700
allocations at hundreds of loads a second. The second kind made full collections come every
~5 s of cold loads, each scanning every loaded model's objects: 74 → 218 ms over the first 8,000
loads in the frontend, 100+ ms in each backend, with every request in flight stalled behind
them (the slowest 1 % of cold loads were exactly those).

:func:`tune_collector` collects the youngest generation every :data:`YOUNG_OBJECTS` net
allocations and the middle one every :data:`MIDDLE_COLLECTIONS` young collections, so that
objects of a load or request die young instead of being promoted; the oldest generation keeps
CPython's rule (a full collection when it has grown by a quarter), now driven by the models
loaded, not by the traffic. The uncollected cyclic garbage this lets wait is bounded by the
thresholds (a few MB at most). The frontend and every backend call it at start, then freeze
(``gc.freeze``) what start-up made (modules, classes, functions: never garbage), which no
collection scans again (in a backend, neither does it write to the pages shared with the fork
server). Measured over 20,000 cold loads from 16 connections (``scripts/bench --only scale
--churn-loads 0``, two runs of each build, alternated): 452 to 484 against 369 to 444 loads/s, p99
68 to 72 against 86 to 142 ms, the slowest load 102 to 123 against 633 to 746 ms.

An unpacking process (:mod:`mmserver.procs.sidework`) freezes what it was forked with too: the
fork server's modules, which its collections otherwise scanned again and again in a stream of
cold loads (and copied the pages it shares with the fork server as they went).
"""

from __future__ import annotations

import ctypes
import functools
import gc
from collections.abc import Callable

#: Blocks of this many bytes or more are mapped on their own and given back when freed.
MMAP_THRESHOLD = 1 << 20
#: ``mallopt``'s parameter for it (glibc's ``malloc.h``).
M_MMAP_THRESHOLD = -3

#: Net allocations of container objects between two collections of the youngest generation
#: (CPython: 700).
YOUNG_OBJECTS = 20_000
#: Young collections between two collections of the middle generation (CPython: 10).
MIDDLE_COLLECTIONS = 50


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Have malloc map every block of ``threshold`` bytes or more on its own, for good (this
    also keeps its trim threshold from rising); whether the C library took it."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this interpreter runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold) == 1)


def release_freed() -> None:
    """Give the pages of freed blocks back to the system (glibc's ``malloc_trim``): glibc keeps
    freed small blocks (a tree's arrays are ~100 KB each) for reuse, so a process that unloaded
    a model would otherwise stay as large as it was, and the next load, reusing those pages,
    would seem to cost nothing. A no-op where there is no glibc. Its cost grows with the heap
    (it walks every free block): half a millisecond in a process holding 2,500 small models."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
        return trim
    except (OSError, AttributeError):
        return None


def tune_collector() -> int:
    """Set the collector's thresholds as the module docstring says (the oldest generation's is
    left as it is), then freeze every object there is now: call it once start-up is done.
    Returns how many objects were frozen."""
    oldest = gc.get_threshold()[2]
    gc.set_threshold(YOUNG_OBJECTS, MIDDLE_COLLECTIONS, oldest)
    gc.freeze()
    return gc.get_freeze_count()
