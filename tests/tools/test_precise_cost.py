"""`tools.precise_cost long`, small: it runs and prints both arms' CPU per token."""

from __future__ import annotations

import asyncio

import pytest

from tools import precise_cost


def test_long_prompts_prints_both_arms(capsys: pytest.CaptureFixture[str]) -> None:
    asyncio.run(precise_cost.long_prompts(2))
    out = capsys.readouterr().out
    assert "prompts: 2 in groups of 4" in out
    assert out.count("us/token") == 6 and "cut " in out and "whole " in out
