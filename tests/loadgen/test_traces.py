"""Trace readers (Mooncake, Qwen-Bailian, agent sessions) and prompt synthesis: equal hash-id
prefixes give equal token prefixes, and prompts have exactly their token counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachemap.keys import hash_prompt
from loadgen.engine.tokenizer import count_tokens, default_tokenizer
from loadgen.traces import CONVERSATION_TRACE
from loadgen.traces.readers import (
    Trace,
    TraceRequest,
    read_trace,
    tenant_of,
    write_trace,
)
from loadgen.traces.synthesis import PromptSynthesizer

SAMPLES = Path(__file__).resolve().parents[2] / "loadgen" / "traces" / "samples"
TOK = default_tokenizer()


def _write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_the_mooncake_conversation_trace_reads_whole() -> None:
    trace = read_trace(CONVERSATION_TRACE)
    assert len(trace.requests) == 12_031
    assert trace.block_size == 512
    assert trace.requests[0].hash_ids[:3] == (0, 1, 2)
    assert all(r.hash_ids[0] == 0 for r in trace.requests)
    assert trace.span_s == pytest.approx(3536.999)
    assert 182_000 < trace.unique_blocks() < 184_000


def test_a_slice_starts_its_clock_at_its_first_request() -> None:
    whole = read_trace(CONVERSATION_TRACE, limit=4010)
    part = read_trace(CONVERSATION_TRACE, start=4000, limit=10)
    assert [r.hash_ids for r in part.requests] == [r.hash_ids for r in whole.requests[4000:]]
    assert part.requests[0].arrival_s == 0.0
    offset = whole.requests[4000].arrival_s
    assert part.requests[-1].arrival_s == pytest.approx(whole.requests[-1].arrival_s - offset)
    assert [r.index for r in part.requests] == list(range(10))


def test_another_block_size_is_read_and_a_wrong_one_is_named(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        '{"timestamp": 0, "input_length": 300, "output_length": 5, "hash_ids": [0, 1, 2]}',
        '{"timestamp": 1500, "input_length": 257, "output_length": 5, "hash_ids": [0, 1, 9]}',
    )
    trace = read_trace(path, block_size=128)
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.5]
    with pytest.raises(ValueError, match=r"t.jsonl:1: 3 hash_ids for 300 input tokens .* 512"):
        read_trace(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "malformed JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"input_length": 1, "output_length": 1, "hash_ids": [0]}', "'timestamp'"),
        ('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}', "input_len"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
    ],
)
def test_bad_lines_are_refused_with_their_line_number(
    tmp_path: Path, line: str, message: str
) -> None:
    path = _write(tmp_path / "bad.jsonl", line)
    with pytest.raises(ValueError, match=message) as info:
        read_trace(path)
    assert "bad.jsonl:1" in str(info.value)


def test_timestamps_must_not_go_back(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        '{"timestamp": 10, "input_length": 1, "output_length": 1, "hash_ids": [0]}',
        '{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [0]}',
    )
    with pytest.raises(ValueError, match="non-decreasing"):
        read_trace(path)


def test_a_written_trace_reads_back_the_same(tmp_path: Path) -> None:
    original = read_trace(CONVERSATION_TRACE, start=100, limit=50)
    write_trace(tmp_path / "copy.jsonl", original.requests)
    again = read_trace(tmp_path / "copy.jsonl")
    assert [(r.input_length, r.output_length, r.hash_ids) for r in again.requests] == [
        (r.input_length, r.output_length, r.hash_ids) for r in original.requests
    ]
    for x, y in zip(again.requests, original.requests, strict=True):
        assert x.arrival_s == pytest.approx(y.arrival_s, abs=1e-3)


def test_tenants_keep_a_conversation_together() -> None:
    trace = read_trace(CONVERSATION_TRACE, limit=2000, num_tenants=4)
    assert trace.tenants() == ["tenant-0", "tenant-1", "tenant-2", "tenant-3"]
    by_conversation: dict[tuple[int, ...], set[str | None]] = {}
    for r in trace.requests:
        by_conversation.setdefault(r.hash_ids[:2], set()).add(r.tenant)
    assert all(len(tenants) == 1 for tenants in by_conversation.values())
    assert tenant_of((0, 7402, 9), 4) == tenant_of((0, 7402), 4)


def _prompt(synth: PromptSynthesizer, req: TraceRequest) -> str:
    return TOK.render_chat(synth.messages(req))  # the engine's chat template


def test_prompts_have_exactly_the_input_length_in_engine_tokens() -> None:
    synth = PromptSynthesizer()
    trace = read_trace(CONVERSATION_TRACE, limit=200)
    for req in trace.requests:
        assert count_tokens(_prompt(synth, req)) == req.input_length


def test_equal_hash_id_prefixes_give_byte_identical_prompt_prefixes() -> None:
    synth = PromptSynthesizer(block_size=16)
    # the template around an empty user message is the overhead: "<|im_start|>user\n" ... etc.
    overhead = count_tokens(TOK.render_chat([{"role": "user", "content": ""}]))
    assert synth.chat_overhead_tokens == overhead
    a = TraceRequest(0, 0.0, overhead + 34, 1, (0, 1, 2))  # 34 = 16 + 16 + 2 of content
    b = TraceRequest(1, 0.0, overhead + 53, 1, (0, 1, 3, 4))
    c = TraceRequest(2, 0.0, overhead + 53, 1, (0, 5, 6, 7))
    pa, pb, pc = (_prompt(synth, r) for r in (a, b, c))
    block_0_1 = synth.content((0, 1), 32)
    assert pa.startswith("<|im_start|>user\n" + block_0_1)
    assert pb.startswith("<|im_start|>user\n" + block_0_1)
    assert not pc.startswith("<|im_start|>user\n" + block_0_1)
    # equal hash ids give equal token prefixes: the header's tokens, then exactly two blocks
    header = len(TOK.encode("<|im_start|>user\n"))
    ta, tb, tc = (TOK.encode(p) for p in (pa, pb, pc))
    common = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
    assert common == header + 32
    assert next(i for i, (x, y) in enumerate(zip(ta, tc, strict=False)) if x != y) == header + 16
    # a partial last block is a prefix of the full block with the same id
    d = TraceRequest(3, 0.0, 64, 1, (0, 1, 2, 8))
    assert synth.content(d.hash_ids, 48).startswith(synth.content(a.hash_ids, 40))
    # the gateway's chained byte hashes agree on exactly the blocks of the common bytes
    common = len(next(pa[:i] for i in range(len(pa)) if pa[i] != pb[i]).encode())
    assert common >= len(("<|im_start|>user\n" + block_0_1).encode())
    ha, hb = (hash_prompt(p.encode(), b"salt", "m", 64) for p in (pa, pb))
    shared = next(i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y)
    assert shared == common // 64


def test_synthesis_is_deterministic_across_instances() -> None:
    req = TraceRequest(0, 0.0, 1500, 1, (0, 11, 12))
    assert PromptSynthesizer().messages(req) == PromptSynthesizer().messages(req)
    assert PromptSynthesizer(namespace="x").messages(req) != PromptSynthesizer().messages(req)


# -- the public formats ----------------------------------------------------------------------
def _assert_exact_prompts(trace: Trace) -> None:
    synth = PromptSynthesizer(trace.block_size)
    for req in trace.requests:
        assert count_tokens(_prompt(synth, req)) == req.input_length, req


def test_a_mooncake_trace_of_full_blocks_only_reads_and_its_tails_are_its_own() -> None:
    trace = read_trace(SAMPLES / "mooncake_full_blocks.jsonl")
    assert trace.block_size == 512
    assert [len(r.hash_ids) for r in trace.requests] == [54, 2, 1, 3]
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.5, 2.75, 4.0]
    _assert_exact_prompts(trace)
    # requests 1 and 2 share block 0; past their hash ids each has its own tail
    synth = PromptSynthesizer(512)
    one, two = (TOK.encode(_prompt(synth, r)) for r in trace.requests[1:3])
    header = len(TOK.encode("<|im_start|>user\n"))
    assert one[: header + 512] == two[: header + 512]
    assert one[header + 512 : header + 600] != two[header + 512 : header + 600]


def test_hash_ids_that_are_neither_every_block_nor_the_full_ones_are_named(
    tmp_path: Path,
) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        '{"timestamp": 0, "input_length": 27691, "output_length": 1, "hash_ids": [1, 2]}',
    )
    with pytest.raises(ValueError, match=r"t.jsonl:1: 2 hash_ids .* \(expected 55, or 54 for full"):
        read_trace(path)


def test_the_bailian_format_reads_in_seconds_with_its_conversations() -> None:
    trace = read_trace(SAMPLES / "bailian.jsonl")
    assert trace.block_size == 16
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.75, 2.5, 4.0, 5.5]
    conversations = [r.conversation for r in trace.requests]
    assert conversations == ["bailian/0", "bailian/1", "bailian/0", "bailian/0", "bailian/1"]
    tenants = read_trace(SAMPLES / "bailian.jsonl", num_tenants=8).requests
    assert tenants[0].tenant == tenants[2].tenant == tenants[3].tenant
    assert tenants[1].tenant == tenants[4].tenant
    _assert_exact_prompts(trace)
    # turn 3 extends turn 2's blocks (1, 2, 4, 5 of which turn 2 holds 5 partly): turn 3's
    # prompt starts with all of turn 2's content, and differs right after it
    synth = PromptSynthesizer(16)
    two, three = (TOK.encode(_prompt(synth, r)) for r in trace.requests[2:4])
    header = len(TOK.encode("<|im_start|>user\n"))
    content = trace.requests[2].input_length - synth.chat_overhead_tokens
    assert next(i for i, (x, y) in enumerate(zip(two, three, strict=False)) if x != y) == (
        header + content
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"chat_id": "a", "parent_chat_id": -1, "timestamp": 0}', "'chat_id' must be an integer"),
        ('{"chat_id": 1, "parent_chat_id": -2, "timestamp": 0}', "parent_chat_id >= -1"),
        (
            '{"chat_id": 1, "parent_chat_id": -1, "timestamp": "now", "input_length": 1}',
            "'timestamp' must be a number",
        ),
        (
            '{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 40, '
            '"output_length": 1, "hash_ids": [1]}',
            r"1 hash_ids for 40 input tokens .* blocks of 16 tokens \(expected 3, or 2",
        ),
        (
            '{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 16, '
            '"output_length": 1, "type": 5, "hash_ids": [1]}',
            "'type' must be a string",
        ),
    ],
)
def test_bad_bailian_lines_are_refused_with_their_line_number(
    tmp_path: Path, line: str, message: str
) -> None:
    path = _write(tmp_path / "bailian.jsonl", line)
    with pytest.raises(ValueError, match=message) as info:
        read_trace(path)
    assert "bailian.jsonl:1" in str(info.value)


def test_an_agent_session_times_its_subagents_from_their_own_starts() -> None:
    trace = read_trace(SAMPLES / "agent_session.json")
    assert trace.block_size == 64
    assert [r.arrival_s for r in trace.requests] == [0.0, 4.5, 6.0, 8.0, 9.5, 12.0]
    assert [r.input_length for r in trace.requests] == [200, 300, 150, 260, 64, 400]
    assert {r.conversation for r in trace.requests} == {"agent/fix-the-build"}
    _assert_exact_prompts(trace)


def test_agent_sessions_merge_into_one_stream_at_their_offsets() -> None:
    spec = f"{SAMPLES / 'agent_session.json'}@0,{SAMPLES / 'agent_sessions.jsonl'}@7"
    trace = read_trace(spec, num_tenants=16)
    arrivals = [(r.arrival_s, r.input_length) for r in trace.requests]
    assert arrivals == [
        (0.0, 200),
        (4.5, 300),
        (6.0, 150),
        (7.0, 128),  # write-the-docs starts at 7 s
        (8.0, 260),
        (8.0, 70),  # the unnamed session, 1 s after its start; ties keep file order
        (9.5, 64),
        (12.0, 400),  # fix-the-build's last request and write-the-docs' second, in file order
        (12.0, 192),
    ]
    assert [r.index for r in trace.requests] == list(range(9))
    assert len({r.conversation for r in trace.requests}) == 3
    by_conversation: dict[str | None, set[str | None]] = {}
    for r in trace.requests:
        by_conversation.setdefault(r.conversation, set()).add(r.tenant)
    assert all(len(t) == 1 for t in by_conversation.values())
    assert read_trace(spec, start=3, limit=2).requests[0].arrival_s == 0.0


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ('{"requests": []}', "'block_size' must be a positive integer"),
        ('{"block_size": 64, "requests": {}}', "'requests' must be a list"),
        (
            '{"block_size": 64, "requests": [{"t": 0, "in": 100, "out": 1, "hash_ids": [1, 2]}]}',
            r"requests\[0\]: 2 hash_ids for 100 input tokens: an agent trace hashes full blocks",
        ),
        (
            '{"block_size": 64, "requests": [{"in": 10, "out": 1, "hash_ids": []}]}',
            r"requests\[0\]: 't' must be a number",
        ),
        (
            '{"block_size": 64, "requests": [{"type": "tool", "t": 0}]}',
            "'type' 'tool' unknown; use 'request' or 'subagent'",
        ),
        (
            '{"block_size": 64, "requests": [{"type": "subagent", "t": 1, "requests": '
            '[{"t": -1, "in": 1, "out": 1, "hash_ids": []}]}]}',
            r"requests\[0\].requests\[0\]: 't' must be a number >= 0",
        ),
    ],
)
def test_bad_agent_sessions_are_refused_naming_the_entry(
    tmp_path: Path, document: str, message: str
) -> None:
    path = _write(tmp_path / "session.json", document)
    with pytest.raises(ValueError, match=message):
        read_trace(path)


def test_sessions_of_different_block_sizes_do_not_merge(tmp_path: Path) -> None:
    other = _write(tmp_path / "b.json", '{"block_size": 16, "requests": []}')
    with pytest.raises(ValueError, match="block_size 16 differs from the trace's 64"):
        read_trace(f"{SAMPLES / 'agent_session.json'}@0,{other}@5")
    with pytest.raises(ValueError, match="offset after '@' must be seconds"):
        read_trace(f"{other}@soon,{other}")


def test_a_file_in_no_known_format_is_refused_naming_its_keys(tmp_path: Path) -> None:
    path = _write(tmp_path / "other.jsonl", '{"prompt": "hi", "model": "m"}')
    with pytest.raises(ValueError, match=r"not a trace in a known format .* keys model, prompt"):
        read_trace(path)
    with pytest.raises(ValueError, match="unknown trace format 'csv'"):
        read_trace(SAMPLES / "bailian.jsonl", fmt="csv")
