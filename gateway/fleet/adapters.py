"""Where LoRA adapters are resident, as one gateway can tell (issue 42, item 7).

vLLM shows only part of it: `/v1/models` lists the adapters a replica can serve (registered:
`--lora-modules`, or `/v1/load_lora_adapter` at run time), and `vllm:lora_requests_info`
names the adapters its running and waiting requests use, with `max_lora`, its GPU slots. An
adapter resident but idle shows nowhere; the GPU slots are least recently used first. So each
replica gets an `AdapterMirror`: the adapters this gateway sent there (and the engine reported
in use), most recent last, as many as its slots. The mirror is the Inference Extension's view
(running adapters are the active ones) with this gateway's own memory of the idle ones.

    slots(adapter) = RESIDENT   the adapter is among the mirror's last `max_lora`
                     LOADABLE   a slot is free, or the least recent adapter there is idle
                                (not reported in use, nor sent within `busy_s`)
                     FULL       otherwise (router.adapters: loading would thrash)

`max_lora` unknown (no LoRA metric yet): every adapter not resident is LOADABLE.

On demand (`lora_loading = "on_demand"`): a replica of the adapter's base model that does not
list the adapter is asked to register it (`load_adapter`: vLLM's `/v1/load_lora_adapter`;
"already loaded" counts as done) before the request goes there.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

import aiohttp

from router.adapters import DEFAULT_ADAPTER_BUSY_S, FULL, LOADABLE, RESIDENT

log = logging.getLogger(__name__)


class AdapterMirror:
    """One replica's adapters as this gateway saw them, least recent first (module docstring)."""

    __slots__ = ("busy", "max_loras", "recent")

    def __init__(self) -> None:
        self.recent: OrderedDict[str, float] = OrderedDict()
        """Adapter -> when it was last sent here or reported in use (monotonic)."""
        self.max_loras: int | None = None
        self.busy: frozenset[str] = frozenset()
        """The adapters the last scrape reported running or waiting."""

    def touch(self, adapter: str, now_s: float) -> None:
        self.recent[adapter] = now_s
        self.recent.move_to_end(adapter)
        self._trim()

    def observe(
        self, max_loras: int | None, running: Iterable[str], waiting: Iterable[str], now_s: float
    ) -> None:
        """A scrape's `vllm:lora_requests_info`: the slots, and the adapters in use."""
        self.max_loras = max_loras
        running, waiting = sorted(a for a in running if a), sorted(a for a in waiting if a)
        self.busy = frozenset((*running, *waiting))
        # waiting ones first: they are about to load, but the running ones hold the slots
        for adapter in (*waiting, *running):
            self.touch(adapter, now_s)
        self._trim()

    def _trim(self) -> None:
        if self.max_loras:
            while len(self.recent) > self.max_loras:
                self.recent.popitem(last=False)

    def slots(self, adapter: str, now_s: float, busy_s: float = DEFAULT_ADAPTER_BUSY_S) -> int:
        if adapter in self.recent:
            return RESIDENT
        if not self.max_loras or len(self.recent) < self.max_loras:
            return LOADABLE
        oldest, seen_s = next(iter(self.recent.items()))
        if oldest not in self.busy and now_s - seen_s >= busy_s:
            return LOADABLE
        return FULL


async def load_adapter(
    session: aiohttp.ClientSession,
    url: str,
    name: str,
    path: str,
    limit: aiohttp.ClientTimeout,
) -> bool:
    """Register `name` at the replica (vLLM's `/v1/load_lora_adapter`); True when it now
    serves it (loaded, or already loaded)."""
    body = {"lora_name": name, "lora_path": path}
    try:
        async with session.post(url + "/v1/load_lora_adapter", json=body, timeout=limit) as resp:
            text = (await resp.read()).decode(errors="replace")
            if resp.status == 200 or (resp.status == 400 and "already been loaded" in text):
                return True
            log.warning(
                "replica %s refused to load adapter %s: %s %s", url, name, resp.status, text[:200]
            )
            return False
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        log.warning("replica %s: loading adapter %s failed: %s", url, name, exc)
        return False


def slots_for(
    adapter: str, mirrors: Iterable[tuple[str, AdapterMirror]], now_s: float, busy_s: float
) -> dict[str, int]:
    """The request's `adapter_slots` over the candidates (router.adapters)."""
    return {rid: m.slots(adapter, now_s, busy_s) for rid, m in mirrors}


__all__ = ["FULL", "LOADABLE", "RESIDENT", "AdapterMirror", "load_adapter", "slots_for"]
