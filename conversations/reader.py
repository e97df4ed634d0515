"""Conversation rows out of ``data.path``: records read in file order, each checked and normalised to messages.

The files are the ones ``inputs.files.resolve_files`` finds for the extraction job (a file, a
directory, a glob, an HF ``save_to_disk`` directory, an fsspec URL), sorted by path, so a
conversation's id (its row index across the files) is the same on every run.

Two schemas, detected per file or named with ``data.format``:

- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...]}``, optionally with a
  ``"system"`` string beside the turns (as LLaMA-Factory's ShareGPT layout has it);
- OpenAI: ``{"messages": [{"role": "user", "content": "..."}, ...]}``, content a string or a list of
  ``{"type": "text", "text": ...}`` parts.

A turn's role and text are read under either pair of names (``from``/``value`` or ``role``/``content``),
as both layouts occur under both fields in published datasets. A row's own ``id`` (ShareGPT's conversation
id) is kept with it. A bad row comes back with its reason
(where it is, what is wrong, what to do); the caller fails or skips it by ``data.on_invalid``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterator, Optional

import fsspec
import pyarrow as pa
import pyarrow.ipc as ipc

from inputs.files import ARROW_FILE, JSONL, PARQUET, InputFile, column_names, open_arrow, open_parquet

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
SHAREGPT, OPENAI = "sharegpt", "openai"
FIELDS = {SHAREGPT: "conversations", OPENAI: "messages"}
SYSTEM_FIELD = "system"
ROLE_ALIASES = {
    "user": USER, "human": USER,
    "assistant": ASSISTANT, "gpt": ASSISTANT, "chatgpt": ASSISTANT,
    "system": SYSTEM, "developer": SYSTEM,  # OpenAI's newer name for the system message
}
OTHER_ROLE_NAMES = ("tool", "function", "ipython", "observation", "function_call")
"""Roles the data.other_roles policy decides about; any other unknown role makes the row invalid."""
RECORD_BATCH_ROWS = 1024
"""Parquet and Arrow rows decoded into Python at once."""
ID_FIELD = "id"
"""A row's own id (ShareGPT's conversation id), kept beside its tokens."""
MAX_CHARS_PER_TOKEN = 16
"""A conversation of more characters than this many per token of ``data.max_length`` is invalid, and never reaches
the tokenizer: it is far longer than the tokens kept of it, and on its own it would decide the run's memory."""
TOKENIZER_BYTES_PER_CHAR = 130
"""What a fast tokenizer holds while it tokenizes one text, per character (measured: 1.2 GB for one 9 MB message)."""


@dataclasses.dataclass(frozen=True)
class RowSource:
    """Where a conversation is in the input, as error messages and the skipped-rows list name it."""

    file: str
    row: int
    """0-based row within the file."""
    line: Optional[int] = None
    """JSONL: 1-based line number."""

    def describe(self) -> str:
        return f"{self.file} row {self.row}" + (f" (line {self.line})" if self.line is not None else "")


@dataclasses.dataclass
class ConversationRow:
    conversation_id: int
    """Row index across the input files (sorted by path)."""
    source: RowSource
    messages: Optional[list[dict[str, str]]]
    """``{"role", "content"}`` dicts, roles normalised (user, assistant, system, or a kept other role)."""
    reason: Optional[str] = None
    """Why the row is invalid (then ``messages`` is None)."""
    row_id: Optional[str] = None
    """The row's own ``id`` field (ShareGPT's conversation id; not a string: its JSON), or None without one."""


# -- records ------------------------------------------------------------------------------------


def count_rows(fs: fsspec.AbstractFileSystem, file: InputFile) -> int:
    """Rows of ``file`` without decoding them (a JSONL file is read once, line by line)."""
    if file.format == PARQUET:
        with open_parquet(fs, file) as parquet:
            return parquet.metadata.num_rows
    if file.format == JSONL:
        with fs.open(file.path, "rb") as handle:
            return sum(1 for line in handle if line.strip())
    with open_arrow(fs, file) as source:
        if file.format == ARROW_FILE:
            reader = ipc.open_file(source)
            return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        return sum(batch.num_rows for batch in ipc.open_stream(source))


def iter_records(fs: fsspec.AbstractFileSystem, file: InputFile, columns: list[str]) -> Iterator[tuple[RowSource, Any, Optional[str]]]:
    """(where, record, parse error) for every row of ``file``; Parquet and Arrow decode only ``columns``."""
    if file.format == JSONL:
        yield from _jsonl_records(fs, file)
        return
    for row, (record, error) in enumerate(_table_records(fs, file, columns)):
        yield RowSource(file.name, row), record, error


