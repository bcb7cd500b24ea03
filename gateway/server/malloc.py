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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from typing import Any

M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter number (malloc.h)."""
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
    return libc is not None and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1


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
