"""The files behind ``data.path``, and reading them in segments.

``data.path`` is a file, a directory, a glob or an fsspec URL (``file://``,
``s3://`` with ``data.storage_options``) of Parquet, JSON Lines or Arrow IPC
files; a directory written by HF ``datasets``' ``save_to_disk`` is read
through its ``state.json``. Files are taken in sorted path order, so the
global row index (the sample id) is the same on every run.

A segment is what is read on demand once the files have been checked: a
Parquet row group, an Arrow record batch (found again by its byte offset in
an IPC stream), or a block of JSONL lines (a byte range). ``scan`` streams
every segment of a file in blocks of rows; ``read_segment`` reads one again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from typing import Any, Callable, Iterator, Optional

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
COLUMNS = (INPUT_IDS, LOSS_MASK)
CONVERSATION_FIELDS = ("conversations", "messages")
"""The fields of a conversations file (ShareGPT, OpenAI): jobs.prepare's input, not this job's."""

PARQUET, JSONL, ARROW_STREAM, ARROW_FILE = "parquet", "jsonl", "arrow_stream", "arrow_file"
SUFFIXES = {".parquet": PARQUET, ".jsonl": JSONL, ".json": JSONL, ".ndjson": JSONL, ".arrow": ARROW_STREAM}
ARROW_FILE_MAGIC = b"ARROW1"
HF_STATE_FILE = "state.json"
HF_DATASET_DICT_FILE = "dataset_dict.json"
GLOB_CHARS = "*?["

SCAN_BATCH_ROWS = 8192
"""Rows per block while a Parquet row group is checked (bounds the scan's memory)."""
JSONL_BLOCK_BYTES = 8 << 20
"""JSONL is parsed and re-read in blocks of whole lines of about this size."""
LARGE_ROW_GROUP_ROWS = 100_000
"""Parquet row groups larger than this are worth a warning: one is decoded whole to send any of its rows."""

_JSONL_SCHEMA = pa.schema([(INPUT_IDS, pa.list_(pa.int64())), (LOSS_MASK, pa.list_(pa.int64()))])
_JSONL_PARSE = pa_json.ParseOptions(explicit_schema=_JSONL_SCHEMA, unexpected_field_behavior="ignore")
_BLANK_LINE = re.compile(rb"^[ \t\r]*\n", re.M)
_FLOAT_HINT = (
    "token ids must be integers; floats are refused even when integral (3.0), since a float id means "
    "the ids went through a lossy conversion"
)


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str
    """As the filesystem names it (no protocol)."""
    name: str
    """As error messages show it: the local path, or the URL for a remote file."""
    format: str
    size: int


@dataclasses.dataclass
class Block:
    """Rows of one segment, as the scan reads them."""

    segment: int
    """Locator of the segment: row group index (Parquet), batch index (Arrow file), byte offset
    (Arrow stream, JSONL)."""
    segment_bytes: int
    """JSONL: bytes of the segment; 0 otherwise."""
    table: pa.Table
    reasons: dict[int, str]
    """Rows the reader could not convert, with why (JSONL lines: bad JSON, float ids)."""
    line_of: Optional[Callable[[int], int]] = None
    """JSONL: 1-based line number of a row of this block."""


def resolve_files(path: str, storage_options: Optional[dict[str, Any]] = None) -> tuple[fsspec.AbstractFileSystem, list[InputFile]]:
    """The filesystem and the input files behind ``data.path``, in the order their rows are numbered."""
    if not path:
        raise ValueError("data.path is empty: name a file, directory, glob or URL of the tokenized dataset")
    fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if any(char in root for char in GLOB_CHARS):
        paths = sorted(p for p in fs.glob(root) if fs.isfile(p))
        if not paths:
            raise ValueError(f"data.path={path}: no file matches this pattern")
        files = [_input_file(fs, p) for p in paths if _format_of(p)]
        if not files:
            raise ValueError(f"data.path={path}: matches {_some(paths)}, none of them {_SUPPORTED_TEXT}")
        return fs, files
    if fs.isdir(root):
        return fs, _directory_files(fs, path, root)
    if not fs.isfile(root):
        raise ValueError(f"data.path={path}: no such file or directory")
    if not _format_of(root):
        raise ValueError(f"data.path={path}: unsupported file type; use {_SUPPORTED_TEXT}")
    return fs, [_input_file(fs, root)]


_SUPPORTED_TEXT = ".parquet, .jsonl (or .json, .ndjson: JSON Lines) or .arrow (HF datasets save_to_disk)"


def _format_of(path: str) -> str:
    name = path.rsplit("/", 1)[-1].lower()
    suffix = name[name.rfind("."):] if "." in name else ""
    return SUFFIXES.get(suffix, "")


def _some(paths: list[str], limit: int = 5) -> str:
    names = [p.rsplit("/", 1)[-1] for p in paths[:limit]]
    return ", ".join(names) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _directory_files(fs: fsspec.AbstractFileSystem, path: str, root: str) -> list[InputFile]:
    root = root.rstrip("/")
    if fs.isfile(f"{root}/{HF_DATASET_DICT_FILE}"):
        splits = json.loads(fs.cat_file(f"{root}/{HF_DATASET_DICT_FILE}")).get("splits", [])
        raise ValueError(
            f"data.path={path} is a DatasetDict saved with save_to_disk (splits: {', '.join(splits)}); "
            f"point data.path at one split, e.g. {path.rstrip('/')}/{splits[0] if splits else 'train'}"
        )
    if fs.isfile(f"{root}/{HF_STATE_FILE}"):
        # HF save_to_disk: the data files are the ones state.json lists (data-00000-of-0000N.arrow).
        state = json.loads(fs.cat_file(f"{root}/{HF_STATE_FILE}"))
        names = sorted(entry["filename"] for entry in state.get("_data_files", []))
        if not names:
            raise ValueError(f"data.path={path}: {HF_STATE_FILE} lists no data files")
        return [_input_file(fs, f"{root}/{name}") for name in names]
    found = sorted(fs.find(root))
    # Hidden and _-prefixed files and folders (_SUCCESS, .crc, _temporary) are not data, as for Spark.
    visible = [p for p in found if not any(part[:1] in "._" for part in p[len(root) + 1:].split("/"))]
    files = [_input_file(fs, p) for p in visible if _format_of(p)]
    if not files:
        holds = _some(visible) if visible else "nothing"
        raise ValueError(
            f"data.path={path} is a directory without readable files: it holds {holds}. Put {_SUPPORTED_TEXT} "
            "files there, or point data.path at a file or a glob"
        )
    return files


def _input_file(fs: fsspec.AbstractFileSystem, path: str) -> InputFile:
    name = path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)
    file_format = _format_of(path)
    if file_format == ARROW_STREAM:
        with fs.open(path, "rb") as handle:
            if handle.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC:
                file_format = ARROW_FILE
    return InputFile(path=path, name=name, format=file_format, size=int(fs.size(path)))


