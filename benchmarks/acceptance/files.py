"""Files the benchmark writes beside the project's: each appears whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def save_torch(record: dict[str, Any], path: Path) -> None:
    """``torch.save`` under a temporary name, then renamed into place."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    torch.save(record, temp)
    os.replace(temp, path)


def write_json(value: Any, path: Path) -> None:
    """JSON under a temporary name, then renamed into place."""
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(temp, path)
