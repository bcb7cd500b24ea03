"""The compiled forms of cachemap's per-block loops, where they are built.

`cachemap/_native.pyx` (Cython) holds `chain` (`cachemap.keys.chain_hashes` without extras),
`Lru` (`cachemap.memory.OrderedLru`), `DomainTable` (`cachemap.events.DomainMaps`: a domain's
blocks in the event index, one C record a key), `WordTable` (the precise word cache's
lookups, `gateway.events.words`), `unpack_u32` (a KV event's token ids read from their msgpack
bytes, `gateway.events.decode`) and `common_prefix` (`gateway.events.texts`'s). The install
builds it when Cython and a C compiler are at hand (`setup.py`; a failed build leaves the pure
install); the pure-Python forms are the definitions, and `KVGATE_PURE=1` in the environment
makes every import choose them."""

from __future__ import annotations

import os
from types import ModuleType

NAMES = ("chain", "Lru", "DomainTable", "WordTable", "unpack_u32", "common_prefix")
"""What the compiled module holds. A build older than one of them (a checkout's `.so` not
rebuilt since, or copied from another) is not used at all: its users read these names at
import, and a missing one would fail it."""


def load() -> ModuleType | None:
    """The compiled module, or None where it is not built (or built before one of `NAMES`)
    or `KVGATE_PURE` is set."""
    if os.environ.get("KVGATE_PURE", "") not in ("", "0"):
        return None
    try:
        from cachemap import _native
    except ImportError:
        return None
    if not all(hasattr(_native, name) for name in NAMES):
        return None
    return _native


NATIVE = load()
"""What the imports of this process chose: the compiled module or None (pure)."""
