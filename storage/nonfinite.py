"""Samples whose states hold NaN or Inf: what a shard writer does with them, and how stored bytes show them.

The extractor flags every sample per stored column (each captured layer, then the
final state) on the device, before the host copy (``CapturedBatch.finite``), so the
writer never rescans the states. ``extract.on_nonfinite`` says what happens to a
flagged sample: ``fail`` (the default) fails its shard, naming the sample and the
layer (NaN states usually mean a broken checkpoint or kernel, and a drafter trained
on them learns nothing); ``skip`` leaves it out of the file; ``keep`` writes it. Skipped
and kept samples are listed in the shard's manifest record (``ShardRecord.nonfinite``),
so ``storage.verify`` counts a skipped sample as accounted for and a kept one as
expected to hold NaN/Inf. ``has_nonfinite`` finds them in stored bytes (``verify --deep``).
"""

from __future__ import annotations

from typing import Any, Sequence, get_args

import numpy as np

from storage.schema import FP8, NonfiniteAction, ShardMetadata

ACTIONS: tuple[str, ...] = get_args(NonfiniteAction)
FAIL, SKIP, KEEP = ACTIONS
SKIPPED, KEPT = "skipped", "kept"
"""``action`` of a manifest record: the sample was left out of the file, or written with its NaN/Inf."""

# Element bits that are all ones in a NaN or an Inf, per stored dtype (float8_e4m3fn has no Inf:
# its only non-finite values are the NaNs S.1111.111).
_NONFINITE_BITS: dict[str, tuple[type, int]] = {
    "bfloat16": (np.uint16, 0x7F80),
    "float16": (np.uint16, 0x7C00),
    "float32": (np.uint32, 0x7F800000),
    FP8: (np.uint8, 0x7F),
}


class NonFiniteStates(ValueError):
    """A sample's states hold NaN or Inf and ``extract.on_nonfinite=fail``."""


def flag_columns(metadata: ShardMetadata) -> list[str]:
    """What each column of a ``finite`` flag array stands for: the captured layers, then the final state."""
    names = [f"layer {k}" for k in metadata.layer_ids]
    return names + (["last_hidden_state"] if metadata.has_last_hidden_state else [])


def screen(
    sample_ids: Sequence[int], finite: np.ndarray, metadata: ShardMetadata, action: str, where: str
) -> tuple[np.ndarray | None, list[dict[str, Any]]]:
    """Apply ``action`` to one batch: the rows to write (None: all of them) and a record per flagged sample.

    ``finite`` is [samples, columns] bool (``flag_columns``); raises NonFiniteStates under ``fail``.
    """
    columns = flag_columns(metadata)
    if finite.shape != (len(sample_ids), len(columns)):
        raise ValueError(
            f"{where}: finite flags of shape {finite.shape} for {len(sample_ids)} samples; expected one "
            f"column per stored state ({', '.join(columns)})"
        )
    bad = np.flatnonzero(~finite.all(axis=1))
    if not len(bad):
        return None, []
    reasons = {int(row): "NaN/Inf in " + ", ".join(c for c, ok in zip(columns, finite[row]) if not ok) for row in bad}
    if action == FAIL:
        first = int(bad[0])
        others = f" (and {len(bad) - 1} more samples of this batch)" if len(bad) > 1 else ""
        raise NonFiniteStates(
            f"{where}: sample {sample_ids[first]} has {reasons[first]}{others}: the model produced non-finite "
            "states (a broken checkpoint or kernel?). Fix the model, or rerun with shards=failed and "
            "extract.on_nonfinite=skip (leave such samples out) or keep (write them, flagged in the manifest)"
        )
    recorded = SKIPPED if action == SKIP else KEPT
    records = [{"sample_id": int(sample_ids[row]), "action": recorded, "reason": reason} for row, reason in reasons.items()]
    if action == KEEP:
        return None, records
    keep = np.ones(len(sample_ids), dtype=bool)
    keep[bad] = False
    return keep, records


def has_nonfinite(data: Any, state_dtype: str, start: int, stop: int) -> bool:
    """Whether bytes [start, stop) of a buffer, elements of ``state_dtype`` (float32 for scales), hold a
    NaN or Inf: the element's exponent bits are all ones."""
    if stop <= start:
        return False
    dtype, mask = _NONFINITE_BITS[state_dtype]
    count = (stop - start) // np.dtype(dtype).itemsize
    bits = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    return bool(np.any((bits & dtype(mask)) == dtype(mask)))
