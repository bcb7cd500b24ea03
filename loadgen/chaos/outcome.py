"""What a chaos scenario reports: its figures, and each goal with the figure that decides it.

A scenario runs at one of two sizes: `full` for `kvgate chaos` (the figures in
docs/reliability.md), small for the test suite (seconds, the same goals). Every loop a scenario
runs is bounded by its size, and every wait by a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Size:
    full: bool
    """`kvgate chaos` (True) or the test suite's small run (False)."""
    repeat: int = 1
    """How many kills a repeated scenario makes (the gateway's drain and kill -9)."""

    def pick(self, small: int, full: int) -> int:
        return full if self.full else small


@dataclass(frozen=True)
class Goal:
    name: str
    met: bool
    figure: str
    """The measured value that decides it, as the table prints it."""


@dataclass
class Outcome:
    scenario: str
    goals: list[Goal] = field(default_factory=list)
    figures: dict[str, object] = field(default_factory=dict)
    """Measured but not judged (hit ratios, times), printed after the goals."""

    def goal(self, name: str, met: bool, figure: object) -> None:
        self.goals.append(Goal(name, bool(met), str(figure)))

    @property
    def met(self) -> bool:
        return all(g.met for g in self.goals)

    def describe(self) -> str:
        lines = [f"{self.scenario}: " + ("met" if self.met else "NOT MET")]
        lines += [f"  {'ok ' if g.met else 'NOT'} {g.name}: {g.figure}" for g in self.goals]
        lines += [f"      {k}: {v}" for k, v in self.figures.items()]
        return "\n".join(lines)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll a condition until it holds, bounded: the condition, not a sleep, synchronises."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:g} s")
        time.sleep(0.01)


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
