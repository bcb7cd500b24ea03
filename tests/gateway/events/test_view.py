"""What a precise lookup reads for its candidates (`PreciseKeys.view`): each live candidate's best
data-parallel rank, from a real two-rank engine's events over real ZMQ sockets."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import msgspec

from cachemap.events import EventIndex, precise_keys
from cachemap.tokenizer import ModelTokenizer
from gateway.events.intake import EventIntake, EventsConfig
from gateway.events.precise import PreciseKeys, PromptTokens
from loadgen.engine.tokenizer import MODEL_DIR
from tests.conftest import MODEL
from tests.gateway.events.test_intake import TOPIC, call, joined, until
from tests.loadgen.test_kv_events import A, events_config, free_ports
from tests.servers import Served

OTHER = "http://127.0.0.1:9"
"""A candidate without events (nothing publishes for it)."""


def _stored(ids: list[int], num_blocks: int, first_hash: int) -> bytes:
    """One batch announcing the first `num_blocks` 16-token blocks of `ids` under "salt"."""
    event = {
        "type": "BlockStored",
        "block_hashes": list(range(first_hash, first_hash + num_blocks)),
        "parent_block_hash": None,
        "token_ids": ids[: 16 * num_blocks],
        "block_size": 16,
        "medium": "GPU",
        "extra_keys": [["salt"]],
    }
    payload: bytes = msgspec.msgpack.encode([time.time(), [event]])
    return payload


def on_rank(url: str, prompt: list[int], rank: int) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    headers = {"X-data-parallel-rank": str(rank)}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=10)
    assert r.status_code == 200, r.text


async def test_the_view_is_each_live_candidates_deepest_rank_ties_to_the_lowest(
    start_engines: Callable[..., list[Served]],
) -> None:
    port = free_ports(2)
    (x,) = start_engines(1, kv_events=events_config(port), data_parallel_size=2)
    index = EventIndex()
    config = EventsConfig(endpoints={x.url: f"tcp://127.0.0.1:{port}"}, topic=TOPIC, dp_size=2)
    intake = EventIntake(config, index, lambda: [x.url])
    precise = PreciseKeys(PromptTokens(ModelTokenizer(MODEL_DIR)), index, intake, dp_size=2)
    await intake.start()
    try:
        feeds = intake.feeds(x.url)
        assert [f.config.domain for f in feeds] == [x.url + "#0", x.url + "#1"]
        await joined(x.url, feeds)
        keys = precise_keys(A, None, 16)
        for rank in (0, 1):  # sent there by this gateway (claims are weighed by placements)
            precise.placed.place(f"{x.url}#{rank}", keys)
        # rank 0 holds A's first block, rank 1 both
        await call(on_rank, x.url, A[:20], 0)
        await call(on_rank, x.url, A, 1)
        await until(lambda: index.num_blocks(x.url + "#1") == 2, "rank 1's blocks")
        await until(lambda: index.num_blocks(x.url + "#0") == 1, "rank 0's block")
        view = precise.view(keys, [x.url, OTHER])
        assert view.overlap == {x.url: 2} and view.ranks == {x.url: 1}
        assert view.live == {x.url}
        # a replica that is no candidate is not read, whatever its ranks hold
        assert precise.view(keys, [OTHER]).overlap == {}
        # both ranks as deep: the lowest
        await call(on_rank, x.url, A, 0)
        await until(lambda: index.num_blocks(x.url + "#0") == 2, "rank 0's second block")
        view = precise.view(keys, [OTHER, x.url])
        assert view.overlap == {x.url: 2} and view.ranks == {x.url: 0}
    finally:
        await intake.close()


async def test_the_view_says_which_blocks_only_a_speculative_entry_claims() -> None:
    """A placement's blocks past what its engine's events hold are claimed there
    (`EventsView.claimed`, `RouteRequest.claimed`): the router counts them only while the
    replica's queue is shorter than the turn's re-prefill elsewhere (`router.claims`)."""
    index = EventIndex()
    engine = "http://engine:8000"
    config = EventsConfig(endpoints={engine: "inproc://engine"})
    intake = EventIntake(config, index, lambda: [engine])
    precise = PreciseKeys(PromptTokens(ModelTokenizer(MODEL_DIR)), index, intake)
    intake.refresh()
    try:
        prompt = list(range(2000, 2000 + 16 * 12))
        keys = precise_keys(prompt, "salt", 16)
        [feed] = intake.feeds(engine)
        await feed.receive(0, _stored(list(range(16)), 1, 1))  # its events flow
        precise.speculate(engine, None, keys)  # placed: its 12 blocks claimed, none held
        view = precise.view(keys, [engine])
        assert view.overlap == {engine: 12} and view.claimed == {engine: 12}
        await feed.receive(1, _stored(prompt, 8, 11))  # the engine stored 8 of them
        view = precise.view(keys, [engine])
        assert view.overlap == {engine: 12} and view.claimed == {engine: 4}
        await feed.receive(2, _stored(prompt, 12, 101))
        view = precise.view(keys, [engine])
        assert view.overlap == {engine: 12} and view.claimed == {}  # all held
    finally:
        await intake.close()
