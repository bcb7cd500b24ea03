"""The meter as a front end other than the OpenAI HTTP API uses it: a real director (and its
lifespan) in this event loop, real engines on loopback, requests handed to `director.open`.

This is how the Anthropic Messages front end calls billing: convert the Messages body to the
OpenAI shape with `cache_control` kept on the content parts (and at the top level for automatic
caching), keep `max_tokens: 0` for a ping, then `director.open(parsed, tenant)`: the billing
request hook runs inside `open`, and the exchange's usage comes back with the Anthropic fields.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import orjson
import pytest

from gateway.api.openai.parse import parse_chat
from gateway.billing.pricing.clock import ManualClock
from gateway.pipeline.director import Director
from gateway.pipeline.exchange import Exchange
from gateway.server.app import create_app
from gateway.tenancy.registry import TenantRegistry
from tests.billing.generate import SCENARIOS, session
from tests.conftest import MODEL, TENANT_KEY, gateway_settings
from tests.e2e.billing.test_gateway_billing import TOKENIZER, session_messages
from tests.servers import Served

pytestmark = pytest.mark.e2e

READY_TIMEOUT_S = 10.0


async def until_ready(director: Director) -> None:
    async with asyncio.timeout(READY_TIMEOUT_S):
        await director.replicas.probe_all()  # what the health loop does, now
    assert director.replicas.serving(MODEL)


async def test_the_pings_session_through_the_director_with_max_tokens_0(
    start_engines: Callable[..., list[Served]], tmp_path: Path
) -> None:
    engines = start_engines(2)
    settings = gateway_settings(
        [e.url for e in engines],
        billing_wal_dir=tmp_path / "wal",
        billing_profiles={"acme": "anthropic"},
        billing_model_map={MODEL: "sonnet-5"},
        billing_tokenizer=TOKENIZER,
    )
    app = create_app(settings)
    tenant = TenantRegistry.from_pairs(settings.secret_bytes(), settings.tenants).authenticate(
        TENANT_KEY
    )
    async with app.api.router.lifespan_context(app.api):
        director: Director = app.state.director
        await until_ready(director)
        clock = ManualClock(1_000_000)
        app.state.billing.meter.clock = clock
        total = Decimal(0)
        pings = 0
        for step in session(**SCENARIOS["pings"]):
            clock.set(1_000_000 + step["t"])
            body = {"model": MODEL, "messages": session_messages(step["segments"]), "max_tokens": 1}
            parsed = parse_chat(orjson.dumps(body), settings.max_prompt_bytes)
            parsed.body["max_tokens"] = step["max_tokens"]  # the Messages API allows 0
            exchange = await director.open(parsed, tenant)
            assert isinstance(exchange, Exchange)
            usage = (await exchange.complete())["usage"]
            if step["max_tokens"] == 0:
                pings += 1
                assert usage["completion_tokens"] == 0
                assert usage["cache_read_input_tokens"] == usage["prompt_tokens"]
                assert usage["cache_creation_input_tokens"] == usage["input_tokens"] == 0
            total += Decimal(usage["cost"])
    assert pings == 9
    assert str(total) == "0.97055"
