"""The intake's endpoints per engine where its pod overrides the fleet's (`cachemap.layouts`).

`EventsConfig.feeds` lays every replica out from one port and one DP size; `LaidOutEvents`
takes each replica's own events port, replay port and DP size from `EngineLayouts` first (what
discovery read from the pod's annotations), the fleet's values for what the pod does not say.
An explicit `kv_events_endpoints` entry for the URL still wins over both (it names the engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachemap.layouts import EngineLayouts
from gateway.events.intake import EventsConfig, FeedConfig


@dataclass(frozen=True)
class LaidOutEvents(EventsConfig):
    """`EventsConfig` with per-replica overrides."""

    layouts: EngineLayouts = field(default_factory=EngineLayouts)

    def feeds(self, replica: str) -> list[FeedConfig]:
        layout = self.layouts.get(replica)
        own = EventsConfig(
            port=self.port if layout.events_port is None else layout.events_port,
            replay_port=self.replay_port if layout.replay_port is None else layout.replay_port,
            endpoints=self.endpoints,
            replay_endpoints=self.replay_endpoints,
            topic=self.topic,
            dp_size=self.layouts.dp_size(replica, self.dp_size),
        )
        return own.feeds(replica)
