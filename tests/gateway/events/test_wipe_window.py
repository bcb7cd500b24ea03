"""The wipe window: a wipe that has reached the gateway's socket is in the index before the
next lookup, even when the event loop has not yet run the feed (real engine, real ZMQ)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from cachemap.events import EventIndex, Match, precise_keys
from cachemap.tokenizer import ModelTokenizer
from gateway.events.intake import EventIntake, EventsConfig
from gateway.events.precise import PreciseKeys, PromptTokens
from loadgen.engine.tokenizer import MODEL_DIR
from tests.gateway.events.test_intake import DEADLINE_S, TOPIC, call, joined, until
from tests.loadgen.test_kv_events import A, complete, events_config, free_ports
from tests.servers import Served


async def test_a_wipe_on_the_socket_is_applied_before_the_lookup(
    start_engines: Callable[..., list[Served]],
) -> None:
    port = free_ports(1)
    (engine,) = start_engines(1, kv_events=events_config(port))
    index = EventIndex()
    config = EventsConfig(endpoints={engine.url: f"tcp://127.0.0.1:{port}"}, topic=TOPIC)
    intake = EventIntake(config, index, lambda: [engine.url])
    precise = PreciseKeys(PromptTokens(ModelTokenizer(MODEL_DIR)), index, intake)
    await intake.start()
    try:
        (feed,) = intake.feeds()
        await joined(engine.url, [feed])
        await call(complete, engine.url, A)
        keys = precise_keys(A, None, 16)
        await until(lambda: index.lookup(keys, 0.0) == {engine.url: Match(2, 0)}, "A's blocks")
        wipes = feed.stats.wipes
        # from here to the lookup nothing awaits: the loop cannot run the feed's task (the
        # blocking call is the point; the engine serves from its own thread)
        reset = httpx.post(engine.url + "/reset_prefix_cache")  # noqa: ASYNC210
        assert reset.status_code == 200
        assert feed.socket.poll(DEADLINE_S * 1000), "the wipe never reached the socket"
        assert index.lookup(keys, 0.0) == {engine.url: Match(2, 0)}  # the window
        view = precise.view(keys, [engine.url])
        assert view.overlap == {} and view.live == {engine.url}
        assert feed.stats.wipes == wipes + 1 and index.num_blocks(engine.url) == 0
    finally:
        await intake.close()
