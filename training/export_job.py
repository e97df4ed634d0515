"""An export as its writer and its consumer see it: the config, the plan, the run's shards, the files put.

``training.export`` makes a ``PreparedExport`` and writes it; ``training.consume`` deletes the shards it
consumed. Both import these types from here, so neither imports the other's module for them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch

from common.checks import check_int, check_seconds
from common.config import RunFiles
from storage.manifest import CONSUMED, MANIFEST_FILE
from storage.reader import Sample
from storage.run_index import is_local, local_path
from storage.schema import ShardMetadata
from training import peer_formats
from training.destination import Destination
from training.final_state import FinalNorm, FinalNormSource
from training.peer_formats import SPECFORGE, SPECULATORS

ROWS_DIR = ".export-rows"
"""speculators: each shard's dataset rows (input_ids, loss_mask, seq_len) as an Arrow file, which the dataset is
written from at the end. Removed then, but for the shards consumed into the export: listed with their files, they
stay, the copy the dataset is written again from when one of its files is changed or gone."""


@dataclasses.dataclass
class ExportConfig:
    output: RunFiles = dataclasses.field(default_factory=RunFiles)
    to: str = ""
    """specforge | speculators (any case): the trainer whose layout to write."""
    dest: str = ""
    """Directory (local path or fsspec URL) to write into, created if missing. speculators: the dataset goes at its
    top, the states under hidden_states/."""
    dest_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """fsspec options for dest (e.g. client_kwargs for an S3 endpoint)."""
    consume: bool = False
    """Delete each of the run's local shard files as soon as its samples are exported: after its files are written,
    fsynced and verified against it (sizes and checksums read back, its first and last sample loaded as the trainer loads
    them). The export then needs one shard's worth of space beyond the run, not a second copy. The run's manifest
    records each shard as consumed into dest. Needs the run's output.dir, and no job running on it."""
    fp8: Optional[bool] = None
    """speculators: true writes its fp8 variant (float8_e4m3fn, one float32 scale per token), false the model dtype.
    Unset: fp8 when the run stored fp8, else the model dtype."""
    exact: bool = False
    """Refuse unless the files hold the states exactly as SGLang computed them (a run with fp8 states cannot, nor
    SpecForge's export of a pre-norm run, whose post-norm state the export computes)."""
    model_path: str = ""
    """SpecForge's export of a run with the pre-norm final state: the checkpoint whose final norm is applied to it
    (its safetensors and config.json). Empty: the run's model.path."""
    allow_partial: bool = False
    """Export a run whose manifest still has shards not done (only the done ones)."""
    threads: int = 4
    """Files written at once (hides an object store's latency); at most 2 x threads samples and 512 MiB of their
    states are held at once."""
    progress_interval_s: float = 30.0
    """Without a terminal, a progress line this often; with one, a tqdm bar."""

    def __post_init__(self) -> None:
        self.output.require()
        self.to = self.to.lower() if isinstance(self.to, str) else self.to  # to=SpecForge as the trainer spells it
        if self.to not in peer_formats.FORMATS:
            raise ValueError(f"to={self.to!r}: use {' or '.join(peer_formats.FORMATS)}")
        if not self.dest:
            raise ValueError("name where to write: dest=DIR (a local path or an fsspec URL)")
        if self.fp8 and self.to == SPECFORGE:
            raise ValueError("fp8=true: SpecForge reads model-dtype states only; drop fp8 (or export to=speculators)")
        if self.fp8 and self.exact:
            raise ValueError("fp8=true and exact=true contradict each other: fp8 states are not bit-exact")
        check_int("threads", self.threads, 1)
        check_seconds("progress_interval_s", self.progress_interval_s, positive=True)

    def run_directory(self) -> Optional[Path]:
        """The run's output.dir when it is a local directory with a manifest, else None."""
        if not is_local(self.output.dir, self.output.sink_options):
            return None
        directory = Path(local_path(self.output.dir))
        return directory if (directory / MANIFEST_FILE).is_file() else None


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    trainer: str
    fp8: bool
    """Write fp8 states (speculators' variant)."""
    read_raw: bool
    """Read the shards' raw fp8 values and scales (an fp8 run exported as fp8: re-quantized from float32)."""
    states: str
    """What the files hold: the model dtype's name, or float8_e4m3fn."""
    final_norm: Optional[FinalNormSource] = None
    """The final norm applied to the run's pre-norm final state (SpecForge's export of a pre-norm run)."""
    notes: tuple[str, ...] = ()


