"""The chaos suite at its small size: each scenario once, every goal met (`kvgate chaos` runs
them at full size; docs/reliability.md has those figures). Real processes on loopback, killed by
pid; each scenario starts and stops its own."""

from __future__ import annotations

import argparse
import re

import pytest

# the schemathesis scenario's OpenAPI loader, imported here at collection (one thread): imported
# during the scenario, its modules were parsed (pytest rewrites a plugin's modules) while the
# scenario's server threads ran, and CPython 3.11's parser is not safe across threads there
# ("SystemError: AST constructor recursion depth mismatch", seen once in the suite)
import schemathesis.openapi.loaders
import schemathesis.specs.openapi.schemas  # noqa: F401

from loadgen.chaos.outcome import Size
from loadgen.chaos.runner import SCENARIOS, add_chaos_arguments, run_chaos, scenario

pytestmark = [pytest.mark.e2e, pytest.mark.redis]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_scenario_meets_its_goals_at_the_small_size(name: str) -> None:
    outcome = scenario(name)(Size(full=False))
    assert outcome.goals, "a scenario judges something"
    assert outcome.met, outcome.describe()


def test_the_runner_prints_one_table_and_fails_on_an_unknown_scenario(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    add_chaos_arguments(parser)
    args = parser.parse_args(["--scenario", "redis-slow", "--small"])
    args.argv = ["chaos", "--scenario", "redis-slow", "--small"]
    assert run_chaos(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"^scenario +goal +figure +met +wall s", out, re.MULTILINE)
    assert re.search(r"^redis-slow +failed requests +0 of \d+ +yes", out, re.MULTILINE)
    with pytest.raises(ValueError, match="choose from"):
        scenario("nothing")
