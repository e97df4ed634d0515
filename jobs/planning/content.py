"""The run's content: everything that changes what the shard files contain, under the keys the manifest
records it by. The job builds the block here, and ``jobs.verify`` reads here what it says every shard
file must record; light to import (``jobs.verify`` imports no Ray).
"""

from __future__ import annotations

from typing import Any, Mapping

from jobs.config import JobConfig
from storage.schema import stored_dtype


def run_content(config: JobConfig, spec_fields: dict[str, Any], data_fingerprint: str) -> dict[str, Any]:
    """Everything that changes what the shard files contain: a resume must match it exactly."""
    return {
        "model.path": spec_fields["model_path"],
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
