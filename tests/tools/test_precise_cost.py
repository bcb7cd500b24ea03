"""`tools.precise_cost ingest`, `long`, `images`, `route` and `fleet`, small: they run and print
their arms' CPU."""

from __future__ import annotations

import asyncio

import pytest

from tools import precise_cost


def test_long_prompts_prints_both_arms(capsys: pytest.CaptureFixture[str]) -> None:
    asyncio.run(precise_cost.long_prompts(2))
    out = capsys.readouterr().out
    assert "prompts: 2 in groups of 4" in out
    assert out.count("us/token") == 6 and "cut " in out and "whole " in out


def test_images_prints_the_image_arm_beside_the_text_arm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    asyncio.run(precise_cost.images(3, 4))
    out = capsys.readouterr().out
    assert "requests: 3, one 4 KB image each" in out and "(64 of the image)" in out
    assert "a new image: precise" in out and out.count("the image costs") == 2


def test_route_stores_every_turn_and_prints_both_arms(capsys: pytest.CaptureFixture[str]) -> None:
    precise_cost.route(3, conversations=4, domains=2)
    out = capsys.readouterr().out
    # 4 conversations' last prompts, every block of each stored by its events
    blocks = 4 * len(precise_cost.precise_keys(list(range(16 * 128 + 2 * 16 * 27)), "s", 16))
    assert f"{blocks:,} blocks indexed" in out
    assert "before" in out and "now" in out and "saved" in out


def test_fleet_views_every_size_with_two_replicas_holding_the_chain(
    capsys: pytest.CaptureFixture[str],
) -> None:
    asyncio.run(precise_cost.fleet([2, 5], calls=20))
    out = capsys.readouterr().out
    assert "calls: 20 per fleet size" in out
    assert "   2 replicas:" in out and "   5 replicas:" in out and out.count("lookup alone") == 2


@pytest.mark.parametrize("per_event", [1, 4])
def test_ingest_indexes_batches_of_any_size(
    capsys: pytest.CaptureFixture[str], per_event: int
) -> None:
    precise_cost.ingest(64, per_event)
    out = capsys.readouterr().out
    batches = 2 * 64 // per_event
    assert f"blocks (stored + removed): 128 in {batches} batches of {per_event} block" in out
    assert out.count("us a batch") == 3 and "the feed's CPU" in out
    assert f"a batch every 0.5 ms ({64 // per_event:,} batches): " in out  # the stores, paced