# -- reading ------------------------------------------------------------------------------------


def scan(fs: fsspec.AbstractFileSystem, file: InputFile) -> Iterator[Block]:
    """Every row of ``file`` in order, in blocks; a segment may span several consecutive blocks."""
    if file.format == PARQUET:
        return _scan_parquet(fs, file)
    if file.format == JSONL:
        return _scan_jsonl(fs, file)
    return _scan_arrow(fs, file)


def read_segment(fs: fsspec.AbstractFileSystem, file: InputFile, segment: int, segment_bytes: int) -> pa.Table:
    """The rows of one segment again (only the input columns)."""
    current = int(fs.size(file.path))
    if current != file.size:
        raise ValueError(
            f"{file.name} changed while the job ran ({file.size} bytes when it was checked, {current} now); "
            "restore it, or start again with a new output.dir"
        )
    if file.format == PARQUET:
        with open_parquet(fs, file) as parquet:
            return parquet.read_row_group(segment, columns=_present(parquet.schema_arrow))
    if file.format == JSONL:
        with fs.open(file.path, "rb") as handle:
            handle.seek(segment)
            return _parse_jsonl(handle.read(segment_bytes))[0]
    with open_arrow(fs, file) as source:
        if file.format == ARROW_FILE:
            reader = ipc.open_file(source)
            return pa.Table.from_batches([reader.get_batch(segment)]).select(_present(reader.schema))
        schema = ipc.open_stream(source).schema
        source.seek(segment)
        batch = ipc.read_record_batch(ipc.read_message(source), schema)
        return pa.Table.from_batches([batch]).select(_present(schema))


def column_names(fs: fsspec.AbstractFileSystem, file: InputFile) -> list[str]:
    """The file's columns: the schema's names (JSONL: its first record's keys, which the row checks may refuse)."""
    if file.format == PARQUET:
        with open_parquet(fs, file) as parquet:
            return parquet.schema_arrow.names
    if file.format == JSONL:
        with fs.open(file.path, "rb") as handle:
            return _first_record_fields(next((line for line in handle if not _is_blank(line.rstrip(b"\n"))), b""))
    with open_arrow(fs, file) as source:
        return (ipc.open_file(source) if file.format == ARROW_FILE else ipc.open_stream(source)).schema.names


