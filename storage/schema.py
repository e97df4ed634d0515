"""Parquet format v1: one row per sample, hidden states as raw little-endian bytes.

Columns
  sample_id          int64           row index of the sample in the input dataset
  input_ids          list<int32>     the sample's tokens
  loss_mask          list<uint8>     1 where the token is trained on (all ones if the input had none)
  aux_hidden_states  large_binary    row-major [T, L*H] in the model dtype, layers in ``layer_ids`` order
  last_hidden_state  large_binary    row-major [T, H], post final norm (only when extracted)

Hidden states are stored as bytes, not as Arrow floats: Arrow has no bfloat16,
and ``FixedSizeList<halffloat>`` writes ~8x slower. Shape and dtype live in the
file's key-value metadata (``ShardMetadata``), so a reader rebuilds tensors
without parsing anything per row.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pyarrow as pa

FORMAT_VERSION = 1

SAMPLE_ID = "sample_id"
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
AUX_HIDDEN_STATES = "aux_hidden_states"
LAST_HIDDEN_STATE = "last_hidden_state"

STATE_COLUMNS = (AUX_HIDDEN_STATES, LAST_HIDDEN_STATE)

# Parquet key-value metadata key under which ShardMetadata is stored as JSON.
METADATA_KEY = b"eagle3_hidden_states"

# Storable element types and their bytes (the names are torch's: the reader maps them back).
ITEMSIZES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class ShardMetadata:
    """What a reader needs to interpret the state columns, and where they came from."""

    dtype: str
    """Element type of the state columns: one of ``ITEMSIZES``."""
    hidden_size: int
    layer_ids: list[int]
    """Canonical ids: id k is the output of decoder layer k (0-based) = HF ``hidden_states[k+1]``."""
    layers_to_capture: list[int]
    """What SGLang's ``model.layers_to_capture`` reported while extracting (its own indices)."""
    drafter_layer_ids: list[int]
    """Ids for ``eagle_config.eagle_aux_hidden_state_layer_ids`` that make this SGLang capture ``layer_ids``."""
    has_last_hidden_state: bool
    model_path: str
    model_architecture: str
    sglang_version: str
    tp_size: int
    format_version: int = FORMAT_VERSION
    byte_order: str = "little"
    language_model_architecture: str = ""
    """The language model inside ``model_architecture`` (DeepseekV3ForCausalLM inside
    KimiK25ForConditionalGeneration; the same class for a bare LM); empty in files that predate it."""

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZES:
            raise ValueError(f"dtype {self.dtype!r} is not storable; use one of {sorted(ITEMSIZES)}")

    @property
    def itemsize(self) -> int:
        return ITEMSIZES[self.dtype]

    @property
    def aux_width(self) -> int:
        """Elements per token in ``aux_hidden_states``: L*H."""
        return len(self.layer_ids) * self.hidden_size

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> "ShardMetadata":
        fields = json.loads(text)
        version = fields.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{source}: format_version {version} is not readable by this version "
                f"(reads {FORMAT_VERSION}); re-extract or use the matching release"
            )
        return cls(**fields)


def build_schema(metadata: ShardMetadata) -> pa.Schema:
    """The Arrow schema every shard file is written with; the metadata rides in it."""
    if sys.byteorder != "little":
        raise RuntimeError("format v1 stores little-endian bytes; this host is big-endian")
    fields = [
        pa.field(SAMPLE_ID, pa.int64(), nullable=False),
        pa.field(INPUT_IDS, pa.list_(pa.int32()), nullable=False),
        pa.field(LOSS_MASK, pa.list_(pa.uint8()), nullable=False),
        pa.field(AUX_HIDDEN_STATES, pa.large_binary(), nullable=False),
    ]
    if metadata.has_last_hidden_state:
        fields.append(pa.field(LAST_HIDDEN_STATE, pa.large_binary(), nullable=False))
    flat = {
        METADATA_KEY: metadata.to_json().encode(),
        # Plain keys too, so `parquet-tools meta` or pyarrow users see them without our reader.
        b"format_version": str(metadata.format_version).encode(),
        b"dtype": metadata.dtype.encode(),
        b"hidden_size": str(metadata.hidden_size).encode(),
        b"layer_ids": json.dumps(metadata.layer_ids).encode(),
        b"layers_to_capture": json.dumps(metadata.layers_to_capture).encode(),
        b"drafter_layer_ids": json.dumps(metadata.drafter_layer_ids).encode(),
        b"model_path": metadata.model_path.encode(),
        b"sglang_version": metadata.sglang_version.encode(),
        b"tp_size": str(metadata.tp_size).encode(),
    }
    return pa.schema(fields, metadata=flat)
