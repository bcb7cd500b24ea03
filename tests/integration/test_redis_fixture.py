"""The Redis test servers are real, private and restartable."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from loadgen.harness.redis_servers import PortTaken, RedisServer, redis_server

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


def test_a_server_whose_port_is_taken_never_answers_with_the_other_servers_data(
    tmp_path: Path,
) -> None:
    # Another process's server already on the port (a parallel suite, a leftover): the new
    # redis-server fails to bind and exits, but the other one answers PING. A test must not go
    # on against it (another test's FLUSHALL or restart would take its data).
    with redis_server(port=0) as other:
        taken = RedisServer(tmp_path, port=other.port)
        with pytest.raises(PortTaken, match=str(other.port)):
            taken.start()
        assert taken.proc is None
        other.cli("SET", "mine", "1")
        with redis_server(port=0) as fresh:  # a free port is found, and it is its own server
            assert fresh.port != other.port
            assert fresh.cli("GET", "mine").strip() == ""
