"""Resume and rerun: which shards to run, and what to clean up in output.dir first."""

from __future__ import annotations

import dataclasses
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.config import SELECT_FAILED, SELECT_PENDING
from storage import shard_file_name
from storage.checksum import algorithm_of
from storage.consumed import mismatch, record_name
from storage.manifest import CONSUMED, DONE, FAILED, LOCAL, MANIFEST_FILE, PENDING, Manifest, ShardRecord
from storage.writer import SHARD_GLOB

if TYPE_CHECKING:
    from jobs.cluster.node_disk import LocalDisk

logger = logging.getLogger(__name__)


def select_shards(manifest: Manifest, selection: Any) -> list[ShardRecord]:
    """The shards this run extracts, in plan order."""
    if selection == SELECT_PENDING:
        return manifest.in_state(PENDING, FAILED)
    if selection == SELECT_FAILED:
        failed, pending = manifest.in_state(FAILED), manifest.in_state(PENDING)
        if not failed and pending:  # "nothing to do" would read as "the run is complete"
            raise ValueError(
                f"shards=failed selects no shard: none failed, but {len(pending)} of {len(manifest.shards)} are "
                f"still pending (a run that stopped early). Rerun without shards=failed: it extracts them"
            )
        return failed
    check_selection(selection, len(manifest.shards))
    return [manifest.shards[i] for i in sorted(set(selection))]


def select_planned(selection: Any, shard_count: int) -> list[int]:
    """The shards a run extracts in an output.dir with no manifest yet (every shard is pending)."""
    check_selection(selection, shard_count)
    if selection == SELECT_PENDING:
        return list(range(shard_count))
    if selection == SELECT_FAILED:
        return []
    return sorted(set(selection))


def check_selection(selection: Any, shard_count: int) -> None:
    """ValueError when ``shards=[...]`` names shards the plan does not have (pending and failed always fit)."""
    if selection in (SELECT_PENDING, SELECT_FAILED):
        return
    unknown = sorted(set(selection) - set(range(shard_count)))
    if unknown:
        raise ValueError(f"shards={selection}: the plan has shards 0..{shard_count - 1}, not {unknown}")


@dataclasses.dataclass(frozen=True)
class ClaimedDirectory:
    """A directory this run writes to, claimed: the node label it goes by now, and the labels the run's records of
    files there can carry, those its claim listed before this run (a node's address or label may change, and may
    then be another node's old one; its directory's claim is what stays)."""

    disk: LocalDisk
    node: str
    labels: tuple[str, ...]


def claim_directory(disk: LocalDisk, manifest: Manifest, node: str, is_output_dir: bool) -> ClaimedDirectory:
    """Make one node's directory this run's before anything in it is removed; ValueError if it is
    another run's (its claim), or unclaimed but holding shard files (they are not this run's).

    output.dir's lock guards output.dir only: without the claim, a run whose output.node_dir is
    another run's directory would remove that run's shards as "not recorded here".
    """
    owner = {
        "run_id": manifest.run_id, "output_dir": str(manifest.path.parent), "host": socket.gethostname(), "node": node,
    }
    refusal = disk.claim(owner, adopt_files=is_output_dir)
    if "labels" in refusal:
        return ClaimedDirectory(disk, node, tuple(refusal["labels"]))
    where = f"{disk.directory} (on node {node})" if node else str(disk.directory)
    if "owner" in refusal:
        holder = refusal["owner"]
        why = f"belongs to the run whose output.dir is {holder.get('output_dir')} on {holder.get('host', '?')}"
    else:
        files = refusal["files"]
        why = f"holds {len(files)} shard files (e.g. {files[0]}) that are not this run's"
    raise ValueError(
        f"{where} {why}; nothing there was touched. Give this run a directory of its own "
        "(e.g. output.node_dir=/mnt/nvme/eagle3/<run>/{node}), or rerun that run's own command"
    )


