"""What compiling the pure hot modules with mypyc buys, and msgspec against orjson (issue 41).

    python -m tools.compiled build [DIR]   # a copy of the tree with MODULES compiled in place
    python -m tools.compiled hot           # the hot pure functions, µs of thread CPU each
    (cd build/compiled && python -m tools.compiled hot)     # ... the compiled copy's
    kvgate bench-cpu --against build/compiled                # end to end, both in one run

Nothing here is part of the product: the gateway ships as pure Python (docs/design/compiled.md
says why, with the numbers). `build` copies the checkout's tracked files to DIR (default
`build/compiled`, ignored by git) and runs mypyc (it ships with mypy, a dev dependency) on
`MODULES` there; the extension modules land beside their sources, so a process whose module
path starts at DIR (`python -m` run in it: the current directory comes first) imports the
compiled ones. `hot` times the functions the request path runs in those modules, and the
body's JSON decode by orjson (the gateway's) and by msgspec, each the median of rounds in this
thread's CPU time (a loaded machine deschedules the process between calls, which thread time
does not count).
"""

from __future__ import annotations

import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

MODULES = [
    "cachemap/affinity.py",
    "cachemap/directory.py",
    "cachemap/events.py",
    "cachemap/keys.py",
    "cachemap/memory.py",
    "cachemap/rates.py",
    "cachemap/recency.py",
    "cachemap/rendering.py",
    "router/__init__.py",
    "router/fanout.py",
    "router/filters.py",
    "router/overflow.py",
    "router/pickers.py",
    "router/plan.py",
    "router/profile.py",
    "router/registry.py",
    "router/scorers.py",
    "router/types.py",
    "gateway/request/",
]
"""What mypyc compiles. Left out: `router/fairness.py` (a generic dataclass with slots, which
mypyc 2.4 builds into a module that fails to import: "attribute '__dict__' of 'type' objects is
not writable"), `cachemap/tokenizer.py` and `incremental.py` (precise keying, issue 41 item 1),
and everything that imports an I/O framework."""


def build(out: Path) -> None:
    """The tracked files copied to `out`, then `MODULES` compiled there in place."""
    if out.exists():
        shutil.rmtree(out)
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], check=True, capture_output=True, text=True
    ).stdout.split("\0")
    for name in filter(None, tracked):
        if Path(name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(name, out / name)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "mypyc", *MODULES], cwd=out, check=True)
    print(f"compiled {len(MODULES)} modules into {out} in {time.monotonic() - started:.0f} s")


def _median_us(call: Callable[[], object], repeat: int, rounds: int = 7) -> float:
    timings = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(repeat):
            call()
        timings.append((time.thread_time() - t0) / repeat * 1e6)
    return statistics.median(timings)


def hot() -> None:
    """Each hot function's µs (module docstring), and where its module was imported from."""
    import msgspec
    import orjson

    import cachemap.memory
    from cachemap.keys import chain_hashes, root_hash
    from cachemap.memory import MemoryIndex
    from cachemap.rendering import render_chat, too_deep
    from gateway.request.tenant import hash_key
    from router.plan import plan
    from router.registry import build_policy
    from router.types import Replica, RouteRequest
    from tools.stages import agent_body

    print(f"cachemap.memory from {cachemap.memory.__file__}")
    policy = build_policy("cache_aware")
    replicas = [Replica(f"r{i}", True, i % 3, 0.0) for i in range(4)]
    route = RouteRequest(
        num_blocks=20, num_prompt_tokens=1280, overlap={"r1": 16, "r2": 4}, tokens_per_block=64
    )
    rng = random.Random(1)
    small = [
        {"role": "system", "content": "You are terse. " * 20},
        {"role": "user", "content": "request 7"},
    ]
    raw_small = orjson.dumps({"model": "m", "messages": small, "max_tokens": 4})
    raw_agent = agent_body()
    agent = orjson.loads(raw_agent)["messages"]
    text_small, text_agent = render_chat(small).encode(), render_chat(agent).encode()
    root = root_hash(b"salt", "m")
    index = MemoryIndex()
    small_chain, agent_chain = chain_hashes(text_small, root), chain_hashes(text_agent, root)
    for replica in ("r0", "r1", "r2", "r3"):
        index.record(replica, agent_chain)
    decode = msgspec.json.Decoder().decode
    rows: dict[str, tuple[Callable[[], object], int]] = {
        "router: plan (cache_aware, 4 replicas)": (
            lambda: plan(policy, route, replicas, rng),
            5000,
        ),
        "cachemap: render_chat, small": (lambda: render_chat(small), 5000),
        "cachemap: too_deep, small": (lambda: too_deep({"messages": small}), 5000),
        "cachemap: chain_hashes, small": (lambda: chain_hashes(text_small, root), 5000),
        "cachemap: index lookup + record, small": (
            lambda: (index.lookup_detail(small_chain), index.record("r1", small_chain)),
            5000,
        ),
        "request: hash_key": (lambda: hash_key("sk-bench"), 5000),
        "cachemap: render_chat, agent (100 KB)": (lambda: render_chat(agent), 200),
        "cachemap: chain_hashes, agent": (lambda: chain_hashes(text_agent, root), 200),
        "cachemap: index lookup + record, agent": (
            lambda: (index.lookup_detail(agent_chain), index.record("r1", agent_chain)),
            200,
        ),
        "decode: orjson.loads, small": (lambda: orjson.loads(raw_small), 5000),
        "decode: msgspec.json, small": (lambda: decode(raw_small), 5000),
        "decode: orjson.loads, agent": (lambda: orjson.loads(raw_agent), 200),
        "decode: msgspec.json, agent": (lambda: decode(raw_agent), 200),
    }
    for name, (call, repeat) in rows.items():
        print(f"{name:<44} {_median_us(call, repeat):9.2f} µs")


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        build(Path(argv[1] if len(argv) > 1 else "build/compiled"))
    elif argv[:1] == ["hot"]:
        hot()
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
