"""`python -m tools.index_cost`, small: it runs, and reports the directory's cost lines."""

from __future__ import annotations

import gc
import re

import pytest

from tools import index_cost


def test_a_small_run_reports_every_cost_and_a_directory_the_gc_hardly_sees(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gc.collect()
    before = len(gc.get_objects())
    index_cost.main(["100", "5000"])
    out = capsys.readouterr().out
    for name in ("lookup_detail", "record", "loop total", "cyclic GC", "full collection"):
        assert re.search(rf"^  {name} +[\d.]+ ", out, re.MULTILINE), (name, out)
    # 4 engines x 5,000 blocks (and the run's 200 prompt lists): far below one object per block
    found = re.search(r"over ([\d,]+) tracked objects", out)
    assert found is not None
    assert int(found[1].replace(",", "")) - before < 1_000
