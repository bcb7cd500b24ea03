"""LoRA adapters on the simulated engine, as vLLM serves them (issue 42, item 6).

Two sets, as in vLLM:

  registered  what `/v1/models` lists (each card's `parent` the base model): `--lora-modules` at
              start, `POST /v1/load_lora_adapter` {lora_name, lora_path} and
              `POST /v1/unload_lora_adapter` {lora_name} at run time. vLLM attaches those two
              routes only when `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is set; so does this engine
              (otherwise they are 404s). One registry per app: every rank serves the same set.
  resident    the adapters in a rank's GPU slots (`--max-loras`, vLLM's default 1), least
              recently used first. A request for a registered adapter that is not resident
              takes a free slot, or the slot of the least recently used adapter no request
              holds, and pays `--lora-load-s` (a cold load) before its prefill. While every
              slot holds an adapter in use it waits: vLLM's scheduler admits no request whose
              adapter would take the running batch past `max_loras`.

Residency is visible as vLLM shows it, `vllm:lora_requests_info{max_lora, running_lora_adapters,
waiting_lora_adapters}` (value: the wall time of the report): running names the adapters
requests hold now, waiting those requests wait for (a slot, or the load). An adapter resident
but idle appears in neither, as in vLLM: a router that wants idle residency must remember what
it sent (gateway.fleet.adapters).

Invariants of `AdapterSlots`: len(resident) <= max_loras (0: no limit); an adapter with users is
never evicted; a request holds its adapter from `acquire` to `release`, exactly once.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter, OrderedDict
from collections.abc import Iterable

import orjson

DEFAULT_MAX_LORAS = 1
"""vLLM's `--max-loras` default: one adapter in the batch at a time."""
DEFAULT_LORA_LOAD_S = 0.2
"""A cold load: a rank-16 adapter of an 8B model is ~100 MB, read and copied to the GPU at
~1 GB/s with its set-up (vLLM's CPU cache makes a reload cheaper; the simulation charges every
load the same, so the count of loads is what a router is judged by)."""
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_from_env() -> bool:
    """vLLM's switch for the load and unload routes ("1" or "true", any case)."""
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


def parse_lora_module(text: str) -> tuple[str, str]:
    """One `--lora-modules` value: `name=path`, or vLLM's JSON form {"name", "path"[,
    "base_model_name"]}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: malformed JSON {text!r}: {exc}") from None
        name, path = spec.get("name"), spec.get("path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ValueError(f"--lora-modules: JSON needs 'name' and 'path' strings: {text!r}")
        return name, path
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path, got {text!r}")
    return name, path


class AdapterError(Exception):
    """A load or unload refused as vLLM refuses it: the message and HTTP status it answers."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class AdapterRegistry:
    """The registered adapters (name -> path) of one app, beside its base model."""

    def __init__(self, base: str, modules: Iterable[tuple[str, str]] = ()) -> None:
        self.base = base
        self.paths: dict[str, str] = {}
        for name, path in modules:
            if name == base or name in self.paths:
                raise ValueError(
                    "a LoRA adapter's name must differ from the model's and the others'"
                )
            self.paths[name] = path

    def __contains__(self, name: object) -> bool:
        return name in self.paths

    def names(self) -> list[str]:
        return list(self.paths)

    def load(self, body: object) -> str:
        """`/v1/load_lora_adapter`: register {lora_name, lora_path}; vLLM's answers."""
        name, path = _fields(body, ("lora_name", "lora_path"))
        if not name or not path:
            raise AdapterError("Both 'lora_name' and 'lora_path' must be provided.", 400)
        if name in self.paths or name == self.base:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.", 400)
        self.paths[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: object) -> str:
        """`/v1/unload_lora_adapter`: forget {lora_name} (requests using it finish with it)."""
        (name,) = _fields(body, ("lora_name",))
        if not name:
            raise AdapterError("'lora_name' needs to be provided to unload a LoRA adapter.", 400)
        if name not in self.paths:
            raise AdapterError(f"The lora adapter '{name}' cannot be found.", 404)
        del self.paths[name]
        return f"Success: LoRA adapter '{name}' removed successfully."


