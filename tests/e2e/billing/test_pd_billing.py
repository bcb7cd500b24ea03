"""A P/D request's billing record (issue 42, item 4): one real gateway in front of one prefill
and one decode simulated engine (vLLM NixlConnector's protocol), the ledger its WAL directory.
The decode instance counts the blocks it pulled as cached, and both instances count the prompt:
the record counts it once, with the cached and written tokens of the prefill instance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.billing.wal import read_directory
from gateway.server.app import create_app
from loadgen.engine.disagg import CONSUMER, PRODUCER
from loadgen.text import words
from tests.clients import openai_client as client
from tests.conftest import MODEL, engine_of, gateway_settings
from tests.e2e.test_disaggregation import _engine, ask
from tests.servers import Served, start_app, stop_all

pytestmark = pytest.mark.e2e


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Served, Served, Served]]:
    prefill, decode = _engine(PRODUCER), _engine(CONSUMER)
    settings = gateway_settings(
        [prefill.url],
        decode_engines=[decode.url],
        billing_wal_dir=tmp_path / "wal",
        billing_model_map={MODEL: "sonnet-5", f"openai:{MODEL}": "gpt-5.6"},
    )
    gateway = start_app(create_app(settings))
    yield gateway, prefill, decode
    stop_all([gateway, prefill, decode])


def records(tmp_path: Path) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in read_directory(tmp_path / "wal") if r.get("kind") == "request"}


def test_a_pd_requests_record_counts_the_prompt_once_as_the_prefill_instance_cached_it(
    fleet: tuple[Served, Served, Served], tmp_path: Path
) -> None:
    gateway, prefill, decode = fleet
    c = client(gateway)
    prompt = "Billed once." + words("pd-ledger", 2_000)  # over OpenAI's 1,024-token minimum
    first, _, decoded_at = ask(c, prompt)
    assert decoded_at == decode.url
    n = first.prompt_tokens
    # both instances ran the prompt; the decode instance pulled it and counts it cached
    assert engine_of(prefill).core.counters.prompt_tokens == n
    assert engine_of(decode).core.counters.prompt_tokens == n
    pulled = engine_of(decode).core.counters.external_tokens
    assert pulled > 0
    second, _, _ = ask(c, prompt)
    assert engine_of(prefill).core.counters.cached_tokens == (n - 1) // 16 * 16

    ledger = records(tmp_path)
    assert len(ledger) == 2  # one record per request: the prefill leg is not billed apart
    one = ledger[first.kvgate_billing["id"]]  # type: ignore[attr-defined]
    two = ledger[second.kvgate_billing["id"]]  # type: ignore[attr-defined]
    for record in (one, two):
        assert record["prompt_tokens"] == n  # once, not prefill's + decode's
        assert record["replica"] == prefill.url
        assert record["status"] == "ok"
    # turn 1: the prefill instance computed it all (the decode instance's pulled "hit" is not
    # the client's), and the contract wrote the whole prompt
    assert one["engine_cached_tokens"] == 0
    assert one["written_tokens"] == n and one["read_tokens"] == 0
    assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # turn 2: the prefill instance's own hit, read as the contract reads it
    assert two["engine_cached_tokens"] == (n - 1) // 16 * 16
    assert two["read_tokens"] == n and two["written_tokens"] == 0
    assert two["uncached_tokens"] == 0
    # what the client saw is what the ledger holds
    assert second.prompt_tokens_details.cached_tokens == two["read_tokens"]  # type: ignore[union-attr]
    assert first.prompt_tokens_details.cache_write_tokens == one["written_tokens"]  # type: ignore[union-attr]
    assert first.cost == one["cost"] and second.cost == two["cost"]  # type: ignore[attr-defined]
    c.close()
