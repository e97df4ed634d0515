"""The PYTHONPATH of a command the project starts: the checkout in front, the caller's entries behind it.

The offline install for GPU nodes puts every package in a directory on PYTHONPATH
(``scripts/wheelhouse.sh install --target SITE``); a child given the checkout alone would lose them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional


def checkout_first(checkout: Path, environ: Optional[Mapping[str, str]] = None) -> str:
    """``checkout`` followed by the PYTHONPATH of ``environ`` (the process's own by default)."""
    environ = os.environ if environ is None else environ
    return os.pathsep.join(filter(None, [str(checkout), environ.get("PYTHONPATH")]))
