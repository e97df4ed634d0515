"""What a benchmark's main does around its measurement: a work directory (kept when the user names one, else a
temporary one removed afterwards), and the results written as JSON where ``--out`` says."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def work_dir(named: str, prefix: str) -> Iterator[Path]:
    """``named`` (created if missing, kept), or a new temporary directory removed when the block ends."""
    work = Path(named or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    finally:
        if not named:
            shutil.rmtree(work, ignore_errors=True)


def write_results(results: dict, out: str) -> None:
    """The results as indented JSON at ``out``; nothing when ``out`` is empty."""
    if out:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
