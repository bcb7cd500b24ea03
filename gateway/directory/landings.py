"""Fan-out landings other gateways announce: a subscription to the shared directory's landing
channel, for as long as the gateway runs (a lost connection is re-subscribed shortly after).

The channel only makes a landing fast: a sibling waiting for another gateway's leader also
re-reads the leader's marker every `poll_s` (`gateway.pipeline.flights.Flights.wait_remote`) —
often while this subscription is down (Redis away, or pub/sub refused: a proxy or an ACL without
SUBSCRIBE), rarely while it is up, in case a message was lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from cachemap.redis.client import close_pubsub
from cachemap.redis.directory import RedisDirectory
from cachemap.redis.schema import LAND_CHANNEL

log = logging.getLogger(__name__)

READ_INTERVAL_S = 0.5
"""How long one read of the channel waits: the watcher checks for shutdown this often."""
POLL_SUBSCRIBED_S = 1.0
"""A waiter re-reads its leader's marker once a second while the channel works: a lost message
costs at most a second of hold, at one GET per waiter per second."""
POLL_UNSUBSCRIBED_S = 0.1
"""...and ten times a second while it does not: a landing costs a sibling at most 100 ms more
hold than the channel would, against the prefill a hold saves (seconds)."""


class LandingWatcher:
    def __init__(
        self, shared: RedisDirectory, on_land: Callable[[str], None], closing: Callable[[], bool]
    ) -> None:
        self.shared = shared
        self.on_land = on_land
        self.closing = closing
        self.subscribed = False
        self._failed = False

    @property
    def poll_s(self) -> float:
        """How often a waiter should re-read its leader's marker now."""
        return POLL_SUBSCRIBED_S if self.subscribed else POLL_UNSUBSCRIBED_S

    async def run(self) -> None:
        while not self.closing():
            try:
                pubsub = self.shared.client.pubsub()
                await pubsub.subscribe(LAND_CHANNEL)
                try:
                    while not self.closing():
                        message = await pubsub.get_message(timeout=READ_INTERVAL_S)
                        if message is None:
                            continue
                        if message["type"] == "message":
                            data = message["data"]
                            self.on_land(data.decode() if isinstance(data, bytes) else str(data))
                        elif message["type"] == "subscribe":  # the server confirmed it
                            self._state(True, None)
                finally:
                    self.subscribed = False
                    await close_pubsub(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away or pub/sub refused: waiters poll; retry
                self._state(False, exc)
                await asyncio.sleep(READ_INTERVAL_S)

    def _state(self, up: bool, exc: BaseException | None) -> None:
        """Log each change of the subscription's state once."""
        if up and self._failed:
            log.warning("landing channel %s subscribed again", LAND_CHANNEL)
        elif not up and not self._failed:
            log.warning(
                "cannot subscribe to the landing channel %s (%s: %s): held siblings poll their "
                "leader's marker every %.1f s instead",
                LAND_CHANNEL,
                type(exc).__name__,
                exc,
                POLL_UNSUBSCRIBED_S,
            )
        self._failed = not up
        self.subscribed = up
