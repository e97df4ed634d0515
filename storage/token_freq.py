"""How often each token is trained on: speculators' ``token_freq.pt``, counted from a run's token columns.

speculators builds its reduced draft vocabulary (``d2t`` / ``t2d``) from a dict {token id: count over
the loss-masked tokens} saved with ``torch.save`` (``speculators/train/vocab_mapping.py``
``save_token_frequency_distribution``; its trainer reads ``--token-freq-path``). Counting needs only
the ``input_ids`` and ``loss_mask`` columns (a few bytes a token, next to tens of KB of states), so a
whole run is counted in seconds. ``write_token_freq`` writes it into the run's ``output.dir`` as
``.token_freq.pt`` once the run is complete: after ``jobs.export consume=true`` the shards are gone, and
with them what the count is made from. Hidden (the leading dot) so that the directory still reads as a
Parquet dataset. torch is imported only to save the file: the writer processes never load this module. A link
planted at its name is never read or written through (``_own_file``).
"""

from __future__ import annotations

import errno
import io
import logging
import os
import stat
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import storage.schema as schema
from storage.atomic import replace_atomically
from storage.manifest import CONSUMED, DONE, LOCAL, read_manifest
from storage.run_index import list_run_files, open_parquet

TOKEN_FREQ_FILE = ".token_freq.pt"
NOT_OURS = ("%s is a link (or not a regular file), not a count this job wrote: never read through; the counts "
            "are made from the shards, and the next count written replaces it")

logger = logging.getLogger(__name__)


class TokenCounter:
    """Loss-masked token counts, added a table at a time (any table with list columns of ids and mask)."""

    def __init__(self) -> None:
        self._counts = np.zeros(0, dtype=np.int64)

    def add(self, input_ids: pa.ChunkedArray | pa.Array, loss_mask: pa.ChunkedArray | pa.Array) -> None:
        ids = pc.list_flatten(input_ids).to_numpy()
        mask = pc.list_flatten(loss_mask).to_numpy()
        if len(ids) != len(mask):
            raise ValueError(f"{len(ids)} token ids but {len(mask)} loss-mask entries: the columns are not one table's")
        found = np.bincount(ids[mask == 1], minlength=len(self._counts))
        if len(found) > len(self._counts):
            self._counts = np.concatenate([self._counts, np.zeros(len(found) - len(self._counts), dtype=np.int64)])
        self._counts[: len(found)] += found

    def counts(self) -> dict[int, int]:
        """{token id: count}, only tokens seen under the loss mask (speculators' dict)."""
        return {int(token): int(self._counts[token]) for token in np.flatnonzero(self._counts)}


def count_tokens(run: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> dict[int, int]:
    """The loss-masked token counts over the shard files of ``run`` (an output.dir or a URL of shard files)."""
    counter = TokenCounter()
    files, _ = list_run_files(os.fspath(run), storage_options)
    for url, _checksum in files:
        parquet = open_parquet(url, storage_options)
        try:
            table = parquet.read(columns=[schema.INPUT_IDS, schema.LOSS_MASK])
        finally:
            parquet.close()
        counter.add(table.column(schema.INPUT_IDS), table.column(schema.LOSS_MASK))
    return counter.counts()


def token_freq_bytes(counts: Mapping[int, int]) -> bytes:
    """``counts`` as speculators' ``token_freq.pt`` holds them (``torch.save`` of a plain dict)."""
    import torch

    buffer = io.BytesIO()
    torch.save(dict(counts), buffer)
    return buffer.getvalue()


def write_token_freq(output_dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> Path:
    """Count the run's tokens and write ``output_dir/.token_freq.pt`` (temp file, fsync, rename); returns its path.

    Call it once the run is complete (every shard done), before anything consumes its shards.
    ``storage_options``: the sink's (output.sink_options), for the shards already uploaded there."""
    path = Path(output_dir) / TOKEN_FREQ_FILE
    replace_atomically(path, token_freq_bytes(count_tokens(output_dir, storage_options)))
    return path


def maybe_write_token_freq(output_dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> Path | None:
    """``write_token_freq`` when the run has no count yet, is complete, nothing of it is consumed yet and every
    local shard file is in ``output_dir`` (not on another node's disk); else None. Safe to call at the end of any
    run; ``jobs.export consume=true`` calls it before it deletes anything, the last moment the count can be made."""
    directory = Path(output_dir)
    if _own_file(directory / TOKEN_FREQ_FILE):
        return None
    for record in read_manifest(directory)["shards"]:
        if record["state"] != DONE or record["location"] == CONSUMED:
            return None
        if record["location"] == LOCAL and not (directory / record["file"]).is_file():
            return None
    return write_token_freq(directory, storage_options)


def read_token_freq(output_dir: str | os.PathLike) -> dict[int, int] | None:
    """The counts ``write_token_freq`` left in ``output_dir``, or None when there are none (or a link is there:
    ``_own_file``)."""
    path = Path(output_dir) / TOKEN_FREQ_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        logger.warning(NOT_OURS, path)
        return None
    with os.fdopen(fd, "rb") as file:
        if not _is_own(os.fstat(file.fileno())):
            logger.warning(NOT_OURS, path)
            return None
        import torch

        return torch.load(file, weights_only=True)


def _own_file(path: Path) -> bool:
    """Whether ``path`` is a count this module wrote: a regular file with no other name. A link planted there
    (symbolic or hard) is not: it is neither read nor written through, and the next count replaces it."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return False
    if _is_own(found):
        return True
    logger.warning(NOT_OURS, path)
    return False


def _is_own(found: os.stat_result) -> bool:
    return stat.S_ISREG(found.st_mode) and found.st_nlink == 1
