"""`kvgate bench-keying`: precise keying's CPU against approximate keying's, in process.

The measurement is `tools/keying_cost.py` (its docstring says what it keys and how), run as
`python -m tools.keying_cost` in a process of its own: it needs the gateway's keying code in
process, and loadgen meets the gateway only over the wire (the import contracts).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

OPTIONS = ("conversations", "turns", "long", "mooncake", "novel")


def add_bench_keying_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=8, help="chat conversations")
    parser.add_argument("--turns", type=int, default=20, help="turns per conversation")
    parser.add_argument("--long", type=int, default=30, help="long-message requests")
    parser.add_argument("--mooncake", type=int, default=300, help="Mooncake slice requests")
    parser.add_argument("--novel", type=int, default=10, help="first turns of novel text")


def run_bench_keying(args: argparse.Namespace) -> int:
    argv = [f"--{name}={getattr(args, name)}" for name in OPTIONS]
    return subprocess.run(
        [sys.executable, "-m", "tools.keying_cost", *argv], check=False
    ).returncode
