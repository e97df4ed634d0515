"""The driver's schedule: one extractor actor, a pool of writer actors, batches streamed between them.

Batches of a shard go to one writer in order, followed by ``finish``; the
extractor runs batch after batch while writers pack and write the previous
ones. At most ``output.max_inflight_batches`` batches are between the
extractor and a finished write, which bounds the states held in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Iterator

import ray
from ray.experimental.tqdm_ray import tqdm

from extractor.actor import Extractor
from extractor.checkpoint import CheckpointInfo
from extractor.config import ExtractConfig, ModelConfig
from extractor.types import EngineInfo, EngineSpec
from jobs.dataset import TokenizedDataset
from jobs.plan import Shard, pack_batches
from jobs.writer import BatchRows, WriterActor
from storage import ShardFileInfo, ShardMetadata

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_AUTO_WRITERS = 8


@dataclasses.dataclass
class ScheduleResult:
    done: dict[int, ShardFileInfo]
    failed: dict[int, str]
    engine: EngineInfo
    seconds: float


@contextlib.contextmanager
def ray_session(address: str) -> Iterator[None]:
    """Join the given cluster (or the job's), else start a local one on loopback."""
    if ray.is_initialized():
        yield
        return
    # Workers import this repository's packages from its root.
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}}
    joining = bool(address or os.environ.get("RAY_ADDRESS"))
    kwargs = {} if joining else {"_node_ip_address": "127.0.0.1"}
    ray.init(address=address or None, runtime_env=None if joining else runtime_env, **kwargs)
    try:
        yield
    finally:
        ray.shutdown()


def resolve_device(requested: str, tp_size: int) -> str:
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if requested == "auto":
        return "cuda" if gpus >= tp_size else "cpu"
    if requested == "cuda" and gpus < tp_size:
        raise ValueError(f"model.device=cuda with model.tp_size={tp_size}, but the Ray cluster has {gpus} GPUs")
    return requested


def build_engine_spec(
    model: ModelConfig, extract: ExtractConfig, layer_ids: list[int], device: str,
    checkpoint: CheckpointInfo, longest_sample: int,
) -> EngineSpec:
    return EngineSpec(
        model_path=str(Path(model.path).resolve()),
        dtype=model.dtype,
        device=device,
        tp_size=model.tp_size,
        attention_backend=model.attention_backend or ("torch_native" if device == "cpu" else "flashinfer"),
        layer_ids=tuple(layer_ids),
        last_hidden_state=extract.last_hidden_state,
        max_tokens_per_batch=max(extract.max_tokens_per_batch, longest_sample),
        max_samples_per_batch=extract.max_samples_per_batch,
        context_length=model.context_length,
        mem_fraction_static=model.mem_fraction_static,
        load_format=model.load_format,
    )


def shard_metadata(engine: EngineInfo, model_path: str, has_last_hidden_state: bool) -> ShardMetadata:
    return ShardMetadata(
        dtype=engine.dtype,
        hidden_size=engine.hidden_size,
        layer_ids=engine.layer_ids,
        layers_to_capture=engine.layers_to_capture,
        drafter_layer_ids=engine.drafter_layer_ids,
        has_last_hidden_state=has_last_hidden_state,
        model_path=model_path,
        model_architecture=engine.model_architecture,
        sglang_version=engine.sglang_version,
        tp_size=engine.tp_size,
    )


def count_writers(requested: int, extractor_cpus: int) -> int:
    if requested > 0:
        return requested
    spare = int(ray.cluster_resources().get("CPU", 1)) - extractor_cpus
    return max(1, min(MAX_AUTO_WRITERS, spare))


def run_schedule(
    spec: EngineSpec, dataset: TokenizedDataset, shards: list[Shard], extract: ExtractConfig,
    output_dir: Path, num_writers: int, max_inflight_batches: int,
) -> ScheduleResult:
    """Extract and write every shard; a failed shard is reported, the others go on."""
    started = time.perf_counter()
    on_gpu = spec.device == "cuda"
    extractor_cpus = 1
    extractor = (
        ray.remote(Extractor)
        .options(num_gpus=spec.tp_size if on_gpu else 0, num_cpus=extractor_cpus, name="extractor")
        .remote(spec)
    )
    engine: EngineInfo = ray.get(extractor.info.remote())
    logger.info(
        "extractor ready after %.1f s: %s captures layers_to_capture %s for canonical ids %s (drafter ids %s)",
        time.perf_counter() - started, engine.model_architecture, engine.layers_to_capture,
        engine.layer_ids, engine.drafter_layer_ids,
    )
    metadata = shard_metadata(engine, spec.model_path, spec.last_hidden_state)
    writer_class = ray.remote(WriterActor).options(num_cpus=1)
    writers = [writer_class.remote(str(output_dir), metadata) for _ in range(count_writers(num_writers, extractor_cpus))]

    lengths = dataset.lengths
    shard_bar = tqdm(total=len(shards), desc="shards")
    token_bar = tqdm(total=int(sum(lengths[s.start : s.stop].sum() for s in shards)), desc="tokens")
    appends: dict[ray.ObjectRef, None] = {}
    finishes: dict[ray.ObjectRef, int] = {}
    done: dict[int, ShardFileInfo] = {}
    failed: dict[int, str] = {}

    def settle(block_until: int) -> None:
        """Collect finished appends/finishes until at most ``block_until`` appends are pending."""
        while len(appends) > block_until or (block_until == 0 and finishes):
            ready, _ = ray.wait([*appends, *finishes], num_returns=1)
            ref = ready[0]
            if ref in finishes:
                shard = finishes.pop(ref)
                try:
                    done[shard] = ray.get(ref)
                except Exception as error:
                    failed[shard] = _error_text(error)
                    logger.error("shard %d failed: %s", shard, failed[shard])
                shard_bar.update(1)
                continue
            appends.pop(ref)
            token_bar.update(ray.get(ref))  # raises if the extractor died: stop the job

    try:
        for shard in shards:
            writer = writers[shard.index % len(writers)]
            for start, stop in pack_batches(
                lengths[shard.start : shard.stop], extract.max_tokens_per_batch, extract.max_samples_per_batch
            ):
                rows = BatchRows(
                    shard=shard.index,
                    sample_ids=list(range(shard.start + start, shard.start + stop)),
                    input_ids=dataset.input_ids[shard.start + start : shard.start + stop],
                    loss_masks=dataset.loss_masks[shard.start + start : shard.start + stop],
                )
                settle(block_until=max_inflight_batches - 1)
                captured = extractor.extract.remote(rows.input_ids)
                appends[writer.append.remote(rows, [captured])] = None
            finishes[writer.finish.remote(shard.index)] = shard.index
        settle(block_until=0)
    finally:
        shard_bar.close()
        token_bar.close()
        with contextlib.suppress(Exception):
            ray.get(extractor.close.remote(), timeout=60)
        ray.kill(extractor)
        for writer in writers:
            ray.kill(writer)
    return ScheduleResult(done=done, failed=failed, engine=engine, seconds=time.perf_counter() - started)


def _error_text(error: Exception) -> str:
    cause = getattr(error, "cause", None) or error
    return f"{type(cause).__name__}: {cause}"
