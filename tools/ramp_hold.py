"""The ramp's request at a fixed rate, on this tree and other checkouts, in one run.

    python -m tools.ramp_hold hold RATE SECONDS TREE[,TREE...] [NAME=DIR ...] [--profile=PATH]
        [--pin] [--small] [--whole]
    python -m tools.ramp_hold ramp TREE[,TREE...] [NAME=DIR ...]
    python -m tools.ramp_hold callgrind RATE COUNT TREE[,TREE...] [NAME=DIR ...] [--cache-sim]

    python -m tools.ramp_hold hold 300 10 base,here,here,base base=/tmp/base --pin
    python -m tools.ramp_hold ramp base,here,here,base base=/tmp/base

Each arm is what `kvgate bench`'s `kvgate:cache_aware` arm runs in its max-rate ramp: one
`kvgate serve` (the tree's code; `here` is this checkout) in front of 4 fresh instant stand-ins
(`loadgen.bench.fast_engine`), sent the ramp's bodies (the Mooncake slice's first 200 prompts from
line 4,000, ~83 KB each, streamed, 16 tokens and a usage event: `loadgen.bench.rate.request_bodies`)
open loop. The directory's capacity is the bench's at `--requests 200 --capacity-frac 0.25`.

`hold`: a step of 2 s at RATE to warm up (every body seen once at 100/s and more), then one of
SECONDS at RATE, measured: the gateway's CPU per request (user + system, from /proc) and its
system share, p50 / p99 TTFT, errors, and the load average. `--profile=PATH` records the measured
step with py-spy (`--native --format raw -r 100`, to PATH.<arm number>).

`--pin`: the gateway on core 0, this client and the stand-ins on core 1, so that the gateway is
not preempted by the peers it wakes (py-spy counts a runnable thread as busy: unpinned, a third
of its samples land in the `write` calls that wake a peer). `--small`: the same requests with a
~300-byte prompt each (what of a request's CPU is its body's size); `--whole`: answered as one JSON
body, not streamed (`bench-cpu`'s default shape). A profile path holding
`.perf` records with `perf` (CPU cycles, native frames only), `.strace` counts the syscalls.

`callgrind`: the gateway under valgrind's callgrind, sent COUNT bodies at RATE to warm, then its
counters zeroed and COUNT more at RATE: the instructions a request (Ir; with `--cache-sim`, also
an estimate of cycles, Ir + 10 a first-level miss + 100 a last-level one, kcachegrind's), a
count that the machine's load does not move. Under valgrind a request costs ~50x: 2/s is safe.

`ramp`: the bench's own ramp (`loadgen.bench.rate.ramp`, its default steps) per arm: the max
sustainable rate, and per step the achieved rate and the gateway's CPU per request.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

from loadgen.bench import peers
from loadgen.bench.fast_engine import fast_engines
from loadgen.bench.rate import RateOptions, _run, ramp, request_bodies, run_step
from loadgen.harness import processes
from loadgen.sim import percentile
from loadgen.traces.readers import read_trace

HERE = str(Path(__file__).resolve().parent.parent)
REQUESTS = 200
CAPACITY_FRAC = 0.25
WARM_S = 2.0


def directory_blocks() -> int:
    """`kvgate bench --requests 200 --capacity-frac 0.25`'s directory capacity (its `Setup`)."""
    from loadgen.sim import SimConfig, TimingModel, run_policies
    from loadgen.traces.synthesis import PromptSynthesizer

    trace = read_trace(str(peers.DEFAULT_TRACE), start=peers.DEFAULT_START, limit=REQUESTS)
    config = SimConfig(
        num_replicas=4,
        capacity_frac=CAPACITY_FRAC,
        timing=TimingModel(peers.DEFAULT_PREFILL_TOKENS_PER_S, peers.DEFAULT_DECODE_S_PER_TOKEN),
        max_output_tokens=peers.DEFAULT_MAX_OUTPUT_TOKENS,
    )
    refs, _ = run_policies(trace, ["round_robin"], config)
    capacity_tokens = refs.capacity_blocks_per_replica * trace.block_size
    synth = PromptSynthesizer(trace.block_size)
    bytes_per_token = len(synth.block_text(0)[0].encode()) / trace.block_size
    scale = peers.DEFAULT_DIRECTORY_SCALE
    return max(math.ceil(capacity_tokens * bytes_per_token / peers.BLOCK_BYTES * scale), 1)


PIN = False
"""`--pin`: the gateway on core 0, this client and the stand-ins on core 1 (py-spy samples
wall clock: a gateway that wakes a peer on its own core is preempted inside its `write`, and
those samples are the peer's CPU, not the gateway's)."""


def _pin_gateway() -> None:
    os.sched_setaffinity(0, {0})


