"""Keeping large freed blocks out of the frontend's resident memory while models churn.

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
"""

from __future__ import annotations

import ctypes

#: Blocks of this many bytes or more are mapped on their own and given back when freed.
MMAP_THRESHOLD = 1 << 20
#: ``mallopt``'s parameter for it (glibc's ``malloc.h``).
M_MMAP_THRESHOLD = -3


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
