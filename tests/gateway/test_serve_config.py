"""`kvgate serve`'s HTTP front end keeps an idle client connection longer than the clients do.

A server that ends an idle connection first races the client's next request on it: a client
whose loop lags (CPU starvation) has not read the server's FIN yet and writes its request into a
closed connection ("Can not write request body", "Server disconnected": the request is lost).
uvicorn's default 5 s was under aiohttp's 15 s pool idle and equal to httpx's 5 s (the openai
and anthropic SDKs'). The race itself, live: docs/reliability.md, "Nothing lost under CPU
starvation"."""

from __future__ import annotations

import asyncio

import aiohttp
import anthropic._constants
import httpx
import openai._constants

from gateway.server.cli import server_config
from gateway.settings import load_settings


async def _aiohttp_pool_idle_s() -> float | None:
    connector = aiohttp.TCPConnector()
    try:
        return connector._keepalive_timeout
    finally:
        await connector.close()


def test_the_gateway_outlasts_the_clients_pool_idle() -> None:
    config = server_config(object(), load_settings(engines=["http://e:1"]))
    clients = {
        "aiohttp": asyncio.run(_aiohttp_pool_idle_s()),
        "httpx": httpx.Limits().keepalive_expiry,
        "openai": openai._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry,
        "anthropic": anthropic._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry,
    }
    for client, idle_s in clients.items():
        assert idle_s is not None and config.timeout_keep_alive > idle_s, client


def test_the_keep_alive_is_a_setting() -> None:
    config = server_config(object(), load_settings(engines=["http://e:1"], client_keep_alive_s=3))
    assert config.timeout_keep_alive == 3
