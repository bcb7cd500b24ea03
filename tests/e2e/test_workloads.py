"""The 50-step agent session: its shape, and a small closed-loop run through kvgate."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from kvgate_cli import main
from loadgen.engine.tokenizer import count_tokens, default_tokenizer
from loadgen.workloads import agent_session, count_requests
from tests.conftest import TENANT_KEY
from tests.servers import Served


def test_the_session_is_fifty_steps_from_twelve_thousand_tokens() -> None:
    phases = agent_session()
    assert count_requests(phases) == 50
    (session,) = phases[0].sessions
    render_chat = default_tokenizer().render_chat  # the engine's chat template
    assert count_tokens(render_chat(session.prefix, session.tools)) == 12_000
    assert all(step.max_tokens == 400 for step in session.steps)
    tool_results = [step.messages for step in session.steps[1:]]
    assert all(count_tokens(m[0]["content"]) == 1_100 for m in tool_results)


def test_gaps_and_fan_out_shape_the_phases() -> None:
    phases = agent_session(steps=20, gap_every=5, gap_s=600.0, fanout_every=10, fanout=4)
    assert [len(p.sessions) for p in phases] == [1, 4, 1]
    assert count_requests(phases) == 20 + 4 * 3
    main_steps = [s for p in phases if len(p.sessions) == 1 for s in p.sessions[0].steps]
    assert [i + 1 for i, s in enumerate(main_steps) if s.delay_s] == [6, 11, 16]
    # subagents start from the session's first 12,000 tokens plus their own task
    start = phases[0].sessions[0].prefix
    assert all(sub.prefix[: len(start)] == start for sub in phases[1].sessions)
    assert phases[2].sessions[0].name == "session" and phases[2].sessions[0].prefix == []
    with pytest.raises(ValueError, match="non-negative"):
        agent_session(fanout=-1)


@pytest.mark.e2e
def test_a_short_session_through_kvgate_hits_its_history(
    tmp_path: Path,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    engines = start_engines(2)
    gateway = start_gateway(engines, policy="cache_aware")
    out = tmp_path / "out"
    argv = [
        "replay",
        "workload:agent-session",
        "--target",
        gateway.url,
        "--api-key",
        TENANT_KEY,
        "--session-steps",
        "6",
        "--fanout-every",
        "3",
        "--fanout",
        "2",
        "--gap-every",
        "4",
        "--gap-s",
        "20",
        "--time-scale",
        "100",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    payload = orjson.loads((out / "results.json").read_bytes())
    rows = payload["rows"]
    assert payload["summary"]["errors"] == 0 and len(rows) == 6 + 2 * 3
    main_rows = [r for r in rows if "subagent" not in r["label"]]
    assert main_rows[0]["prompt_tokens"] == 12_000
    for before, after in itertools.pairwise(main_rows):
        # each step adds the 400-token reply and a 1,100-token tool result (plus template)
        assert 1_500 <= after["prompt_tokens"] - before["prompt_tokens"] <= 1_520
        assert after["cached_tokens"] >= before["prompt_tokens"] - 16  # its history hit
    subagents = [r for r in rows if "subagent" in r["label"]]
    assert all(r["cached_tokens"] >= 12_000 - 16 for r in subagents if "step 1" in r["label"])
    # the gap before step 5: 20 trace seconds, 0.2 s at 100x
    step4 = next(r for r in rows if r["label"] == "session step 4")
    step5 = next(r for r in rows if r["label"] == "session step 5")
    assert step5["sent_s"] - (step4["sent_s"] + step4["e2e_s"]) >= 0.2
