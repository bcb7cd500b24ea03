"""What each stage of the request path costs on one agent-sized body, in process (µs).

    python -m tools.stages [BODY_BYTES]

(`kvgate bench-cpu --suite` runs it in a subprocess: loadgen and the gateway meet only over
the wire or a process boundary.)

The gateway's CPU per request is measured end to end by `kvgate bench-cpu`; this splits the part
that scales with the prompt's size into the stages the director runs on it, each timed alone on
the same body (a long tool-using conversation of ~100 KB of JSON, as coding agents send):

    load      orjson of the raw bytes, and the nesting guard (`load_json_object`)
    parse     the whole of `parse_chat`: load, every field's check, the render
    render    the canonical text of the messages and tools (`render_chat`, then UTF-8)
    hash      the block chain of the rendered text (`chain_hashes`, one mmh3 per 256 bytes)
    upstream  the engine's body: the client's bytes with the salt spliced in (`splice_fields`,
              what the director sends for an OpenAI body)
    redump    the same body as the parsed dict with the salt, dumped again by orjson (the
              path of a body that cannot be spliced, and of every body before the splice)

Each figure is the median of `rounds` timings of `repeat` calls in this thread's CPU time (not
wall time: on a loaded machine the process is descheduled between calls), so spikes move it
little; the stages overlap (parse includes load and render).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from cachemap.keys import chain_hashes, root_hash
from cachemap.rendering import render_chat
from gateway.api.body import load_json_object
from gateway.api.openai.parse import parse_chat
from gateway.pipeline.payload import splice_fields
from loadgen.engine.server import DEFAULT_MODEL
from loadgen.text import words

AGENT_BODY_BYTES = 100_000
"""The independent replay's agent prompts were ~100 KB of JSON (issue 17)."""


def agent_body(num_bytes: int = AGENT_BODY_BYTES, seed: str = "stages") -> bytes:
    """A chat body of about `num_bytes`: a long system prompt, two tools, then turns of user
    text, assistant tool calls and tool results (the shape an agent session grows into)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": words(f"{seed}-{name}", 60),
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
        for name in ("read_file", "run_tests")
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(seed, 4000)}]
    turn = 0
    while len(orjson.dumps(messages)) < num_bytes - 2_000:
        call_id = f"call_{turn}"
        messages += [
            {"role": "user", "content": words(f"{seed}-u{turn}", 120)},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": words(f"{seed}-t{turn}", 500)},
        ]
        turn += 1
    body = {"model": DEFAULT_MODEL, "messages": messages, "tools": tools, "stream": True}
    return orjson.dumps(body)


def _median_us(call: Callable[[], object], repeat: int, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        started = time.thread_time_ns()
        for _ in range(repeat):
            call()
        samples.append((time.thread_time_ns() - started) / repeat / 1e3)
    return statistics.median(samples)


def stage_costs(raw: bytes, repeat: int = 20, rounds: int = 7) -> dict[str, float]:
    """µs per call of each stage on `raw` (see the module docstring)."""
    body = load_json_object(raw)
    messages, tools = body["messages"], body.get("tools")
    rendered = render_chat(messages, tools).encode()
    root = root_hash(b"salt", DEFAULT_MODEL)
    limit = len(raw) * 4
    stages: dict[str, Callable[[], object]] = {
        "load": lambda: load_json_object(raw),
        "parse": lambda: parse_chat(raw, limit),
        "render": lambda: render_chat(messages, tools).encode(),
        "hash": lambda: chain_hashes(rendered, root),
        "upstream": lambda: splice_fields(raw, body, {"cache_salt": "salt", "stream": True}),
        "redump": lambda: orjson.dumps({**body, "cache_salt": "salt"}),
    }
    return {name: _median_us(call, repeat, rounds) for name, call in stages.items()}


def print_stage_costs(num_bytes: int = AGENT_BODY_BYTES) -> None:
    raw = agent_body(num_bytes)
    costs = stage_costs(raw)
    shown = ", ".join(f"{name} {us:,.0f}" for name, us in costs.items())
    print(f"stages on one {len(raw):,}-byte chat body, µs per call: {shown}")


if __name__ == "__main__":
    print_stage_costs(int(sys.argv[1]) if len(sys.argv) > 1 else AGENT_BODY_BYTES)
