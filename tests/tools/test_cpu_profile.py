"""`tools.cpu_profile`: a process started as `serve` with KVGATE_CPU_PROFILE set is profiled on
its CPU clock (the busy function holds the weight), and the report sorts stacks by category."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.cpu_profile import CATEGORIES, categorise, read_folded, report

ROOT = Path(__file__).resolve().parents[2]

BUSY = """
import time
def spin():
    t = time.process_time()
    while time.process_time() - t < 0.4:
        sum(range(200))
spin()
"""


def test_a_serve_process_is_profiled_on_its_cpu_clock(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KVGATE_CPU_PROFILE": str(tmp_path),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tools' / 'cpu_profile_site'}",
    }
    done = subprocess.run(
        [sys.executable, "-c", BUSY, "serve"], env=env, cwd=ROOT, timeout=60, check=True
    )
    assert done.returncode == 0
    (folded,) = tmp_path.glob("*.folded")
    weights = read_folded(folded)
    total = sum(weights.values())
    in_spin = sum(w for stack, w in weights.items() if "spin (" in stack)
    assert 0.25e6 < total < 2e6  # microseconds: the 0.4 s spin, start-up, the exit
    assert in_spin / total > 0.6
    meta = json.loads(folded.with_suffix(".json").read_text())
    assert len(meta["gc"]) == 3 and meta["cpu_s"] >= 0.4
    assert meta["threads"][folded.stem][1] >= 0.3  # the main thread's CPU seconds


def test_a_process_not_serving_is_left_alone(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KVGATE_CPU_PROFILE": str(tmp_path),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tools' / 'cpu_profile_site'}",
    }
    subprocess.run([sys.executable, "-c", "pass", "bench"], env=env, timeout=60, check=True)
    assert list(tmp_path.iterdir()) == []


def test_stacks_fall_in_the_first_category_they_match(tmp_path: Path) -> None:
    loop = "main;Server.run;Runner.run"
    ingest = f"{loop};Feed._readable (gateway/events/intake.py)"
    keyed = f"{loop};RequestResponseCycle.run_asgi;Keying._precise (gateway/pipeline/keying.py)"
    relay = f"{loop};RequestResponseCycle.run_asgi;ChunkedOut.write (gateway/api/asgi.py)"
    assert categorise(ingest) == CATEGORIES[0][0]
    assert categorise(keyed) == CATEGORIES[1][0]
    assert categorise(relay) == "shared: request path"
    assert categorise(f"{loop};ReplicaSet._scrape") == CATEGORIES[-1][0]
    assert categorise("main;_find_and_load;<module>") is None  # start-up
    (tmp_path / "7.folded").write_text(f"{ingest} 3000\n{relay} 1000\nmain;_find_and_load 9\n")
    meta = {"argv": ["serve", "--tokenizer-dir", "m"], "gc": [[1, 0.001]] * 3, "threads": {}}
    (tmp_path / "7.json").write_text(json.dumps(meta))
    lines: list[str] = []
    report(tmp_path, 2, lines.append)
    assert lines[0] == "7 (precise): serving 2.00 ms a request"
    assert "1.500 ms" in lines[1] and "75.0%" in lines[1]