def _gateway(
    tree: str, urls: list[str], blocks: int, wrapper: list[str] | None = None
) -> processes.Proc:
    env = {
        "KVGATE_DIRECTORY_CAPACITY_BLOCKS": str(blocks),
        "KVGATE_SEED": "0",
        **peers.scaled_gateway_env(1.0),
    }
    args = ["--policy", "cache_aware", "--tenant", f"bench:{peers.BENCH_KEY}"]
    args += ["--log-level", "warning"]
    pin = _pin_gateway if PIN else None
    gw = processes.start_gateway(
        processes.free_port(), urls, args, env, cwd=tree, preexec_fn=pin, wrapper=wrapper or ()
    )
    timeout = processes.STARTUP_TIMEOUT_S if wrapper is None else CALLGRIND_STARTUP_S
    processes.wait_ready(gw.url, "/readyz", gw.popen, timeout)
    return gw


CALLGRIND_STARTUP_S = 1200.0
"""A gateway's start under callgrind: ~50x its imports, on a busy machine."""


def callgrind_arm(
    tree: str, rate: float, count: int, bodies: list[bytes], blocks: int, cache_sim: bool
) -> str:
    with tempfile.TemporaryDirectory() as out:
        wrapper = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p"]
        wrapper += ["--cache-sim=yes"] if cache_sim else []
        with fast_engines(4) as stand_ins:
            gw = _gateway(tree, list(stand_ins.urls), blocks, wrapper)
            try:
                step = RateOptions(step_s=count / rate)
                _run(run_step([gw.url], peers.BENCH_KEY, bodies, rate, step, 0))
                load0 = _load()
                _callgrind_control("-z", gw.pid)
                sent, errors, _, _, first_error = _run(
                    run_step([gw.url], peers.BENCH_KEY, bodies, rate, step, count)
                )
                _callgrind_control("-d", gw.pid)
            finally:
                processes.stop([gw])
        totals = _callgrind_totals(next(Path(out).glob("cg.*.1")))
    ok = max(sent - errors, 1)
    ir = totals["Ir"] / ok
    misses = sum(totals.get(e, 0) for e in ("I1mr", "D1mr", "D1mw"))
    last = sum(totals.get(e, 0) for e in ("ILmr", "DLmr", "DLmw"))
    cycles = f"{(totals['Ir'] + 10 * misses + 100 * last) / ok / 1e6:.3f}" if cache_sim else "-"
    return (
        f"| {ir / 1e6:.3f} | {cycles} | {errors} of {sent} | {load0} → {_load()} "
        f"| {first_error[:60]} |"
    )


def _callgrind_control(command: str, pid: int) -> None:
    """`callgrind_control -z` (zero the counters) or `-d` (dump them) for the gateway."""
    subprocess.run(
        ["callgrind_control", command, str(pid)], check=True, capture_output=True, timeout=60
    )


def _callgrind_totals(path: Path) -> dict[str, int]:
    """A callgrind dump's `summary:` line by its `events:` names."""
    events: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("summary:"):
            return dict(zip(events, map(int, line.split()[1:]), strict=True))
    raise ValueError(f"{path}: no summary line")


def _profiler(path: str, pid: int) -> list[str]:
    """py-spy's command; perf's when `path` holds `.perf` (CPU cycles, not wall clock: the
    native stacks only, the interpreter's frames as `_PyEval_EvalFrameDefault`); strace's count
    of syscalls when it holds `.strace`."""
    if ".strace" in path:  # the syscalls counted
        return ["strace", "-c", "-f", "-p", str(pid), "-o", path]
    if ".perf" in path:
        return ["perf", "record", "-F", "999", "-g", "-p", str(pid), "-o", path]
    spy = str(Path(sys.executable).parent / "py-spy")
    return [
        spy,
        "record",
        "--pid",
        str(pid),
        "--native",
        "--format",
        "raw",
        "-r",
        "100",
        "-o",
        path,
    ]


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg()[:1])


