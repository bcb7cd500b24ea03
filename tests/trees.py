"""An earlier commit's code beside this checkout's: the rolling-upgrade tests run a gateway or a
directory of the commit before against this one over one Redis."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def unpacked(commit: str, *, native: bool = False) -> Iterator[Path]:
    """`commit`'s tree under /tmp for as long as the block runs (the checkout's history must
    hold it); `native` copies this checkout's compiled module in (it is not in git)."""
    with tempfile.TemporaryDirectory(prefix=f"kvgate-{commit[:8]}-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", commit],
            capture_output=True,
            check=False,
        )
        assert archive.returncode == 0, (
            f"this test runs commit {commit} from this checkout's history: "
            f"{archive.stderr.decode().strip()}"
        )
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        tree = Path(tmp)
        if native:
            for module in (REPO / "cachemap").glob("_native*.so"):
                (tree / "cachemap" / module.name).write_bytes(module.read_bytes())
        yield tree
