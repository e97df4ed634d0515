"""What the driver decides before Ray starts and before the model loads.

The demo's paths (and never into a directory that holds something else), the
checkpoint's weight files (no pickled weights unless trusted), output.dir
(writable, outside the input), the sink (a test write), and whether every shard
this run would write fits the disk budget and the disk (from config.json and the
dataset's lengths alone).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import fnmatch
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from common.checks import format_bytes
from extractor.config import ModelConfig
from inputs.demo import prepare_demo
from inputs.files import GLOB_CHARS
from jobs.config import JobConfig
from jobs.outdir.budget import DiskBudget
from jobs.planning.content import recorded_model_path
from jobs.planning.shards import Shard
from runtime.errors import BudgetExhausted, ConfigError
from runtime.lock import LOCK_FILE
from storage import ShardMetadata
from storage.manifest import MANIFEST_FILE, SINK, Manifest, read_manifest
from storage.sink import claim, claim_refusal, sink_url_for
from storage.sink import probe as probe_sink
from storage.writer import state_bytes_per_token

DEMO_OUTPUT = "hidden_states-{arch}-{num_samples}-seed{seed}"
"""The demo's own output.dir under demo.dir, one per demo model and dataset (like theirs: model-{arch}-seed{seed},
data-{num_samples}-seed{seed}): each demo resumes in its own, whatever ran before."""
DEMO_SHARD_SIZE = 16
# Weight files torch.load unpickles: loading them can run code stored in them.
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth")
SINK_PROBE_TIMEOUT_S = 30.0
"""A test write to the sink that takes longer means uploads would crawl or hang: refused up front."""


def demo_config(config: JobConfig) -> JobConfig:
    """The demo's model, data and output paths filled in (model and data built once, then reused).

    The demo resumes like any run: nothing is deleted. Each demo model and dataset has its own
    output directory, so the demos run in any order. A user-named ``output.dir`` that holds
    anything but a demo's output is refused: with model.path and data.path both empty, the
    likelier story is a forgotten ``--config``.
    """
    demo = config.demo
    demo_dir = Path(demo.dir)
    default_output = demo_dir / DEMO_OUTPUT.format(arch=demo.arch, num_samples=demo.num_samples, seed=demo.seed)
    output_dir = Path(config.output.dir) if config.output.dir else default_output
    if config.output.dir:
        _refuse_foreign_demo_output(output_dir, demo_dir)
    model_dir, data_path = prepare_demo(demo_dir, config.demo.arch, config.demo.num_samples, config.demo.seed)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=str(model_dir)),
        data=dataclasses.replace(
            config.data, path=str(data_path), shard_size=min(config.data.shard_size, DEMO_SHARD_SIZE)
        ),
        output=dataclasses.replace(config.output, dir=str(output_dir)),
    )


def _refuse_foreign_demo_output(output_dir: Path, demo_dir: Path) -> None:
    if not output_dir.is_dir():
        return
    entries = sorted(path.name for path in output_dir.iterdir() if path.name != LOCK_FILE)
    if not entries:
        return
    if MANIFEST_FILE in entries:
        model_path = Path(recorded_model_path(read_manifest(output_dir)["content"]))
        if model_path.resolve().is_relative_to(demo_dir.resolve()):
            return  # an earlier demo run: resume it
    raise ConfigError(
        f"model.path and data.path are empty, so this would run the demo, but output.dir={output_dir} holds "
        f"{len(entries)} entries that are not a demo's output (e.g. {', '.join(entries[:3])}). Did you forget "
        "--config? Set model.path and data.path for a real run, or give the demo an empty or new output.dir"
    )


def refuse_pickled_weights(model: ModelConfig) -> None:
    """Without ``model.trust_remote_code`` a checkpoint must ship safetensors: .bin/.pt files are
    pickles, and some SGLang releases fall back to a full (code-running) unpickle for them."""
    if model.trust_remote_code or model.load_format not in ("auto", "pt"):
        return
    directory = Path(model.path)
    if model.load_format == "auto" and any(directory.glob("*.safetensors")):
        return  # SGLang prefers safetensors and never opens the pickles
    pickled = sorted(path.name for pattern in PICKLED_WEIGHTS for path in directory.glob(pattern))
    if pickled:
        raise ConfigError(
            f"model.path={directory} has only pickled weights ({', '.join(pickled[:3])}), and loading a pickle "
            "can run code stored in it. Convert the checkpoint to safetensors, or set "
            "model.trust_remote_code=true if you trust where it came from"
        )


def check_shards_fit(
    shards: Iterable[Shard], budget: DiskBudget, metadata: ShardMetadata, reclaimable: int = 0,
) -> None:
    """Every planned shard must fit the disk budget whole, and the disk above output.min_free,
    or it could never be written. ``reclaimable``: bytes of this run's own files in output.dir that a
    consumer or the sink may free."""
    bytes_per_token = state_bytes_per_token(metadata)
    largest = 0
    for shard in shards:
        need = budget.predict(shard.tokens, bytes_per_token, len(shard.batches))
        largest = max(largest, need)
        if need > budget.shard_limit:
            own = (f", of which the job's own files in output.dir take up to {format_bytes(budget.own_files)} "
                   f"({budget.own.describe()}), which leaves {format_bytes(budget.shard_limit)} for shard files"
                   if budget.own_files else "")
            raise ConfigError(
                f"shard {shard.index} needs about {format_bytes(need)} but output.disk_budget is "
                f"{format_bytes(budget.limit)}{own}: a shard must fit the budget whole. Raise output.disk_budget to "
                f"at least {budget.own_files + need} bytes, or lower data.shard_size"
            )
    free = free_bytes(budget.output_dir)
    if largest and free + reclaimable - budget.min_free_bytes < largest:
        raise BudgetExhausted(
            f"output.dir={budget.output_dir} has {format_bytes(free)} free; above output.min_free="
            f"{format_bytes(budget.min_free_bytes)} the largest shard (about {format_bytes(largest)}) can never be "
            "written there. Free space, lower output.min_free or data.shard_size, or choose another output.dir"
        )


def free_bytes(output_dir: Path) -> int:
    """Free bytes on the filesystem output.dir is (or will be) on."""
    existing = next(path for path in (output_dir, *output_dir.parents) if path.exists())
    return shutil.disk_usage(existing).free


def check_output_dir(output_dir: Path, data_path: str, create: bool = True) -> None:
    """output.dir must be writable, and never where data.path reads (its shards would be read as input next
    time). ``create``: make it and write a probe there (the job); without, look only (the dry run)."""
    if data_path:
        fs, local = fsspec.core.url_to_fs(data_path)
        if isinstance(fs, LocalFileSystem):  # a file:// URL too: its directory is read the same way
            refuse_output_in_input(output_dir, local)
    if not create:
        _check_writable(output_dir)
        return
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".eagle3-write-probe-", dir=output_dir)  # new, never through a link
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise _unwritable(output_dir, error) from None


def refuse_sink_in_output(sink: str, options: dict[str, Any], output_dir: Path, node_dir: str = "") -> None:
    """ConfigError when a local output.sink is output.dir (through a link too), inside it, or at or inside a node's
    output.node_dir: each upload would copy a shard onto itself (or into the directory the run reads as its own)
    and then delete the local file, its only copy."""
    fs, remote = fsspec.core.url_to_fs(sink, **options)
    if not isinstance(fs, LocalFileSystem):
        return
    target = Path(remote).resolve()
    output = Path(output_dir).resolve()
    if target == output or output in target.parents:
        where = "is output.dir" if target == output else "is inside output.dir"
        raise ConfigError(
            f"output.sink={sink} {where}={output_dir}: each upload would land where the run keeps its shards and "
            "then delete the local file. Name a sink outside output.dir (or drop output.sink to keep the shards "
            "in output.dir)"
        )
    from jobs.cluster.nodes import NODE_PLACEHOLDER  # here: the dry run and the checks before it run without Ray

    pattern = str(Path(node_dir.replace(NODE_PLACEHOLDER, "*")).resolve()) if node_dir else ""
    inside = [path for path in (target, *target.parents) if pattern and path.match(pattern)]  # `*`: one name
    if inside:
        where = "is a node's directory" if inside[0] == target else "is inside a node's directory"
        raise ConfigError(
            f"output.sink={sink} {where} (output.node_dir={node_dir}): each upload would land where that node keeps "
            "its shards and then delete the local file. Name a sink outside the node directories"
        )


def refuse_output_in_input(output_dir: Path, data_path: str) -> None:
    """ConfigError when the shard files in ``output_dir`` would be input of a run reading ``data_path``:
    output.dir inside the data.path directory, the directory that holds the data.path file (a glob over
    it, or the directory itself as data.path, would read them), or one a data.path glob matches."""
    data, output = Path(data_path).resolve(), output_dir.resolve()
    if data.is_dir() and (output == data or data in output.parents):
        where = f"is inside data.path={data_path}"
    elif data.is_file() and output == data.parent:
        where = f"is the directory that holds data.path={data_path}"
    elif any(char in data_path for char in GLOB_CHARS) and any(
        fnmatch.fnmatch(str(path), data_path) for path in (output, output / "shard-00000.parquet")
    ):
        where = f"is matched by the glob data.path={data_path}"
    else:
        return
    raise ConfigError(
        f"output.dir={output_dir} {where}: its shard files would be read as input by the next run (a glob or "
        "a directory over the input). Choose an output.dir outside the input"
    )


def _check_writable(output_dir: Path) -> None:
    """What ``mkdir`` and a probe write would find, without either: the nearest existing path must be a
    directory this user can write into."""
    existing = next(path for path in (output_dir, *output_dir.parents) if path.exists() or path.is_symlink())
    if not existing.is_dir():
        raise _unwritable(output_dir, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _unwritable(output_dir, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))


def _unwritable(output_dir: Path, error: OSError) -> ConfigError:
    return ConfigError(
        f"output.dir={output_dir}: cannot write there ({type(error).__name__}: {error.strerror or error}); "
        "choose a directory this user can write to, or fix its permissions"
    )


def check_sink(sink: str, options: dict[str, Any], output_dir: Path, node_dir: str = "") -> None:
    """output.sink is not where the run keeps its shards (``refuse_sink_in_output``), takes a file, gives it
    back and deletes it, within SINK_PROBE_TIMEOUT_S, and is not another run's (``refuse_foreign_sink``)."""
    if not sink:
        return
    refuse_sink_in_output(sink, options, output_dir, node_dir)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        pool.submit(probe_sink, sink, options).result(timeout=SINK_PROBE_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        raise ConfigError(
            f"output.sink={sink}: no answer within {SINK_PROBE_TIMEOUT_S:.0f} s to a test write; check the URL, "
            "the endpoint and the network (output.sink_options), or drop output.sink"
        ) from None
    except Exception as error:
        raise ConfigError(
            f"output.sink={sink}: a test write, read and delete failed ({type(error).__name__}: "
            f"{' '.join(str(error).split())}); check the URL, credentials and output.sink_options, or drop output.sink"
        ) from None
    finally:
        pool.shutdown(wait=False)
    refuse_foreign_sink(sink, options, output_dir)


def refuse_foreign_sink(sink: str, options: dict[str, Any], output_dir: Path) -> None:
    """ConfigError when output.sink belongs to another run (its claim: ``storage.sink.claim``), or holds shard files
    the run in output.dir did not upload: an upload replaces a file of the same name, then deletes the local copy."""
    stored = read_manifest(output_dir) if (output_dir / MANIFEST_FILE).exists() else {"run_id": "", "shards": []}
    why = claim_refusal(sink, options, stored.get("run_id", ""), uploaded_into(sink, stored["shards"]))
    if why:
        raise ConfigError(sink_taken(sink, why))


def claim_sink(sink: str, options: dict[str, Any], manifest: Manifest) -> None:
    """Make output.sink the run's own before its first upload (``storage.sink.claim``); ConfigError when it is
    another's: two runs starting at once with one sink, after ``refuse_foreign_sink`` let both through."""
    if not sink:
        return
    owner = {"run_id": manifest.run_id, "output_dir": str(manifest.path.parent), "host": socket.gethostname()}
    why = claim(sink, options, owner, uploaded_into(sink, manifest.shards.values()))
    if why:
        raise ConfigError(sink_taken(sink, why))


def uploaded_into(sink: str, records: Iterable[Any]) -> set[str]:
    """The files a run's manifest records (dicts, or ``ShardRecord``) as uploaded into ``sink``."""
    records = [record if isinstance(record, dict) else dataclasses.asdict(record) for record in records]
    return {record["file"] for record in records
            if record.get("location") == SINK and record.get("sink_url") == sink_url_for(sink, record["file"])}


def sink_taken(sink: str, why: str) -> str:
    """The refusal of a sink that is not the run's (``why``: ``storage.sink.claim_refusal``), and what to do."""
    return (f"output.sink={sink} {why}; nothing there was touched. Give each run a sink of its own (e.g. "
            "output.sink=s3://bucket/eagle3/<run>/), or rerun that run's own command")