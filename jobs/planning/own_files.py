"""The bound of the job's own files in output.dir for one run, from its inputs and plan (``jobs.rundir.bookkeeping``
says what it counts); the job and its dry run both take it from here."""

from __future__ import annotations

from jobs.planning.inputs import RunInputs
from jobs.rundir.bookkeeping import OwnFiles, own_files_of
from jobs.rundir.summary import invalid_rows_bytes
from storage import ShardMetadata
from storage.nonfinite import flag_columns


def own_files(
    inputs: RunInputs, plan: list[tuple[int, int, int]], metadata: ShardMetadata, summary_room: int,
) -> OwnFiles:
    """The most the job's own files take in output.dir for this run of ``plan`` (``jobs.rundir.bookkeeping``);
    ``summary_room``: ``RunSummary.room``."""
    config = inputs.config
    # model.device=auto settles on Ray's devices: the manifest's content is bounded on either.
    devices = ("cpu", "cuda") if config.model.device == "auto" else (config.model.device,)
    return own_files_of(
        inputs.output_dir, [inputs.content(device) for device in devices], plan, config.output.sink,
        "NaN/Inf in " + ", ".join(flag_columns(metadata)), summary_room, invalid_rows_bytes(inputs.dataset.invalid),
        config.model.path, inputs.layer_ids,
    )
