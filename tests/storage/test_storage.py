"""Parquet format v2 (and v1 files): bit-exact round trips, fp8 states, metadata, atomic commit."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from extractor.quantize import dequantize_fp8, fp8_relative_errors, quantize_fp8
from storage import ShardMetadata, ShardReader, ShardWriter
from storage.reader import read_metadata
from storage.run_index import RunIndex
from storage.schema import METADATA_KEY, build_schema
from storage.writer import choose_rows_per_group, state_bytes_per_token, temp_file_name
from tests.conftest import REPO_ROOT
from tests.helpers import checksum_of

HIDDEN = 16


def metadata(dtype="bfloat16", last="post_norm", state_dtype=None) -> ShardMetadata:
    return ShardMetadata(
        dtype=dtype, state_dtype=state_dtype or dtype, hidden_size=HIDDEN, layer_ids=[2, 30, 58],
        layers_to_capture=[3, 31, 59], drafter_layer_ids=[3, 31, 59], last_hidden_state=last,
        model_path="/models/kimi", model_architecture="DeepseekV3ForCausalLM", sglang_version="0.5.23", tp_size=8,
    )


def raw_bits(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy()
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).numpy()
    return tensor.numpy()


def write_batches(path, meta, batches, checksum="xxh3_128"):
    """Each batch: (sample_ids, lengths, aux, last[, aux_scales, last_scales])."""
    with ShardWriter(path, meta, checksum_algorithm=checksum) as writer:
        for sample_ids, lengths, aux, last, *scales in batches:
            ids = [np.arange(n, dtype=np.int32) + sid for sid, n in zip(sample_ids, lengths)]
            masks = [np.arange(n) % 2 for n in lengths]
            writer.append(sample_ids, ids, masks, raw_bits(aux), None if last is None else raw_bits(last),
                          *[None if scale is None else scale.numpy() for scale in scales])
        return writer.finalize()


@pytest.mark.parametrize("dtype, checksum", [("bfloat16", "xxh3_128"), ("float16", "sha256"), ("float32", "xxh3_128")])
def test_round_trip_is_bit_exact(tmp_path, dtype, checksum):
    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    batches, expected = [], {}
    sample = 10
    for lengths in ([5, 1, 9], [4], [2, 7]):
        aux = (torch.randn(sum(lengths), 3 * HIDDEN) * 100).to(torch_dtype)
        last = torch.randn(sum(lengths), HIDDEN).to(torch_dtype)
        sample_ids = list(range(sample, sample + len(lengths)))
        batches.append((sample_ids, lengths, aux, last))
        for sid, a, b in zip(sample_ids, aux.split(lengths), last.split(lengths)):
            expected[sid] = (a, b)
        sample += len(lengths)
    info = write_batches(tmp_path / "shard.parquet", metadata(dtype), batches, checksum)

    assert info.rows == 6 and info.tokens == 28
    assert info.bytes == (tmp_path / "shard.parquet").stat().st_size
    assert info.checksum == checksum_of((tmp_path / "shard.parquet").read_bytes(), checksum)
    reader = ShardReader(info.path)
    assert len(reader) == 6 and reader.sample_ids() == list(range(10, 16))
    for sample in reader:
        aux, last = expected[sample.sample_id]
        assert sample.aux_hidden_states.dtype == torch_dtype
        assert sample.aux_hidden_states.shape == (len(aux), 3 * HIDDEN)
        assert torch.equal(sample.aux_hidden_states.view(torch.uint8), aux.view(torch.uint8))
        assert torch.equal(sample.last_hidden_state.view(torch.uint8), last.view(torch.uint8))
        assert sample.input_ids.tolist() == list(range(sample.sample_id, sample.sample_id + len(aux)))
        assert sample.loss_mask.tolist() == [i % 2 for i in range(len(aux))]
    # random access lands on the same sample
    assert reader[4].sample_id == 14
    assert torch.equal(reader[4].aux_hidden_states.view(torch.uint8), expected[14][0].view(torch.uint8))


def test_metadata_and_schema_are_in_the_file(tmp_path):
    aux = torch.zeros(3, 3 * HIDDEN, dtype=torch.bfloat16)
    info = write_batches(tmp_path / "s.parquet", metadata(last="none"), [([0], [3], aux, None)])
    meta = read_metadata(info.path)
    assert meta == metadata(last="none")
    kv = pq.read_schema(info.path).metadata
    assert kv[b"layer_ids"] == b"[2, 30, 58]" and kv[b"layers_to_capture"] == b"[3, 31, 59]"
    assert kv[b"format_version"] == b"2" and kv[b"dtype"] == b"bfloat16" and kv[b"tp_size"] == b"8"
    assert kv[b"state_dtype"] == b"bfloat16" and kv[b"last_hidden_state"] == b"none"
    names = pq.read_schema(info.path).names
    assert names == ["sample_id", "input_ids", "loss_mask", "aux_hidden_states"]
    assert ShardReader(info.path)[0].last_hidden_state is None


def test_the_plain_metadata_keys_are_the_formats():
    """The plain keys come from ShardMetadata's fields: a field added there must not change them unnoticed."""
    kv = build_schema(metadata()).metadata
    assert set(kv) == {METADATA_KEY} | {key.encode() for key in (
        "format_version", "dtype", "state_dtype", "last_hidden_state", "hidden_size", "layer_ids", "layers_to_capture",
        "drafter_layer_ids", "model_path", "sglang_version", "tp_size")}


