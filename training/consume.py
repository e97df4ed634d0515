"""Export in place: a shard of the run is deleted only once its samples are safe in the export.

With ``jobs.export consume=true``, after the export has written all the files of one of the run's
local shards, ``ShardConsumer`` makes them durable, verifies them against the shard, records the
shard as consumed (in the export and in the run's manifest) and only then deletes it, so that the
export needs one shard of room beyond the run, not a second copy. A kill anywhere leaves what a rerun
finishes, and ``check_space`` refuses, before anything is written, an export whose peak would not
fit. The steps, what a kill leaves and the space it needs: docs/training.md ("Export in place").
"""

from __future__ import annotations

import concurrent.futures
import io
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from common.checks import format_bytes
from runtime.errors import DiskFull
from storage import checksum
from storage.atomic import fsync_path
from storage.exported import check_exported_files, list_bytes, list_path
from storage.manifest import CONSUMED, LOCAL, Manifest, read_manifest
from storage.reader import Sample
from storage.token_freq import TOKEN_FREQ_FILE, maybe_write_token_freq
from training.export_job import ExportShard, PreparedExport, Put
from training.peer_formats import SPECFORGE, SPECULATORS

logger = logging.getLogger(__name__)

FILE_OVERHEAD_BYTES = 4096
"""What a file adds beyond its tensors, at most: its header (torch's zip records, safetensors' JSON) and a
partly filled last block."""
TOKEN_IDS_BYTES = 16
"""input_ids and loss_mask as int64, per token: SpecForge's files; speculators' token_ids plus its rows."""


class ExportVerificationError(RuntimeError):
    """A file read back is not what the run's shard gives; the shard is kept."""


