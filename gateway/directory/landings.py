"""Fan-out landings other gateways announce: a subscription to the shared directory's landing
channel, for as long as the gateway runs (a lost connection is re-subscribed shortly after)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from cachemap.redis.directory import RedisDirectory
from cachemap.redis.schema import LAND_CHANNEL

log = logging.getLogger(__name__)

READ_INTERVAL_S = 0.5
"""How long one read of the channel waits: the watcher checks for shutdown this often."""


async def watch_landings(
    shared: RedisDirectory, on_land: Callable[[str], None], closing: Callable[[], bool]
) -> None:
    while not closing():
        try:
            pubsub = shared.client.pubsub()
            await pubsub.subscribe(LAND_CHANNEL)
            try:
                while not closing():
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=READ_INTERVAL_S
                    )
                    if message is not None:
                        data = message["data"]
                        on_land(data.decode() if isinstance(data, bytes) else str(data))
            finally:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis away: waiters time out; try again shortly
            log.debug("landing watcher: %s", exc)
            await asyncio.sleep(READ_INTERVAL_S)
