"""The shard file's format: every column, how each is stored, and every metadata key.

One row per sample; hidden states are raw little-endian bytes in ``state_dtype`` (the model's dtype,
bit-exact with SGLang, or float8_e4m3fn with float32 scale columns), whose shape and dtype live in the
file's key-value metadata (``ShardMetadata``): a reader rebuilds tensors without parsing anything per
row. Files of format v1 are read as the v2 metadata they imply. What each column holds, and why bytes
rather than Arrow floats: docs/format.md.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from typing import Literal

import pyarrow as pa

FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)

SAMPLE_ID = "sample_id"
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
AUX_HIDDEN_STATES = "aux_hidden_states"
LAST_HIDDEN_STATE = "last_hidden_state"
SCALES_SUFFIX = "_scales"
AUX_HIDDEN_STATES_SCALES = AUX_HIDDEN_STATES + SCALES_SUFFIX
LAST_HIDDEN_STATE_SCALES = LAST_HIDDEN_STATE + SCALES_SUFFIX

STATE_COLUMNS = (AUX_HIDDEN_STATES, LAST_HIDDEN_STATE)


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a shard file and how the writer stores it."""

    name: str
    type: pa.DataType
    compression: str
    """Parquet codec. Token columns are small and compress well; state columns are high-entropy floats
    where compression costs far more time than the ~20% it saves."""
    statistics: bool = False
    """Min/max per row group in the footer: only sample ids, which a reader may look up."""

    @property
    def parquet_path(self) -> str:
        """The Parquet leaf column's path: a list's values live at ``<name>.list.element``, and a setting
        keyed by the list's own name would not reach them."""
        return f"{self.name}.list.element" if pa.types.is_list(self.type) else self.name


COLUMNS: dict[str, Column] = {column.name: column for column in (
    Column(SAMPLE_ID, pa.int64(), "zstd", statistics=True),
    Column(INPUT_IDS, pa.list_(pa.int32()), "zstd"),
    Column(LOSS_MASK, pa.list_(pa.uint8()), "zstd"),
    Column(AUX_HIDDEN_STATES, pa.large_binary(), "none"),
    Column(AUX_HIDDEN_STATES_SCALES, pa.large_binary(), "none"),
    Column(LAST_HIDDEN_STATE, pa.large_binary(), "none"),
    Column(LAST_HIDDEN_STATE_SCALES, pa.large_binary(), "none"),
)}
"""Every column a shard file may have; ``columns`` says which one has."""

# Parquet key-value metadata key under which ShardMetadata is stored as JSON.
METADATA_KEY = b"eagle3_hidden_states"
# Every ShardMetadata field is also a plain key of the file unless marked _JSON_ONLY. The plain keys are part
# of the format (``storage.verify`` compares a file's with what ``build_schema`` makes of its metadata), so a
# field left out of them stays out.
_FLAT = "flat_key"
_JSON_ONLY = {_FLAT: False}

# The model dtypes the job runs (model.dtype) and the states' bytes per element in each (the names are torch's:
# the reader maps them back).
ModelDtype = Literal["bfloat16", "float16", "float32"]
MODEL_DTYPES: dict[str, int] = dict(zip(typing.get_args(ModelDtype), (2, 2, 4)))
# Element type of the stored states (output.state_dtype): the model's own (bit-exact with SGLang), or fp8 with
# a float32 scale per token and layer (half the bytes through the host copy, object store and disk).
StateDtype = Literal["model", "float8_e4m3fn"]
SAME_AS_MODEL, FP8 = typing.get_args(StateDtype)
ITEMSIZES: dict[str, int] = {**MODEL_DTYPES, FP8: 1}
SCALE_ITEMSIZE = 4  # float32
# Which final hidden state is stored (extract.last_hidden_state): the residual stream entering the model's final
# norm (speculators' verifier state; SpecForge's export applies the norm), after it (SpecForge's target), or none.
FINAL_STATES = ("post_norm", "pre_norm", "none")
# Checksums of the files (``storage.checksum``): the manifest, the exports and their lists record
# them as "<algorithm>:<hex>"; new files get output.checksum's algorithm.
ChecksumAlgorithm = Literal["xxh3_128", "sha256"]
# What the writer does with a sample whose captured states hold NaN or Inf (extract.on_nonfinite; the writer acts
# on the extractor's per-sample flags): its shard fails, it is left out, or it is written flagged.
NonfiniteAction = Literal["fail", "skip", "keep"]
DEFAULT_CHECKSUM: ChecksumAlgorithm = "xxh3_128"


def stored_dtype(state_dtype: str, model_dtype: str) -> str:
    """The element type the states are stored in for a ``StateDtype`` choice and the model's dtype."""
    return model_dtype if state_dtype == SAME_AS_MODEL else state_dtype


