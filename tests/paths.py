"""Where the checkout is: the one fact both ``tests.conftest`` and ``tests.helpers`` start from (each imports it,
neither imports the other for it)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