def _present(schema: pa.Schema) -> list[str]:
    return [name for name in COLUMNS if name in schema.names]


def check_schema(file: InputFile, schema: pa.Schema) -> None:
    """Column types are checked per file: a float column is refused whole, whatever on_invalid says."""
    if INPUT_IDS not in schema.names:
        _refuse_conversations(file, schema.names)
        raise ValueError(f"{file.name}: no {INPUT_IDS!r} column (found {schema.names})")
    for name in _present(schema):
        kind = schema.field(name).type
        if name == LOSS_MASK and pa.types.is_null(kind):
            continue  # a column of nulls only: no row has a mask
        is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
        if is_list and pa.types.is_null(kind.value_type):
            continue  # only nulls (JSON with no such key): checked per row
        if not is_list or not pa.types.is_integer(kind.value_type):
            hint = _FLOAT_HINT if is_list and pa.types.is_floating(kind.value_type) else "it must be a list of integers"
            raise ValueError(
                f"{file.name}: column {name!r} has type {kind}: {hint}. Cast it to a list of int32 or int64 "
                "where the dataset is made"
            )


@contextlib.contextmanager
def open_parquet(fs: fsspec.AbstractFileSystem, file: InputFile) -> Iterator[pq.ParquetFile]:
    """Local files through Arrow's own reader; remote ones through fsspec (range requests)."""
    if isinstance(fs, LocalFileSystem):
        with pq.ParquetFile(file.path) as parquet:
            yield parquet
        return
    with fs.open(file.path, "rb") as handle, pq.ParquetFile(handle) as parquet:
        yield parquet


def _scan_parquet(fs: fsspec.AbstractFileSystem, file: InputFile) -> Iterator[Block]:
    with open_parquet(fs, file) as parquet:
        check_schema(file, parquet.schema_arrow)
        columns = _present(parquet.schema_arrow)
        for group in range(parquet.num_row_groups):
            for batch in parquet.iter_batches(batch_size=SCAN_BATCH_ROWS, row_groups=[group], columns=columns):
                yield Block(group, 0, pa.Table.from_batches([batch]), {})


def largest_row_group(fs: fsspec.AbstractFileSystem, file: InputFile) -> int:
    if file.format != PARQUET:
        return 0
    with open_parquet(fs, file) as parquet:
        metadata = parquet.metadata
        return max((metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)), default=0)


def open_arrow(fs: fsspec.AbstractFileSystem, file: InputFile) -> Any:
    """Local files are memory-mapped: their batches are read without a copy."""
    if isinstance(fs, LocalFileSystem):
        return pa.memory_map(file.path)
    return pa.PythonFile(fs.open(file.path, "rb"), mode="r")


def _scan_arrow(fs: fsspec.AbstractFileSystem, file: InputFile) -> Iterator[Block]:
    with open_arrow(fs, file) as source:
        if file.format == ARROW_FILE:
            reader = ipc.open_file(source)
            check_schema(file, reader.schema)
            for index in range(reader.num_record_batches):
                yield Block(index, 0, pa.Table.from_batches([reader.get_batch(index)]).select(_present(reader.schema)), {})
            return
        stream = ipc.open_stream(source)
        check_schema(file, stream.schema)
        if any(pa.types.is_dictionary(field.type) for field in stream.schema):
            raise ValueError(
                f"{file.name}: an Arrow stream with dictionary-encoded columns cannot be read by row range; "
                "save the dataset as Parquet (Dataset.to_parquet) or without dictionary columns"
            )
        offset = source.tell()
        for batch in stream:
            yield Block(offset, 0, pa.Table.from_batches([batch]).select(_present(stream.schema)), {})
            offset = source.tell()


def _scan_jsonl(fs: fsspec.AbstractFileSystem, file: InputFile) -> Iterator[Block]:
    offset, first_line, carry = 0, 1, b""
    with fs.open(file.path, "rb") as handle:
        while True:
            data = handle.read(JSONL_BLOCK_BYTES)
            text = carry + data
            if not text:
                return
            cut = text.rfind(b"\n") + 1 if data else len(text)  # blocks end at a line end
            if cut == 0:
                carry = text
                continue
            block, carry = text[:cut], text[cut:]
            if offset == 0:
                _refuse_conversations(file, _first_record_fields(block))
            table, reasons = _parse_jsonl(block)
            yield Block(offset, len(block), table, reasons, _line_numbers(block, first_line))
            offset += len(block)
            first_line += block.count(b"\n")
            if not data:
                return


