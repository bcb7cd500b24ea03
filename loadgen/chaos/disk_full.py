"""The WAL's disk fills under a live billed gateway: no acknowledged record is lost.

The WAL lives on a tmpfs of `size` bytes mounted for the run (`mount -t tmpfs`, as root in the
container); where mounting is refused, a failing-write shim instead: the gateway process's
RLIMIT_FSIZE stops its segment's writes part way, as a full disk does (SIGXFSZ ignored, so the
write fails with EFBIG). Clients send until the gateway refuses `REFUSALS` in a row. Then the
gateway stops, space is freed (the tmpfs remounted larger; the shim's limit dropped), it
restarts over the same WAL, and every response a client got whole must have its record, once.
Goals: that, and every refusal a clear `billing_unavailable` (a 503, or a stream's error event).
"""

from __future__ import annotations

import contextlib
import resource
import signal
import subprocess
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loadgen.chaos.billed import (
    KEY,
    Billed,
    billed_config,
    billed_request,
    start_billed,
    wal_contents,
)
from loadgen.chaos.outcome import Outcome, Size
from loadgen.harness import processes

REFUSALS = 8
CLIENTS = 4


@contextlib.contextmanager
def small_disk(path: Path, size_bytes: int) -> Iterator[bool]:
    """Mount a tmpfs of `size_bytes` at `path`: True, or False when mounting is refused."""
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _grow(path: Path, size_bytes: int) -> None:
    remount = ["mount", "-o", f"remount,size={size_bytes}", str(path)]
    subprocess.run(remount, capture_output=True, check=True)


def _file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:  # in the child, before exec: an ignored signal stays ignored
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return apply


def _fill(url: str, bound: int) -> list[Billed]:
    """Requests until REFUSALS in a row were refused (or `bound` were sent)."""
    results: list[Billed] = []
    lock, stop = threading.Lock(), threading.Event()
    streak = 0

    def one(i: int) -> None:
        nonlocal streak
        if stop.is_set():
            return
        got = billed_request(url, KEY, i, max_tokens=2)
        with lock:
            results.append(got)
            streak = 0 if got.outcome == "completed" else streak + 1
            if streak >= REFUSALS:
                stop.set()

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(one, range(bound)))
    return results


def run(size: Size) -> Outcome:
    disk_bytes, bound = size.pick(24_000, 400_000), size.pick(400, 4_000)
    with tempfile.TemporaryDirectory(prefix="kvgate-chaos-") as tmp, processes.engines(1) as eng:
        wal = Path(tmp) / "wal"
        with small_disk(wal, disk_bytes) as mounted:
            config = billed_config(Path(tmp) / "gateway.yaml", wal)
            port = processes.free_port()
            shim = None if mounted else _file_size_limit(disk_bytes)
            proc = processes.start_gateway(
                port, [eng[0].url], ["--config", str(config), "--log-level", "error"],
                preexec_fn=shim,
            )  # fmt: skip
            try:
                processes.wait_ready(proc.url, "/readyz", proc.popen, processes.STARTUP_TIMEOUT_S)
                results = _fill(proc.url, bound)
            finally:
                processes.stop([proc])
            if mounted:
                _grow(wal, 4 * disk_bytes)
            restarted = start_billed(port, [eng[0].url], config)
            processes.stop([restarted])
            counts = Counter(i for i, _ in wal_contents(wal).records)
    return _judge(results, counts, "tmpfs" if mounted else "RLIMIT_FSIZE shim", disk_bytes)


def _judge(results: list[Billed], counts: Counter[str], how: str, disk_bytes: int) -> Outcome:
    acked = [r.record_id for r in results if r.outcome == "completed" and r.record_id]
    refused = [r for r in results if r.outcome != "completed"]
    unclear = [r for r in refused if r.error != "billing_unavailable"]
    lost = sum(1 for i in acked if counts[i] != 1)
    out = Outcome("disk-full")
    out.goal("the disk filled (503s seen)", len(refused) >= REFUSALS, f"{len(refused)} refused")
    out.goal("acknowledged records lost (or twice)", lost == 0, f"{lost} of {len(acked)}")
    out.goal("refusals other than a clear billing_unavailable", not unclear,
             f"{len(unclear)} {sorted({(r.status, r.error) for r in unclear})}")  # fmt: skip
    out.figures["disk"] = f"{how}, {disk_bytes} bytes"
    out.figures["records after restart"] = sum(counts.values())
    return out
