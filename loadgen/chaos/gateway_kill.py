"""The billed gateway under load, SIGTERMed (a drain) and SIGKILLed, each `size.repeat` times.

Counted from outside, per kill: the client's completed responses against the WAL read after a
restart over the same directory. Goals: no completed response without its record, no record
twice, every stream cut mid-body a record (the drain cuts those past the grace, the kill every
one in flight; the restart writes the kill's aborted records), nothing left unsettled. Figure:
the WAL's recovery time (the restarted gateway's start to ready, aborted records written).

A stream cut mid-body is billed by its aborted record, or by its own when the cut came after
that record's write: a `kill -9` during the usage's fsync, or between the usage and `[DONE]`,
leaves the exchange's `ok` record in the WAL (docs/billing.md#durability: billed as if its
response had gone out) and no aborted one. The client cannot name the record of a stream cut
before its usage, so the goal is counted: the aborted records and the `ok` records of responses
the client never saw whole (`landed`) together at least the cut streams (non-streamed requests
in flight add to both sides' surplus only), and each cut stream whose usage arrived has its id
in the WAL.
"""

from __future__ import annotations

import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.chaos.billed import (
    KEY,
    Billed,
    WalContents,
    billed_config,
    billed_request,
    start_billed,
    wal_contents,
)
from loadgen.chaos.outcome import Outcome, Size, wait_for
from loadgen.harness import processes

SHORT_CLIENTS, LONG_CLIENTS = 4, 2
LONG_TOKENS = 400
"""~2.3 s of decode at the engine's real-time speed: past the 1-s grace, so a drain cuts some."""
GRACE_S = 1.0
MAX_REQUESTS = 2_000
"""A bound on each kill's load, whatever happens."""


@dataclass
class Kill:
    completed: list[str] = field(default_factory=list)
    cut: int = 0
    cut_ids: list[str] = field(default_factory=list)
    """The record ids of cut streams whose usage arrived before the cut."""
    attempts: int = 0
    unrecorded: int = 0
    twice: int = 0
    aborted: int = 0
    landed: int = 0
    """`ok` records of responses the client did not read whole (cut after the record's write)."""
    cut_unrecorded: int = 0
    """Cut streams that named their record id, without that record in the WAL."""
    left_unsettled: int = 0
    recovery_s: float = 0.0
    kept: str = ""
    """Where a run that missed a goal left its WAL, and the statuses of each id seen twice."""


def _load(url: str, kill: Kill, stop: threading.Event) -> list[threading.Thread]:
    lock = threading.Lock()

    def client(worker: int) -> None:
        i = worker
        tokens = LONG_TOKENS if worker < LONG_CLIENTS else 16
        while not stop.is_set() and kill.attempts < MAX_REQUESTS:
            got: Billed = billed_request(url, KEY, i if tokens == 16 else 2 * i, tokens)
            with lock:
                kill.attempts += 1
                if got.outcome == "completed" and got.record_id:
                    kill.completed.append(got.record_id)
                if got.outcome == "cut":
                    kill.cut += 1
                    if got.record_id:
                        kill.cut_ids.append(got.record_id)
            i += SHORT_CLIENTS + LONG_CLIENTS

    threads = [threading.Thread(target=client, args=(w,), daemon=True)
               for w in range(SHORT_CLIENTS + LONG_CLIENTS)]  # fmt: skip
    for t in threads:
        t.start()
    return threads


