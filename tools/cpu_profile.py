"""A gateway's CPU by where it runs, sampled on the process's CPU clock rather than the wall
clock: what `py-spy record` cannot tell on a shared machine.

    KVGATE_CPU_PROFILE=DIR PYTHONPATH=<tree>:<tree>/tools/cpu_profile_site kvgate bench ...
    python -m tools.cpu_profile report DIR REQUESTS

Every `kvgate serve` started with KVGATE_CPU_PROFILE set (the bench's gateways inherit its
environment; `tools/cpu_profile_site/sitecustomize.py` calls `install`) arms `ITIMER_PROF`, a
timer on the process's CPU time (user + system, every thread). Its signal's handler folds the
main thread's Python stack and weighs it with the CPU time spent since the handler last ran:
signals that arrive during one long C call (a `write`, a compiled loop) are delivered once, so
a count of samples would undercount the frames that call C and the weight does not. CPU spent
in C between two Python callbacks (the event loop's own, a socket call) lands on the next
Python frame that runs. DIR/<pid>.folded (`frame;frame;... microseconds`) is rewritten every
`DUMP_S` and at exit, beside DIR/<pid>.json (the collector's collections and CPU time a
generation, by `gc.callbacks`, and every thread's CPU time and run-queue wait from /proc).

Why not py-spy: it samples on the wall clock, so a thread that is runnable but not running
counts where it was preempted. At bench point 2 on two shared cores (load 6-11) the gateway's
main thread waited 2-4 s in the run queue a second of CPU, most of it right after a `write`
woke the engine or the client: py-spy put precise mode's request path at 2.0x approximate's a
request, this sampler at 0.98x (docs/design/compiled.md, "Precise mode's second half").

`report` prints, per profiled gateway, the CPU of its serving (start-up's imports and build
left out) a request by category (`CATEGORIES`, the first that matches a stack), and the
collector's and the threads' totals. Nothing here is asserted; it prints numbers.
"""

from __future__ import annotations

import atexit
import collections
import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

ENV = "KVGATE_CPU_PROFILE"
"""The directory the profiles are written to; unset: nothing is installed."""
INTERVAL_S = 0.002
"""`ITIMER_PROF`'s period (the kernel's tick bounds it: ~4 ms at 250 Hz)."""
DUMP_S = 2.0
"""How often the profile is rewritten (a gateway stopped by SIGKILL keeps the last one)."""

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("precise: event ingest", ("gateway/events/intake.py",)),
    (
        "precise: keying, view, speculation",
        ("Keying._precise", "Keying.placed", "gateway/events/", "cachemap/events.py"),
    ),
    ("approximate: keying", ("Keying._approximate",)),
    ("shared: request path", ("RequestResponseCycle.run_asgi",)),
    ("shared: replicas, flow, other tasks", ("Runner.run",)),
)
"""(name, any of these in a frame): the first category a stack matches is its own."""


def install(out_dir: str) -> None:
    """Profile this process (its main thread's stacks, every thread's CPU) into `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    folded: collections.Counter[str] = collections.Counter()
    gens = [[0, 0.0] for _ in range(3)]  # collections, CPU seconds
    started = [0.0]
    last = [time.process_time()]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            gens[info["generation"]][0] += 1
            gens[info["generation"]][1] += time.thread_time() - started[0]

    def on_signal(signum: int, frame: FrameType | None) -> None:
        now = time.process_time()
        weight, last[0] = int((now - last[0]) * 1e6), now
        folded[_fold(frame)] += weight

    def dump() -> None:
        pid = os.getpid()
        _write(Path(out_dir, f"{pid}.folded"), "".join(f"{k} {v}\n" for k, v in folded.items()))
        meta = {"argv": sys.argv, "gc": gens, "threads": _threads(), "cpu_s": time.process_time()}
        _write(Path(out_dir, f"{pid}.json"), json.dumps(meta))

    def dumping() -> None:
        while True:
            time.sleep(DUMP_S)
            dump()

    gc.callbacks.append(on_gc)
    signal.signal(signal.SIGPROF, on_signal)
    signal.setitimer(signal.ITIMER_PROF, INTERVAL_S, INTERVAL_S)
    threading.Thread(target=dumping, name="cpu-profile", daemon=True).start()
    atexit.register(dump)
    atexit.register(signal.setitimer, signal.ITIMER_PROF, 0.0, 0.0)  # first: before the dump


def _fold(frame: FrameType | None) -> str:
    names: list[str] = []
    while frame is not None:
        code = frame.f_code
        where = "/".join(code.co_filename.rsplit("/", 3)[-3:])
        names.append(f"{code.co_qualname} ({where})")
        frame = frame.f_back
    return ";".join(reversed(names))


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _threads() -> dict[str, list[Any]]:
    """tid -> [name, CPU seconds, run-queue wait seconds] (/proc's stat and schedstat)."""
    out: dict[str, list[Any]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            task = Path("/proc/self/task", tid)
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            sched = (task / "schedstat").read_text().split()
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[tid] = [name, (int(stat[11]) + int(stat[12])) / tick, int(sched[1]) / 1e9]
    return out


def categorise(stack: str) -> str | None:
    """The stack's category (`CATEGORIES`); None for start-up (imports, the app's build)."""
    if "Runner.run" not in stack or "_find_and_load" in stack:
        return None
    for name, marks in CATEGORIES:
        if any(mark in stack for mark in marks):
            return name
    return CATEGORIES[-1][0]


def read_folded(path: Path) -> collections.Counter[str]:
    out: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, weight = line.rpartition(" ")
        out[stack] += int(weight)
    return out


def report(directory: Path, requests: int, emit: Callable[[str], None] = print) -> None:
    for path in sorted(directory.glob("*.folded")):
        meta = json.loads(path.with_suffix(".json").read_text())
        mode = "precise" if "--tokenizer-dir" in meta["argv"] else "approximate"
        by: collections.Counter[str] = collections.Counter()
        for stack, weight in read_folded(path).items():
            name = categorise(stack)
            if name is not None:
                by[name] += weight
        serving = sum(by.values())
        emit(f"{path.stem} ({mode}): serving {serving / 1e3 / requests:.2f} ms a request")
        for name, _ in CATEGORIES:
            share = by[name] / serving if serving else 0.0
            emit(f"  {name:<38} {by[name] / 1e3 / requests:7.3f} ms  {share:6.1%}")
        gens = ", ".join(f"{n} in {s * 1e3:.0f} ms" for n, s in meta["gc"])
        emit(f"  collections by generation: {gens}")
        for tid, (name, cpu_s, wait_s) in sorted(meta["threads"].items(), key=lambda t: -t[1][1]):
            if cpu_s >= 0.01:
                emit(f"  thread {tid} {name}: CPU {cpu_s:.2f} s, run-queue wait {wait_s:.2f} s")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "report":
        raise SystemExit("usage: python -m tools.cpu_profile report DIR REQUESTS")
    report(Path(args[1]), int(args[2]))


if __name__ == "__main__":
    main()
