"""What an export holds of a shard it consumed: each file's size and checksum, listed in the export.

``jobs.export consume=true`` deletes a run's shard file once its samples are exported and
verified: the export is then the only copy of them. Before the run's manifest records the
shard as consumed, the export writes the list of the files it made of the shard, with
their sizes and checksums (``storage.checksum``), into itself (``.export-files/shard-00007.json``,
whole and fsynced), and the manifest records the list's own checksum with the shard
(``ShardRecord.exported_files_checksum``). ``jobs.verify`` and the export's rerun check the
list against the manifest and every listed file against the list: a byte changed in an
export that is the only copy is found, named, and never taken for whole.

speculators' export also writes, once every shard's files are there, its dataset (input_ids, loss_mask, seq_len:
``data-*.arrow`` and the files beside it) and ``token_freq.pt``; their sizes and checksums are recorded in the
export's state (``STATE_FILE``, under ``DATASET_FILES``) when it completes, and checked the same way
(``check_dataset_files``).

A consumed shard's ``consumed_into`` is ``<format>:<dest>`` (``training.export.export_key``):
the export's directory is what follows the first colon.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Mapping

import fsspec

import storage.checksum as checksum

EXPORTED_FILES_DIR = ".export-files"
"""In the export: one list per consumed shard (hidden: the trainers' loaders and listings skip it)."""
STATE_FILE = ".export_state.json"
"""In the export: what it exports and how far it got (``training.export``)."""
DATASET_FILES = "dataset_files"
"""The complete export state's path -> [size, checksum] of each file written once every shard's files were."""


def list_path(shard_file: str) -> str:
    """Where, relative to the export's directory, the list of the files made of ``shard_file`` is."""
    return f"{EXPORTED_FILES_DIR}/{shard_file.removesuffix('.parquet')}.json"


def list_bytes(shard_file: str, files: Mapping[str, tuple[int, str]]) -> bytes:
    """The list's bytes: ``files`` maps a path relative to the export's directory to (size, checksum)."""
    payload = {"shard_file": shard_file, "files": {path: list(files[path]) for path in sorted(files)}}
    return (json.dumps(payload, indent=1) + "\n").encode()


def export_directory(consumed_into: str) -> str:
    """The export's directory (a local path or a URL) in a consumed shard's ``consumed_into``."""
    return consumed_into.split(":", 1)[1] if ":" in consumed_into else ""


def check_exported_files(
    fs: fsspec.AbstractFileSystem, root: str, shard_file: str, list_checksum: str,
    map_: Callable[..., Iterable[Any]] = map,
) -> tuple[int, list[tuple[str, str]]]:
    """How many files the export at ``root`` lists for ``shard_file``, and every problem with them, as (path relative
    to root, what is wrong): the list missing or not the one the manifest recorded (``list_checksum``), a listed file
    missing, of another size or checksum. No problem when every file is as it was when the shard was consumed.
    ``map_`` checks the files (a thread pool's map: reading and hashing wait on the storage)."""
    where = list_path(shard_file)
    try:
        with fs.open(f"{root}/{where}", "rb") as file:
            data = file.read()
    except FileNotFoundError:
        return 0, [(where, f"missing: the list of the files made of {shard_file}, written when it was consumed")]
    if checksum.of_bytes(data, checksum.algorithm_of(list_checksum)) != list_checksum:
        return 0, [(where, f"the list of the files made of {shard_file} is not the one the run's manifest recorded "
                           "when the shard was consumed (changed or replaced since)")]
    try:
        files: dict[str, Any] = json.loads(data)["files"]
    except (ValueError, KeyError, TypeError):
        return 0, [(where, "not a list of exported files (its checksum matches the manifest's: report it)")]
    return len(files), check_files(fs, root, files, f"exported from {shard_file}, which was then consumed",
                                   f"{shard_file} was exported and consumed", map_)


def check_dataset_files(
    fs: fsspec.AbstractFileSystem, root: str, map_: Callable[..., Iterable[Any]] = map,
) -> tuple[int, list[tuple[str, str]]]:
    """How many files the complete export at ``root`` recorded in its state (``DATASET_FILES``: speculators' dataset
    and token_freq.pt), and every problem with them (as ``check_exported_files``). None for an export that has no
    state, is not complete, or recorded none."""
    try:
        with fs.open(f"{root}/{STATE_FILE}", "rb") as file:
            state = json.loads(file.read())
    except FileNotFoundError:
        return 0, []
    files = (state.get(DATASET_FILES) or {}) if state.get("complete") else {}
    return len(files), check_files(fs, root, files, "written when the export completed", "the export completed", map_)


def check_files(
    fs: fsspec.AbstractFileSystem, root: str, files: Mapping[str, Any], made: str, recorded: str,
    map_: Callable[..., Iterable[Any]] = map,
) -> list[tuple[str, str]]:
    """Each of ``files`` (path relative to ``root`` -> (size, checksum)) that is missing or not of that size and
    checksum, with what is wrong; ``made`` says where they came from, ``recorded`` when their checksums were taken."""
    def check(item: tuple[str, Any]) -> str:
        path, (size, expected) = item
        expected = expected if checksum.SEPARATOR in expected else f"sha256:{expected}"  # a version-1 list: sha256 hex
        try:
            found = fs.info(f"{root}/{path}")["size"]
        except FileNotFoundError:
            return f"missing: {made}"
        if found != size:
            return f"{found} bytes; {size} were {made}"
        if checksum.of_remote(fs, f"{root}/{path}", checksum.algorithm_of(expected)) != expected:
            return f"its checksum is not the one recorded when {recorded} (changed since)"
        return ""

    items = sorted(files.items())
    return [(path, what) for (path, _), what in zip(items, map_(check, items)) if what]
