"""`tools.compiled`: what it would compile is the pure part of the tree (not a build: mypyc
takes minutes, so `python -m tools.compiled build` is run by hand, docs/design/compiled.md)."""

from __future__ import annotations

import ast
from pathlib import Path

from tools import compiled

ROOT = Path(__file__).resolve().parents[2]
IO = {"asyncio", "redis", "aiohttp", "httpx", "grpc", "starlette", "fastapi", "uvicorn"}


def _sources(entry: str) -> list[Path]:
    path = ROOT / entry
    return sorted(path.glob("*.py")) if entry.endswith("/") else [path]


def test_every_compiled_module_exists_and_imports_no_io_framework() -> None:
    """A module renamed or moved would make mypyc fail on a name; one that grew an import of an
    I/O framework has left the pure part the measurement is about."""
    for entry in compiled.MODULES:
        sources = _sources(entry)
        assert sources and all(p.is_file() for p in sources), entry
        for source in sources:
            tree = ast.parse(source.read_text())
            imported = {
                (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.walk(tree)
                if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in node.names
            }
            assert not {name.split(".")[0] for name in imported} & IO, source


def test_without_a_command_it_prints_its_usage_and_fails() -> None:
    assert compiled.main([]) == 2