def _fields(body: object, names: tuple[str, ...]) -> tuple[str, ...]:
    if not isinstance(body, dict):
        raise AdapterError("the request body must be a JSON object", 400)
    values = tuple(body.get(n) for n in names)
    for n, v in zip(names, values, strict=True):
        if v is not None and not isinstance(v, str):
            raise AdapterError(f"'{n}' must be a string", 400)
    return tuple(v or "" for v in values)


class AdapterSlots:
    """One rank's GPU adapter slots (module docstring: LRU, a cold load's cost, the wait)."""

    def __init__(self, max_loras: int = DEFAULT_MAX_LORAS, load_s: float = 0.0) -> None:
        if max_loras < 0:
            raise ValueError("max_loras must be non-negative (0: no limit)")
        if load_s < 0:
            raise ValueError("the LoRA load time must be non-negative")
        self.max_loras = max_loras
        self.load_s = load_s
        self.resident: OrderedDict[str, int] = OrderedDict()
        """Resident adapters, least recently used first -> requests holding each."""
        self.waiting: Counter[str] = Counter()
        """Adapter -> requests waiting for it (for a slot, or during its load)."""
        self.num_loads = 0
        self.num_evictions = 0
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._freed: asyncio.Event | None = None

    @property
    def num_waiting(self) -> int:
        return sum(self.waiting.values())

    def running(self) -> list[str]:
        return [name for name, users in self.resident.items() if users > 0]

    def _slot_for(self, name: str) -> bool:
        """Make room for `name` if there is some: a free slot, or the LRU idle adapter's."""
        if not self.max_loras or len(self.resident) < self.max_loras:
            return True
        for victim, users in self.resident.items():
            if users == 0 and victim not in self._loading:
                del self.resident[victim]
                self.num_evictions += 1
                return True
        return False

    async def acquire(self, name: str) -> bool:
        """Hold `name` for one request: at once when resident, else after a slot frees and
        the load; True when this request paid a cold load."""
        self.waiting[name] += 1
        try:
            while True:
                loading = self._loading.get(name)
                if loading is not None:  # another request is loading it: wait for that
                    await asyncio.shield(loading)
                    continue
                if name in self.resident:
                    self.resident[name] += 1
                    self.resident.move_to_end(name)
                    return False
                if self._slot_for(name):
                    break
                if self._freed is None:
                    self._freed = asyncio.Event()
                self._freed.clear()
                await self._freed.wait()
            self.resident[name] = 1
            self.num_loads += 1
            done = asyncio.get_running_loop().create_future()
            self._loading[name] = done
            try:
                if self.load_s > 0:
                    await asyncio.sleep(self.load_s)
            except BaseException:  # the client left during the load: it never landed
                users = self.resident[name] - 1
                if users:
                    self.resident[name] = users
                else:
                    del self.resident[name]
                    if self._freed is not None:
                        self._freed.set()
                raise
            finally:
                self._loading.pop(name, None)
                done.set_result(None)
            return True
        finally:
            self.waiting[name] -= 1
            if not self.waiting[name]:
                del self.waiting[name]

    def release(self, name: str) -> None:
        """A request holding `name` is done (finished or aborted)."""
        self._release_one(name)

    def _release_one(self, name: str) -> None:
        users = self.resident.get(name)
        assert users is not None and users > 0, f"release of {name!r} not held"
        self.resident[name] = users - 1
        if users == 1 and self._freed is not None:
            self._freed.set()

    def forget(self, name: str) -> None:
        """An unloaded adapter leaves its slot once no request holds it."""
        if self.resident.get(name) == 0:
            del self.resident[name]
            if self._freed is not None:
                self._freed.set()


def lora_info_labels(max_loras: int, slots: Iterable[AdapterSlots]) -> dict[str, str]:
    """`vllm:lora_requests_info`'s labels over a replica's ranks: running and waiting adapters
    comma-separated, sorted (one series per replica: ranks' names united)."""
    running: set[str] = set()
    waiting: set[str] = set()
    for s in slots:
        running.update(s.running())
        waiting.update(s.waiting)
    return {
        "max_lora": str(max_loras),
        "running_lora_adapters": ",".join(sorted(running)),
        "waiting_lora_adapters": ",".join(sorted(waiting)),
    }
