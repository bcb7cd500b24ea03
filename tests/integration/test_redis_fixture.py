"""The Redis test servers are real, private and restartable."""

from __future__ import annotations

import pytest
import redis

from loadgen.harness.redis_servers import RedisServer

pytestmark = pytest.mark.redis


def test_the_session_server_is_real_and_not_6379(redis_url: str) -> None:
    assert ":6379" not in redis_url
    client = redis.Redis.from_url(redis_url)
    client.set("kvgate:test:fixture", b"1")
    assert client.get("kvgate:test:fixture") == b"1"
    assert client.delete("kvgate:test:fixture") == 1
    client.close()


def test_a_private_server_can_be_killed_and_restarted(fresh_redis: RedisServer) -> None:
    assert fresh_redis.cli("ping").strip() == "PONG"
    fresh_redis.stop()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(fresh_redis.url, socket_timeout=0.5).ping()
    fresh_redis.start()
    assert redis.Redis.from_url(fresh_redis.url).ping()
