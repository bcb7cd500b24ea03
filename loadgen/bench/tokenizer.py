"""The simulated engine's tokenization cost per prompt (a benchmark, not a test).

`python -m loadgen.bench.tokenizer` times, in this process, what the engine does to a chat
request before it can schedule it: render the chat template, then encode with the BPE. Prompts
are the agent-sized ones load generation sends (single-token words, `loadgen.text.words`) and,
for comparison, English prose with code and JSON (docs/*.md, which tokenizes into shorter
pieces). Each figure is the best of `--repeat` runs, in µs per 1,000 tokens.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from loadgen.engine.tokenizer import default_tokenizer
from loadgen.text import words

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _best_s(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadgen.bench.tokenizer", description=__doc__)
    parser.add_argument("--tokens", type=int, default=12_000, help="prompt size (words)")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args(argv)
    tokenizer = default_tokenizer()
    messages = [
        {"role": "system", "content": "You are a coding agent." + words("bench/system", 2_700)},
        {"role": "user", "content": "Task:" + words("bench/task", args.tokens - 2_700)},
    ]
    prose = "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    rendered = tokenizer.render_chat(messages)
    cases = {
        "render the chat template": (lambda: tokenizer.render_chat(messages), rendered),
        "encode the rendered chat": (lambda: tokenizer.encode(rendered), rendered),
        "render + encode (a generation)": (
            lambda: tokenizer.encode(tokenizer.render_chat(messages)),
            rendered,
        ),
        "encode docs/*.md (prose, code, JSON)": (lambda: tokenizer.encode(prose), prose),
    }
    print(f"{'case':<40} {'tokens':>8} {'µs / 1k tokens':>15} {'ms / prompt':>12}")
    for name, (fn, text) in cases.items():
        num_tokens = tokenizer.count(text)
        seconds = _best_s(fn, args.repeat)
        per_1k = seconds / num_tokens * 1e9
        print(f"{name:<40} {num_tokens:>8,} {per_1k:>15,.0f} {seconds * 1e3:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
