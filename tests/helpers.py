"""What the tests share: the environment of the commands they start, a small job config (and the keys of
conftest's finished run, copies of a run), extractor actors, HF reference states, checks of a run's output, tools
to damage files or sample a directory, the processes a command started, the trainers' own loaders, a process that
holds a run's lock, SmolLM2-135M-Instruct (real trained weights) with its extraction runs, and the tiny DeepSeek-V3
with its bf16 job run, each made once per
test session.

Test modules import from here, ``tests.paths`` and ``tests.conftest`` only, never from one another."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
import xxhash

from extractor.drafter_config import IDS_KEY as IDS
from extractor.types import CapturedBatch, EngineInfo, EngineSpec, TokenBatch
from inputs.demo import build_synthetic_dataset, build_tiny_model
from jobs.actors.extractor import fetch_batch, start_extractor
from jobs.config import load_config
from storage import ShardReader, ShardWriter
from testbeds.smollm2 import checkpoint_dir
from tests.paths import REPO_ROOT
from training import peer_formats


def engine_spec(model: Path, layer_ids, dtype: str = "float32", tp_size: int = 1, **overrides) -> EngineSpec:
    fields = dict(
        model_path=str(model),
        dtype=dtype,
        device="cpu",
        tp_size=tp_size,
        attention_backend="torch_native",
        layer_ids=tuple(layer_ids),
        last_hidden_state="post_norm",
        max_tokens_per_batch=2048,
        max_samples_per_batch=32,
    )
    fields.update(overrides)
    return EngineSpec(**fields)


def checksum_of(data: bytes, like: str) -> str:
    """``data``'s checksum in the ``<algorithm>:<hex>`` form and algorithm of ``like`` (a recorded value), computed
    here with the hash libraries themselves, not through ``storage.checksum``."""
    algorithm = like.split(":", 1)[0]
    digest = {"xxh3_128": lambda: xxhash.xxh3_128(data).hexdigest(), "sha256": lambda: hashlib.sha256(data).hexdigest()}
    return f"{algorithm}:{digest[algorithm]()}"


class ExtractorHandle:
    """An extractor actor (its own process: SGLang's runtime is once per process)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.actor = start_extractor(spec)
        self.info = ray.get(self.actor.info.remote())

    def extract(self, input_ids: list[np.ndarray]) -> CapturedBatch:
        return fetch_batch(self.actor.extract.remote(TokenBatch.of(input_ids)))

    def close(self) -> None:
        ray.get(self.actor.close.remote())
        ray.kill(self.actor)


def extract_once(spec: EngineSpec, sequences: list[np.ndarray]) -> tuple[EngineInfo, CapturedBatch]:
    """Start an extractor, run one packed batch, stop it."""
    extractor = ExtractorHandle(spec)
    try:
        return extractor.info, extractor.extract(sequences)
    finally:
        extractor.close()


def load_hf_model(model_path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_hidden_states(model, input_ids: np.ndarray) -> tuple[torch.Tensor, ...]:
    """HF ``output_hidden_states`` for one sequence: [embeddings, layer 0 out, ..., final (normed)]."""
    with torch.no_grad():
        out = model(torch.as_tensor(input_ids, dtype=torch.long)[None], output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def hf_final_states(model, input_ids: np.ndarray) -> dict[str, torch.Tensor]:
    """HF's final state of one sequence both ways: the input of ``model.model.norm`` (pre_norm) and
    the last ``output_hidden_states`` entry (post_norm)."""
    kept = {}
    hook = model.model.norm.register_forward_hook(lambda module, args, output: kept.update(pre_norm=args[0][0]))
    try:
        post_norm = hf_hidden_states(model, input_ids)[-1]
    finally:
        hook.remove()
    return {"pre_norm": kept["pre_norm"], "post_norm": post_norm}


def split_tokens(states: np.ndarray, lengths) -> list[np.ndarray]:
    return np.split(states, np.cumsum(lengths)[:-1])


def random_sequences(lengths, vocab_size: int = 512, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).astype(np.int32) for n in lengths]


def assert_matches_hf(model_path: Path, layer_ids, captured: CapturedBatch, sequences, hidden: int,
                      neighbour_gap: float, final: str = "post_norm") -> None:
    """Aux states equal HF ``hidden_states[k+1]`` within 1e-5 and are at least ``neighbour_gap``
    away from ``[k]`` and ``[k+2]`` (an off-by-one convention fails loudly); the final state
    equals HF's ``final`` one (post_norm or pre_norm) and is far from the other kind."""
    hf = load_hf_model(model_path)
    lengths = [len(ids) for ids in sequences]
    other = {"post_norm": "pre_norm", "pre_norm": "post_norm"}[final]
    for ids, aux, last in zip(sequences, split_tokens(captured.aux_hidden_states, lengths),
                              split_tokens(captured.last_hidden_state, lengths)):
        reference = hf_hidden_states(hf, ids)
        aux = torch.from_numpy(aux)
        for j, k in enumerate(layer_ids):
            got = aux[:, j * hidden : (j + 1) * hidden]
            assert (got - reference[k + 1]).abs().max() < 1e-5, f"layer {k}"
            assert (got - reference[k]).abs().max() > neighbour_gap, f"layer {k} looks like HF[{k}]"
            assert (got - reference[k + 2]).abs().max() > neighbour_gap, f"layer {k} looks like HF[{k + 2}]"
        finals = hf_final_states(hf, ids)
        last = torch.from_numpy(last)
        scale = max(1.0, finals[final].abs().max().item())
        assert (last - finals[final]).abs().max() < 1e-5 * scale, f"final state is not HF's {final}"
        assert (last - finals[other]).abs().max() > neighbour_gap, f"final state looks like HF's {other}"


def assert_reads_as_parquet_dataset(out: Path, rows: int) -> None:
    """pyarrow.dataset, duckdb, polars and HF datasets open the output directory as one dataset of
    ``rows`` rows: the job's own files (.manifest.json, .summary.json, .drafter_config.json, .job.lock)
    and a shard being written (a hidden temp file) are skipped."""
    import datasets
    import duckdb
    import polars
    import pyarrow.dataset

    cache = str(out.parent / "hf-cache")
    meta = ShardReader(next(out.glob("shard-*.parquet"))).metadata
    bits = np.dtype(f"u{meta.itemsize}")
    with ShardWriter(out / "shard-99999.parquet", meta) as partial:
        tokens = np.arange(7, dtype=np.int32)
        partial.append([10**6], [tokens], [np.ones(7, np.uint8)], np.zeros((7, meta.aux_width), bits),
                       np.zeros((7, meta.hidden_size), bits) if meta.has_last_hidden_state else None)
        assert any(path.name.startswith(".shard-99999") for path in out.iterdir())  # mid-write
        counts = {
            "pyarrow.dataset": pyarrow.dataset.dataset(out, format="parquet").count_rows(),
            "duckdb": duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/*.parquet')").fetchone()[0],
            "polars": polars.scan_parquet(f"{out}/*.parquet").select(polars.len()).collect().item(),
            "datasets by directory": datasets.load_dataset(str(out), split="train", cache_dir=cache).num_rows,
            "datasets data_dir": datasets.load_dataset("parquet", data_dir=str(out), split="train", cache_dir=cache).num_rows,
        }
    assert counts == dict.fromkeys(counts, rows), counts


def assert_run_verifies(output_dir: Path, sink_options: dict | None = None) -> None:
    """``jobs.verify --deep`` finds no problem in the run (files, sizes, checksums, schema, ids, NaN/Inf)."""
    from jobs.verify import format_report, verify

    report = verify(Path(output_dir), deep=True, sink_options=sink_options)
    assert report.ok, format_report(report)


def assert_every_sample_once(output_dir: Path | Sequence[Path], dataset_path: Path) -> None:
    """The shard files under ``output_dir`` (one directory or several: one per node) hold every sample
    of the dataset exactly once, and no temp file of a shard remains; a run's directory (one with a
    manifest) also passes ``jobs.verify --deep``."""
    from inputs.dataset import open_tokenized_dataset
    from storage.manifest import MANIFEST_FILE
    from storage.writer import TEMP_GLOB

    directories = [Path(output_dir)] if isinstance(output_dir, (str, Path)) else [Path(d) for d in output_dir]
    if len(directories) == 1 and (directories[0] / MANIFEST_FILE).exists():
        assert_run_verifies(directories[0])
    seen: list[int] = []
    for directory in directories:
        assert not list(directory.glob(TEMP_GLOB)), f"temp files left in {directory}"
        for path in sorted(directory.glob("shard-*.parquet")):
            seen.extend(sample.sample_id for sample in ShardReader(path))
    expected = open_tokenized_dataset(str(dataset_path), vocab_size=2**31 - 1, max_length=2**31 - 1).sample_ids
    duplicates = sorted(sample for sample, count in collections.Counter(seen).items() if count > 1)
    assert not duplicates, f"samples written more than once: {duplicates[:10]}"
    assert sorted(seen) == sorted(expected.tolist()), f"{len(seen)} samples written, {len(expected)} in the dataset"


HIDDEN = 64
"""Hidden size of the tiny test models (conftest)."""


def python_env(**extra: str) -> dict[str, str]:
    """The environment of a command the tests start: this checkout on the path, no Ray address (a command
    starts its own private cluster), Ray's auth off; ``extra`` on top."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    return dict(env, PYTHONPATH=str(REPO_ROOT), RAY_AUTH_MODE="disabled", **extra)


def user_env(**extra: str) -> dict[str, str]:
    """A user's shell: like ``python_env`` but without the test session's loopback switch either."""
    env = python_env(RAY_USAGE_STATS_ENABLED="0", **extra)
    if "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in extra:
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    return env


def imported_by(modules: str, prefixes: tuple[str, ...]) -> list[str]:
    code = f"import sys, {modules}; print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=python_env(),
                            capture_output=True, text=True, check=True)
    return eval(result.stdout)


def job_args(model, data, out, *extra) -> list[str]:
    """The job's keys for a small CPU run of ``model`` over ``data`` into ``out``, as a command's arguments;
    ``extra`` overrides."""
    return [f"model.path={model}", f"data.path={data}", f"output.dir={out}", "data.shard_size=8",
            "extract.max_tokens_per_batch=300", "model.device=cpu", "output.min_free=1GB",
            "output.budget_wait_s=30", *extra]


def job_config(model, data, out, *extra):
    """The job's config for a small CPU run of ``model`` over ``data`` into ``out`` (``job_args``)."""
    return load_config(job_args(model, data, out, *extra))


FINISHED_RUN = ("data.shard_size=4", "output.min_free=0")
"""The keys of conftest's ``finished_run`` beside ``job_args``'s: the demo dataset's 20 samples in five shards, in
the model's dtype (bfloat16) with the pre-norm final state (the defaults). A rerun of a copy of it with
``job_args(..., *FINISHED_RUN)`` resumes it."""


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of a run's output.dir, as a user's ``cp -a`` makes it: the run there is resumed, never redone."""
    out = tmp_path / "out"
    shutil.copytree(run_dir, out, symlinks=True)
    return out


def own_files_bytes(config) -> int:
    """The most the job's own files take in output.dir for a run of ``config``, as the job fixes it before Ray
    (``jobs.rundir.bookkeeping``): what a budget needs besides room for its shards."""
    from jobs.planning.engine import planned_metadata
    from jobs.planning.inputs import read_inputs
    from jobs.planning.own_files import own_files
    from jobs.planning.shards import plan_shards
    from jobs.rundir.summary import RunSummary
    from storage.manifest import MANIFEST_FILE, Manifest, ShardRecord

    inputs = read_inputs(config)
    config = inputs.config
    plan = plan_shards(inputs.dataset.lengths, config.data.shard_size, config.extract.max_tokens_per_batch,
                       config.extract.max_samples_per_batch)
    ranges = [(shard.index, shard.start, shard.stop) for shard in plan]
    summary = RunSummary(config, inputs.output_dir, {s.index: s.tokens for s in plan}, [s.index for s in plan],
                         inputs.dataset.invalid)
    before = Manifest(inputs.output_dir / MANIFEST_FILE, {}, {i: ShardRecord(i, a, b) for i, a, b in ranges})
    metadata = planned_metadata(config, inputs.checkpoint, inputs.layer_ids)
    return own_files(inputs, ranges, metadata, summary.room(before)).total


def read_all(out_dir):
    """Every sample of the shard files in ``out_dir`` by sample id (none may be there twice)."""
    samples = {}
    for path in sorted(out_dir.glob("shard-*.parquet")):
        for sample in ShardReader(path):
            assert sample.sample_id not in samples, f"sample {sample.sample_id} written twice"
            samples[sample.sample_id] = sample
    return samples


def check_drafter(run_dir, variants: dict[str, dict], tmp_path) -> tuple[int, dict[str, str], str]:
    """Run the CLI on every variant at once; returns the exit code and each variant's PASS/FAIL line."""
    paths = []
    for name, config in variants.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        paths.append(str(path))
    result = subprocess.run(
        [sys.executable, "-m", "jobs.check_drafter", *paths, f"output.dir={run_dir}"],
        cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=600,
    )
    verdicts = {}
    for line in result.stdout.splitlines():
        found = re.match(r"(PASS|FAIL) .*/([\w+-]+)\.json: (.*)", line)
        if found:
            verdicts[found.group(2)] = f"{found.group(1)} {found.group(3)}"
    return result.returncode, verdicts, result.stdout + result.stderr[-3000:]


def with_ids(config: dict, ids: list[int]) -> dict:
    return {**config, "eagle_config": {**config["eagle_config"], IDS: ids}}


def vllm_style(config: dict, ids: list[int]) -> dict:
    return {**{k: v for k, v in config.items() if k != "eagle_config"}, IDS: ids}


class DiskSampler:
    """Looks at a directory's files again and again while a job runs (a thread of its own, every ``interval_s``):
    by default the shard files directly in it, committed and temp; with ``every_file``, every file at any depth.
    Keeps the peak of their total size (``peak``) with the sizes at that peak (``at_peak``), the peak of their
    allocated blocks (``peak_blocks``), every name seen (relative to the directory) and how many looks there were
    (``samples``). A look that fails fails the ``with`` block: the peak is of every look, none skipped."""

    def __init__(self, directory: Path, every_file: bool = False, interval_s: float = 0.005) -> None:
        self.directory = directory
        self.every_file = every_file
        self.interval_s = interval_s
        self.peak = self.peak_blocks = self.samples = 0
        self.at_peak: dict[str, int] = {}
        self.names: set[str] = set()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _paths(self) -> Iterator[Path]:
        if not self.every_file:
            yield from self.directory.glob("*shard-*")  # committed and temp (.shard-*.tmp)
            return
        for root, _, files in os.walk(self.directory):
            yield from (Path(root) / name for name in files)

    def _look(self) -> None:
        sizes, blocks = {}, 0
        for path in list(self._paths()):
            try:
                stat = path.lstat()
            except FileNotFoundError:
                continue  # uploaded, consumed or renamed between the listing and the look
            sizes[str(path.relative_to(self.directory))] = stat.st_size
            blocks += stat.st_blocks * 512
        self.names.update(sizes)
        if sum(sizes.values()) > self.peak:
            self.peak, self.at_peak = sum(sizes.values()), sizes
        self.peak_blocks = max(self.peak_blocks, blocks)
        self.samples += 1

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._look()
                time.sleep(self.interval_s)
        except BaseException as error:  # noqa: BLE001 - handed to the with block's end
            self._error = error

    def __enter__(self) -> "DiskSampler":
        self.directory.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None and exc[0] is None:
            raise AssertionError(f"a look at {self.directory} failed after {self.samples} looks") from self._error


@contextlib.contextmanager
def small_disk(directory: Path, size: str = "64m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``directory`` (made): a real filesystem to fill (needs root; CI runs as root)."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        reason = f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}"
        if os.environ.get("CI"):  # a skip there would hide the disk-full case
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill_disk(path: Path) -> None:
    """Write ``path`` until its filesystem is full (ENOSPC)."""
    with open(path, "wb", buffering=0) as file:
        for chunk in (1 << 20, 4096):
            with contextlib.suppress(OSError):
                while True:
                    file.write(b"\0" * chunk)


def flip_middle(path, nbytes=4096) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2 - nbytes // 2
    data[middle : middle + nbytes] = bytes(b ^ 0xFF for b in data[middle : middle + nbytes])
    path.write_bytes(bytes(data))


# -- the trainers' own loaders (speculators 0.9.0, SpecForge 0.2.0), and bit-for-bit equality ---------------

def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Raw bits, so that equality is bit for bit (NaN-safe, -0 vs 0 told apart)."""
    return tensor.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def specforge_files(directory: Path) -> list[str]:
    """SpecForge 0.2.0's trainer lists its offline features with list_feature_files: every .ckpt / .ckpt.gz
    below the directory, as absolute paths sorted as strings (the order it trains in)."""
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    return list_feature_files(str(directory))


def specforge_item(path: str, max_len: int) -> dict:
    """SpecForge 0.2.0's item for one file: its feature store's load_feature_file (torch.load, weights_only=False,
    mmap), then the EAGLE-3 normalizer (normalize_offline_sample: what OfflineEagle3Dataset.process_data did)."""
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file

    return normalize_offline_sample(load_feature_file(path), max_len)


def speculators_dataset(dest: Path, fp8: bool = False, **kwargs):
    """speculators 0.9.0's own dataset over an export: ArrowDataset reading hidden_states/hs_{i}.safetensors through
    its FileTransfer (fp8 files: FP8Transfer, which dequantizes them to bf16), never asking vLLM for a missing file."""
    from hs_connectors.transfer import FileTransfer, FP8Transfer
    from speculators.train.data import ArrowDataset

    transfer = (FP8Transfer if fp8 else FileTransfer)(Path(dest) / "hidden_states")
    return ArrowDataset(peer_formats.SPECFORGE_MAX_LEN, str(dest), transfer=transfer, on_missing="raise", **kwargs)


def descendants(pid: int) -> list[psutil.Process]:
    """Every process below ``pid`` now (none once it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive(processes: dict[int, psutil.Process]) -> list[str]:
    """What of ``processes`` still runs (a zombie has ended)."""
    left = []
    for process in processes.values():
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{process.pid} {' '.join(process.cmdline())[:80]}")
        except psutil.NoSuchProcess:
            pass
    return left


LOCK_HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from runtime.lock import OutputLock
with OutputLock(__import__("pathlib").Path(sys.argv[1]), ray_job="raysubmit_holder"):
    print("held", flush=True)
    time.sleep(600)
"""
"""A process that holds the output.dir lock of its argument until killed: ``python -c LOCK_HOLDER.format(root=...)``."""


# -- SmolLM2-135M-Instruct: real trained weights, each extraction run once per test session -------

CHATS = (
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name three primary colors.", "Red, yellow and blue."),
    ("Translate 'good morning' into Spanish.", "Buenos días."),
    ("What is 12 times 7?", "12 times 7 is 84."),
    ("Write a haiku about the sea.", "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
    ("Why is the sky blue?", "Sunlight scatters off air molecules, and blue light scatters the most."),
    ("Give me a synonym for happy.", "Joyful."),
    ("How do I reverse a list in Python?", "Use my_list.reverse() in place, or my_list[::-1] for a reversed copy."),
)
"""Single-turn chats; their answers are hand-written (the acceptance benchmark uses the target's own)."""

EXTRACT_TIMEOUT_S = 600
POST_NORM_LAYERS = [1, 14, 26]
"""The acceptance benchmark's layers (low, mid, high of 30)."""
PRE_NORM_LAYERS = [0, 13, 25]
"""One lower: the layers whose outputs are HF hidden_states[1, 14, 26], the states arm B of the
acceptance benchmark trains on."""


def shared_dir(tmp_path_factory) -> Path:
    """A directory every xdist worker of this session sees (the session's temp root), or this
    process's own temp root without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def made_once(path: Path) -> Iterator[bool]:
    """Hold ``path``'s lock; yields True when ``path`` still has to be made (by the caller, in the
    with block), False when another worker made it. It counts as made once the block ends without an
    exception (a marker beside it), so a worker whose attempt failed leaves the next one to retry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    done = path.parent / f".{path.name}.done"
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        needed = not done.exists()
        yield needed
        if needed:
            done.touch()


def tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(checkpoint_dir()))


def render(chat_tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """The chat's ids by the model's own chat template, and a loss mask over the answer's tokens (from
    the end of the rendered generation prompt, which must be a prefix of the whole conversation's ids)."""
    messages = [{"role": "user", "content": prompt}]
    head = list(chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"])
    full = list(chat_tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}],
                                                   tokenize=True, return_dict=True)["input_ids"])
    assert full[: len(head)] == head, "the generation prompt is not a prefix of the conversation"
    return full, [0] * len(head) + [1] * (len(full) - len(head))


def chat_dataset(tmp_path_factory) -> Path:
    """``CHATS`` as the Parquet ``jobs.extract`` reads (``input_ids``, ``loss_mask``)."""
    path = shared_dir(tmp_path_factory) / "smollm2-chats.parquet"
    with made_once(path) as needed:
        if needed:
            chat_tokenizer = tokenizer()
            rows = [render(chat_tokenizer, prompt, answer) for prompt, answer in CHATS]
            pq.write_table(pa.table({"input_ids": [ids for ids, _ in rows], "loss_mask": [m for _, m in rows]}), path)
    return path


def session_ray_address() -> str:
    """The GCS address of this test process's Ray cluster (conftest's ``ray_cluster``): the runs join it
    (``ray.address``) rather than each starting a cluster of its own, which on the loaded 2-core machine
    costs seconds of CPU and has timed out."""
    import ray

    return ray.get_runtime_context().gcs_address


def extraction_run(tmp_path_factory, name: str, overrides: Sequence[str]) -> Path:
    """The output.dir of ``python -m jobs.extract`` on SmolLM2 (CPU, float32) over ``chat_dataset``
    with ``overrides``, run once per session under ``name``, on this process's Ray cluster, with one writer
    (the readers of these runs compare states, not how writers shared the shards)."""
    model, data = checkpoint_dir(), chat_dataset(tmp_path_factory)
    out = shared_dir(tmp_path_factory) / f"smollm2-run-{name}"
    with made_once(out) as needed:
        if needed:
            command = [sys.executable, "-m", "jobs.extract", f"model.path={model}", f"data.path={data}",
                       f"output.dir={out}", "model.device=cpu", "model.dtype=float32",
                       "output.min_free=1GB", "output.num_writers=1", f"ray.address={session_ray_address()}",
                       *overrides]
            env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
            result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                    timeout=EXTRACT_TIMEOUT_S)
            # a failed attempt leaves its output.dir: the next attempt's run resumes it
            assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"
    return out


def post_norm_run(tmp_path_factory) -> Path:
    """Layers [1, 14, 26] with the post-norm final state: the acceptance benchmark's arm A, on CPU."""
    return extraction_run(tmp_path_factory, "post_norm",
                          [f"extract.layers={POST_NORM_LAYERS}", "extract.last_hidden_state=post_norm"])


def pre_norm_run(tmp_path_factory) -> Path:
    """Layers [0, 13, 25] (arm B's states) with the pre-norm final state."""
    return extraction_run(tmp_path_factory, "pre_norm",
                          [f"extract.layers={PRE_NORM_LAYERS}", "extract.last_hidden_state=pre_norm"])


# -- the tiny DeepSeek-V3 and its bf16 job run, each made once per test session -------------------------

DEEPSEEK_RUN_SAMPLES = 6
DEEPSEEK_RUN_SETTINGS = ("data.shard_size=4", "extract.max_tokens_per_batch=300", "model.dtype=bfloat16")
"""The Kimi-K2.5 demo's settings in tests/extractor/test_kimi.py: the bare model's run is compared with the
demo's run of the same language model, bit for bit."""


def deepseek_v3_checkpoint(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 with a q LoRA (rank 32), float32: ``build_tiny_model``'s defaults, so the language
    model the Kimi-K2.5 demo wraps, tensor for tensor."""
    model = shared_dir(tmp_path_factory) / "deepseek_v3-fp32"
    with made_once(model) as needed:
        if needed:
            build_tiny_model(model, arch="deepseek_v3")
    return model


def deepseek_bf16_run(tmp_path_factory) -> Path:
    """The output.dir of the job (in this process, on its Ray cluster) on ``deepseek_v3_checkpoint`` in bf16
    over the dataset the Kimi-K2.5 demo builds (``demo.num_samples=6``, seed 0: the same rows), with
    ``DEEPSEEK_RUN_SETTINGS`` and one writer."""
    from jobs.extract import run

    model = deepseek_v3_checkpoint(tmp_path_factory)
    out = shared_dir(tmp_path_factory) / "deepseek_v3-bf16-run"
    with made_once(out) as needed:
        if needed:
            data = build_synthetic_dataset(out.parent / "deepseek_v3-bf16-data.parquet",
                                           num_samples=DEEPSEEK_RUN_SAMPLES, seed=0)
            # a failed attempt leaves its output.dir: the next attempt's run resumes it
            run(job_config(model, data, out, *DEEPSEEK_RUN_SETTINGS, "output.num_writers=1"))
    return out


KILL_DEADLINE_S = 900.0
"""A bound for a ``When`` that never fires; on a loaded machine a model load alone took 285 s."""
POLL_S = 0.02
"""How often a ``When`` looks: a ``find`` that scans every process of the machine takes milliseconds (look at the
run's files first where they say when the moment has come)."""


class Beside(threading.Thread):
    """A thread that runs beside the job (which runs in the main thread) for the length of a ``with`` block:
    ``run`` loops until ``quitting`` is set."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.quitting = threading.Event()

    def __enter__(self) -> "Beside":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.quitting.set()
        self.join()


class When(Beside):
    """Polls ``find`` while the job runs in the main thread; the first time it returns something,
    ``act`` is done to it (once) and it is kept in ``done``."""

    def __init__(self, find: Callable[[], Any], act: Callable[[Any], None]) -> None:
        super().__init__()
        self.find = find
        self.act = act
        self.done: Any = None

    def run(self) -> None:
        deadline = time.monotonic() + KILL_DEADLINE_S
        while not self.quitting.is_set() and time.monotonic() < deadline:
            try:
                found = self.find()
                if found is not None:
                    self.act(found)
                    self.done = found
                    return
            except psutil.Error:
                pass  # the process exited while we looked
            time.sleep(POLL_S)


def sigkill(process: psutil.Process) -> None:
    os.kill(process.pid, signal.SIGKILL)
