"""Commands packed by hiredis itself (`cachemap.redis.client`): a client `open_redis` makes
writes the same bytes as redis-py's own packer, without its per-argument Python encoding, and
commands still round-trip on a real redis-server (unix socket and TCP)."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, Connection, UnixDomainSocketConnection
from redis.connection import HiredisRespSerializer
from redis.exceptions import DataError

from cachemap.redis.client import open_redis
from loadgen.harness.redis_servers import RedisServer

pytestmark = pytest.mark.redis

COMMANDS: list[tuple[Any, ...]] = [
    ("EVALSHA", "a" * 40, 1, b"kvg:{0a1b}:" + bytes(range(14)), b"kvg:{0a1b}:", bytes(330 * 14)),
    ("HSET", b"kvg:{kvg-load}:gateways", "host-1-ab", b"1733550000000|[]", 0, -1, 2**62),
    ("HGETALL", b"kvg:{kvg-load}:gateways"),
    ("SET", "caf\u00e9", "\u00fcber"),  # str arguments: UTF-8, as the client's encoder
    ("CONFIG GET", "maxmemory"),  # a command name with its subcommand in one argument
    (b"CLIENT SETINFO", b"LIB-NAME", b"x"),
    ("ZADD", "z", 0.1, "m"),  # floats: as redis-py writes them (repr)
    ("SET", "k", memoryview(b"view")),
    ("SET", "k", bytearray(b"array")),
]


async def single(url: str) -> Redis:
    client = await open_redis(url, cluster=False)
    assert isinstance(client, Redis)
    return client


def connection(client: Redis) -> AbstractConnection:
    """A connection of the client's pool's kind (not connected)."""
    conn: AbstractConnection = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    return conn


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: str(c[0]))
async def test_the_same_bytes_as_redis_pys_packer(redis_url: str, command: tuple[Any, ...]) -> None:
    client = await single(redis_url)
    try:
        conn = connection(client)
        plain = UnixDomainSocketConnection()
        assert b"".join(conn.pack_commands([command, command])) == b"".join(
            plain.pack_commands([command, command])
        )
    finally:
        await client.aclose()


async def test_packing_skips_the_librarys_packer(redis_url: str) -> None:
    """hiredis packs the whole command; redis-py's packer (`_command_packer`) checks and
    encodes each argument in Python first."""
    client = await single(redis_url)
    try:
        conn = connection(client)
        packed: list[tuple[Any, ...]] = []
        library = conn._command_packer
        assert library is not None

        class Spy(HiredisRespSerializer):
            def pack(self, *args: Any) -> list[bytes]:
                packed.append(args)
                assert library is not None
                out: list[bytes] = library.pack(*args)
                return out

        conn._command_packer = Spy()  # type: ignore[no-untyped-call]
        conn.pack_commands([COMMANDS[0], COMMANDS[1]])
        assert packed == []
        conn.pack_command("ZADD", "z", 0.1, "m")  # a float goes the library's way
        assert len(packed) == 1
    finally:
        await client.aclose()


async def test_a_bool_is_refused_as_redis_py_refuses_it(redis_url: str) -> None:
    client = await single(redis_url)
    try:
        conn = connection(client)
        with pytest.raises(DataError):
            conn.pack_command("SET", "k", True)
    finally:
        await client.aclose()


async def test_commands_round_trip(redis_url: str, fresh_redis: RedisServer) -> None:
    for url in (redis_url, fresh_redis.url):
        client = await single(url)
        try:
            assert isinstance(connection(client), Connection) == (not url.startswith("unix://"))
            await client.delete("caf\u00e9", "pack:z")
            assert await client.set("caf\u00e9", "\u00fcber")
            assert await client.get("caf\u00e9") == "\u00fcber".encode()
            await client.zadd("pack:z", {"m": 0.1})
            assert await client.zscore("pack:z", "m") == 0.1
            assert await client.eval("return ARGV[1] + ARGV[2]", 0, 40, 2) == 42
            config: Any = await client.config_get("maxmemory")
            assert "maxmemory" in config
            pipe = client.pipeline(transaction=False)
            pipe.set("pack:k", memoryview(b"view"))
            pipe.get("pack:k")
            assert await pipe.execute() == [True, b"view"]
            await client.delete("caf\u00e9", "pack:z", "pack:k")
        finally:
            await client.aclose()
