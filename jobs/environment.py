"""Whether this Python holds what the commands import, asked before any of it is imported.

``python -m jobs.X`` on a Python without the project's packages (a Ray head started from another
Python runs ``ray job submit``'s ``python`` with its own) would die on the first import with a
traceback. Instead the command says in one line what is missing and what to do (exit 2):
under ``ray job submit``, pass the runtime env that runs the job in the project's virtualenv
(``conf/runtime-env.yaml``), or, with it, the virtualenv it names that the node lacks; elsewhere, run the
command with that virtualenv's python.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from runtime.cluster.submission import inside_ray_job
from runtime.errors import EXIT_BAD_INPUT

REQUIRED_MODULES = {
    "torch": "torch", "transformers": "transformers", "ray": "ray", "pyarrow": "pyarrow", "fsspec": "fsspec",
    "omegaconf": "omegaconf", "PyYAML": "yaml", "numpy": "numpy", "psutil": "psutil", "tqdm": "tqdm",
    "huggingface-hub": "huggingface_hub", "xxhash": "xxhash",
}
"""pyproject.toml's dependencies (distribution -> the module the code imports)."""
RUNTIME_ENV = "conf/runtime-env.yaml"
VENV_ENV = "EAGLE3_JOB_VENV"
"""The virtualenv the runtime env puts first on the entrypoint's PATH (``conf/runtime-env.yaml``)."""


def missing_requirements() -> list[str]:
    """The distributions whose modules this Python cannot find (nothing is imported)."""
    return [name for name, module in REQUIRED_MODULES.items() if importlib.util.find_spec(module) is None]


def refuse_incomplete_environment() -> None:
    """When this process is a command (``python -m jobs.X``, ``eagle3-*``) on a Python that lacks the project's
    packages: one ``error:`` line and exit 2. An import from elsewhere gets Python's own ImportError."""
    starting = sys.argv[:1] == ["-m"] or Path(sys.argv[0] if sys.argv else "").name.startswith("eagle3-")
    missing = missing_requirements() if starting else []
    if not missing:
        return
    where = f"this Python ({sys.executable}) lacks {', '.join(missing)}, which eagle3-extract needs"
    venv = os.environ.get(VENV_ENV, "")
    in_job = inside_ray_job()
    if in_job and venv and not (Path(venv) / "bin" / "python").exists():
        todo = (f"{RUNTIME_ENV} runs the job in {venv}, but {Path(venv) / 'bin' / 'python'} does not exist on this "
                "node; install the project there (cluster.yaml does) or write the path of the virtualenv that "
                f"holds it on every node into {RUNTIME_ENV} (docs/cluster.md)")
    elif in_job and venv:
        todo = f"install the project into {venv} (pip install -e \".[gpu]\", docs/install.md)"
    elif in_job:
        todo = (f"the Ray cluster started the job with its own Python; submit with --runtime-env {RUNTIME_ENV} to run "
                "it in the project's virtualenv on every node (docs/cluster.md), or install the project there")
    else:
        todo = "run the command with the project's virtualenv (bash scripts/setup.sh makes it and prints its python)"
    print(f"error: {where}: {todo}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)
