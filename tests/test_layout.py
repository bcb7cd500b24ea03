"""The layout and the direction of imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import cachemap
import gateway
import loadgen
import router

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
