"""The job's ``output`` section: the output directory (``common.config.OutputDir``), its disk budget, the sink (its
options: ``common.config.SinkOptions``) and the writers that fill it.

It checks its own keys when built; byte sizes are parsed once, into ``*_bytes`` (``output.disk_budget`` by
``parse_disk_budget``, which ``jobs.status`` parses its own with too). It sits low in ``jobs/`` with the
budget (``jobs.outdir.budget``), so that what plans a run and the actors import down to it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from common.checks import check_choice, check_int, check_seconds, parse_bytes
from common.config import OutputDir, SinkOptions
from storage.schema import DEFAULT_CHECKSUM, SAME_AS_MODEL, ChecksumAlgorithm, StateDtype

ResumeCheck = Literal["size", "checksum"]
AUTO = "auto"
WRITER_CPUS = (AUTO, "all")


def parse_cpu_list(value: str, key: str) -> list[int]:
    """``"4-7,9"`` -> [4, 5, 6, 7, 9] (the notation of taskset and /sys/devices/system/cpu)."""
    cores: set[int] = set()
    for part in str(value).split(","):
        first, _, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            low, high = 0, -1
        if low < 0 or high < low:
            raise ValueError(f"{key}={value!r}: use auto, all, or a list of cores such as 4-15 or 2,3,8-11")
        cores.update(range(low, high + 1))
    return sorted(cores)


def parse_disk_budget(value: str) -> int:
    """``output.disk_budget`` in bytes, more than 0."""
    budget = parse_bytes(value, "output.disk_budget")
    if budget <= 0:
        raise ValueError(f"output.disk_budget={value!r}: must be more than 0 bytes, or no shard could ever be written")
    return budget


@dataclasses.dataclass
class OutputConfig(SinkOptions, OutputDir):
    node_dir: str = ""
    """With extractor groups on several nodes: each node's local directory for its shard files, {node} standing
    for the node's name (its eagle3-node label, else its IP), e.g. /mnt/nvme/run1/{node}. Empty: output.dir on every node."""
    disk_budget: str = "1.3TB"
    """Most bytes kept under output.dir at once, per node: shard files (committed + being written) and the job's own
    files (manifest, summary and its reserve, ...: at most a bound fixed before Ray starts); 500GB, 1.3TB or bytes."""
    min_free: str = "10GB"
    """Free-space floor on output.dir's filesystem: no batch starts that could push free space below it; 10GB, 500MB or bytes."""
    budget_wait_s: float = 3600.0
    """How long the job waits for disk budget when nothing it does can free any and nothing is consumed, before it
    stops (exit 3; a rerun resumes). Each shard a trainer consumes restarts the wait: set it above the trainer's
    longest pause between two shards (a checkpoint, an evaluation, a restart)."""
    rescan_s: float = 10.0
    """How often output.dir is re-scanned for shard files deleted by someone else (a trainer consuming them)."""
    sink: str = ""
    """fsspec URL (s3://bucket/prefix, file:///mnt/big): committed shards are uploaded, verified, then deleted locally."""
    num_writers: int = 0
    """CPU writer actors per extractor group (one group per tp_size GPUs of a node); 0: half the node's CPUs (8 to
    32) shared among its groups, at most what is left after the extractors. A run starts no more than it has shards
    to write (a rerun of one shard: one writer)."""
    num_uploaders: int = 2
    """CPU actors uploading committed shards to the sink."""
    upload_attempts: int = 6
    """Tries per shard's upload in one run, output.rescan_s apart after the first failure and four times longer after
    each next one (at most 30 min): six span 45 minutes of a sink's outage. After the last the shard stays local,
    listed, and the run exits 7."""
    max_inflight_batches: int = 0
    """Batches between extraction and a finished write; bounds the states held in memory. 0: writers + 2."""
    resume_check: ResumeCheck = "size"
    """What a rerun checks of every done shard's file before it trusts it: size (present, of its recorded size) or
    checksum (also its recorded checksum; reads every file once). A file that fails is extracted again."""
    checksum: ChecksumAlgorithm = DEFAULT_CHECKSUM
    """Checksum of every shard file, computed as it is written, recorded in the manifest and checked by the
    sink upload, resume_check=checksum and jobs.verify: xxh3_128 (xxhash; ~15x less CPU) or sha256 (what
    sha256sum prints). Files are always checked with the algorithm they were recorded with."""
    writer_cpus: str = AUTO
    """Cores the writer actors run on. auto: with CUDA extractors, every core of the node but the first 2 per GPU
    of its extractors + 2 (left to their forward threads, the driver and Ray), writers at nice 5; all cores on
    CPU or on a node with fewer than 4 cores beyond those. all: no pinning. Or a core list for every node, e.g.
    8-15. The summary's nodes.<node>.writer_cpus says what each node's writers got."""
    state_dtype: StateDtype = SAME_AS_MODEL
    """model (bit-exact with SGLang) | float8_e4m3fn: states quantized on the device with one float32 scale
    per token and layer (amax / 448), half the bytes; readers get the model dtype back, dequantized."""


    def __post_init__(self) -> None:
        self.disk_budget_bytes  # each raises naming its key
        self.min_free_bytes
        for key in ("budget_wait_s", "rescan_s"):
            check_seconds(f"output.{key}", getattr(self, key))
        if self.rescan_s == 0:
            raise ValueError("output.rescan_s=0: must be more than 0 seconds (the job re-scans output.dir that often)")
        check_int("output.num_writers", self.num_writers, 0, "0 picks the count from the CPUs Ray has left")
        check_int("output.num_uploaders", self.num_uploaders, 1, "at least one uploader carries shards to the sink")
        check_int("output.upload_attempts", self.upload_attempts, 1)
        check_int("output.max_inflight_batches", self.max_inflight_batches, 0, "0 picks writers + 2")
        check_choice("output.state_dtype", self.state_dtype, StateDtype)
        check_choice("output.resume_check", self.resume_check, ResumeCheck)
        check_choice("output.checksum", self.checksum, ChecksumAlgorithm)
        if self.writer_cpus not in WRITER_CPUS:
            parse_cpu_list(self.writer_cpus, "output.writer_cpus")
        if self.sink_options and not self.sink:
            raise ValueError("output.sink_options is set but output.sink is empty: name the sink URL too")

    @functools.cached_property
    def disk_budget_bytes(self) -> int:
        """``disk_budget`` in bytes."""
        return parse_disk_budget(self.disk_budget)

    @functools.cached_property
    def min_free_bytes(self) -> int:
        """``min_free`` in bytes."""
        return parse_bytes(self.min_free, "output.min_free")