@dataclasses.dataclass(frozen=True)
class ShardMetadata:
    """What a reader needs to interpret the state columns, and where they came from."""

    dtype: str
    """The model's dtype: what SGLang computed and what the reader returns (one of ``MODEL_DTYPES``)."""
    state_dtype: str
    """Element type of the state columns: ``dtype`` (bit-exact) or float8_e4m3fn (with scale columns)."""
    hidden_size: int
    layer_ids: list[int]
    """Canonical ids: id k is the output of decoder layer k (0-based) = HF ``hidden_states[k+1]``."""
    layers_to_capture: list[int]
    """What SGLang's ``model.layers_to_capture`` reported while extracting (its own indices)."""
    drafter_layer_ids: list[int]
    """Ids for ``eagle_config.eagle_aux_hidden_state_layer_ids`` that make this SGLang capture ``layer_ids``."""
    last_hidden_state: str
    """What the last_hidden_state column holds: post_norm (after the model's final norm), pre_norm
    (the residual stream entering it) or none (no such column)."""
    model_path: str
    model_architecture: str = dataclasses.field(metadata=_JSON_ONLY)
    sglang_version: str
    tp_size: int
    format_version: int = FORMAT_VERSION
    byte_order: str = dataclasses.field(default="little", metadata=_JSON_ONLY)
    language_model_architecture: str = dataclasses.field(default="", metadata=_JSON_ONLY)
    """The language model inside ``model_architecture`` (DeepseekV3ForCausalLM inside
    KimiK25ForConditionalGeneration; the same class for a bare LM); empty in files that predate it."""

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not a model dtype; use one of {sorted(MODEL_DTYPES)}")
        if self.state_dtype not in (self.dtype, FP8):
            raise ValueError(f"state_dtype {self.state_dtype!r}: store {self.dtype} or {FP8}")
        if self.last_hidden_state not in FINAL_STATES:
            raise ValueError(f"last_hidden_state {self.last_hidden_state!r}: one of {', '.join(FINAL_STATES)}")

    @property
    def has_last_hidden_state(self) -> bool:
        return self.last_hidden_state != "none"

    @property
    def fp8(self) -> bool:
        return self.state_dtype == FP8

    @property
    def itemsize(self) -> int:
        """Bytes per stored state element."""
        return ITEMSIZES[self.state_dtype]

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
        if version not in READABLE_FORMAT_VERSIONS:
            raise ValueError(
                f"{source}: format_version {version} is not readable by this version "
                f"(reads {', '.join(map(str, READABLE_FORMAT_VERSIONS))}); re-extract or use the matching release"
            )
        if version == 1:  # the final state was post-norm or absent; states in the model dtype
            fields["last_hidden_state"] = "post_norm" if fields.pop("has_last_hidden_state") else "none"
            fields["state_dtype"] = fields["dtype"]
        return cls(**fields)


def metadata_from_schema(arrow_schema: pa.Schema, source: str) -> ShardMetadata:
    """The ``ShardMetadata`` a shard file's Arrow schema carries; ``source`` names the file in errors."""
    kv = arrow_schema.metadata or {}
    if METADATA_KEY not in kv:
        raise ValueError(f"{source}: not a hidden-states shard (no {METADATA_KEY.decode()} metadata)")
    return ShardMetadata.from_json(kv[METADATA_KEY].decode(), source=source)


def columns(metadata: ShardMetadata) -> list[Column]:
    """The columns of a shard file with this metadata, in the file's order."""
    names = [SAMPLE_ID, INPUT_IDS, LOSS_MASK]
    for state in STATE_COLUMNS if metadata.has_last_hidden_state else STATE_COLUMNS[:1]:
        names += [state, state + SCALES_SUFFIX] if metadata.fp8 else [state]
    return [COLUMNS[name] for name in names]


def flat_metadata(metadata: ShardMetadata) -> dict[bytes, bytes]:
    """Each field of ``metadata`` as a plain key-value pair (lists as JSON), so that `parquet-tools meta` or
    pyarrow users see them without our reader; fields marked ``_JSON_ONLY`` are only in the JSON record."""
    flat = {}
    for field in dataclasses.fields(metadata):
        if field.metadata.get(_FLAT, True):
            value = getattr(metadata, field.name)
            flat[field.name.encode()] = (value if isinstance(value, str) else json.dumps(value)).encode()
    return flat


def build_schema(metadata: ShardMetadata) -> pa.Schema:
    """The Arrow schema every shard file is written with; the metadata rides in it."""
    if sys.byteorder != "little":
        raise RuntimeError("the shard format stores little-endian bytes; this host is big-endian")
    fields = [pa.field(column.name, column.type, nullable=False) for column in columns(metadata)]
    return pa.schema(fields, metadata={METADATA_KEY: metadata.to_json().encode(), **flat_metadata(metadata)})