def _jsonl_records(fs: fsspec.AbstractFileSystem, file: InputFile) -> Iterator[tuple[RowSource, Any, Optional[str]]]:
    row = 0
    with fs.open(file.path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue  # JSON Lines' blank lines hold no record (as inputs.files counts them)
            try:  # without its line end, the parser's positions are columns of this line
                record, error = json.loads(line.rstrip(b"\r\n")), None
            except ValueError as why:
                record, error = None, f"not valid JSON ({why})"
            yield RowSource(file.name, row, line_number), record, error
            row += 1


def _table_records(
    fs: fsspec.AbstractFileSystem, file: InputFile, columns: list[str],
) -> Iterator[tuple[Optional[dict], Optional[str]]]:
    if file.format == PARQUET:
        with open_parquet(fs, file) as parquet:
            for batch in parquet.iter_batches(batch_size=RECORD_BATCH_ROWS, columns=columns):
                yield from _batch_records(batch)
        return
    with open_arrow(fs, file) as source:
        if file.format == ARROW_FILE:
            reader = ipc.open_file(source)
            batches: Iterator[pa.RecordBatch] = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(ipc.open_stream(source))
        for batch in batches:
            yield from _batch_records(batch.select(columns))


def _batch_records(batch: pa.RecordBatch) -> Iterator[tuple[Optional[dict], Optional[str]]]:
    """(record, None) per row; a batch holding text that is not UTF-8 is decoded row by row, so such a row comes
    back as (None, why) and the others as records."""
    try:
        records = batch.to_pylist()
    except UnicodeDecodeError:
        records = None
    if records is not None:
        yield from ((record, None) for record in records)
        return
    for row in range(batch.num_rows):
        try:
            yield batch.slice(row, 1).to_pylist()[0], None
        except UnicodeDecodeError as why:
            yield None, f"holds text that is not valid UTF-8 ({why}); fix or drop the row"


# -- schema ----------------------------------------------------------------------------------------


def detect_format(names: Any) -> Optional[str]:
    """sharegpt or openai by which field a record (or a table's columns) has; None if neither.
    Raises ValueError if both."""
    found = [fmt for fmt, field in FIELDS.items() if field in names]
    if len(found) > 1:
        raise ValueError(
            f"has both a {FIELDS[SHAREGPT]!r} (ShareGPT) and a {FIELDS[OPENAI]!r} (OpenAI) field; name the one "
            "to read with data.format=sharegpt or data.format=openai"
        )
    return found[0] if found else None


def file_format(fs: fsspec.AbstractFileSystem, file: InputFile, requested: str) -> Optional[str]:
    """The schema of a Parquet or Arrow file (named, or from its columns); None for JSONL under auto
    (decided by its first record that has either field)."""
    if file.format == JSONL:
        return None if requested == "auto" else requested
    columns = column_names(fs, file)
    try:
        detected = detect_format(columns)
    except ValueError as error:
        if requested != "auto":
            return requested
        raise ValueError(f"{file.name} {error}") from None
    fmt = detected if requested == "auto" else requested
    if fmt is None or FIELDS[fmt] not in columns:
        wanted = f"a {FIELDS[fmt]!r} column" if fmt else (
            f"a {FIELDS[SHAREGPT]!r} (ShareGPT) or {FIELDS[OPENAI]!r} (OpenAI) column")
        raise ValueError(f"{file.name} has no {wanted} (its columns: {', '.join(columns)}); point data.path at "
                         "conversations, or name the format with data.format")
    return fmt


# -- one row ---------------------------------------------------------------------------------------


def to_messages(record: Any, fmt: str, other_roles: str) -> tuple[Optional[list[dict[str, str]]], Optional[str]]:
    """The row as messages with normalised roles, or why it cannot be (missing fields, unknown roles, empty turns)."""
    field = FIELDS[fmt]
    if not isinstance(record, dict):
        return None, f"a row must be a JSON object with a {field!r} list, got {type(record).__name__}"
    turns = record.get(field)
    if turns is None and field in record:
        return None, f"its {field!r} is null; a {fmt} row holds {_layout(fmt)}"
    if turns is None:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        return None, f"no {field!r} field (its keys: {keys}); a {fmt} row holds {_layout(fmt)}"
    if not isinstance(turns, list):
        return None, f"{field} must be a list of turns, got {type(turns).__name__}"
    if not turns:
        return None, f"{field} is empty"
    messages: list[dict[str, str]] = []
    system = record.get(SYSTEM_FIELD)
    if system is not None and not isinstance(system, str):  # rendered without it, the row would be another one
        return None, f"its {SYSTEM_FIELD!r} is {type(system).__name__}, not a string"
    if isinstance(system, str) and system.strip() and not _starts_with_system(turns):
        messages.append({"role": SYSTEM, "content": system})
    role_keys, text_keys = (("from", "role"), ("value", "content")) if fmt == SHAREGPT else (("role", "from"), ("content", "value"))
    for index, turn in enumerate(turns):
        where = f"{field}[{index}]"
        if not isinstance(turn, dict):
            return None, f"{where} is {type(turn).__name__}, not an object with {role_keys[0]!r} and {text_keys[0]!r}"
        role = next((turn[key] for key in role_keys if turn.get(key) is not None), None)
        if not isinstance(role, str):
            return None, f"{where} has no {role_keys[0]!r} (its role)" if role is None else (
                f"{where}.{role_keys[0]} is {type(role).__name__}, not a role name")
        name = ROLE_ALIASES.get(role.strip().lower())
        if name is None:
            if role.strip().lower() not in OTHER_ROLE_NAMES:
                return None, (f"{where} has the unknown role {role!r} (known: user/human, assistant/gpt, system, "
                              f"and {'/'.join(OTHER_ROLE_NAMES)} under data.other_roles)")
            if other_roles == "fail":
                return None, (f"{where} has the role {role!r}: data.other_roles=drop leaves such turns out, keep "
                              "renders them (never in the loss mask)")
            if other_roles == "drop":
                continue
            name = role.strip().lower()
        text, why = _text(next((turn[key] for key in text_keys if key in turn), None))
        if why:
            return None, f"{where} ({role}): {why}"
        if not text.strip():
            return None, f"{where} ({role}) is empty"
        messages.append({"role": name, "content": text})
    if not any(message["role"] != SYSTEM for message in messages):
        return None, f"{field} holds no user or assistant turn" + (" once data.other_roles=drop left turns out"
                                                                   if other_roles == "drop" else "")
    return messages, None


def _layout(fmt: str) -> str:
    return ('"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]' if fmt == SHAREGPT
            else '"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]')


def _starts_with_system(turns: list) -> bool:
    first = turns[0] if isinstance(turns[0], dict) else {}
    role = first.get("from", first.get("role"))
    return isinstance(role, str) and ROLE_ALIASES.get(role.strip().lower()) == SYSTEM


def _text(content: Any) -> tuple[str, Optional[str]]:
    """A turn's text: a string, or OpenAI's list of text parts (concatenated)."""
    if isinstance(content, str):
        return content, None
    if content is None:
        return "", "has no text"
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                return "", f"holds a {kind!r} part; only text parts are rendered"
            parts.append(part["text"])
        return "".join(parts), None
    return "", f"its text is {type(content).__name__}, not a string"


def check_ending(messages: list[dict[str, str]], regenerate: bool) -> Optional[str]:
    """Why the conversation cannot be trained on as it ends, or None.

    Trained as is, it must end with the assistant's answer (the text the drafter learns). To be
    regenerated, it needs a user turn for the target to answer; a trailing user turn is answered too.
    """
    if regenerate:
        if not any(message["role"] == USER for message in messages):
            return "has no user turn for the target to answer"
        return None
    last = messages[-1]["role"]
    if last != ASSISTANT:
        return (f"ends with a {last} turn, not the assistant's answer (the text the drafter learns from); drop "
                "the trailing turn, or use regenerate=true to have the target answer it")
    return None



def read_conversations(
    fs: fsspec.AbstractFileSystem, files: list[InputFile], requested_format: str, other_roles: str, regenerate: bool,
    max_chars: int,
) -> Iterator[ConversationRow]:
    """Every row of ``files`` in order, checked: its messages, or the reason it is invalid (one whose turns hold
    more than ``max_chars`` characters among them)."""
    conversation_id = 0
    for file in files:
        fmt = file_format(fs, file, requested_format)
        wanted = (FIELDS[fmt], SYSTEM_FIELD, ID_FIELD) if fmt else ()  # JSONL under auto: decided below
        columns = [] if file.format == JSONL else [name for name in wanted if name in column_names(fs, file)]
        for source, record, error in iter_records(fs, file, columns):
            if fmt is None and error is None and isinstance(record, dict):
                try:
                    fmt = detect_format(record)  # JSONL under auto: the first record with either field decides
                except ValueError as why:
                    error = f"the record {why}"
            messages = None
            if error is None:
                messages, error = _check(record, fmt, other_roles, regenerate, max_chars)
            yield ConversationRow(conversation_id, source, messages if error is None else None, error, _row_id(record))
            conversation_id += 1


def _row_id(record: Any) -> Optional[str]:
    value = record.get(ID_FIELD) if isinstance(record, dict) else None
    return value if value is None or isinstance(value, str) else json.dumps(value)


def _check(
    record: Any, fmt: Optional[str], other_roles: str, regenerate: bool, max_chars: int,
) -> tuple[Optional[list], Optional[str]]:
    if fmt is None:
        if not isinstance(record, dict):
            return None, f"a row must be a JSON object, got {type(record).__name__}"
        return None, f"has neither a {FIELDS[SHAREGPT]!r} (ShareGPT) nor a {FIELDS[OPENAI]!r} (OpenAI) field"
    messages, error = to_messages(record, fmt, other_roles)
    if error is None and messages is not None:
        size = sum(len(message["content"]) for message in messages)
        if size > max_chars:
            return None, (
                f"its turns hold {size:,} characters, more than {max_chars:,} ({MAX_CHARS_PER_TOKEN} per token of "
                f"data.max_length={max_chars // MAX_CHARS_PER_TOKEN:,}), not tokenized: about "
                f"{size * TOKENIZER_BYTES_PER_CHAR / 1e9:.1f} GB of tokenizer memory for a row mostly cut off; "
                "shorten or split it"
            )
        error = check_ending(messages, regenerate)
    return messages, error