def relabel_moved_files(manifest: Manifest, directories: list[ClaimedDirectory]) -> None:
    """Done shards are recorded on the node whose directory holds their file (a head restarted on another address,
    a cluster created again, a node replaced by one with the same disk): the one whose claim lists the record's
    label, whichever node goes by that label now; of several, the one where the file is of its recorded size, else
    the one that goes by the label. A label no claim lists stays with the node that goes by it, or, if none does,
    moves to a directory where the file is of its recorded size. The records change, never the files;
    ``check_done_files`` then checks them there (a damaged or lost one is written again). A record none of these
    directories holds is left as it is: its node may come back.
    """
    directories = list({(d.node, str(d.disk.directory)): d for d in directories}.values())  # groups share them
    live = {directory.node for directory in directories}
    records = [record for record in manifest.in_state(DONE) if record.location == LOCAL and record.node]
    listed = {record.index: [d for d in directories if record.node in d.labels] for record in records}
    # the files looked for: a label several claims list, or one no claim lists and no node goes by
    looked = {record.index: record.file for record in records
              if len(listed[record.index]) > 1 or (not listed[record.index] and record.node not in live)}
    sizes = {id(d): d.disk.file_facts(looked.values(), {}) for d in directories} if looked else {}
    moved: dict[tuple[str, str], list[int]] = {}
    for record in records:
        claims = listed[record.index]
        if len(claims) == 1:
            home = claims[0]
        elif record.index in looked:
            whole = [directory for directory in claims or directories
                     if sizes[id(directory)].get(record.file, (None, ""))[0] == record.bytes]
            home = (whole or sorted(claims, key=lambda directory: directory.node != record.node) or [None])[0]
        else:
            continue  # no claim lists the label, and a node goes by it: its own
        if home is not None and home.node != record.node:
            moved.setdefault((record.node, home.node), []).append(record.index)
            manifest.update(record.index, node=home.node)
    for (old, new), indices in sorted(moved.items()):
        logger.info("%d done shards recorded on node %s are on node %s now (its directory holds them): "
                    "recorded there, no file touched", len(indices), old, new)


def check_absent_nodes(
    manifest: Manifest, directories: list[ClaimedDirectory], output_dir: Path, node_dir: str,
) -> None:
    """After ``relabel_moved_files``, done shards still recorded on a label no node of this run goes by: left as they
    are (their node may come back, its files on its disk), with a warning. ValueError, before anything is removed,
    where ``{node}`` in output.node_dir puts that label's directory on this host, claimed by this run: the files are
    here, in a directory no node of this run writes to (the node's name changed, and its directory with it), and
    the run would end complete with them where neither it nor ``jobs.verify`` looks."""
    from jobs.cluster.node_disk import read_claim  # here: the dry run imports this module without Ray
    from jobs.cluster.nodes import NODE_PLACEHOLDER, node_directory

    live = {directory.node for directory in directories}
    absent: dict[str, list[int]] = {}
    for record in manifest.in_state(DONE):
        if record.location == LOCAL and record.node and record.node not in live:
            absent.setdefault(record.node, []).append(record.index)
    left_here = {}
    for label, shards in sorted(absent.items()):
        directory = node_directory(output_dir, node_dir, label)
        if NODE_PLACEHOLDER in node_dir and (read_claim(directory) or {}).get("run_id") == manifest.run_id:
            left_here[label] = directory
        else:
            logger.warning("%d done shards are recorded on node %s, which is not in this run: their files were not "
                           "checked and stay on its disk", len(shards), label)
    if left_here:
        name = next(iter(left_here)) if len(left_here) == 1 else "NAME"
        ours = ", ".join(sorted({f"{d.disk.directory} (node {d.node})" for d in directories}))
        where = "; ".join(f"shards {shard_list(absent[label])} are recorded done on node {label}, in {directory}"
                          for label, directory in left_here.items())
        raise ValueError(
            f"{where} (on this host), but no node of this run goes by {' or '.join(left_here)}: with {{node}} in "
            f"output.node_dir={node_dir} a node's directory follows its name, and this run writes to {ours}. No shard "
            f"file was removed or written. Rerun with a node of that name in the run (the same ray.address and "
            f"model.dp_size; a node started with ray start --labels='{{\"eagle3-node\": \"{name}\"}}'), or move "
            f"those shard-*.parquet files into the directory of the node that holds them now and rerun: it records "
            f"them there"
        )


