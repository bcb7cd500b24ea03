"""The directory's capacity per replica from its engine's reported KV, at the fleet's learned
bytes a token (issue 42): the real in-process directory and token estimator, no engine."""

from __future__ import annotations

from cachemap.memory import MemoryDirectory, MemoryIndex
from gateway.directory.routing import RoutingDirectory
from gateway.directory.sizing import DirectorySizer
from gateway.request.parsed import CHAT, ParsedRequest
from gateway.request.tokens import TokenEstimator


def _parsed(num_bytes: int) -> ParsedRequest:
    return ParsedRequest(CHAT, "m", {"messages": []}, b"x" * num_bytes, False, False)


def test_the_fleet_ratio_is_learned_from_every_tenant_and_leaves_theirs_alone() -> None:
    estimator = TokenEstimator(4.0)
    assert estimator.fleet_bytes_per_token == 4.0  # the setting until a response
    estimator.learn(_parsed(6500), 1000, tenant="a")
    assert estimator.fleet_bytes_per_token == 6.5  # the first response's ratio
    for _ in range(50):
        estimator.learn(_parsed(2000), 1000, tenant="b")
    assert 2.0 < estimator.fleet_bytes_per_token < 2.05  # an EMA: b's text now fills the KV
    assert estimator.bytes_per_token("m", tenant="a") == 6.5  # a's own estimate is a's
    estimator.learn(_parsed(100), 1000, tenant="c")  # 0.1 a token: clamped to 1
    assert estimator.fleet_bytes_per_token > 1.9


def test_the_sizer_follows_the_engine_and_the_ratio_and_never_passes_the_setting() -> None:
    directory = RoutingDirectory(MemoryDirectory(MemoryIndex(capacity_blocks=2000)))
    index = directory.local.index
    ratio = [4.0]
    sizer = DirectorySizer(directory, lambda: ratio[0], 2000, dp_size=1, block_bytes=256)
    sizer.engine("r", 4096, 16)  # 65,536 tokens at 4 bytes: 1,024 entries
    assert index.capacity_of("r") == 1024
    ratio[0] = 6.5  # learned from the responses: 1,664 entries
    sizer.engine("r", 4096, 16)
    assert index.capacity_of("r") == 1664
    sizer.engine("r", 8192, 16)  # more KV than the setting: the setting
    assert index.capacity_of("r") == 2000
    sizer.engine("r", 64, 16)
    assert index.capacity_of("r") == 26
    sizer.engine("r", None, 16)  # it stopped reporting: the setting again
    assert index.capacity_of("r") == 2000