@dataclasses.dataclass
class ExportShard:
    """One shard file of the run, as the export sees it."""

    name: str
    """Its file name (shard-00007.parquet): what the export state knows it by."""
    rows: int
    checksum: str
    """As the run's manifest recorded it (empty for a run listed without a manifest)."""
    ids: np.ndarray
    """Its sample ids, sorted: speculators' row i is the i-th sample id over the shards in order."""
    first_row: int = 0
    """speculators: the dataset row of its first sample."""
    url: str = ""
    """Where its file is read from; empty once it is consumed."""
    index: Optional[int] = None
    """Its record in the run's manifest (None without one)."""
    location: str = ""
    """local | sink | consumed, as the manifest says (empty without a manifest)."""
    bytes: int = 0
    tokens: int = 0
    exported_files_checksum: str = ""
    """A shard consumed into this export: the checksum of its files' list (``storage.exported``), as the run's manifest
    recorded it (empty for a shard declared consumed through ``storage.consumed``, whose consumer listed no files)."""

    @property
    def consumed(self) -> bool:
        return self.location == CONSUMED

    def record(self) -> dict[str, Any]:
        """What the export state keeps of it."""
        return {"file": self.name, "rows": self.rows, "checksum": self.checksum, "sample_ids": id_ranges([self.ids])}


@dataclasses.dataclass
class PreparedExport:
    """Everything checked, nothing written but the export state in ``dest``."""

    config: ExportConfig
    metadata: ShardMetadata
    plan: ExportPlan
    shards: list[ExportShard]
    """In order: by first sample id (speculators' rows follow it)."""
    dest: Destination
    key: str
    """How the run's manifest names this export in a consumed shard's ``consumed_into``."""
    state: dict[str, Any]
    final_norm: Optional[FinalNorm] = None
    """``plan.final_norm``, loaded."""

    @property
    def samples(self) -> int:
        return sum(shard.rows for shard in self.shards)

    def path(self, shard: ExportShard, sample_id: int) -> str:
        """The file a sample of ``shard`` goes to."""
        if self.plan.trainer == SPECFORGE:
            return peer_formats.specforge_path(sample_id)
        return peer_formats.speculators_path(shard.first_row + int(np.searchsorted(shard.ids, sample_id)))

    def paths(self, shard: ExportShard, rows: bool = True) -> list[str]:
        """Every file the export writes for ``shard``: its samples', and (speculators, with ``rows``) its rows file
        (``ROWS_DIR``)."""
        paths = [self.path(shard, int(sample_id)) for sample_id in shard.ids]
        return paths + [rows_file(shard)] if rows and self.plan.trainer == SPECULATORS else paths

    def as_trained(self, sample: Sample) -> Sample:
        """The sample with the final state the trainer reads: the final norm applied where the run stored the
        pre-norm state and the trainer reads the post-norm one."""
        if self.final_norm is None:
            return sample
        return dataclasses.replace(sample, last_hidden_state=self.final_norm(sample.last_hidden_state))

    def file_tensors(self, sample: Sample) -> dict[str, torch.Tensor]:
        """The tensors of the sample's file, as the trainer's loader gets them back."""
        if self.plan.trainer == SPECFORGE:
            return peer_formats.specforge_file(sample)
        return peer_formats.speculators_file(sample, self.metadata.hidden_size, self.plan.fp8)


def rows_file(shard: ExportShard) -> str:
    return f"{ROWS_DIR}/{shard.name.removesuffix('.parquet')}.arrow"


def id_ranges(ids_per_file: Sequence[np.ndarray]) -> list[list[int]]:
    """Sample ids in order, as [start, stop) runs: speculators' row i is the i-th of them."""
    ranges: list[list[int]] = []
    for ids in ids_per_file:
        for sample_id in ids.tolist():
            if ranges and ranges[-1][1] == sample_id:
                ranges[-1][1] += 1
            else:
                ranges.append([sample_id, sample_id + 1])
    return ranges


@dataclasses.dataclass(frozen=True)
class Put:
    """One file of the export, as it is now in ``dest``."""

    path: str
    size: int
    checksum: str
    """Of the bytes made from the run's shard (consume only: what the file is verified against)."""
    wrote: bool
    """Written now; False: it was there with exactly these bytes (read back and compared)."""
