"""The chart's defaults close the cluster (issue 45 items 12, 13): the picker fails closed, the
in-chart Redis takes a generated password, a NetworkPolicy admits the tenants' ports from
anywhere and the admin port, the picker's port and Redis only from whom they serve, and the
admin port can take a bearer key for every route."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path
from typing import Any

import redis

from gateway.settings import load_settings
from loadgen.harness.processes import free_port
from tests.servers import wait_until
from tests.tools.test_chart import EPP_VALUES, Objects, helm_binary, one
from tools import chart

__all__ = ["helm_binary"]  # the module's fixture (fetches helm once)


def secret_data(objects: Objects) -> dict[str, str]:
    data = one(objects, "Secret", "kvgate")["data"]
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env", [])}


def test_the_picker_fails_closed_by_default_and_in_the_example_values() -> None:
    """FailOpen routes without cache_salt (engines share prefix caches across tenants: the
    timing channel) and bills nothing: it is never what a values file gets by default."""
    for values, extra in ((None, ("--set", "epp.enabled=true")), (EPP_VALUES, ())):
        pool = one(chart.template(values, *extra), "InferencePool")
        assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose", values
    chosen = chart.template(EPP_VALUES, "--set", "epp.failureMode=FailOpen")
    assert one(chosen, "InferencePool")["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_the_in_chart_redis_takes_a_generated_password_the_gateway_reads_from_the_secret(
    tmp_path: Path,
) -> None:
    objects = chart.template()
    password = secret_data(objects)["redis-password"]
    assert len(password) >= 32
    assert password != secret_data(chart.template())["redis-password"]  # random per install
    (server,) = one(objects, "StatefulSet", "kvgate-redis")["spec"]["template"]["spec"][
        "containers"
    ]
    args = server["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    ref = env_of(server)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "kvgate", "key": "redis-password"}
    assert "REDISCLI_AUTH" in env_of(server)  # the probes' redis-cli authenticates
    (gateway,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = env_of(gateway)
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
    url = env["KVGATE_REDIS_URL"]["value"]
    assert url == "redis://:$(REDIS_PASSWORD)@kvgate-redis:6379/0"
    # a real redis-server with the rendered arguments refuses a client without the password
    # and serves the gateway's URL (the kubelet's $(VAR) expansion done by hand)
    port = free_port()
    argv = [a.replace("$(REDIS_PASSWORD)", password) for a in args]
    argv[argv.index("--dir") + 1] = str(tmp_path)
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", *argv],
        stdout=subprocess.DEVNULL,
    )
    try:
        anonymous = redis.Redis(port=port, socket_connect_timeout=1)

        def refuses_anonymous() -> bool:
            try:
                anonymous.ping()
            except redis.AuthenticationError:
                return True
            except redis.ConnectionError:
                return False  # not listening yet
            return False

        wait_until(refuses_anonymous, 10, "redis-server refusing a client without the password")
        settings = load_settings(
            redis_url=url.replace("$(REDIS_PASSWORD)", password).replace(
                "kvgate-redis:6379", f"127.0.0.1:{port}"
            )
        )
        assert settings.redis_url is not None
        assert redis.Redis.from_url(settings.redis_url).ping() is True
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_password_of_your_own_and_an_external_redis_take_no_generated_one() -> None:
    own = secret_data(chart.template(None, "--set", "redis.password=correct-horse"))
    assert own["redis-password"] == "correct-horse"
    external = chart.template(chart.CHART / "ci" / "external-redis-values.yaml")
    assert not [o for o in external if o["kind"] == "StatefulSet"]
    secrets = [o for o in external if o["kind"] == "Secret"]
    assert all("redis-password" not in s.get("data", {}) for s in secrets)


def policy_rules(policy: dict[str, Any]) -> dict[str, list[Any] | None]:
    """Each port of a NetworkPolicy's ingress and who may reach it (None: anyone)."""
    rules: dict[str, list[Any] | None] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            rules[str(port["port"])] = rule.get("from")
    return rules