def test_token_columns_are_zstd_and_states_are_not(tmp_path):
    """The codec must reach a list column's leaf (``input_ids.list.element``), not just its name."""
    aux = torch.zeros(3, 3 * HIDDEN, dtype=torch.bfloat16)
    last = torch.zeros(3, HIDDEN, dtype=torch.bfloat16)
    info = write_batches(tmp_path / "s.parquet", metadata(), [([0], [3], aux, last)])
    group = pq.ParquetFile(info.path).metadata.row_group(0)
    codecs = {group.column(i).path_in_schema: group.column(i).compression for i in range(group.num_columns)}
    assert codecs == {
        "sample_id": "ZSTD", "input_ids.list.element": "ZSTD", "loss_mask.list.element": "ZSTD",
        "aux_hidden_states": "UNCOMPRESSED", "last_hidden_state": "UNCOMPRESSED",
    }


def test_wrong_shape_is_rejected_and_nothing_is_published(tmp_path):
    path = tmp_path / "s.parquet"
    aux = torch.zeros(4, 3 * HIDDEN, dtype=torch.bfloat16)  # 4 tokens, but the sample has 3
    with pytest.raises(ValueError, match=r"samples 7\.\.7 has shape \(4, 48\)"):
        write_batches(path, metadata(last="none"), [([7], [3], aux, None)])
    assert not path.exists()
    assert not path.with_name(temp_file_name(path.name)).exists()


def test_a_loss_mask_not_as_long_as_its_tokens_is_rejected(tmp_path):
    """Masks are stored end to end at their tokens' offsets: one longer or shorter than its input_ids would shift
    the masks of the samples after it. Refused naming the file and the sample; nothing is published."""
    path = tmp_path / "s.parquet"
    states = raw_bits(torch.zeros(6, 3 * HIDDEN, dtype=torch.bfloat16))
    with ShardWriter(path, metadata(last="none")) as writer:
        with pytest.raises(ValueError, match=r"s\.parquet: sample 8 has 3 input_ids but a loss mask of 4"):
            writer.append([8, 9], [np.arange(3), np.arange(3)], [np.ones(4), np.zeros(2)], states)
    assert list(tmp_path.iterdir()) == []


def test_unfinalized_writer_leaves_no_file(tmp_path):
    path = tmp_path / "s.parquet"
    with ShardWriter(path, metadata(last="none")) as writer:
        writer.append([0], [np.arange(2)], [np.ones(2)], raw_bits(torch.zeros(2, 3 * HIDDEN, dtype=torch.bfloat16)))
        assert path.with_name(temp_file_name(path.name)).exists()
    assert list(tmp_path.iterdir()) == []


