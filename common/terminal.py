"""The width a progress bar or live line draws in: the terminal's, or 80 columns where it reports none.

A pseudo-terminal nobody sized (``script`` without a size, some CI runners, an SSH session without a pty
size) reports 0 columns; tqdm then draws nothing and a live line could not be cut to fit.
"""

from __future__ import annotations

import os
from typing import Any, TextIO

FALLBACK_COLUMNS = 80
FALLBACK_ROWS = 24
"""tqdm hides a bar below its terminal's last row: one that reports no size has, to tqdm, -1 rows."""


def reported_columns(stream: TextIO) -> int:
    """The columns ``stream``'s terminal reports; 0 where it reports none or is no terminal."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def terminal_columns(stream: TextIO) -> int:
    """The columns to draw in on ``stream``: the terminal's, or ``FALLBACK_COLUMNS`` where it reports none."""
    return reported_columns(stream) or FALLBACK_COLUMNS


def tqdm_width(stream: TextIO) -> dict[str, Any]:
    """tqdm's size arguments for a bar on ``stream``: following the terminal's size, or 80 columns and 24 rows where
    it reports none."""
    return {"dynamic_ncols": True} if reported_columns(stream) else {"ncols": FALLBACK_COLUMNS, "nrows": FALLBACK_ROWS}
