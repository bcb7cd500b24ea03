"""A process that takes a set share of one core, beside a bench arm (`kind:policy~P`).

Issue 39's TTFT goal compares N gateways on Redis with one in-process gateway on this 2-core
machine, where the tier's extra CPU (the gateways' Redis path and Redis itself) runs on the
same cores as the simulated engines and the replay. Whether that extra CPU, and not the
routing, is what an arm's TTFT loses is a question one arm answers: the one gateway with a hog
taking what the N-gateway tier spent beyond it. The hog spins for `share` of every `PERIOD_S`
and sleeps the rest, so its CPU arrives spread over the run as the tier's does, not in one
block; it stops when its parent's pipe closes (a bounded loop: the bench ends it).
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator

PERIOD_S = 0.002
"""Short against a prefill (tens of ms at the bench's time scale), long against a switch."""


def hog(share: float, stop_fd: int) -> None:
    """Spin `share` of each period until `stop_fd` is readable (its writer closed)."""
    spin = share * PERIOD_S
    while not select.select([stop_fd], [], [], 0)[0]:
        start = time.perf_counter()
        while time.perf_counter() - start < spin:
            pass
        rest = PERIOD_S - (time.perf_counter() - start)
        if rest > 0 and select.select([stop_fd], [], [], rest)[0]:
            break


@contextlib.contextmanager
def hogging(percent: int) -> Iterator[list[float]]:
    """A hog taking `percent`% of one core while the block runs (none at 0). Yields a list the
    hog's CPU seconds are appended to when the block ends."""
    if not percent:
        yield []
        return
    from loadgen.harness import processes  # not in the hog's own start-up: it would count

    proc = subprocess.Popen(
        [sys.executable, "-m", "loadgen.bench.hog", f"{percent / 100:g}"], stdin=subprocess.PIPE
    )
    spent: list[float] = []
    try:
        yield spent
    finally:
        cpu = processes.cpu_seconds(proc.pid)
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
        spent.append(cpu)


def main() -> None:
    share = float(sys.argv[1])
    if not 0 < share <= 1:
        raise SystemExit("usage: python -m loadgen.bench.hog SHARE (0 < SHARE <= 1)")
    hog(share, sys.stdin.fileno())
    os._exit(0)


if __name__ == "__main__":
    main()
