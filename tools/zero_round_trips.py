"""What share of lookups a gateway could answer from its own memory, nothing it would read having
changed since it last read it (issue 39 item 2's rest; docs/design/directory.md, "Round trips
on the request path").

    PYTHONPATH=. python -m tools.zero_round_trips

Replays bench point 1's slice (2,000 requests of the Mooncake conversation trace from line
4,000) and the agent sessions (`agent-sessions`, defaults) over N gateways round robin, as the
bench's Service does. A request's lookup reads its chain up to the first block never recorded
(and that one: the walk stops there); its record, `RECORD_DELAY_S` later (its first token),
writes every block of its chain (the last use). Variants:
- `tracking`: a key is served from memory only if this gateway read it before and nobody
  wrote it since (RESP3 `CLIENT TRACKING`, default mode: invalidations of keys it read);
- `bcast`: a key never read counts as known (tracking in broadcast mode, `BCAST PREFIX kvg:`,
  from an empty Redis: told of every write, so a key nobody wrote is known absent); a key
  written since this gateway's last read is read again. (A replica applying a change stream
  answers every lookup from memory instead: its cost is every write shipped to every
  gateway, not a share of lookups.)
- `own writes invalidate`: False when a gateway applies its own writes to its copy (`NOLOOP`);
- `skip`: a record does not rewrite a block it recorded less than this long ago (no change to
  tell anyone), instead of every block of every turn.
Blocks are the traces' own (Mooncake's 512-token blocks; the gateway's are finer, 256 bytes,
which only adds keys to each read). Nothing here is asserted; it prints numbers.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from loadgen.traces.readers import TraceRequest, read_trace
from loadgen.traces.sessions import agent_sessions_trace

RECORD_DELAY_S = 1.5
"""A request's record after its lookup: its first token, ~TTFT (the bench's 0.42 s mean at time
scale 4 is ~1.7 s of trace time)."""


def served_from_memory(
    requests: Sequence[TraceRequest],
    gateways: int,
    *,
    bcast: bool,
    own_writes_invalidate: bool,
    skip_s: float,
) -> float:
    last_read: list[dict[int, int]] = [{} for _ in range(gateways)]
    last_write: dict[int, tuple[int, int]] = {}  # block -> (event, gateway)
    last_use: dict[int, float] = {}
    events: list[tuple[float, int, int]] = []  # (time, order: lookup before record, request)
    for i, r in enumerate(requests):
        heapq.heappush(events, (r.arrival_s, 2 * i, i))
        heapq.heappush(events, (r.arrival_s + RECORD_DELAY_S, 2 * i + 1, i))
    seq = served = 0
    while events:
        t, order, i = heapq.heappop(events)
        seq += 1
        g, chain = i % gateways, requests[i].hash_ids
        if order % 2 == 0:  # the lookup
            reads = []
            for block in chain:
                reads.append(block)
                if block not in last_use:
                    break
            fresh = True
            for block in reads:
                read = last_read[g].get(block, 0 if bcast else None)
                wrote = last_write.get(block)
                if read is None or (
                    wrote is not None
                    and wrote[0] > read
                    and (own_writes_invalidate or wrote[1] != g)
                ):
                    fresh = False
                    break
            served += fresh
            for block in reads:
                last_read[g][block] = seq
        else:  # the record
            for block in chain:
                before = last_use.get(block)
                last_use[block] = t
                if before is not None and t - before < skip_s:
                    continue
                last_write[block] = (seq, g)
    return served / len(requests)


def main() -> None:
    workloads = {
        "point 1's slice": read_trace(
            "loadgen/traces/mooncake/conversation_trace.jsonl", start=4000, limit=2000
        ).requests,
        "agent sessions": agent_sessions_trace().requests,
    }
    for name, requests in workloads.items():
        print(f"{name}: {len(requests)} requests")
        for gateways in (2, 4):
            for bcast in (False, True):
                for own in (True, False):
                    for skip_s in (0.0, 5.0):
                        share = served_from_memory(
                            requests,
                            gateways,
                            bcast=bcast,
                            own_writes_invalidate=own,
                            skip_s=skip_s,
                        )
                        print(
                            f"  {gateways} gateways, {'bcast   ' if bcast else 'tracking'}, "
                            f"own writes invalidate {own!s:5}, skip < {skip_s:.0f} s: "
                            f"{share:6.1%} from memory"
                        )


if __name__ == "__main__":
    main()
