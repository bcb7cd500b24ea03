"""Every WAL directory has an owner: the directories of gateways that are gone are taken over.

With the chart's billing persistence every gateway's WAL sits on one shared claim:

    <root>/<pod name>/                    one gateway's WAL (`billing_wal_dir`)
    <root>/<pod name>/worker-<i>/         or, under `--workers`, each worker's

A Deployment's pods never come back under their names (scaled down, replaced, evicted), so
nobody would open such a directory again: its unshipped records and its open entries (billed as
aborted by whoever opens it) would never reach the ledger store. Each gateway therefore renews
its own directory's lease (`LEASE`, every lease/3) and, with `billing_wal_takeover`, looks at
its siblings as often: a directory is taken over when both say its gateway is gone —

- its lock is free (the kernel releases a `flock` with its process; a network filesystem
  with the lease of the node that held it), and
- its lease is at least `billing_wal_lease_s` old (for a filesystem whose locks are local to a
  node: a live gateway on another node renews its lease; a container restart takes seconds).

The taker opens it as its own gateway would on a restart (unsettled open entries billed as
aborted), ships it whole, and lets it go; a directory left with no record to ship keeps no
segment, and is passed over from then on. Only while the store answers: with the store away a
takeover would only add empty segments, and the directory waits, whole, for the next scan.

Why this, not a StatefulSet: a StatefulSet's ordinal would give a replaced pod its predecessor's
directory, but a scale-down leaves the highest ordinals' directories unowned until the next
scale-up (maybe never), and per-pod claims (ReadWriteOnce) cannot be read by the survivors. The
takeover covers both, on the Deployment and HPA the chart already runs."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from redis.exceptions import RedisError

from gateway.billing.store import RedisLedgerStore, Shipper
from gateway.billing.wal import WalLocked, WriteAheadLog, segment_paths
from gateway.tasks import BackgroundTasks

log = logging.getLogger(__name__)


def wal_directories(root: Path, own: Path) -> list[Path]:
    """The WAL directories under `root` (a gateway's, or its workers'), `own`'s left out."""
    found: list[Path] = []
    if not root.is_dir():
        return found
    for child in sorted(root.iterdir()):
        if child == own or not child.is_dir():
            continue
        if (child / "LOCK").exists():
            found.append(child)
        else:
            found.extend(sorted(p for p in child.iterdir() if (p / "LOCK").exists()))
    return found


async def take_over(path: Path, store: RedisLedgerStore, lease_s: float) -> int | None:
    """Ship the directory of a gateway that is gone: the records shipped, None when it has an
    owner (its lock held, or its lease fresh) or nothing to ship. Raises the store's error
    (the directory is let go, whole, for a later try)."""
    if not segment_paths(path):
        return None
    wal = WriteAheadLog(path)
    try:
        await asyncio.to_thread(wal.open, take_over_after_s=lease_s)
    except WalLocked:
        return None
    shipper = Shipper(wal, store)
    try:
        shipped = await shipper.ship_once()
        current, size = wal.synced
    finally:
        await wal.aclose()
    # everything is in the store: the segment this takeover opened goes too, so the directory
    # is passed over from now on (its LOCK and LEASE stay: a gateway may yet reopen it)
    if (
        current is not None
        and segment_paths(path) == [current]
        and shipper.offsets.get(current.name) == size == current.stat().st_size
    ):
        current.unlink()
        (path / "shipped.json").unlink(missing_ok=True)
    return shipped


class Takeover:
    """Renews this gateway's lease; with a store, ships the siblings whose gateway is gone."""

    def __init__(
        self,
        wal: WriteAheadLog,
        own: Path,
        lease_s: float,
        store: RedisLedgerStore | None = None,
    ) -> None:
        """`own`: this gateway's directory under the shared root (its workers' parent under
        `--workers`); `store`: None renews the lease only."""
        self.wal = wal
        self.own = own
        self.lease_s = lease_s
        self.store = store
        self.num_taken_over = 0
        self.num_shipped = 0
        self._tasks = BackgroundTasks("billing takeover")

    async def scan_once(self) -> dict[Path, int]:
        """One look at the siblings: each directory taken over, with its records shipped."""
        if self.store is None:
            return {}
        try:
            await self.store.client.ping()
        except (RedisError, OSError) as exc:
            log.debug("billing: no takeover while the ledger store is away: %s", exc)
            return {}
        done: dict[Path, int] = {}
        for path in wal_directories(self.own.parent, self.own):
            shipped = await take_over(path, self.store, self.lease_s)
            if shipped is not None:
                done[path] = shipped
                self.num_taken_over += 1
                self.num_shipped += shipped
                log.warning(
                    "billing: took over %s (its gateway is gone): %d records shipped", path, shipped
                )
        return done

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.wal.renew_lease)
                await self.scan_once()
            except (RedisError, OSError) as exc:  # the next turn tries again
                log.warning("billing: WAL takeover failed, will retry: %s", exc)
            await asyncio.sleep(self.lease_s / 3)

    def start(self) -> None:
        if not self._tasks:
            self._tasks.spawn(self._run(), name="billing-takeover")

    async def stop(self) -> None:
        await self._tasks.close()