def test_a_network_policy_admits_the_tenants_from_anywhere_and_the_rest_from_whom_it_serves() -> (
    None
):
    objects = chart.template(EPP_VALUES)
    gateway = one(objects, "NetworkPolicy", "kvgate")
    assert gateway["spec"]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kvgate",
        "app.kubernetes.io/instance": "kvgate",
        "app.kubernetes.io/component": "gateway",
    }
    assert gateway["spec"]["policyTypes"] == ["Ingress"]
    rules = policy_rules(gateway)
    assert rules["http"] is None and rules["grpc"] is None  # the tenants' ports: anyone
    monitoring = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert rules["metrics"] == monitoring
    assert rules["epp"] == [{"podSelector": {}}]  # Envoy: this namespace's pods, by default
    redis_policy = one(objects, "NetworkPolicy", "kvgate-redis")
    assert policy_rules(redis_policy) == {
        "redis": [
            {
                "podSelector": {
                    "matchLabels": {
                        "app.kubernetes.io/name": "kvgate",
                        "app.kubernetes.io/instance": "kvgate",
                        "app.kubernetes.io/component": "gateway",
                    }
                }
            }
        ]
    }
    assert chart.validate(objects).returncode == 0
    # configurable: the monitoring peers, the picker's callers
    peers = '[{"podSelector":{"matchLabels":{"app":"prometheus"}}}]'
    custom = chart.template(
        EPP_VALUES,
        "--set-json",
        f"networkPolicy.adminFrom={peers}",
        "--set-json",
        'networkPolicy.eppFrom=[{"namespaceSelector":{"matchLabels":{"gw":"envoy"}}}]',
    )
    rules = policy_rules(one(custom, "NetworkPolicy", "kvgate"))
    assert rules["metrics"] == [{"podSelector": {"matchLabels": {"app": "prometheus"}}}]
    assert rules["epp"] == [{"namespaceSelector": {"matchLabels": {"gw": "envoy"}}}]
    off = chart.template(None, "--set", "networkPolicy.enabled=false")
    assert not [o for o in off if o["kind"] == "NetworkPolicy"]


def test_admin_port_auth_reaches_the_gateway_and_the_service_monitor_sends_the_key(
    tmp_path: Path,
) -> None:
    objects = chart.template(
        None,
        "--set",
        "config.admin_port_auth=true",
        "--set",
        "config.admin_keys={sha256:" + "ab" * 32 + "}",
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "serviceMonitor.bearerTokenSecret.name=prometheus-kvgate",
        "--set",
        "serviceMonitor.bearerTokenSecret.key=admin-key",
    )
    config = tmp_path / "kvgate.yaml"
    config.write_text(one(objects, "ConfigMap", "kvgate")["data"]["kvgate.yaml"])
    settings = load_settings(config)
    assert settings.admin_port_auth is True and settings.admin_keys == ["sha256:" + "ab" * 32]
    (endpoint,) = one(objects, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "prometheus-kvgate", "key": "admin-key"},
    }
    plain = one(chart.template(None, "--set", "serviceMonitor.enabled=true"), "ServiceMonitor")
    assert "authorization" not in plain["spec"]["endpoints"][0]


def test_the_pickers_token_goes_from_the_secret_to_the_gateway() -> None:
    objects = chart.template(EPP_VALUES, "--set", "epp.token=envoy-only")
    assert secret_data(objects)["epp-token"] == "envoy-only"
    (gateway,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    ref = env_of(gateway)["KVGATE_EPP_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "kvgate", "key": "epp-token"}
    assert "epp_token" not in one(objects, "ConfigMap", "kvgate")["data"]["kvgate.yaml"]
    assert "KVGATE_EPP_TOKEN" not in env_of(
        one(chart.template(EPP_VALUES), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    )


def test_the_billing_store_takes_the_password_and_only_the_gateways_reach_it() -> None:
    objects = chart.template(None, "--set", "billing.store.enabled=true")
    password = secret_data(objects)["redis-password"]
    assert password
    (store,) = one(objects, "StatefulSet", "kvgate-billing-store")["spec"]["template"]["spec"][
        "containers"
    ]
    assert store["args"][store["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    ref = env_of(store)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "kvgate", "key": "redis-password"} and "REDISCLI_AUTH" in env_of(store)
    (gateway,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    names = [e["name"] for e in gateway["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("KVGATE_BILLING_REDIS_URL")  # $(VAR)
    url = env_of(gateway)["KVGATE_BILLING_REDIS_URL"]["value"]
    assert url == "redis://:$(REDIS_PASSWORD)@kvgate-billing-store:6379/0"
    policy = one(objects, "NetworkPolicy", "kvgate-billing-store")
    assert policy_rules(policy) == policy_rules(one(objects, "NetworkPolicy", "kvgate-redis"))
    # without the in-chart directory Redis, the store alone still gets a password
    alone = chart.template(
        None,
        "--set",
        "billing.store.enabled=true",
        "--set",
        "redis.enabled=false",
        "--set",
        "replicaCount=1",
        "--set",
        "autoscaling.enabled=false",
        "--set",
        "workers=1",
    )
    assert secret_data(alone)["redis-password"]
    (gateway,) = one(alone, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "KVGATE_REDIS_URL" not in env_of(gateway) and "REDIS_PASSWORD" in env_of(gateway)
