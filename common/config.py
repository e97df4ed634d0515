"""The ``output`` section's directory, which every command that writes or reads a run has: ``output.dir``,
declared and checked here once. Each command's ``output`` section extends one of these with its own keys
(``jobs.outdir.config.OutputConfig``, the job's; ``jobs.status``, ``jobs.verify``, ``jobs.export``,
``jobs.check_drafter``, ``jobs.check_serving``, which read a run); ``output.sink_options`` too, for the job and the
commands that open a run's uploaded files. Here, below ``training/`` and ``jobs/``, so that both extend them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict


@dataclasses.dataclass
class OutputDir:
    """``output.dir``: the run's directory; empty is allowed (the job's demo picks one)."""

    dir: str = ""
    """The run's directory: its shard files and the job's own files (.manifest.json, .summary.json, ...).
    jobs.extract and jobs.plan: where it goes (local NVMe; jobs.extract with it empty: the demo's
    <demo.dir>/hidden_states-<arch>-<num_samples>-seed<seed>). The commands that read a run: where it is now
    (required; a copied or moved run is read there; jobs.export also takes a URL holding its shard-*.parquet files)."""


@dataclasses.dataclass
class RunDir(OutputDir):
    """``output.dir`` of a command that reads a run: required. The command's config calls ``require`` when built
    (the section's default is built before the user's keys reach it, so it cannot refuse an empty one itself)."""

    def require(self) -> None:
        if not self.dir:
            raise ValueError("output.dir is empty: name the run's directory, output.dir=DIR")


@dataclasses.dataclass
class SinkOptions:
    """``output.sink_options``, declared once for the job (its uploads) and the commands that read a run (the files
    it uploaded)."""

    sink_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments for the sink's fsspec filesystem (e.g. client_kwargs for an S3 endpoint). The job: for its
    uploads; the commands that read a run: as the run had them, for its shards in its sink (the manifest records
    each uploaded file's URL) or at output.dir given as a URL."""


@dataclasses.dataclass
class RunFiles(SinkOptions, RunDir):
    """A run's files wherever they are: its directory, and the options to open those uploaded to its sink."""
