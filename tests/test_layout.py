"""The layout and the direction of imports."""

from __future__ import annotations

import ast
import fnmatch
import hashlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import cachemap
import gateway
import loadgen
import router
from loadgen.traces import CONVERSATION_TRACE, MOONCAKE_DIR, SYNTHETIC_TRACE

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN_IN_PURE = {
    "redis",
    "httpx",
    "aiohttp",
    "grpc",
    "fastapi",
    "starlette",
    "asyncio",
    "gateway",
    "loadgen",
}


def test_packages_are_the_repositorys_own() -> None:
    for package in (router, cachemap, gateway, loadgen):
        assert Path(package.__file__ or "").resolve().is_relative_to(REPO), package


def _imports(package: Path) -> set[str]:
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_the_router_does_no_io_and_imports_neither_cachemap_nor_the_gateway() -> None:
    imported = _imports(REPO / "router")
    assert not imported & (FORBIDDEN_IN_PURE | {"cachemap"})


def test_cachemap_never_imports_the_gateway_loadgen_or_the_router() -> None:
    assert not _imports(REPO / "cachemap") & {"gateway", "loadgen", "router"}


def test_import_linter_contracts_hold() -> None:
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_cli_loads_only_the_chosen_commands_module() -> None:
    probe = (
        "import sys, kvgate_cli\n"
        "try:\n    kvgate_cli.main(['engine', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'gateway', 'loadgen'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "['loadgen']"


# -- a repo that stands on its own ----------------------------------------------------------
OUTSIDE = [
    b"../" + b"shared",
    b"/work/" + b"shared",
    b"shared/" + b"traces",
    b"shared/" + b"billing",
]
"""Paths outside the repo (built in pieces, so this file does not name them itself)."""
RULES_FILE = b"RULES" + b".md"


def _tracked() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return [REPO / name for name in listed.stdout.decode().split("\0") if name]


def test_no_tracked_file_names_a_path_outside_the_repo() -> None:
    found = []
    for path in _tracked():
        if not path.is_file():  # deleted in the worktree, not yet committed
            continue
        data = path.read_bytes()
        found += [
            f"{path.relative_to(REPO)}: {needle.decode()}"
            for needle in [*OUTSIDE, RULES_FILE]
            if needle in data
        ]
    assert not found, "the repo must stand on its own:\n" + "\n".join(found)


def _billing_anchors() -> set[str]:
    text = (REPO / "docs" / "billing.md").read_text()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#+ (.+)$", text, re.MULTILINE):  # GitHub's slugs
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_every_citation_of_docs_billing_md_names_a_section_it_has() -> None:
    anchors = _billing_anchors()
    cited = re.compile(rb"billing\.md#([\w-]+)")
    missing = []
    for path in _tracked():
        if path.suffix not in {".py", ".md", ".jsonl", ".yaml", ".toml"} or not path.is_file():
            continue
        for anchor in cited.findall(path.read_bytes()):
            if anchor.decode() not in anchors:
                missing.append(f"{path.relative_to(REPO)}: #{anchor.decode()}")
    assert not missing, "\n".join(missing)


def test_the_shipped_traces_are_the_ones_their_readme_records() -> None:
    readme = (MOONCAKE_DIR / "README.md").read_text()
    recorded = {
        name: (int(size.replace(",", "")), sha256, blob)
        for name, size, sha256, blob in re.findall(
            r"^\| `([^`]+)` \|.*\| ([\d,]+) \| `([0-9a-f]{64})` \| `([0-9a-f]{40})` \|$",
            readme,
            re.MULTILINE,
        )
    }
    shipped = {path.name for path in MOONCAKE_DIR.iterdir()} - {"README.md"}
    assert (
        set(recorded)
        == shipped
        == {
            "conversation_trace.jsonl",
            "synthetic_trace.jsonl",
            "LICENSE-APACHE",
        }
    )
    for name, (size, sha256, blob) in recorded.items():
        data = (MOONCAKE_DIR / name).read_bytes()
        assert len(data) == size, name
        assert hashlib.sha256(data).hexdigest() == sha256, name
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, name
    assert CONVERSATION_TRACE.parent == SYNTHETIC_TRACE.parent == MOONCAKE_DIR


def test_the_traces_ship_as_package_data() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["loadgen.traces"]
    package = Path(loadgen.__file__).resolve().parent / "traces"
    assert MOONCAKE_DIR.is_relative_to(package)
    for path in MOONCAKE_DIR.iterdir():
        relative = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), relative


def test_the_image_installs_every_runtime_extra_the_gateway_serves() -> None:
    """Item 17: parquet exports answered 500 in the image, whose `pip install .` left out
    pyarrow (then a dev extra only). The image installs the `parquet` extra, which holds it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("pyarrow") for d in project["optional-dependencies"]["parquet"])
    install = next(
        line for line in (REPO / "Dockerfile").read_text().splitlines() if "pip install" in line
    )
    assert re.search(r"\.\[[^\]]*\bparquet\b[^\]]*\]", install), install