def test_rows_per_group():
    assert choose_rows_per_group(88 * 2**20) == 2  # two 2K-token Kimi samples per 256 MiB group
    assert choose_rows_per_group(10**9) == 1
    assert choose_rows_per_group(1000, target_bytes=10**6) == 1000


def test_reader_refuses_other_format_versions(tmp_path):
    meta = metadata(last="none")
    bad = ShardMetadata(**{**meta.__dict__, "format_version": 99})
    aux = torch.zeros(1, 3 * HIDDEN, dtype=torch.bfloat16)
    info = write_batches(tmp_path / "s.parquet", bad, [([0], [1], aux, None)])
    with pytest.raises(ValueError, match="format_version 99"):
        ShardReader(info.path)


def fp8_batches(lengths_per_batch, scale=3.0, zero_token=None):
    """bf16 states (one token all zeros if asked) and their fp8 quantization, per batch."""
    torch.manual_seed(1)
    batches, originals, sample = [], {}, 0
    for lengths in lengths_per_batch:
        aux = (torch.randn(sum(lengths), 3 * HIDDEN) * scale).to(torch.bfloat16)
        last = torch.randn(sum(lengths), HIDDEN).to(torch.bfloat16)
        if zero_token is not None and sample == 0:
            aux[zero_token] = 0
            last[zero_token] = 0
        (aux_q, aux_s), (last_q, last_s) = quantize_fp8(aux, 3), quantize_fp8(last, 1)
        sample_ids = list(range(sample, sample + len(lengths)))
        batches.append((sample_ids, lengths, aux_q, last_q, aux_s, last_s))
        for sid, a, b, qa, sa, qb, sb in zip(sample_ids, aux.split(lengths), last.split(lengths), aux_q.split(lengths),
                                             aux_s.split(lengths), last_q.split(lengths), last_s.split(lengths)):
            originals[sid] = (a, b, qa, sa, qb, sb)
        sample += len(lengths)
    return batches, originals


def test_fp8_round_trip_raw_and_dequantized(tmp_path):
    batches, originals = fp8_batches(([5, 1, 9], [4]), zero_token=2)
    meta = metadata(state_dtype="float8_e4m3fn", last="pre_norm")
    info = write_batches(tmp_path / "fp8.parquet", meta, batches)
    assert read_metadata(info.path) == meta
    assert pq.read_schema(info.path).names == [
        "sample_id", "input_ids", "loss_mask", "aux_hidden_states", "aux_hidden_states_scales",
        "last_hidden_state", "last_hidden_state_scales",
    ]
    raw = {sample.sample_id: sample for sample in ShardReader(info.path, raw_fp8=True)}
    for sample in ShardReader(info.path):
        aux, last, aux_q, aux_s, last_q, last_s = originals[sample.sample_id]
        stored = raw[sample.sample_id]
        # raw: exactly the fp8 bits and float32 scales the device produced
        assert stored.aux_hidden_states.dtype == torch.float8_e4m3fn
        assert torch.equal(stored.aux_hidden_states.view(torch.uint8), aux_q.view(torch.uint8))
        assert torch.equal(stored.aux_hidden_states_scales, aux_s) and stored.aux_hidden_states_scales.shape == (len(aux), 3)
        assert torch.equal(stored.last_hidden_state.view(torch.uint8), last_q.view(torch.uint8))
        assert torch.equal(stored.last_hidden_state_scales, last_s) and stored.last_hidden_state_scales.shape == (len(aux), 1)
        # default: the model dtype, dequantized as the extractor's own inverse does
        assert sample.aux_hidden_states.dtype == torch.bfloat16 and sample.aux_hidden_states_scales is None
        assert torch.equal(sample.aux_hidden_states, dequantize_fp8(aux_q, aux_s, torch.bfloat16))
        assert torch.equal(sample.last_hidden_state, dequantize_fp8(last_q, last_s, torch.bfloat16))
        assert not torch.isnan(sample.aux_hidden_states).any()
        # e4m3 keeps 3 mantissa bits: each element within half a step (1/16) of its own magnitude,
        # and the largest one of each token and layer exactly
        for restored, original in ((sample.aux_hidden_states, aux), (sample.last_hidden_state, last)):
            error = (restored.float() - original.float()).abs()
            assert (error <= original.float().abs() / 16 + 1e-6 * original.float().abs().amax()).all()
    zero = next(s for s in ShardReader(info.path) if s.sample_id == 0)
    assert not zero.aux_hidden_states[2].any() and not zero.last_hidden_state[2].any()
    assert raw[0].aux_hidden_states_scales[2].tolist() == [0.0, 0.0, 0.0]


