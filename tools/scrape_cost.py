"""One /metrics scrape's cost with many hot-prefix counters tracked (issue 14, item 2).

    python -m tools.scrape_cost [NUM_PREFIXES]

Builds a gateway's parts (nothing started, no socket), counts NUM_PREFIXES distinct prefixes
(100,000: the rate table's capacity) in its hot-prefix rates, then times rendering /metrics, the
work a scrape does on the event loop: the median of 7. Run it from another checkout with
PYTHONPATH pointing there to compare (docs/benchmarks-archive.md).
"""

from __future__ import annotations

import statistics
import sys
import time

from gateway.observability.metrics import render
from gateway.server.app import build
from gateway.settings import load_settings

DEFAULT_PREFIXES = 100_000
"""The rate table's capacity (cachemap.rates.MAX_TRACKED_PREFIXES): the worst case."""
ROUNDS = 7


def main(argv: list[str]) -> int:
    num = int(argv[0]) if argv else DEFAULT_PREFIXES
    settings = load_settings(engines=["http://127.0.0.1:9"], tenants=["a:k"], server_secret="s")
    parts = build(settings)
    rates = parts.directory.rates
    assert rates is not None, "overflow is on by default"
    for i in range(num):
        rates.observe(i.to_bytes(16, "big"))  # type: ignore[arg-type]
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        render(parts.registry)
        times.append(time.perf_counter() - started)
    median_ms = statistics.median(times) * 1e3
    print(f"{num} prefixes tracked: a scrape takes {median_ms:.2f} ms (median of {ROUNDS})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
