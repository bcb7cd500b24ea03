"""SDK clients for the tests, closed after each test (conftest's autouse fixture), and the
director of an in-process gateway."""

from __future__ import annotations

import anthropic
import openai

from gateway.pipeline.director import Director
from tests.conftest import TENANT_KEY
from tests.servers import Served

_OPEN: list[openai.OpenAI | anthropic.Anthropic] = []


def openai_client(gateway: Served, key: str = TENANT_KEY) -> openai.OpenAI:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    _OPEN.append(client)
    return client


def anthropic_client(gateway: Served, key: str = TENANT_KEY) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0)
    _OPEN.append(client)
    return client


def close_all() -> None:
    while _OPEN:
        _OPEN.pop().close()


def director(gateway: Served) -> Director:
    d: Director = gateway.app.state.director
    return d
