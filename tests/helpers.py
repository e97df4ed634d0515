"""Test helpers: start an extractor actor, compute HF reference states."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Sequence

import numpy as np
import ray
import torch

from extractor.types import CapturedBatch, EngineInfo, EngineSpec, TokenBatch
from jobs.actors.extractor import fetch_batch, start_extractor
from storage import ShardReader, ShardWriter


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
    """``jobs.verify --deep`` finds no problem in the run (files, sizes, sha256, schema, ids, NaN/Inf)."""
    from jobs.verify import format_report, verify

    report = verify(Path(output_dir), deep=True, sink_options=sink_options)
    assert report.ok, format_report(report)


def assert_every_sample_once(output_dir: Path | Sequence[Path], dataset_path: Path) -> None:
    """The shard files under ``output_dir`` (one directory or several: one per node) hold every sample
    of the dataset exactly once, and no temp file of a shard remains; a run's directory (one with a
    manifest) also passes ``jobs.verify --deep``."""
    from jobs.inputs.dataset import open_tokenized_dataset
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
