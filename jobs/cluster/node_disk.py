"""A directory on one node's local disk, as the driver sees it: every look runs on that node.

With data parallelism across hosts a node's shard files are on its own disk,
which the driver's host cannot see. ``LocalDisk`` looks directly (the driver's
own output.dir before Ray runs, and tests); ``NodeDisk`` runs the same looks
as small Ray tasks pinned to the node (no CPU slot: they must never wait
behind the writers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from storage import checksum
from storage.atomic import replace_atomically
from storage.claim import CLAIM_FILE, link_new_claim
from storage.consumed import RECORD_GLOB, file_of_record, read_records
from storage.writer import SHARD_GLOB, TEMP_GLOB, shard_file_name, temp_file_name


def _free_and_unwritten(directory: str, reserved: dict[int, int]) -> tuple[int, int]:
    """Free bytes on the filesystem, and the reserved bytes the open shards' temp files do not hold yet.

    One stat per open shard, not a listing of the directory: it holds every committed file of the
    run (10,000 at the end of a large one), and this runs at every shard's start.
    """
    path = Path(directory)
    unwritten = 0
    for shard, nbytes in reserved.items():
        try:
            written = (path / temp_file_name(shard_file_name(shard))).stat().st_size
        except FileNotFoundError:  # not created yet, or renamed into place a moment ago by its writer
            written = 0
        unwritten += max(0, nbytes - written)
    return shutil.disk_usage(path).free, unwritten


def _existing(directory: str, names: list[str]) -> list[str]:
    return [name for name in names if (Path(directory) / name).exists()]


def _file_facts(directory: str, names: list[str], algorithms: Mapping[str, str]) -> dict[str, tuple[int, str]]:
    """Size (and, for a name in ``algorithms``, its checksum of that algorithm) of each of ``names`` that is a file
    there."""
    facts = {}
    for name in names:
        path = Path(directory) / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue
        facts[name] = (size, checksum.of_file(path, algorithms[name]) if name in algorithms else "")
    return facts


def _remove(directory: str, names: list[str]) -> None:
    for name in names:
        (Path(directory) / name).unlink(missing_ok=True)


def _read_declarations(directory: str, names: list[str]) -> dict[str, dict[str, Any]]:
    return read_records(Path(directory), names)


def _clean(directory: str, keep: set[str]) -> list[str]:
    """Temp files, shard files not in ``keep`` and the consumption records of files not in ``keep`` (of shards
    recorded consumed already, or written again now), removed; returns what went."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    removed = []
    for file in [*path.glob(TEMP_GLOB), *path.glob(SHARD_GLOB), *path.glob(RECORD_GLOB + "*")]:
        declared = file_of_record(file.name)
        if file.name not in keep and (declared is None or declared not in keep) and not file.is_dir():
            file.unlink()
            removed.append(file.name)
    return removed