def test_fp8_bytes_on_disk_are_the_states_and_their_scales(tmp_path):
    """Bytes per token on disk within 1% of fp8 states + float32 scales, at a realistic width."""
    hidden, lengths = 1024, [512, 512, 512, 512]
    meta = dataclasses.replace(metadata(state_dtype="float8_e4m3fn"), hidden_size=hidden)
    torch.manual_seed(2)
    aux, last = torch.randn(2048, 3 * hidden).to(torch.bfloat16), torch.randn(2048, hidden).to(torch.bfloat16)
    (aux_q, aux_s), (last_q, last_s) = quantize_fp8(aux, 3), quantize_fp8(last, 1)
    info = write_batches(tmp_path / "fp8.parquet", meta, [([0, 1, 2, 3], lengths, aux_q, last_q, aux_s, last_s)])
    per_token = state_bytes_per_token(meta)
    assert per_token == 4 * hidden + 4 * 4
    assert per_token * info.tokens <= info.bytes <= 1.01 * per_token * info.tokens, info.bytes / info.tokens


def test_fp8_relative_error_per_layer():
    """What e4m3 with one scale per token and layer costs on Gaussian states: ~2-3% per layer."""
    torch.manual_seed(3)
    states = torch.randn(4096, 3 * HIDDEN) * torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(HIDDEN)
    errors = fp8_relative_errors(states.to(torch.bfloat16), 3)
    assert len(errors) == 3
    assert all(0.005 < error < 0.05 for error in errors), errors
    assert fp8_relative_errors(torch.zeros(4, HIDDEN), 1) == [0.0]
    kept = states.clone()
    quantize_fp8(states, 3)  # float32 states: quantizing must leave them as they were
    assert torch.equal(states, kept)


def test_fp8_missing_scales_are_refused(tmp_path):
    batches, _ = fp8_batches(([3],))
    sample_ids, lengths, aux_q, last_q, aux_s, last_s = batches[0]
    with pytest.raises(ValueError, match="aux_hidden_states_scales for samples 0..0 has none"):
        write_batches(tmp_path / "s.parquet", metadata(state_dtype="float8_e4m3fn"),
                      [(sample_ids, lengths, aux_q, last_q, None, last_s)])
    assert not list(tmp_path.iterdir())


