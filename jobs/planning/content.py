"""The run's content: everything that changes what the shard files contain, under the keys the manifest
records it by. The job builds the block here, and ``jobs.verify`` reads here what it says every shard
file must record; light to import (``jobs.verify`` imports no Ray).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from extractor.checkpoint import checkpoint_identity
from jobs.config import JobConfig
from storage.schema import stored_dtype

CHECKPOINT = "model.checkpoint"
"""The checkpoint's identity (``extractor.checkpoint.checkpoint_identity``): model.path names where it is, not
what it is."""
RECORDED_SINCE = (CHECKPOINT,)
"""Keys a run recorded before them lacks: it resumes, and records them then."""


def run_content(
    config: JobConfig, spec_fields: dict[str, Any], data_fingerprint: str, checkpoint_id: str,
) -> dict[str, Any]:
    """Everything that changes what the shard files contain: a resume must match it exactly."""
    return {
        "model.path": spec_fields["model_path"],
        CHECKPOINT: checkpoint_id,
        "model.dtype": spec_fields["dtype"],
        "model.tp_size": spec_fields["tp_size"],
        "model.device": spec_fields["device"],
        "model.attention_backend": spec_fields["attention_backend"],
        "model.load_format": spec_fields["load_format"],
        "extract.layers": list(spec_fields["layer_ids"]),
        "extract.last_hidden_state": spec_fields["last_hidden_state"],
        "output.state_dtype": spec_fields["state_dtype"],
        "model.engine": spec_fields["engine"],
        "data.fingerprint": data_fingerprint,
        "data.shard_size": config.data.shard_size,
        # Only with serving settings that reach the forward: runs without them keep the content they had.
        **({"model.serving": spec_fields["server_args"]} if spec_fields["server_args"] else {}),
    }


def checkpoint_notes(content: Mapping[str, Any]) -> list[str]:
    """What ``jobs.verify`` says of the checkpoint a run recorded: a line when the one at its model.path is another
    now (a rerun there is refused; the files stay whole and of the recorded one); nothing when it is the same, or
    cannot be looked at from here."""
    path = recorded_model_path(content)
    if CHECKPOINT not in content or not (Path(path) / "config.json").is_file():
        return []
    now = checkpoint_identity(path)
    if now == content[CHECKPOINT]:
        return []
    return [f"the checkpoint at model.path={path} is not the one this run was extracted with (recorded "
            f"{content[CHECKPOINT]}, now {now}): the shards are of the recorded one, and a rerun into this output.dir "
            "is refused until model.path points at it again"]


def resumed_device(requested: str, recorded: Mapping[str, Any]) -> str:
    """The device a rerun runs on: ``model.device=auto`` resumes on the device the run recorded."""
    return str(recorded.get("model.device", "cpu")) if requested == "auto" else requested


def recorded_model_path(recorded: Mapping[str, Any]) -> str:
    """The checkpoint a run recorded (empty when its content names none)."""
    return str(recorded.get("model.path", ""))


RECORDED_IN_EVERY_FILE = {
    "model.path": "model_path",
    "model.dtype": "dtype",
    "model.tp_size": "tp_size",
    "extract.layers": "layer_ids",
    "extract.last_hidden_state": "last_hidden_state",
}
"""Keys of the run's content -> the ShardMetadata field every shard file records for them as they are."""


def expected_metadata(content: Mapping[str, Any]) -> dict[str, Any]:
    """The ShardMetadata fields every shard file of a run with this content must carry, as far as the content
    tells them (``storage.verify.verify_run``'s ``expected_metadata``); a key the content lacks is not checked."""
    expected = {field: content[key] for key, field in RECORDED_IN_EVERY_FILE.items() if key in content}
    if "output.state_dtype" in content and "model.dtype" in content:
        expected["state_dtype"] = stored_dtype(content["output.state_dtype"], content["model.dtype"])
    return expected
