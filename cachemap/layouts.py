"""Engine layouts: how many cache domains an engine has and where their events are published,
per engine where its pod says so (discovery reads the annotations), else the settings' values.

    settings (kv_events_port, kv_events_replay_port, engine_dp_size)   the fleet's defaults
        ▲ overridden, field by field, by
    EngineLayouts[replica URL] = EngineLayout(events_port, replay_port, dp_size)
        written by discovery when the pod joins; read by the event intake (which feeds to open)
        and by precise lookups (which domains `url#r` make up the replica)

Invariants:
- A field left None falls back to the default the reader passes: one replica's override never
  changes another's, and a replica with no entry is laid out exactly as before.
- The intake and the lookups read the same entry, so a replica's domains (`domain_of(url, r,
  dp_size)`) are the same on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """One engine's own values (None: the fleet's default)."""

    events_port: int | None = None
    """Rank 0's KV events PUB port on the engine's host (rank r on port + r)."""
    replay_port: int | None = None
    """Rank 0's replay ROUTER port (vLLM `replay_endpoint`)."""
    dp_size: int | None = None
    """Data-parallel ranks behind the engine's one HTTP port."""


DEFAULT_LAYOUT = EngineLayout()


class EngineLayouts:
    """replica URL -> its `EngineLayout` (the module docstring's invariants)."""

    def __init__(self) -> None:
        self._layouts: dict[str, EngineLayout] = {}

    def __len__(self) -> int:
        return len(self._layouts)

    def get(self, replica: str) -> EngineLayout:
        return self._layouts.get(replica, DEFAULT_LAYOUT)

    def set(self, replica: str, layout: EngineLayout) -> None:
        if layout == DEFAULT_LAYOUT:
            self._layouts.pop(replica, None)
        else:
            self._layouts[replica] = layout

    def drop(self, replica: str) -> None:
        self._layouts.pop(replica, None)

    def dp_size(self, replica: str, default: int) -> int:
        size = self.get(replica).dp_size
        return default if size is None else size
