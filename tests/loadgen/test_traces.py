"""Trace readers and prompt synthesis: equal hash-id prefixes, exact token counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachemap.keys import hash_prompt
from loadgen.engine.tokenizer import count_tokens, default_tokenizer
from loadgen.traces.readers import (
    TraceRequest,
    read_trace,
    tenant_of,
    write_trace,
)
from loadgen.traces.synthesis import PromptSynthesizer

MOONCAKE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake"
CONVERSATION = MOONCAKE / "conversation_trace.jsonl"
TOK = default_tokenizer()


def _write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_the_mooncake_conversation_trace_reads_whole() -> None:
    trace = read_trace(CONVERSATION)
    assert len(trace.requests) == 12_031
    assert trace.block_size == 512
    assert trace.requests[0].hash_ids[:3] == (0, 1, 2)
    assert all(r.hash_ids[0] == 0 for r in trace.requests)
    assert trace.span_s == pytest.approx(3536.999)
    assert 182_000 < trace.unique_blocks() < 184_000


def test_a_slice_starts_its_clock_at_its_first_request() -> None:
    whole = read_trace(CONVERSATION, limit=4010)
    part = read_trace(CONVERSATION, start=4000, limit=10)
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
    original = read_trace(CONVERSATION, start=100, limit=50)
    write_trace(tmp_path / "copy.jsonl", original.requests)
    again = read_trace(tmp_path / "copy.jsonl")
    assert [(r.input_length, r.output_length, r.hash_ids) for r in again.requests] == [
        (r.input_length, r.output_length, r.hash_ids) for r in original.requests
    ]
    for x, y in zip(again.requests, original.requests, strict=True):
        assert x.arrival_s == pytest.approx(y.arrival_s, abs=1e-3)


def test_tenants_keep_a_conversation_together() -> None:
    trace = read_trace(CONVERSATION, limit=2000, num_tenants=4)
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
    trace = read_trace(CONVERSATION, limit=200)
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
