"""Every key of the chart's values.yaml says what it is (`make helm` checks it too)."""

from __future__ import annotations

from tools import chart


def test_every_values_key_has_a_comment() -> None:
    assert chart.uncommented_keys(chart.VALUES.read_text()) == []


def test_a_key_without_one_is_named() -> None:
    text = "# the pods\nresources:\n  requests: {cpu: 1}  # reserved\n  limits: {}\n"
    assert chart.uncommented_keys(text) == ["values.yaml:4: limits: {}"]
