"""Billing in a running gateway: the meter, its WAL, the shipper and the ledger store, built
once by `create_app` and opened and closed by the lifespan."""

from __future__ import annotations

import logging
from decimal import Decimal
from typing import Any

from redis.exceptions import RedisError

from gateway.billing.meter import BillingMeter
from gateway.billing.pricing.layout import load_tokenizer
from gateway.billing.pricing.prices import load_price_table
from gateway.billing.shared import SharedEntries
from gateway.billing.store import (
    LedgerStore,
    LocalLedger,
    RedisLedgerStore,
    Shipper,
    check_durability,
    check_layout,
)
from gateway.billing.takeover import Takeover
from gateway.billing.wal import WalLayoutError, WriteAheadLog
from gateway.errors import GatewayError
from gateway.request.tenant import hash_key
from gateway.request.tokens import TokenEstimator
from gateway.settings import Settings

log = logging.getLogger(__name__)

EXPORT_DRAIN_TIMEOUT_S = 5.0
"""An admin export first ships this gateway's WAL; past 5 s the store is taken as down."""


class LedgerUnavailable(GatewayError):
    """503: the shared ledger store cannot be read right now (the WALs still hold everything)."""

    status = 503
    type = "service_unavailable_error"


def admin_key_hashes(keys: list[str]) -> frozenset[str]:
    """`sha256:<hex>` entries as given, clear keys hashed (never kept in clear)."""
    return frozenset(k[len("sha256:") :] if k.startswith("sha256:") else hash_key(k) for k in keys)


class Billing:
    def __init__(self, settings: Settings, estimator: TokenEstimator | None = None) -> None:
        assert settings.billing_wal_dir is not None
        self.settings = settings
        tokenizer = (
            load_tokenizer(settings.billing_tokenizer) if settings.billing_tokenizer else None
        )
        self.wal = WriteAheadLog(
            settings.billing_wal_dir, deadline_s=settings.billing_wal_deadline_s
        )
        self.meter = BillingMeter(
            settings,
            load_price_table(settings.billing_prices_file),
            self.wal,
            estimator=estimator,
            tokenizer=tokenizer,
        )
        self.admin_hashes = admin_key_hashes(settings.admin_keys)
        self.store: LedgerStore | None = None
        self.shipper: Shipper | None = None
        self.takeover: Takeover | None = None
        self._client: Any = None

    async def start(self) -> None:
        self.wal.open()
        restored = self.meter.load_contents()
        if restored:
            log.info("billing: restored %d explicit cached contents", restored)
        url = self.settings.billing_redis_url
        if url:
            from cachemap.redis.client import open_redis

            self._client = await open_redis(url, cluster=False)
            durability = await check_durability(
                self._client, allow_unsafe=self.settings.billing_redis_allow_unsafe_fsync
            )  # a store that may lose what it acknowledged fails the start
            await check_layout(self._client, claim=True)  # an unknown layout fails the start
            self.store = RedisLedgerStore(self._client, wait_aof=durability.wait_aof)
            self.meter.shared = SharedEntries(self._client, self.settings.billing_ledger_deadline_s)
            self.shipper = Shipper(self.wal, self.store)
            self.shipper.start()  # replays whatever earlier runs left unshipped
        # a worker's directory is <pod's>/worker-<i>: the pod's directory is the one its
        # siblings are beside (gateway.billing.takeover)
        own = self.wal.directory
        if self.settings.worker_index is not None:
            own = own.parent
        store = self.store if isinstance(self.store, RedisLedgerStore) else None
        if self.settings.billing_wal_takeover and store is None:
            log.warning("billing: billing_wal_takeover needs billing_redis_url; not taking over")
        self.takeover = Takeover(
            self.wal,
            own,
            self.settings.billing_wal_lease_s,
            store if self.settings.billing_wal_takeover else None,
        )
        self.takeover.start()

    async def stop(self) -> None:
        await self.meter.drain()  # abandoned leaders' aborted records, before the WAL closes
        if self.meter.shared is not None:
            await self.meter.shared.drain()
        if self.takeover is not None:
            await self.takeover.stop()
        if self.shipper is not None:
            await self.shipper.stop()
        await self.wal.aclose()
        if self._client is not None:
            await self._client.aclose()

    async def records(
        self, tenant: str | None, start: Decimal | None, end: Decimal | None
    ) -> list[dict[str, Any]]:
        """The ledger's records in a window, this gateway's newest included."""
        if self.shipper is None or self.store is None:
            try:
                return await LocalLedger([self.wal.directory]).query(tenant, start, end)
            except WalLayoutError as exc:
                raise LedgerUnavailable(str(exc)) from None
        try:
            await self.shipper.drain(EXPORT_DRAIN_TIMEOUT_S)
            return await self.store.query(tenant, start, end)
        except (RedisError, OSError, TimeoutError) as exc:  # a down store: a 503, never a 500
            raise LedgerUnavailable(f"the ledger store is unavailable: {exc}") from None
