"""The C allocator under the gateway: glibc's mmap threshold pinned, and what its heap holds.

CPython allocates a dict's table (and any object past 512 bytes) with the C `malloc`. The
directory's dicts are large (an index of 262,144 entries has a 24 MiB table) and are
reallocated whole as they churn. glibc's threshold for serving an allocation by `mmap` (given
back to the OS on `free`) is dynamic: the first large block freed raises it to that block's
size (up to 32 MiB), so every later table of that size comes from the heap, where a freed one
stays resident: RSS kept growing by the tables freed (+20 MB over 476k prefixes past the
directory's capacity in `kvgate footprint`, with Python's objects and the live C heap flat).
Pinned at `MMAP_THRESHOLD_BYTES` (which also turns the dynamic adjustment off), a freed table
leaves RSS at once: the same run stays flat to the MB. An operator's own
`MALLOC_MMAP_THRESHOLD_` is left alone; elsewhere than glibc nothing is done.

Pinning the mmap threshold also stops glibc from raising its trim threshold, which then stays at
128 KiB: whenever the top of the heap has that much free, it is handed back (`brk`), and the
next request's ~80 KB body, its parsed prompt, rendering and payload fault their pages in again.
At bench point 1 the gateway's `orjson.loads` of a body read ~110 µs of thread CPU per call
against ~40 µs in a loop, and a loop of `parse_chat` over the trace's bodies with 30 requests
alive took 142 µs and 21 page faults per parse with 128 KiB, 87 µs and 12 with the trim
threshold at 64 MiB (12 faults at this module's 32 MiB too; the µs vary with the machine's
load, the faults do not). So the trim threshold is pinned too, at `TRIM_THRESHOLD_BYTES` (an
operator's `MALLOC_TRIM_THRESHOLD_` left alone): at most that much freed heap stays resident,
the request path's working set, while the directory's tables (mmapped) still leave at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from typing import Any

M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter number (malloc.h)."""
M_TRIM_THRESHOLD = -1
TRIM_THRESHOLD_BYTES = 32 << 20
"""32 MiB of freed heap kept for the next requests: ~50 agent-sized requests in flight, each
with a few copies of its ~80 KB prompt (body, parsed text, rendering, payload)."""
MMAP_THRESHOLD_BYTES = 1 << 20
"""1 MiB: the directory's tables (MiBs each) are mmapped, while the allocations a request makes
(bodies and chunks of KBs) stay on the heap; a large allocation then costs one mmap and its
page faults, which only a dict's resize or a body past 1 MiB pays."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "mallinfo2") else None


def pin_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold (see the module docstring); True when it was pinned here."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    if libc is None:
        return False
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1)


@dataclass(frozen=True)
class CHeap:
    live_mb: float
    """In use: on the heap, and mmapped."""
    free_mb: float
    """Freed but kept by the heap (resident once touched)."""


def c_heap() -> CHeap | None:
    """What glibc's heap holds (`mallinfo2`), None where it does not say."""
    libc = _libc()
    if libc is None:
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return CHeap((info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20)
