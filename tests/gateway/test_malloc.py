"""glibc's mmap threshold pinned by the gateway: a large block freed leaves RSS at once.

Each case runs in a fresh interpreter (the threshold is per process): a 16 MiB block freed
(glibc's dynamic threshold then rises to 16 MiB), then three 8 MiB blocks — the size of the
directory's dict tables — freed as a churning dict frees its old tables. Unpinned, glibc keeps
them on its heap (resident); pinned, they were mmapped and are gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.server.malloc import c_heap

SCRIPT = """
import sys
from gateway.server.malloc import c_heap, pin_mmap_threshold
pinned = pin_mmap_threshold() if sys.argv[1] == "pin" else False
big = bytes(16 << 20); del big
tables = [bytearray(8 << 20) for _ in range(3)]
del tables
print(pinned, c_heap().free_mb)
"""

pytestmark = pytest.mark.skipif(c_heap() is None, reason="glibc's mallinfo2 is not available")


def _free_mb_after_tables(how: str, env: dict[str, str] | None = None) -> tuple[bool, float]:
    run_env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    run_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, check=True, env=run_env
    )
    pinned, free_mb = done.stdout.split()
    return pinned == "True", float(free_mb)


def test_freed_tables_stay_resident_unless_the_threshold_is_pinned() -> None:
    assert _free_mb_after_tables("leave") == (False, pytest.approx(24, abs=1))
    pinned, free_mb = _free_mb_after_tables("pin")
    assert pinned and free_mb < 1


def test_an_operators_own_threshold_is_left_alone() -> None:
    pinned, _ = _free_mb_after_tables("pin", {"MALLOC_MMAP_THRESHOLD_": "4194304"})
    assert not pinned


REQUEST_SCRIPT = """
import sys
from gateway.server.malloc import c_heap, pin_mmap_threshold
pin_mmap_threshold()
bodies = [bytearray(80_000) for _ in range(100)]  # 8 MB of request-sized blocks, on the heap
del bodies
print(c_heap().free_mb)
"""


def _free_mb_after_requests(env: dict[str, str]) -> float:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    run_env.update(env)
    done = subprocess.run(
        [sys.executable, "-c", REQUEST_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        env=run_env,
    )
    return float(done.stdout)


def test_request_sized_blocks_freed_stay_on_the_heap_for_the_next_requests() -> None:
    """The pinned mmap threshold freezes glibc's trim threshold at 128 KiB, which handed freed
    bodies back at once (each next body faulted its pages in again): it is pinned higher."""
    assert _free_mb_after_requests({}) > 7
    # an operator's own trim threshold is left alone
    assert _free_mb_after_requests({"MALLOC_TRIM_THRESHOLD_": "131072"}) < 1