def _refuse_conversations(file: InputFile, fields: list[str]) -> None:
    """A file of conversations where token ids are expected: name the command that makes them."""
    found = [name for name in CONVERSATION_FIELDS if name in fields]
    if found and INPUT_IDS not in fields:
        raise ValueError(
            f"{file.name} is a conversations file ({found[0]!r}, no {INPUT_IDS!r}): jobs.extract reads token ids. "
            "Tokenize it first with python -m jobs.prepare model.path=MODEL data.path=FILE output.dir=DIR, then "
            "give jobs.extract data.path=DIR (docs/conversations.md)"
        )


def _first_record_fields(block: bytes) -> list[str]:
    """The keys of the block's first record (none when it is not a JSON object: the row checks say why)."""
    line = next((line for line in io.BytesIO(block) if not _is_blank(line.rstrip(b"\n"))), b"")
    try:
        record = json.loads(line)
    except ValueError:
        return []
    return list(record) if isinstance(record, dict) else []


def _is_blank(line: bytes) -> bool:
    return not line.strip(b" \t\r")  # JSON's whitespace: such lines hold no record


def _line_numbers(block: bytes, first_line: int) -> Callable[[int], int]:
    def line_of(row: int) -> int:
        if not _BLANK_LINE.search(block):
            return first_line + row
        records = [i for i, line in enumerate(block.split(b"\n")) if not _is_blank(line)]
        return first_line + records[row]

    return line_of


def _count_records(block: bytes) -> int:
    tail = block[block.rfind(b"\n") + 1:]
    return block.count(b"\n") - len(_BLANK_LINE.findall(block)) + (0 if _is_blank(tail) else 1)


def _parse_jsonl(block: bytes) -> tuple[pa.Table, dict[int, str]]:
    """One row per non-blank line; Arrow's parser when every line is clean, else line by line."""
    records = _count_records(block)
    if records > 0:
        try:
            table = pa_json.read_json(io.BytesIO(block), parse_options=_JSONL_PARSE)
        except pa.ArrowInvalid:
            pass
        else:
            if table.num_rows == records:  # else a line held two objects: the slow path names it
                return table, {}
    return _parse_jsonl_lines(block)


def _parse_jsonl_lines(block: bytes) -> tuple[pa.Table, dict[int, str]]:
    """The slow path: Python's parser on each line, naming what is wrong with each bad one."""
    ids_rows: list[Any] = []
    mask_rows: list[Any] = []
    reasons: dict[int, str] = {}
    for line in block.split(b"\n"):
        if _is_blank(line):
            continue
        row = len(ids_rows)
        ids = mask = why = None
        try:
            record = json.loads(line)
        except ValueError as error:
            why = f"not valid JSON ({error})"
        else:
            if not isinstance(record, dict):
                why = f"a line must be a JSON object, got {type(record).__name__}"
            else:
                ids, why = _integer_list(record.get(INPUT_IDS), INPUT_IDS)
                mask, mask_why = _integer_list(record.get(LOSS_MASK), LOSS_MASK)
                why = why or mask_why
        if why:
            reasons[row] = why
            ids = mask = None
        ids_rows.append(ids)
        mask_rows.append(mask)
    table = pa.table({INPUT_IDS: pa.array(ids_rows, _JSONL_SCHEMA.field(INPUT_IDS).type),
                      LOSS_MASK: pa.array(mask_rows, _JSONL_SCHEMA.field(LOSS_MASK).type)})
    return table, reasons


_INT64 = np.iinfo(np.int64)


def _integer_list(value: Any, name: str) -> tuple[Optional[list], Optional[str]]:
    if value is None:
        return None, None  # missing: the vectorised checks say what that means for this column
    if not isinstance(value, list):
        return None, f"{name} must be a list of integers, got {type(value).__name__} {value!r:.60}"
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (int, type(None))):
            if isinstance(item, float):
                return None, f"{name} holds the float {item!r} at position {position}: {_FLOAT_HINT}"
            return None, f"{name} holds {type(item).__name__} {item!r:.40} at position {position}; it must hold integers"
        if item is not None and not _INT64.min <= item <= _INT64.max:
            what = "is outside the model's vocabulary" if name == INPUT_IDS else "is not 0 or 1"
            return None, f"{name} value {item} at position {position} {what}"
    return value, None