class ShardConsumer:
    """Verifies, records and deletes the run's shards one at a time (``consume=true``); does nothing without it."""

    def __init__(self, job: PreparedExport, present: dict[str, int], report: dict[str, Any]) -> None:
        self.job = job
        self.present = present
        self.report = report
        self.directory = job.config.run_directory()
        self.manifest: Manifest | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(job.config.threads, thread_name_prefix="verify")

    def __enter__(self) -> "ShardConsumer":
        if self.job.config.consume:
            if maybe_write_token_freq(self.directory) is not None:
                logger.info("counted the run's tokens into %s/%s before consuming its shards (speculators' "
                            "token_freq.pt)", self.directory, TOKEN_FREQ_FILE)
            # The caller holds the run's lock: no driver writes the manifest while this does.
            self.manifest = Manifest.open(self.directory, read_manifest(self.directory)["content"], [])
        return self

    def __exit__(self, *exc: Any) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.manifest is not None:
            self.manifest.close()

    def consume(self, shard: ExportShard, puts: Iterable[Put], ends: Sequence[Sample]) -> None:
        """Consume a local shard whose files ``puts`` are; ``ends``: its first and last samples as the export read
        them from it. In order, each before the next:

        1. durable: each file was fsynced when written (``training.destination``); their directories are
           fsynced now, so that no crash can take back a name the deletion relies on;
        2. verified against the shard: every file written now is read back from the storage (a local file's
           cached pages dropped first) and its size and checksum compared with the bytes made from the shard;
           the files of the first and last samples are loaded as the trainer loads them and compared, bit for
           bit, with what the format makes of them and with their own token ids and states;
        3. recorded: the list of the shard's files with their sizes and checksums is written into the export
           (``storage.exported``) and made durable; then the run's manifest marks the shard consumed into
           ``<format>:<dest>``, with the list's own checksum;
        4. deleted: the shard file is unlinked and output.dir fsynced.

        A kill before 3 leaves the shard the run's (a rerun reads its files back and writes any that
        differ); between 3 and 4, the rerun deletes the file (``finish_consumed``).
        """
        dest = self.job.dest
        puts = list(puts)
        dest.sync_directories(put.path for put in puts)
        written = [put for put in puts if put.wrote]  # the others were read back and compared before they were kept
        # Hashing releases the GIL: the files are read back and hashed by as many threads as wrote them.
        digests = self._pool.map(lambda put: dest.digest(put.path, checksum.algorithm_of(put.checksum)), written)
        for put, (size, value) in zip(written, digests):
            if (size, value) != (put.size, put.checksum):
                raise ExportVerificationError(
                    f"{dest.url}/{put.path} reads back as {size} bytes with checksum {value}, but {put.size} bytes "
                    f"with checksum {put.checksum} were written from {shard.url}: the storage changed them. {shard.name} is "
                    "kept; check the disk under dest, then rerun the same command (the file is written again)"
                )
        self._check_first_and_last(shard, ends)
        listed = self._list_files(shard, puts)
        self.manifest.update(shard.index, location=CONSUMED, consumed_into=self.job.key,
                             exported_files_checksum=checksum.of_bytes(listed))
        self._delete(Path(shard.url))
        self.report["consumed"] += 1
        self.report["freed_bytes"] += shard.bytes
        logger.info("shard %d: %d files exported and verified, %s deleted (%.1f MB freed)", shard.index, len(puts),
                    shard.name, shard.bytes / 1e6)

    def _list_files(self, shard: ExportShard, puts: Sequence[Put]) -> bytes:
        """The list of the shard's files with their sizes and checksums (``storage.exported``), written into the export
        and made durable before the manifest records the shard consumed; returns its bytes."""
        mine = set(self.job.paths(shard))  # speculators: its rows file too, kept (ROWS_DIR)
        files = {put.path: (put.size, put.checksum) for put in puts if put.path in mine}
        listed = list_bytes(shard.name, files)
        self.job.dest.write_bytes(list_path(shard.name), listed)
        self.job.dest.sync_directories([list_path(shard.name)])
        return listed

    def finish_consumed(self, shard: ExportShard, rows: bool) -> None:
        """A shard consumed into this export earlier: its files must all be here, as they were when it was consumed;
        with ``consume``, a shard file left behind (killed between recording and deleting) is deleted now."""
        missing = [path for path in self.job.paths(shard, rows) if path not in self.present]
        if missing:
            raise ExportVerificationError(
                f"{shard.name} was consumed into {self.job.key} (the run's manifest says so), but "
                f"{self.job.dest.url} lacks {len(missing)} of its files ({', '.join(missing[:3])}): they were deleted "
                f"since, and the run no longer holds them. Rerun the extraction with shards=[{shard.index}] to write "
                "the shard again, then this export"
            )
        check_consumed(self.job, shard, self._pool.map)
        leftover = self.directory / shard.name if self.directory is not None else None
        if self.manifest is not None and leftover is not None and leftover.exists():
            self._delete(leftover)
            logger.info("shard %d: consumed by an earlier export that stopped before deleting it; %s deleted",
                        shard.index, shard.name)

    def _check_first_and_last(self, shard: ExportShard, ends: Sequence[Sample]) -> None:
        """The shard's first and last samples against their files, loaded back as the trainer loads them."""
        job, dest = self.job, self.job.dest
        for sample in ends:
            path = job.path(shard, sample.sample_id)
            loaded = load_file(job.plan.trainer, dest.read_bytes(path))
            problem = differs(job.file_tensors(sample), loaded) or self._differs_from_sample(loaded, sample)
            if problem:
                raise ExportVerificationError(
                    f"{dest.url}/{path} loads with {problem}, not as sample {sample.sample_id} of {shard.url} gives "
                    f"it. {shard.name} is kept; delete {path} and rerun the same command (if it happens again, the "
                    "export is wrong: report it)"
                )

    def _differs_from_sample(self, loaded: dict[str, Any], sample: Sample) -> str:
        """The file against the sample itself, not through the format's own code: its token ids, and (unless the
        states were quantized again) its layers and final state, bit for bit."""
        trainer, meta = self.job.plan.trainer, self.job.metadata
        ids = loaded["input_ids" if trainer == SPECFORGE else "token_ids"]
        if ids.shape != sample.input_ids.shape or not torch.equal(ids, sample.input_ids.to(torch.int64)):
            return f"the token ids of another sample (the file holds {ids.shape[0]} tokens)"
        if self.job.plan.fp8:
            return ""  # quantized again: checked through the format's function only
        tokens, layers = sample.input_ids.shape[0], len(meta.layer_ids)
        if trainer == SPECFORGE:
            aux, last = loaded["aux_hidden_state"][0], loaded["hidden_state"][0]
        else:
            aux = loaded["hidden_states"][:, :layers].reshape(tokens, -1)
            last = loaded["hidden_states"][:, layers]
        for name, mine, theirs in (("the captured layers", aux, sample.aux_hidden_states),
                                   ("the final state", last, sample.last_hidden_state)):
            if mine.shape != theirs.shape or not same_bits(mine, theirs):
                return f"other values than the sample's in {name}"
        return ""

    def _delete(self, path: Path) -> None:
        path.unlink()
        fsync_path(path.parent)  # the deletion is durable before the next shard's files are written