def test_format_v1_files_stay_readable(tmp_path):
    """A file as format v1 wrote it: has_last_hidden_state, no state_dtype, no scale columns."""
    torch.manual_seed(4)
    aux = torch.randn(5, 3 * HIDDEN).to(torch.bfloat16)
    last = torch.randn(5, HIDDEN).to(torch.bfloat16)
    v1 = {
        "byte_order": "little", "drafter_layer_ids": [3, 31, 59], "dtype": "bfloat16", "format_version": 1,
        "has_last_hidden_state": True, "hidden_size": HIDDEN, "layer_ids": [2, 30, 58],
        "layers_to_capture": [3, 31, 59], "model_architecture": "DeepseekV3ForCausalLM",
        "model_path": "/models/kimi", "sglang_version": "0.5.17", "tp_size": 8,
    }
    table = pa.table(
        {
            "sample_id": pa.array([7], pa.int64()),
            "input_ids": pa.array([list(range(5))], pa.list_(pa.int32())),
            "loss_mask": pa.array([[1] * 5], pa.list_(pa.uint8())),
            "aux_hidden_states": pa.array([raw_bits(aux).tobytes()], pa.large_binary()),
            "last_hidden_state": pa.array([raw_bits(last).tobytes()], pa.large_binary()),
        }
    ).replace_schema_metadata({b"eagle3_hidden_states": json.dumps(v1).encode(), b"format_version": b"1"})
    pq.write_table(table, tmp_path / "v1.parquet")
    reader = ShardReader(tmp_path / "v1.parquet")
    assert reader.metadata.format_version == 1
    assert (reader.metadata.last_hidden_state, reader.metadata.state_dtype) == ("post_norm", "bfloat16")
    sample = reader[0]
    assert sample.sample_id == 7
    assert torch.equal(sample.aux_hidden_states.view(torch.int16), aux.view(torch.int16))
    assert torch.equal(sample.last_hidden_state.view(torch.int16), last.view(torch.int16))


def test_writing_a_shard_imports_no_pandas(tmp_path):
    """pyarrow imports pandas (0.5-1 s, on each writer's first batch) when handed numpy data through
    ``pa.array``: the writer builds its columns from buffers instead."""
    code = f"""
import sys, numpy as np
from storage import ShardMetadata, ShardWriter
meta = ShardMetadata(dtype="bfloat16", state_dtype="float8_e4m3fn", hidden_size=4, layer_ids=[1], layers_to_capture=[2],
                     drafter_layer_ids=[1], last_hidden_state="pre_norm", model_path="m", model_architecture="a",
                     sglang_version="s", tp_size=1)
with ShardWriter({str(tmp_path / "s.parquet")!r}, meta) as writer:
    writer.append([0], [np.arange(3)], [np.ones(3)], np.zeros((3, 4), np.uint8), np.zeros((3, 4), np.uint8),
                  np.zeros((3, 1), np.float32), np.zeros((3, 1), np.float32))
    writer.finalize()
print("pandas" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_damaged_shard_file_is_named_with_what_restores_it(tmp_path):
    """A page whose CRC fails, or a file cut short: the shard readers (ShardReader, the run index's footers) raise a
    ValueError naming the file, the shard, its sample ids and the commands that restore it, not pyarrow's bare
    error."""
    torch.manual_seed(0)
    run = tmp_path / "run"
    run.mkdir()
    path = run / "shard-00003.parquet"
    lengths = [40, 50, 60]
    aux = torch.randn(sum(lengths), 3 * HIDDEN).to(torch.bfloat16)
    write_batches(path, metadata(), [([12, 13, 14], lengths, aux, torch.randn(sum(lengths), HIDDEN).to(torch.bfloat16))])
    whole = path.read_bytes()
    damaged = bytearray(whole)
    where = whole.find(raw_bits(aux[45:46]).tobytes())  # a state of sample 13
    damaged[where + 5] ^= 0x40
    path.write_bytes(bytes(damaged))
    restore = (f"python -m jobs.verify output.dir={run}` to find every damaged shard, then rerun the extraction "
               "with shards=[3]")

    with pytest.raises(ValueError) as raised:
        list(ShardReader(path))
    message = str(raised.value)
    assert message.startswith(f"{path} (shard 3, row group 0: sample ids 12..14): cannot be read"), message
    assert "CRC checksum verification failed" in message and restore in message, message

    path.write_bytes(whole[: len(whole) // 2])
    for read in (lambda: ShardReader(path), lambda: RunIndex.build(run)):
        with pytest.raises(ValueError) as raised:
            read()
        message = str(raised.value)
        assert message.startswith(f"{path} (shard 3): cannot be read"), message
        assert "Parquet magic bytes not found" in message and restore in message, message
