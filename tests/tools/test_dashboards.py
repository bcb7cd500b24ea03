"""The chart's Grafana dashboards (helm/kvgate/dashboards/): rendered into a ConfigMap for
Grafana's dashboard sidecar, and every panel's query names a metric that a running gateway
really exports on its admin port (a renamed metric breaks this test, not an operator's panel)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL, TENANT_KEY, metrics_url
from tests.servers import Served
from tools import chart

DASHBOARDS = sorted((chart.CHART / "dashboards").glob("*.json"))
METRIC = re.compile(r"\bkvgate_[a-z0-9_]+")
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queried(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    """panel title -> the kvgate metric names its queries read"""
    return {
        p["title"]: {m for t in p.get("targets", []) for m in METRIC.findall(t["expr"])}
        for p in panels(dashboard)
        if p["type"] != "row"
    }


def exported(scrape: str) -> set[str]:
    """Every series name the scrape can hold: a family's own name and its type's suffixes (a
    family with no sample yet still counts: its HELP and TYPE lines are there)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(scrape):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def test_the_chart_ships_the_dashboards_for_the_sidecar_when_asked() -> None:
    assert DASHBOARDS, "no dashboard in helm/kvgate/dashboards/"
    assert not [o for o in chart.template() if o["metadata"]["name"] == "kvgate-dashboards"]
    everything = chart.template(chart.EVERYTHING_VALUES)
    (config_map,) = [o for o in everything if o["metadata"]["name"] == "kvgate-dashboards"]
    assert config_map["kind"] == "ConfigMap"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "kvgate"}
    for path in DASHBOARDS:
        assert json.loads(config_map["data"][path.name]) == json.loads(path.read_text())


@pytest.mark.e2e
def test_every_panel_reads_a_metric_the_gateway_exports(
    start_engines: Callable[..., list[Served]],
    start_gateway: Callable[..., Served],
    redis_url: str,
) -> None:
    gateway = start_gateway(start_engines(2), redis_url=redis_url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auth = {"authorization": f"Bearer {TENANT_KEY}"}
    assert httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=auth).is_success
    names = exported(httpx.get(metrics_url(gateway) + "/metrics").text)
    assert "kvgate_no_such_metric" not in names  # the check itself can fail
    for path in DASHBOARDS:
        for title, metrics in queried(json.loads(path.read_text())).items():
            assert metrics, f"{path.name}: panel {title!r} reads no kvgate metric"
            assert metrics <= names, f"{path.name}: panel {title!r} reads {metrics - names}"