def check_consumed(job: PreparedExport, shard: ExportShard, map_: Callable[..., Iterable[Any]] = map) -> None:
    """The files of a shard consumed into this export, the only copy of its samples, against the sizes and checksums
    listed when it was consumed (a shard declared consumed through ``storage.consumed`` lists none: not checked);
    ExportVerificationError naming every file that differs (``map_`` hashes them, a pool's map in threads)."""
    if not shard.exported_files_checksum:
        return
    _, problems = check_exported_files(job.dest.fs, job.dest.root, shard.name, shard.exported_files_checksum, map_)
    if problems:
        named = "; ".join(f"{job.dest.url}/{path}: {what}" for path, what in problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ExportVerificationError(
            f"{named}{more}. {shard.name} was consumed into this export, the only copy of its samples now: rerun the "
            f"extraction with shards=[{shard.index}] to write the shard again, then this command (it writes the "
            "shard's files again)"
        )


def load_file(trainer: str, data: bytes) -> dict[str, torch.Tensor]:
    """A file's tensors as the trainer's loader reads them: ``torch.load`` (SpecForge; its loader passes
    weights_only=False, which changes nothing for a dict of tensors) or safetensors (speculators)."""
    if trainer == SPECFORGE:
        return torch.load(io.BytesIO(data), weights_only=True)
    from safetensors.torch import load

    return load(data)


def differs(expected: dict[str, torch.Tensor], loaded: dict[str, Any]) -> str:
    """What differs between two files' tensors (keys, dtype, shape, any bit), or "" when nothing does."""
    if sorted(expected) != sorted(loaded):
        return f"keys {sorted(loaded)} instead of {sorted(expected)}"
    for key, tensor in expected.items():
        other = loaded[key]
        if not isinstance(other, torch.Tensor) or other.dtype != tensor.dtype or other.shape != tensor.shape:
            what = f"{other.dtype} {tuple(other.shape)}" if isinstance(other, torch.Tensor) else type(other).__name__
            return f"{key} as {what} instead of {tensor.dtype} {tuple(tensor.shape)}"
        if not same_bits(other, tensor):
            return f"other values in {key}"
    return ""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal byte for byte (NaN-safe, fp8 included); numpy compares raw bytes faster than torch.equal does."""
    def raw(tensor: torch.Tensor) -> np.ndarray:
        return tensor.contiguous().view(-1).view(torch.uint8).numpy()

    return a.dtype == b.dtype and np.array_equal(raw(a), raw(b))


# -- room on the disk ------------------------------------------------------------------------------

def estimated_bytes(job: PreparedExport, shard: ExportShard) -> int:
    """What the export writes for ``shard``, at most: its states, token ids and a header per file."""
    meta, plan = job.metadata, job.plan
    values = (len(meta.layer_ids) + 1) * meta.hidden_size  # the captured layers and the final state
    if plan.fp8:
        per_token = values + 4 + TOKEN_IDS_BYTES  # fp8 values, one float32 scale
    else:
        per_token = values * getattr(torch, meta.dtype).itemsize + TOKEN_IDS_BYTES
    if plan.trainer == SPECULATORS:
        per_token += 2 * TOKEN_IDS_BYTES  # its rows file, then the dataset (and its scratch copy) made from it
    return shard.tokens * per_token + shard.rows * FILE_OVERHEAD_BYTES


def check_space(job: PreparedExport) -> None:
    """Refuse (DiskFull: exit 3) an export into a local ``dest`` whose peak would not fit in the free space there: the
    files still to write, less (``consume``, the run on the same filesystem) the shards deleted on the way."""
    dest = job.dest
    if not dest.local:
        return
    present = dest.file_sizes()
    where = _existing_ancestor(Path(dest.root))
    directory = job.config.run_directory()
    same_disk = directory is not None and os.stat(directory).st_dev == os.stat(where).st_dev
    peaks = {}
    for consume in (False, True):
        need = peak = 0
        for shard in job.shards:
            if shard.consumed:
                continue
            have = sum(present.get(path, 0) for path in job.paths(shard))
            need += max(0, estimated_bytes(job, shard) - have)
            peak = max(peak, need)
            if consume and same_disk and shard.location == LOCAL:
                need -= shard.bytes
        peaks[consume] = peak
    free = shutil.disk_usage(where).free
    peak = peaks[job.config.consume]
    if peak <= free:
        return
    hint = ""
    if not job.config.consume and same_disk and peaks[True] <= free:
        hint = (f"; with consume=true (each shard deleted once exported and verified) it needs "
                f"{format_bytes(peaks[True])}, which fits")
    raise DiskFull(
        f"the export into {dest.url} needs about {format_bytes(peak)} more at its peak, but that filesystem has "
        f"{format_bytes(free)} free{hint}. Free space there, then rerun the same command: it resumes"
    )


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path
