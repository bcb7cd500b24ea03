"""The console the commands print their reports on."""

from __future__ import annotations

import os
from typing import IO

from rich.console import Console

LOG_WIDTH = 160
"""Outside a terminal (a pipe, a file, a CI log) rich would squeeze tables to 80 columns and cut
their headers (`cache_aw…`); a log keeps whole rows at this width instead."""


def report_console(file: IO[str] | None = None) -> Console:
    """A terminal's own width; elsewhere `COLUMNS` if set, or `LOG_WIDTH`."""
    console = Console(file=file)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = LOG_WIDTH
    return console
