"""The cyclic garbage collector under the gateway: a young generation larger than the requests
in flight, and the start-up heap frozen out of every collection.

A finished exchange is freed by reference count (`gateway.pipeline.exchange.Exchange.finish`
lets go of its callbacks), so a collection of the request path's objects finds nothing to
free. CPython still starts one each time 700 more container objects are alive than at the last
one (its default first threshold): 16 small requests in flight hold more than that, so at
`kvgate bench-cpu` the collector ran every ~29 requests, traversed the requests in flight,
collected 0 objects, and took ~10 µs of CPU a request (`gc.callbacks`: 173 young collections,
52 ms over 5,000 requests), plus a full collection of the ~120,000 objects the imports and the
app left (~55 ms each, one per ~5,000 requests there, more often as the stores grow).

`YOUNG_THRESHOLD` is above what the requests in flight hold at once, so a young collection runs
only when that many objects have outlived their requests (the stores' entries): 2 in the same
5,000 requests. `gc.freeze` after start-up moves the objects alive then (modules, the app,
settings) to a generation no collection traverses; cycles made later are still found, at most
`YOUNG_THRESHOLD` allocations later.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""Container objects allocated (net of those freed) between two young collections."""


def tune_collector() -> None:
    """The young threshold raised (the older two kept); what start-up left collected once,
    then frozen. Called once the app is built, before it serves."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    gc.collect()
    gc.freeze()
