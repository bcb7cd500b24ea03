"""`python -m tools.events_replay replay`, small: a recorded stream replays through the index."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from loadgen.engine.kv_events import encode_batch
from loadgen.engine.kvpool import Removed, Stored
from tools import events_replay


def test_a_recorded_stream_replays_and_reports_its_blocks_a_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chain = [bytes([i]) * 32 for i in range(1, 9)]
    batches = [
        # engine 0 stores 8 blocks then drops the last 2; engine 1 stores the first 4
        (0, 0, encode_batch([Stored(chain, None, tuple(range(128)), 16, "GPU")], 1.0, 0, "vllm")),
        (0, 1, encode_batch([Removed(chain[6:], "GPU")], 2.0, 0, "vllm")),
        (
            1,
            0,
            encode_batch([Stored(chain[:4], None, tuple(range(64)), 16, "GPU")], 1.5, 0, "vllm"),
        ),
    ]
    recorded = tmp_path / "events.msgpack"
    recorded.write_bytes(msgspec.msgpack.encode(batches))
    events_replay.replay(str(recorded), requests=2, rounds=2)
    out = capsys.readouterr().out
    found = re.search(
        r"^3 batches: decode \+ apply [\d.]+ ms a request \(decode [\d.]+\); "
        r"blocks a request: (\d+) stored, (\d+) removed",
        out,
        re.MULTILINE,
    )
    assert found is not None, out
    # 12 blocks stored and 2 removed over the 2 requests
    assert (found[1], found[2]) == ("6", "1")
