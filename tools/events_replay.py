"""Precise mode's event ingest per request on a recorded stream: capture a bench run's KV
events, then replay them through a checkout's decoder and event index (thread CPU, ms).

    python -m tools.events_replay capture OUT BENCH_PID
    python -m tools.events_replay replay FILE REQUESTS [ROUNDS]
    python -m tools.events_replay ab FILE REQUESTS [PAIRS]

`capture` subscribes to every engine the `kvgate bench` process BENCH_PID starts (its
`--kv-events-config` endpoint; a PUB sends to the gateway and to this SUB alike) and keeps
every batch (engine, seq, payload) until the bench exits, into OUT (msgpack). `replay` decodes
and applies FILE's batches in order (`decode_batch`, `EventIndex.apply`, one domain an engine,
the collector tuned as `kvgate serve` tunes it) ROUNDS times (default 3) and prints the best
round's decode + apply per request (REQUESTS: the bench's --requests), the decode alone, and
the blocks stored and removed per request. `ab` decodes FILE once, then applies it with the
index's domain maps compiled and pure in turn (`cachemap._native.DomainTable` against
`cachemap.events.DomainMaps`; the chain compiled in both), A B B A PAIRS times (default 2),
and prints each round's apply per request (thread CPU).

Bench point 2's stream (`kvgate bench --start 4000 --requests 1000 --engines 4 --capacity-frac
0.10 --utilization 0.85 --time-scale 4 --arms precise:cache_aware --rate-steps 0`): ~3,400
batches, 725 blocks stored and 661 removed a request. To compare another checkout, run
`replay` from inside it (`cd <tree> && python -m tools.events_replay replay ...`): `python -m`
puts the current directory ahead of `PYTHONPATH`. The live gateway also pays the feeds' reads
and the fan-out's `on_stored`, not replayed here.

Nothing here is asserted; it prints numbers.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import msgspec
import zmq

from cachemap import events
from cachemap.events import EventIndex
from cachemap.native import NATIVE
from gateway.events.decode import decode_batch
from gateway.server.cyclic_gc import tune_collector

_ENDPOINT = re.compile(r'"endpoint":"tcp://\*:(\d+)"')


def _engine_ports(bench_pid: int) -> tuple[bool, list[str]]:
    """(whether the bench still has children, the events ports of its engines)."""
    table = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True)
    alive, ports = False, []
    for line in table.stdout.splitlines():
        fields = line.split(None, 2)
        if len(fields) == 3 and fields[1] == str(bench_pid):
            alive = True
            found = _ENDPOINT.search(fields[2])
            if found:
                ports.append(found.group(1))
    return alive, ports


def capture(out: str, bench_pid: int) -> None:
    context = zmq.Context()
    poller = zmq.Poller()
    engines: dict[zmq.Socket[bytes], int] = {}
    seen: set[str] = set()
    batches: list[tuple[int, int, bytes]] = []
    while True:
        alive, ports = _engine_ports(bench_pid)
        for port in ports:
            if port not in seen:
                seen.add(port)
                sub = context.socket(zmq.SUB)
                sub.setsockopt(zmq.RCVHWM, 0)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(f"tcp://127.0.0.1:{port}")
                engines[sub] = len(engines)
                poller.register(sub, zmq.POLLIN)
        if not alive and engines:
            break
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            for sub, _ in poller.poll(100):
                while True:
                    try:
                        _, seq, payload = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    batches.append((engines[sub], int.from_bytes(seq, "big", signed=True), payload))
    with open(out, "wb") as f:
        f.write(msgspec.msgpack.encode(batches))
    print(f"{len(batches)} batches from {len(engines)} engines -> {out}")


def replay(path: str, requests: int, rounds: int) -> None:
    with open(path, "rb") as f:
        batches: list[tuple[int, int, bytes]] = msgspec.msgpack.decode(f.read())
    tune_collector()
    clock = time.thread_time
    best: tuple[float, float] | None = None
    index = EventIndex()
    for _ in range(rounds):
        index = EventIndex()
        domains = [f"http://engine-{i}" for i in range(1 + max(b[0] for b in batches))]
        start = clock()
        decoding = 0.0
        for engine, _, payload in batches:
            t = clock()
            batch = decode_batch(payload)
            decoding += clock() - t
            domain = domains[engine]
            for event in batch.events:
                index.apply(domain, event)
        spent = (clock() - start, decoding)
        best = spent if best is None or spent[0] < best[0] else best
    assert best is not None
    stats = index.stats
    print(
        f"{len(batches)} batches: decode + apply {best[0] / requests * 1e3:.3f} ms a request "
        f"(decode {best[1] / requests * 1e3:.3f}); blocks a request: "
        f"{stats.stored_blocks / requests:.0f} stored, {stats.removed_blocks / requests:.0f} "
        f"removed (best of {rounds} rounds, thread CPU)"
    )


def ab(path: str, requests: int, pairs: int) -> None:
    if NATIVE is None:
        sys.exit("cachemap._native is not built here (or KVGATE_PURE is set): nothing to compare")
    with open(path, "rb") as f:
        batches: list[tuple[int, int, bytes]] = msgspec.msgpack.decode(f.read())
    decoded = [(engine, decode_batch(payload).events) for engine, _, payload in batches]
    domains = [f"http://engine-{i}" for i in range(1 + max(b[0] for b in batches))]
    tune_collector()
    forms = {"compiled": NATIVE.DomainTable, "pure": events.DomainMaps}
    spent: dict[str, list[float]] = {name: [] for name in forms}
    for name in ["compiled", "pure", "pure", "compiled"] * pairs:
        events._MAPS = forms[name]
        index = EventIndex()
        start = time.thread_time()
        for engine, batch in decoded:
            domain = domains[engine]
            for event in batch:
                index.apply(domain, event)
        spent[name].append((time.thread_time() - start) / requests * 1e3)
    events._MAPS = forms["compiled"]
    for name, times in spent.items():
        print(f"{name}: apply {' / '.join(f'{t:.3f}' for t in times)} ms a request")
    saved = 1 - sum(spent["compiled"]) / sum(spent["pure"])
    print(f"compiled against pure: {saved:.1%} of the apply off (A B B A x {pairs}, thread CPU)")


def main() -> None:
    args = sys.argv[1:]
    if len(args) == 3 and args[0] == "capture":
        capture(args[1], int(args[2]))
    elif len(args) in (3, 4) and args[0] == "replay":
        replay(args[1], int(args[2]), int(args[3]) if len(args) == 4 else 3)
    elif len(args) in (3, 4) and args[0] == "ab":
        ab(args[1], int(args[2]), int(args[3]) if len(args) == 4 else 2)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