def read_claim(directory: Path) -> Optional[dict[str, Any]]:
    """The claim of a directory on this host, if it has a readable one."""
    try:
        return json.loads((Path(directory) / CLAIM_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None


def claimed_labels(claim: dict[str, Any]) -> list[str]:
    """The node labels a run's files in a claimed directory have been recorded under, oldest first (claims
    before the list name one ``node``)."""
    labels = list(claim.get("nodes") or [])
    if claim.get("node") and claim["node"] not in labels:
        labels.append(claim["node"])
    return labels


def _claim(directory: str, owner: dict[str, str], adopt_files: bool) -> dict[str, Any]:
    """Claim ``directory`` for the run ``owner`` names. ``{"labels": [...]}`` if it is now the run's: the node labels
    the run's files there can be recorded under, those its claim listed before (``claimed_labels``; a new claim: the
    label it is made under). The claim adds ``owner["node"]`` when it is new to it (the directory is the node's
    identity, its label may change), left out of the answer: no file there carries it yet. Else why not:
    ``{"owner": record}`` (another run's claim) or ``{"files": [names]}`` (an unclaimed directory that holds shard
    or temp files, which ``adopt_files`` accepts: the run's own output.dir, under its lock).
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    claim = path / CLAIM_FILE
    if claim.is_symlink():  # never a claim (a run writes a plain file): removed, what it points to untouched
        claim.unlink()
    if not claim.exists():
        files = sorted(file.name for file in [*path.glob(SHARD_GLOB), *path.glob(TEMP_GLOB)])
        if files and not adopt_files:
            return {"files": files}
        link_new_claim(path, owner)
    try:
        holder = json.loads(claim.read_text())
    except ValueError:
        holder = {"run_id": "?", "output_dir": f"(unreadable {claim})"}
    if holder.get("run_id") != owner["run_id"]:
        return {"owner": holder}
    labels = claimed_labels(holder)
    node = owner.get("node", "")
    if node and node not in labels:  # relabelled: the run's files here stay the run's under the new label too
        replace_atomically(claim, json.dumps(dict(holder, node=node, nodes=[*labels, node])).encode())
    return {"labels": labels}


class LocalDisk:
    """A directory the driver's own host holds."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def free_and_unwritten(self, reserved: dict[int, int]) -> tuple[int, int]:
        """Free bytes on the filesystem, and of ``reserved`` (shard -> bytes) what is not written yet."""
        return _free_and_unwritten(str(self.directory), reserved)

    def existing(self, names: Iterable[str]) -> set[str]:
        return set(_existing(str(self.directory), list(names)))

    def file_facts(self, names: Iterable[str], algorithms: Mapping[str, str]) -> dict[str, tuple[int, str]]:
        """Size and (for a name in ``algorithms``) checksum of each named file present."""
        return _file_facts(str(self.directory), list(names), dict(algorithms))

    def remove(self, names: Iterable[str]) -> None:
        _remove(str(self.directory), list(names))

    def read_declarations(self, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        """File name -> its consumption record (``storage.consumed``), for those of ``names`` declared consumed."""
        return _read_declarations(str(self.directory), list(names))

    def clean(self, keep: set[str]) -> list[str]:
        return _clean(str(self.directory), keep)

    def claim(self, owner: dict[str, str], adopt_files: bool) -> dict[str, Any]:
        return _claim(str(self.directory), owner, adopt_files)


def disk_on(directory: Path, node_id: str, placement: dict[str, Any]) -> LocalDisk:
    """The directory on node ``node_id``: looked at directly when that is the driver's own node (no task
    per look: the free-space check runs at every shard's start), else through tasks pinned there."""
    import ray

    if node_id == ray.get_runtime_context().get_node_id():
        return LocalDisk(directory)
    return NodeDisk(directory, placement)


_TASKS: dict[Any, Any] = {}
"""Each look as a Ray task, made once."""


class NodeDisk(LocalDisk):
    """A directory on the node ``placement`` pins tasks to."""

    def __init__(self, directory: Path, placement: dict[str, Any]) -> None:
        super().__init__(directory)
        self._placement = placement

    def _on_node(self, function: Any, *args: Any) -> Any:
        import ray  # here: `jobs.status` reads budgets without starting Ray's client

        if function not in _TASKS:
            _TASKS[function] = ray.remote(num_cpus=0)(function)
        return ray.get(_TASKS[function].options(**self._placement).remote(*args))

    def free_and_unwritten(self, reserved: dict[int, int]) -> tuple[int, int]:
        return self._on_node(_free_and_unwritten, str(self.directory), reserved)

    def existing(self, names: Iterable[str]) -> set[str]:
        return set(self._on_node(_existing, str(self.directory), list(names)))

    def file_facts(self, names: Iterable[str], algorithms: Mapping[str, str]) -> dict[str, tuple[int, str]]:
        return self._on_node(_file_facts, str(self.directory), list(names), dict(algorithms))

    def remove(self, names: Iterable[str]) -> None:
        self._on_node(_remove, str(self.directory), list(names))

    def read_declarations(self, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        return self._on_node(_read_declarations, str(self.directory), list(names))

    def clean(self, keep: set[str]) -> list[str]:
        return self._on_node(_clean, str(self.directory), keep)

    def claim(self, owner: dict[str, str], adopt_files: bool) -> dict[str, Any]:
        return self._on_node(_claim, str(self.directory), owner, adopt_files)
