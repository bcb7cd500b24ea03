"""The gRPC contract: proto/ holds only .proto files, and the committed stubs in
gateway/api/grpc/_pb/ are exactly what `make proto` generates from them (the drift check)."""

from __future__ import annotations

from pathlib import Path

from tools.protogen import PROTO_ROOT, REPO, drift, generate


def test_proto_holds_only_proto_files() -> None:
    files = [p for p in PROTO_ROOT.rglob("*") if p.is_file()]
    assert files and all(p.suffix == ".proto" for p in files), files


def test_the_committed_stubs_have_not_drifted_from_the_proto() -> None:
    generated = generate()
    assert {p.name for p in generated} == {
        "gateway_pb2.py",
        "gateway_pb2.pyi",
        "gateway_pb2_grpc.py",
    }
    assert {str(p.parent) for p in generated} == {"gateway/api/grpc/_pb", "loadgen/_pb"}
    assert drift(generated) == [], (
        "run `make proto` and commit gateway/api/grpc/_pb/ and loadgen/_pb/"
    )
    # each service module imports the messages from its own package, not a top-level kvgate
    for package in ("gateway.api.grpc._pb", "loadgen._pb"):
        service = (REPO / package.replace(".", "/") / "gateway_pb2_grpc.py").read_text()
        assert f"from {package} import gateway_pb2" in service
        assert "from kvgate" not in service


def test_a_changed_stub_is_reported_as_drift() -> None:
    generated = generate()
    generated[Path("loadgen/_pb/gateway_pb2.pyi")] += "\n# edited by hand\n"
    assert drift(generated) == [Path("loadgen/_pb/gateway_pb2.pyi")]
