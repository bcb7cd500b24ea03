"""The collector under `kvgate serve` (gateway.server.cyclic_gc): the young threshold raised,
the start-up heap frozen. In a fresh interpreter: both are per process."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
from gateway.server.cyclic_gc import tune_collector
before = gc.get_threshold()
tune_collector()
print(before[1:] == gc.get_threshold()[1:], gc.get_threshold()[0], gc.get_freeze_count() > 0)
"""


def test_the_young_threshold_is_raised_and_start_up_frozen() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["True", "10000", "True"]
