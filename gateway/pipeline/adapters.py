"""The route step's LoRA adapters (issue 42, item 7): which replicas may serve a request for an
adapter, what each costs in adapter slots, and what placing it there does.

    candidates  `preloaded`: the replicas whose /v1/models lists the adapter (as for any
                model); `on_demand`: also the base model's other replicas
    slots       per candidate: RESIDENT / LOADABLE / FULL from its `AdapterMirror`
                (`router.adapters` ranks by them: resident first, never a thrash)
    placed      the mirror of the chosen replica counts the adapter as just used; on demand, a
                replica that does not list the adapter registers it first

A model is an adapter when `lora_adapters` names it, or a replica lists it with a `parent`
(vLLM's card for an adapter). A base model's request passes through untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from gateway.fleet.adapters import slots_for
from gateway.fleet.replicas import ReplicaSet, ReplicaState

log = logging.getLogger(__name__)


class AdapterRouting:
    def __init__(
        self,
        replicas: ReplicaSet,
        adapters: Mapping[str, str],
        *,
        on_demand: bool = False,
        paths: Mapping[str, str] | None = None,
        busy_s: float,
    ) -> None:
        self.replicas = replicas
        self.adapters = dict(adapters)
        """Adapter -> its base model (settings `lora_adapters`)."""
        self.on_demand = on_demand
        self.paths = dict(paths or {})
        self.busy_s = busy_s
        self.num_loads_requested = 0
        """Adapters this gateway registered at a replica (on demand)."""

    def is_adapter(self, model: str) -> bool:
        return model in self.adapters or any(
            model in s.adapters_listed for s in self.replicas.states.values()
        )

    def candidates(self, model: str, serving: list[ReplicaState]) -> list[ReplicaState]:
        """On demand, an adapter's candidates include its base model's replicas."""
        base = self.adapters.get(model)
        if not self.on_demand or base is None:
            return serving
        known = {s.id for s in serving}
        return serving + [s for s in self.replicas.serving(base) if s.id not in known]

    def slots(self, model: str, candidates: Sequence[ReplicaState]) -> dict[str, int]:
        if not self.is_adapter(model):
            return {}
        mirrors = ((c.id, c.adapters) for c in candidates)
        return slots_for(model, mirrors, time.monotonic(), self.busy_s)

    async def placed(self, model: str, state: ReplicaState) -> bool:
        """The request goes to `state`: its adapter is there from now (loaded first if it
        must); True when this gateway asked the replica to load it."""
        if not self.is_adapter(model):
            return False
        loaded = False
        if self.on_demand and model not in state.models:
            loaded = True
            self.num_loads_requested += 1
            path = self.paths.get(model, model)
            if not await self.replicas.load_adapter(state, model, path):
                log.warning("adapter %s could not be loaded at %s", model, state.url)
        state.adapters.touch(model, time.monotonic())
        return loaded