def hold_arm(
    tree: str, rate: float, seconds: float, bodies: list[bytes], blocks: int, profile: str | None
) -> str:
    with fast_engines(4) as stand_ins:
        gw = _gateway(tree, list(stand_ins.urls), blocks)
        try:
            warm = RateOptions(step_s=WARM_S)
            _run(run_step([gw.url], peers.BENCH_KEY, bodies, rate, warm, 0))
            load0 = _load()
            spy = None
            if profile is not None:
                spy = subprocess.Popen(
                    _profiler(profile, gw.pid),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            user0, sys0 = processes.cpu_split(gw.pid)
            options = RateOptions(step_s=seconds)
            first = int(rate * WARM_S)
            sent, errors, ttfts, _, first_error = _run(
                run_step([gw.url], peers.BENCH_KEY, bodies, rate, options, first)
            )
            user1, sys1 = processes.cpu_split(gw.pid)
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(60)
        finally:
            processes.stop([gw])
    ok = max(len(ttfts), 1)
    cpu = (user1 - user0 + sys1 - sys0) / ok * 1e3
    system = (sys1 - sys0) / ok * 1e3
    p50 = percentile(ttfts, 0.5) * 1e3 if ttfts else math.inf
    p99 = percentile(ttfts, 0.99) * 1e3 if ttfts else math.inf
    return (
        f"| {cpu:.3f} | {system:.3f} | {p50:.1f} / {p99:.1f} | {errors} of {sent} "
        f"| {load0} → {_load()} | {first_error[:60]} |"
    )


def ramp_arm(tree: str, bodies: list[bytes], blocks: int) -> str:
    with fast_engines(4) as stand_ins:
        gw = _gateway(tree, list(stand_ins.urls), blocks)
        try:
            load0 = _load()
            result = ramp(
                [gw.url],
                peers.BENCH_KEY,
                bodies,
                RateOptions(),
                lambda: (processes.cpu_seconds(gw.pid), 0.0),
            )
        finally:
            processes.stop([gw])
    best = result.max_sustained_rps
    steps = ", ".join(
        f"{s.offered_rps:.0f}{'' if s.sustained else '✗'}: {s.achieved_rps:.0f}/s "
        f"p99 {s.ttft_p99_s * 1e3:.0f} ms {s.router_cpu_ms_per_request or 0.0:.2f} ms"
        + (f" ({s.errors} errors)" if s.errors else "")
        for s in result.steps
    )
    shown = "none" if best is None else f"{best:.0f}"
    return f"| {shown} | {steps} | {load0} → {_load()} |"


def _small(body: bytes, k: int) -> bytes:
    parsed = orjson.loads(body)
    text = f"request {k}: " + "the quick brown fox jumps over the lazy dog " * 6
    parsed["messages"] = [{"role": "user", "content": text}]
    return orjson.dumps(parsed)


def _whole(body: bytes) -> bytes:
    parsed = orjson.loads(body)
    parsed["stream"] = False
    parsed.pop("stream_options", None)
    return orjson.dumps(parsed)


def main(argv: list[str]) -> int:
    profile = next((a.split("=", 1)[1] for a in argv if a.startswith("--profile=")), None)
    argv = [a for a in argv if not a.startswith("--profile=")]
    cache_sim = "--cache-sim" in argv
    argv = [a for a in argv if a != "--cache-sim"]
    if not argv or argv[0] not in ("hold", "ramp", "callgrind"):
        print(__doc__)
        return 2
    trace = read_trace(str(peers.DEFAULT_TRACE), start=peers.DEFAULT_START, limit=REQUESTS)
    bodies = request_bodies(trace, RateOptions())
    if "--pin" in argv:
        global PIN
        PIN = True
        argv = [a for a in argv if a != "--pin"]
        os.sched_setaffinity(0, {1})  # the stand-ins started later inherit it
    if "--small" in argv:  # the same requests with a ~300-byte prompt each (distinct)
        argv = [a for a in argv if a != "--small"]
        bodies = [_small(body, k) for k, body in enumerate(bodies)]
    if "--whole" in argv:  # the same requests answered whole (JSON), not streamed
        argv = [a for a in argv if a != "--whole"]
        bodies = [_whole(body) for body in bodies]
    blocks = directory_blocks()
    if argv[0] == "ramp":
        names, rest = argv[1], argv[2:]
        print("| tree | max sustained req/s | steps: offered (✗ not sustained) | load |")
        print("| --- | ---: | --- | --- |")
    elif argv[0] == "callgrind":
        rate, count = float(argv[1]), int(argv[2])
        names, rest = argv[3], argv[4:]
        print(
            f"| tree ({count} at {rate:g}/s) | M instructions / req | M est. cycles / req "
            "| errors | load | first error |"
        )
        print("| --- | ---: | ---: | ---: | --- | --- |")
    else:
        rate, seconds = float(argv[1]), float(argv[2])
        names, rest = argv[3], argv[4:]
        print(
            f"| tree ({rate:g}/s for {seconds:g} s) | gateway CPU ms/req | of it system "
            "| TTFT p50 / p99 ms | errors | load | first error |"
        )
        print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    trees = {"here": HERE} | dict(a.split("=", 1) for a in rest)
    for number, name in enumerate(names.split(",")):
        if argv[0] == "ramp":
            row = ramp_arm(trees[name], bodies, blocks)
        elif argv[0] == "callgrind":
            row = callgrind_arm(trees[name], rate, count, bodies, blocks, cache_sim)
        else:
            out = None if profile is None else f"{profile}.{number}"
            row = hold_arm(trees[name], rate, seconds, bodies, blocks, out)
        print(f"| {name} " + row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
