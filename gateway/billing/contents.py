"""The snapshot of live explicit cached contents, kept next to the WAL (`contents.json`).

Objects are few and small next to the records, so the whole set is rewritten on every change:
written to a temporary file, fsync'd, renamed over the old one (atomic), before the API answers.
A restarted gateway loads it and drops what expired meanwhile; the money is in the WAL either
way (creation, extensions and deletions are ledger records).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from decimal import Decimal
from pathlib import Path

import orjson

from gateway.billing.pricing.model import CachedContent


def to_json(o: CachedContent) -> dict[str, object]:
    return {
        "id": o.object_id,
        "tenant": o.tenant,
        "model": o.model,
        "tokens": o.num_tokens,
        "blocks": o.num_blocks,
        "created": str(o.created),
        "expires": str(o.expires),
        "deleted": None if o.deleted is None else str(o.deleted),
        "payload": o.payload,
        **({"scope": o.scope} if o.scope else {}),
    }


def from_json(item: dict[str, object]) -> CachedContent:
    deleted = item.get("deleted")
    payload = item["payload"]
    assert isinstance(payload, dict)
    return CachedContent(
        object_id=str(item["id"]),
        tenant=str(item["tenant"]),
        model=str(item["model"]),
        num_tokens=int(str(item["tokens"])),
        num_blocks=int(str(item["blocks"])),
        created=Decimal(str(item["created"])),
        expires=Decimal(str(item["expires"])),
        deleted=None if deleted is None else Decimal(str(deleted)),
        payload=payload,
        scope=str(item.get("scope") or ""),
    )


def save_snapshot(path: Path, objects: Iterable[CachedContent], now: Decimal) -> None:
    data = [to_json(o) for o in objects if o.deleted is None and o.expires > now]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(data))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_snapshot(path: Path, now: Decimal) -> list[CachedContent]:
    """The objects still live at `now` (none when there is no snapshot)."""
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    objects = [from_json(item) for item in data]
    return [o for o in objects if o.expires > now]