def check_done_files(
    disk: LocalDisk, manifest: Manifest, node: str, holds_unnamed: bool, checksum: bool,
) -> list[int]:
    """Before a rerun trusts them: every done shard's file in this node's directory is there, of the size the
    manifest recorded (and, with ``checksum``, of its recorded checksum). A shard whose file is not is pending again (the
    clean-up removes what is left of it) and is written again; returns those shards.

    A file that is gone was consumed only if a consumer declared it (``storage.consumed.consume_shard``): then it
    is recorded as consumed into what the declaration names, and the declaration removed. A declaration that does
    not name the recorded file's size and checksum (``storage.consumed.mismatch``) is dropped, present file or not. Gone without one, it was
    lost: written again like a damaged one (``shards=[i]`` rewrites a consumed one on request)."""
    records = [
        record for record in manifest.in_state(DONE)
        if record.location == LOCAL and (record.node == node or (not record.node and holds_unnamed))
    ]
    algorithms = {record.file: algorithm_of(record.checksum) for record in records} if checksum else {}
    facts = disk.file_facts([record.file for record in records], algorithms)
    declared = disk.read_declarations(record.file for record in records)
    damaged, served = [], []
    for record in records:
        size, found = facts.get(record.file, (None, ""))
        declaration = declared.get(record.file)
        why = mismatch(declaration, record.bytes, record.checksum) if declaration is not None else ""
        if why:
            logger.warning("shard %d: %s does not vouch for the file the run recorded (%s): dropped", record.index,
                           disk.directory / record_name(record.file), why)
            served.append(record.file)
            declaration = None
        if size is None and declaration is not None:
            logger.info("shard %d: %s was consumed into %s (declared by its consumer)", record.index,
                        disk.directory / record.file, declaration["into"])
            manifest.update(record.index, location=CONSUMED, consumed_into=declaration["into"])
            served.append(record.file)
            continue
        if size is None:
            problem = ("is gone and no consumer declared it consumed (storage.consumed.consume_shard): lost, not "
                       "consumed")
        elif size != record.bytes:
            problem = f"{size} bytes, the manifest recorded {record.bytes}"
        elif checksum and found != record.checksum:
            problem = "its checksum is not the one the manifest recorded"
        else:
            continue
        message = f"{disk.directory / record.file}: {problem}; the shard is written again"
        logger.warning("shard %d: %s", record.index, message)
        manifest.update(record.index, state=PENDING, error=message)
        damaged.append(record.index)
    disk.remove(record_name(name) for name in served)  # a declaration beside its file: a consumer is at work
    return damaged


def clean_output_dir(
    disk: LocalDisk, manifest: Manifest, to_run: list[ShardRecord], node: str = "", holds_unnamed: bool = True,
) -> None:
    """Remove what an interrupted run left in one node's directory: temp files, and shard files the
    manifest does not vouch for there (done, local, on ``node``; records of single-node runs name no
    node and vouch for files in output.dir: ``holds_unnamed``). The looks run on the node.

    A file renamed into place right before a crash is complete but unrecorded; it is
    deleted and its shard extracted again, so that no row is ever in two files.
    """
    rerun = {record.index for record in to_run}
    keep = {
        shard_file_name(index) for index, record in manifest.shards.items()
        if record.state == DONE and record.location == LOCAL and index not in rerun
        and (record.node == node or (not record.node and holds_unnamed))
    }
    for name in disk.clean(keep):
        logger.info("removing %s from %s (not recorded as done there)", name, disk.directory)
    manifest.start_over(rerun)


def refuse_foreign_output(output_dir: Path, manifest_exists: bool) -> None:
    """Shard files without a manifest belong to something else: never overwrite them."""
    if manifest_exists:
        return
    existing = sorted(output_dir.glob(SHARD_GLOB))
    if existing:
        raise ValueError(
            f"output.dir={output_dir} holds {len(existing)} shard files (e.g. {existing[0].name}) but no "
            f"{MANIFEST_FILE}: they are not from a run of this job; choose a new output.dir"
        )


def shard_list(shards: list[int], limit: int = 20) -> str:
    """Shard indices for a message: the first ``limit`` of them, then how many more."""
    more = f" and {len(shards) - limit} more" if len(shards) > limit else ""
    return ", ".join(str(index) for index in shards[:limit]) + more
