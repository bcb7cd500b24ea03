"""Images in precise mode: real engines expanding a chat's `image_url` parts into placeholder
tokens, their KV events over real ZMQ carrying each image's identifier in the extra keys of the
blocks its placeholders fill (vLLM's `(identifier, offset)`), a real gateway keying a request
with the same identities."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest

from cachemap.chat_template import ChatTemplateError
from cachemap.events import EventIndex, precise_keys
from cachemap.multimodal import Placeholder, blocks_mm_keys, extras_of, identify
from gateway.events.decode import decode_batch
from gateway.events.precise import ImageIds
from loadgen.engine.kv_events import encode_batch
from loadgen.engine.kvpool import GPU, Stored
from loadgen.engine.tokenizer import block_hashes, default_tokenizer
from loadgen.text import words
from tests.conftest import MODEL
from tests.e2e.test_precise import (
    AUTH,
    chat,
    direct,
    indexed,
    parts_of,
    precise_fleet,
    salt_of,
    via,
)
from tests.loadgen.test_engine_tokenizer import data_url, image_message
from tests.servers import Served, wait_until

pytestmark = pytest.mark.e2e
__all__ = ["precise_fleet"]  # the fixture, used by name
TOK = default_tokenizer()
SYSTEM = {"role": "system", "content": "Describe images." + words("mm-system", 60)}
CAT = data_url(b"\x89PNG\r\n cat pixels " * 40)
DOG = data_url(b"\x89PNG\r\n dog pixels " * 40)


def with_image(url: str) -> dict[str, Any]:
    return chat([SYSTEM, image_message(url)])


def placeholder_start(ids: list[int]) -> int:
    start = ids.index(TOK.image_token_id)
    assert TOK.image_token_id is not None and start % 16 != 0  # the image starts mid-block
    return start


def test_an_images_blocks_carry_its_identifier_and_match_only_that_image() -> None:
    ids = list(range(20)) + [4096] * 24 + list(range(20, 40))  # an image at 20..43
    cat = (Placeholder("cat", 20, 24),)
    dog = (Placeholder("dog", 20, 24),)
    assert blocks_mm_keys(cat, 5, 16) == {1: (("cat", 4),), 2: (("cat", -12),)}
    hashes = block_hashes(ids, 16, "s", extras=extras_of(cat, 4, 16))
    assert (
        hashes[0] == block_hashes(ids, 16, "s")[0] and hashes[1:] != block_hashes(ids, 16, "s")[1:]
    )
    mm_keys = ((), (("cat", 4),), (("cat", -12),), ())
    stored = Stored(tuple(hashes), None, tuple(ids[:64]), 16, GPU, "s", None, mm_keys)
    for encoding in ("vllm", "vllm-array"):
        event = msgspec.msgpack.decode(encode_batch([stored], 1.0, 0, encoding))[1][0]
        extra = event["extra_keys"] if encoding == "vllm" else event[8]
        assert extra == [["s"], [["cat", 4]], [["cat", -12]], None]  # vLLM's order: mm, salt
        (decoded,) = decode_batch(encode_batch([stored], 1.0, 0, encoding)).events
        index = EventIndex()
        index.apply("x", decoded)
        assert index.lookup(precise_keys(ids, "s", 16, None, cat), 0.0)["x"].depth == 4
        # the same ids with another image: only the block before the image matches
        assert index.lookup(precise_keys(ids, "s", 16, None, dog), 0.0)["x"].depth == 1
        # the image one token later: other offsets, so block 1 differs too
        later = (Placeholder("cat", 21, 24),)
        assert index.lookup(precise_keys(ids, "s", 16, None, later), 0.0)["x"].depth == 1
        assert index.lookup(precise_keys(ids, "t", 16, None, cat), 0.0) == {}  # another salt


def test_image_identifiers_are_cached_per_tenant_and_a_bad_part_still_fails() -> None:
    ids = ImageIds(max_entries=2)
    part = {"type": "image_url", "image_url": {"url": CAT}}
    first = ids.identifier("a", part, "p")
    assert first == identify(part, "p") and (ids.hits, ids.misses) == (0, 1)
    assert ids.identifier("a", part, "p") == first and ids.hits == 1
    assert ids.identifier("b", part, "p") == first and ids.misses == 2  # another tenant: its own
    ids.identifier("c", part, "p")  # a third entry evicts the least recent ("a")
    assert ids.identifier("a", part, "p") == first and ids.misses == 4
    with pytest.raises(ChatTemplateError, match="not fetched"):
        ids.identifier("a", {"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "p")


def test_the_same_image_routes_to_its_replica_and_another_matches_only_the_text_before_it(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    (x, _), (gateway,) = precise_fleet(2)
    salt = salt_of(gateway)
    direct(x, with_image(CAT), salt)  # only X's events know it holds the cat
    ids = httpx.post(x.url + "/tokenize", json=with_image(CAT)).json()["tokens"]
    full = len(ids) // 16
    wait_until(indexed(gateway, x.url, full), what="X's blocks indexed")
    same = via(gateway, with_image(CAT))
    assert same.headers["x-kvgate-replica"] == x.url
    assert int(same.headers["x-kvgate-matched-blocks"]) == full
    assert (
        same.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 16 * 16
    )
    before = placeholder_start(ids) // 16  # full blocks of text before the image
    other = via(gateway, with_image(DOG))  # the same text, another image
    assert other.headers["x-kvgate-replica"] == x.url  # still the best: the system prompt
    assert int(other.headers["x-kvgate-matched-blocks"]) == before
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == before * 16
    precise = parts_of(gateway).keying.precise  # type: ignore[union-attr]
    assert precise is not None and precise.stats.image_requests == 2


def test_gateway_ids_of_an_image_request_equal_the_engines_and_the_check_agrees(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    (x, _), (gateway,) = precise_fleet(2)
    answer = via(gateway, with_image(CAT)).json()  # the first request: checked
    keying = parts_of(gateway).keying
    assert keying is not None and keying.precise is not None and keying.check is not None
    check = keying.check
    wait_until(lambda: check.stats.checks == 1, what="the first request's tokenizer check")
    assert check.stats.mismatches == 0
    precise = keying.precise
    body = with_image(CAT)
    text_ids = precise.tokens.ids(body, chat=True)
    ids, spans = TOK.with_images(text_ids, body, True, precise.mm_tokens_per_image)
    assert list(ids) == httpx.post(x.url + "/tokenize", json=body).json()["tokens"]
    assert answer["usage"]["prompt_tokens"] == len(ids)
    assert [s.length for s in spans] == [64] and list(ids).count(4096) == 64


def test_an_anthropic_image_block_is_keyed_as_the_same_image_url_part(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]],
) -> None:
    (_, y), (gateway,) = precise_fleet(2)
    direct(y, with_image(CAT), salt_of(gateway))  # Y holds the OpenAI-shaped request
    ids = httpx.post(y.url + "/tokenize", json=with_image(CAT)).json()["tokens"]
    wait_until(indexed(gateway, y.url, len(ids) // 16), what="Y's blocks indexed")
    media, data = CAT.removeprefix("data:").split(";base64,")
    image = {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "system": SYSTEM["content"],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is in this picture?"}, image],
            }
        ],
    }
    r = httpx.post(gateway.url + "/v1/messages", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvgate-replica"] == y.url
    assert int(r.headers["x-kvgate-matched-blocks"]) == len(ids) // 16
    assert r.json()["usage"]["engine_cached_tokens"] == (len(ids) - 1) // 16 * 16


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", "image URLs are not fetched"),
        ("data:image/png;base64,not base64!", "not valid base64"),
        ("data:image/png,raw", "data:image/<type>;base64"),
    ],
)
def test_a_malformed_image_part_is_a_400_naming_it(
    precise_fleet: Callable[..., tuple[list[Served], list[Served]]], url: str, message: str
) -> None:
    _, (gateway,) = precise_fleet(1)
    r = httpx.post(gateway.url + "/v1/chat/completions", json=with_image(url), headers=AUTH)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert "messages[1].content[1]" in r.json()["error"]["message"]


def test_in_approximate_mode_the_engines_400_names_the_remote_image(
    start_engines: Callable[..., list[Served]], start_gateway: Callable[..., Served]
) -> None:
    gateway = start_gateway(start_engines(1))  # no tokenizer_dir: the gateway keys bytes
    body = with_image("https://example.com/cat.png")
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 400, r.text
    assert "image URLs are not fetched" in r.json()["error"]["message"]
    assert via(gateway, with_image(CAT)).json()["usage"]["prompt_tokens"] > 64