def one_kill(engines: list[str], how: signal.Signals, after: int, tmp: Path) -> Kill:
    config = billed_config(tmp / "gateway.yaml", tmp / "wal", shutdown_grace_s=GRACE_S)
    port = processes.free_port()
    gateway = start_billed(port, engines, config)
    kill, stop = Kill(), threading.Event()
    threads = _load(gateway.url, kill, stop)
    try:
        wait_for(lambda: len(kill.completed) >= after, 120, "completed responses before the kill")
        gateway.popen.send_signal(how)
        gateway.popen.wait(timeout=30)
    finally:
        stop.set()
        processes.stop([gateway])
        for t in threads:
            t.join(timeout=60)
    started = time.monotonic()
    restarted = start_billed(port, engines, config)  # the WAL's recovery runs at start
    kill.recovery_s = time.monotonic() - started
    processes.stop([restarted])
    wal = wal_contents(tmp / "wal")
    counts = count(kill, wal)
    if missed(kill):
        kept = Path(tempfile.mkdtemp(prefix="kvgate-chaos-failed-"))
        shutil.copytree(tmp / "wal", kept / "wal")
        doubles = {i: [s for j, s in wal.records if j == i]
                   for i, n in counts.items() if n > 1}  # fmt: skip
        kill.kept = f"{kept} {doubles or ''}"
    return kill


def count(kill: Kill, wal: WalContents) -> Counter[str]:
    """Set the kill's counts from the WAL read after the restart; returns each id's count."""
    counts = Counter(i for i, _ in wal.records)
    completed = set(kill.completed)
    kill.unrecorded = sum(1 for i in kill.completed if counts[i] == 0)
    kill.twice = sum(1 for n in counts.values() if n > 1)
    kill.aborted = sum(1 for _, status in wal.records if status == "aborted")
    kill.landed = sum(1 for i, s in wal.records if s == "ok" and i not in completed)
    kill.cut_unrecorded = sum(1 for i in kill.cut_ids if counts[i] == 0)
    kill.left_unsettled = len(wal.unsettled)
    return counts


def short(kill: Kill) -> bool:
    """Fewer records than cut streams, or a cut stream's named record missing."""
    return kill.aborted + kill.landed < kill.cut or kill.cut_unrecorded > 0


def missed(kill: Kill) -> bool:
    return bool(kill.unrecorded or kill.twice or short(kill) or kill.left_unsettled)


def run(size: Size) -> Outcome:
    out = Outcome("gateway-killed")
    after = size.pick(8, 20)
    with processes.engines(2) as engines:
        urls = [e.url for e in engines]
        for name, how in (("drain", signal.SIGTERM), ("kill -9", signal.SIGKILL)):
            kills = []
            for _ in range(size.repeat):
                with tempfile.TemporaryDirectory(prefix="kvgate-chaos-") as tmp:
                    kills.append(one_kill(urls, how, after, Path(tmp)))
            _judge(out, name, kills)
    return out


def _judge(out: Outcome, name: str, kills: list[Kill]) -> None:
    n = len(kills)
    completed = sum(len(k.completed) for k in kills)
    unrecorded, twice = sum(k.unrecorded for k in kills), sum(k.twice for k in kills)
    cut, aborted = sum(k.cut for k in kills), sum(k.aborted for k in kills)
    out.goal(f"{name}: completed but unrecorded", unrecorded == 0,
             f"{unrecorded} of {completed} completed, {n} runs")  # fmt: skip
    out.goal(f"{name}: recorded twice", twice == 0, f"{twice}")
    landed = sum(k.landed for k in kills)
    runs_short = sum(1 for k in kills if short(k))
    out.goal(f"{name}: each cut stream a record", runs_short == 0,
             f"{cut} cut, {aborted} aborted records + {landed} landed before the cut; "
             f"{runs_short} runs short")  # fmt: skip
    left = sum(k.left_unsettled for k in kills)
    out.goal(f"{name}: unsettled after restart", left == 0, f"{left}")
    times = [k.recovery_s for k in kills]
    out.figures[f"{name}: WAL recovery (restart to ready) s, median / max"] = (
        f"{statistics.median(times):.2f} / {max(times):.2f}"
    )
    out.figures[f"{name}: requests sent"] = sum(k.attempts for k in kills)
    for k in kills:
        if k.kept:
            out.figures[f"{name}: a run that missed a goal left its WAL in"] = k.kept
