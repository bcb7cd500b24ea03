"""Generate the gRPC stubs from `proto/` into `gateway/api/grpc/_pb/` and `loadgen/_pb/` (the
two meet only over the wire, so each has its own copy), or check that they have not drifted.

The stubs are committed (so an install needs no protoc) and checked: `make proto` regenerates
them and fails when that changed a file (commit the result); `python -m tools.protogen
--check` (and `tests/tools/test_proto.py`) only compares. Generation uses grpcio-tools' bundled
protoc (a dev dependency, pinned in pyproject so the output is reproducible).

protoc writes `kvgate/v1/gateway_pb2_grpc.py` with `from kvgate.v1 import gateway_pb2`; the
stubs live flat in `<package>._pb`, so that one import is rewritten. The descriptor keeps its
proto path (`kvgate/v1/gateway.proto`), so both packages' copies load side by side in one
process (the pool accepts an identical file twice).
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PACKAGES = ("gateway.api.grpc._pb", "loadgen._pb")
PROTOS = ("kvgate/v1/gateway.proto",)


def generate() -> dict[Path, str]:
    """Path (relative to the repository) → content of every generated stub."""
    from grpc_tools import protoc  # a dev dependency: only generation needs it

    include = importlib.resources.files("grpc_tools") / "_proto"
    out: dict[Path, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for proto in PROTOS:
            stem = Path(proto).with_suffix("")
            module = ".".join(stem.parent.parts)
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                path = Path(tmp) / f"{stem}{suffix}"
                text = path.read_text()
                for package in PACKAGES:
                    target = Path(*package.split(".")) / path.name
                    out[target] = text.replace(f"from {module} import ", f"from {package} import ")
    return out


def drift(generated: dict[Path, str]) -> list[Path]:
    """The stub files whose committed content differs from `generated`."""
    return [
        path
        for path, text in sorted(generated.items())
        if not (REPO / path).is_file() or (REPO / path).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.protogen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare only; write nothing")
    args = parser.parse_args(argv)
    generated = generate()
    changed = drift(generated)
    names = ", ".join(str(path) for path in changed)
    if not changed:
        print(f"{len(generated)} stubs up to date with proto/")
        return 0
    if args.check:
        print(f"stubs drifted from proto/: {names}; run `make proto`")
        return 1
    for path in changed:
        (REPO / path).write_text(generated[path])
    print(f"regenerated {names}; commit them")
    return 1


if __name__ == "__main__":
    sys.exit(main())
