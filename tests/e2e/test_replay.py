"""A small replay through a gateway with engines on loopback, and the replay's reports."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from kvgate_cli import main
from loadgen.replay import ReplayOptions, replay, summarise
from loadgen.traces.readers import TraceRequest, read_trace, write_trace
from tests.conftest import OTHER_KEY, TENANT_KEY
from tests.servers import Served

pytestmark = pytest.mark.e2e


def conversations(path: Path, num: int = 3, turns: int = 4) -> Path:
    """`num` conversations of `turns` turns, interleaved one second apart (512-token blocks):
    turn t of conversation c carries its previous turns' blocks plus 3 new ones."""
    requests = []
    next_id = 1
    history: dict[int, list[int]] = {c: [0] for c in range(num)}
    for _ in range(turns):
        for c in range(num):
            history[c] = history[c] + list(range(next_id, next_id + 3))
            next_id += 3
            blocks = history[c]
            requests.append(
                TraceRequest(
                    len(requests), float(len(requests)), 512 * len(blocks) - 100, 8, tuple(blocks)
                )
            )
    write_trace(path, requests)
    return path


SCALE = 4.0


def test_a_replay_through_kvgate_measures_every_request(
    tmp_path: Path,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
) -> None:
    trace = read_trace(conversations(tmp_path / "conv.jsonl"))
    engines = start_engines(2)
    gateway = start_gateway(engines, policy="cache_aware")
    # 4x: a conversation's next turn comes 750 ms after the previous one, which has finished by
    # then even on a loaded machine (at 20x, 150 ms, only 3 of the 9 later turns came after
    # their previous one finished at a load average of 18 under pytest-xdist; the replay takes
    # 3 s instead of 0.6). At 100x, with the engine's real tokenizer (its CPU
    # time is not scaled), turns of one conversation overlapped in flight: a turn held behind
    # its predecessor's write was released together with the next turn, which could reach the
    # engine first, so the earlier turn hit the later one's blocks (cached > its history).
    options = ReplayOptions(gateway.url, (TENANT_KEY,), time_scale=SCALE, progress=False)
    rows, wall = asyncio.run(replay(trace, options))
    assert [r.index for r in rows] == list(range(12))
    assert all(r.ok for r in rows), [r.error for r in rows if not r.ok]
    # the synthesized prompts are exactly the trace's input length in engine tokens
    assert [r.prompt_tokens for r in rows] == [r.input_length for r in trace.requests]
    assert all(r.output_tokens == 8 for r in rows)
    # later turns hit their whole history: the previous prompt (512 * (3t + 1) - 100 tokens)
    # but its cut last block, chat template and one 16-token engine block — when the previous
    # turn had finished before this one was sent (open-loop requests can overtake each other
    # on their way in: a request opening a new connection arrives after a later one that took
    # a pooled connection, seen on a loaded machine)
    in_order = [
        r for r in rows[3:] if r.sent_s >= rows[r.index - 3].sent_s + rows[r.index - 3].e2e_s
    ]
    assert len(in_order) >= 6, "too few turns came after their previous one finished"
    for r in in_order:
        previous_input = 512 * (3 * (r.index // 3) + 1) - 100
        assert previous_input - 48 <= r.cached_tokens <= previous_input, r
    summary = summarise(rows, options.time_scale, wall)
    assert summary.errors == 0 and summary.requests == 12
    assert 0.5 < summary.hit_ratio < 1.0
    assert 0 < summary.ttft_p50_s <= summary.ttft_p99_s <= summary.e2e_p99_s
    assert summary.ttft_p99_trace_s == pytest.approx(summary.ttft_p99_s * SCALE)
    # arrivals were respected: request i was not sent before i / SCALE s
    assert all(r.sent_s >= r.arrival_s / SCALE - 1e-3 for r in rows)


def test_the_command_writes_results_a_summary_and_plots(
    tmp_path: Path,
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = conversations(tmp_path / "conv.jsonl", num=2, turns=2)
    engines = start_engines(2)
    gateway = start_gateway(engines)
    out = tmp_path / "out"
    argv = [
        "replay",
        str(path),
        "--target",
        gateway.url,
        "--time-scale",
        "100",
        "--tenants",
        "2",
        "--api-key",
        TENANT_KEY,
        "--api-key",
        OTHER_KEY,
        "--out",
        str(out),
        "--plot",
        "--no-progress",
    ]
    assert main(argv) == 0
    payload = orjson.loads((out / "results.json").read_bytes())
    assert payload["summary"]["requests"] == 4 and payload["summary"]["errors"] == 0
    assert {r["tenant"] for r in payload["rows"]} <= {"tenant-0", "tenant-1"}
    assert payload["meta"]["command"].startswith("kvgate replay ")
    assert "| requests | errors | hit ratio" in (out / "summary.md").read_text()
    for png in ("ttft_cdf.png", "hit_ratio.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()


def test_a_replay_against_one_engine_directly_and_errors_are_counted(
    tmp_path: Path, start_engines: Callable[..., list[Served]]
) -> None:
    path = conversations(tmp_path / "conv.jsonl", num=1, turns=2)
    (engine,) = start_engines(1)
    trace = read_trace(path)
    rows, _ = asyncio.run(replay(trace, ReplayOptions(engine.url, progress=False)))
    assert all(r.ok for r in rows) and rows[1].cached_tokens > 0
    wrong = ReplayOptions(engine.url, model="no-such-model", progress=False)
    rows, wall = asyncio.run(replay(trace, wrong))
    assert summarise(rows, 1.0, wall).errors == 2
    assert rows[0].status == 404 and "does not exist" in rows[0].error


def test_bad_options_are_refused_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="time_scale must be positive"):
        ReplayOptions("http://127.0.0.1:1", time_scale=0)
    assert main(["replay", "/nonexistent.jsonl", "--target", "http://127.0.0.1:1"]) == 2
    assert "No such file" in capsys.readouterr().out
    assert main(["replay", "x.jsonl", "--target", "localhost:80"]) == 2
    assert "must start with http://" in capsys.readouterr().out


SAMPLES = Path(__file__).resolve().parents[2] / "loadgen" / "traces" / "samples"


@pytest.mark.parametrize(
    "spec",
    [
        "mooncake_full_blocks.jsonl",
        "bailian.jsonl",
        "agent_session.json@0,agent_sessions.jsonl@7",
    ],
)
def test_every_trace_format_replays_with_exact_prompt_lengths(
    start_engines: Callable[..., list[Served]], spec: str
) -> None:
    spec = ",".join(str(SAMPLES / part) for part in spec.split(","))
    trace = read_trace(spec)
    (engine,) = start_engines(1)
    options = ReplayOptions(engine.url, (), time_scale=100.0, progress=False)
    rows, _ = asyncio.run(replay(trace, options))
    assert all(r.ok for r in rows), [r.error for r in rows if not r.ok]
    # the engine's own tokenization of each synthesized chat is the trace's input length
    assert [r.prompt_tokens for r in rows] == [r.input_length for r in trace.requests]
    assert [r.output_tokens for r in rows] == [r.output_length for r in trace.requests]
