"""A prefix-cache reset sent through the gateway's admin port: no routing decision after it
matches what the engine held, even when the engine's AllBlocksCleared never reaches the
gateway (real engines publishing over ZMQ, a real gateway)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from cachemap.events import EventIndex, precise_keys
from tests.conftest import metrics_url
from tests.e2e.test_precise import (
    CONVERSATION,
    chat,
    feeds,
    indexed,
    parts_of,
    precise_fleet,
    salt_of,
    via,
)
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e
__all__ = ["precise_fleet"]  # the fixture, used by name

ADMIN_KEY = "sk-admin-reset"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def reset(gateway: Served, headers: dict[str, str] | None = None, **params: str) -> httpx.Response:
    url = metrics_url(gateway) + "/reset_prefix_cache"
    return httpx.post(url, params=params, headers=ADMIN if headers is None else headers)


def test_a_reset_through_the_gateway_stops_routing_on_the_wiped_entries(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    engines, (gateway,) = precise_fleet(2, admin_keys=[ADMIN_KEY])
    keying = parts_of(gateway).keying
    assert keying is not None and keying.precise is not None
    index = keying.precise.index
    body = chat(CONVERSATION)
    via(gateway, body)
    wait_until(lambda: any(indexed(gateway, e.url, 4)() for e in engines), what="the blocks")
    (holder,) = [e for e in engines if indexed(gateway, e.url, 4)()]
    salt = salt_of(gateway)
    keys = precise_keys(keying.precise.tokens.ids(body, chat=True, cache_salt=salt), salt, 16)
    # read on the gateway's loop: the engine may still be publishing the reply's blocks
    assert gateway.on_loop(lambda: index.lookup(keys, 0.0))[holder.url].depth >= 4
    # the engine's AllBlocksCleared must not be what tells the gateway: from here its feed
    # applies what it receives to an index nobody reads
    (feed,) = feeds(gateway, holder.url)
    feed.index = EventIndex()
    r = reset(gateway, replica=holder.url)
    assert r.status_code == 200 and r.json() == {holder.url: 200}
    assert gateway.on_loop(lambda: index.lookup(keys, 0.0)) == {}
    assert index.num_blocks(holder.url) == 0
    assert keying.num_resets == 1 and not keying.wiping


def test_a_reset_of_every_engine_and_of_an_unknown_one(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    engines, (gateway,) = precise_fleet(2, admin_keys=[ADMIN_KEY])
    r = reset(gateway, replica="http://x")
    assert r.status_code == 404
    r = reset(gateway)
    assert r.status_code == 200 and r.json() == {e.url: 200 for e in engines}


def test_a_reset_needs_an_admin_key(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
    start_gateway: Callable[..., Served],
) -> None:
    """Wiping every tenant's cache is an operator's act: the admin port's only write takes an
    `admin_keys` key, and without any configured it is refused outright; nothing is reset."""
    engines, (gateway,) = precise_fleet(2, admin_keys=[ADMIN_KEY])
    keying = parts_of(gateway).keying
    assert keying is not None
    for headers in ({}, {"authorization": "Bearer sk-not-admin"}):
        r = reset(gateway, headers)
        assert r.status_code == 401 and "admin key" in r.json()["error"]
    assert keying.num_resets == 0
    bare = start_gateway(engines)  # no admin_keys
    r = reset(bare)
    assert r.status_code == 403 and "set admin_keys" in r.json()["error"]
