"""Parquet format v1: bit-exact round trips, metadata, atomic commit."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from storage import ShardMetadata, ShardReader, ShardWriter
from storage.reader import read_metadata
from storage.writer import choose_rows_per_group, temp_file_name

HIDDEN = 16


def metadata(dtype="bfloat16", last=True) -> ShardMetadata:
    return ShardMetadata(
        dtype=dtype, hidden_size=HIDDEN, layer_ids=[2, 30, 58], layers_to_capture=[3, 31, 59],
        drafter_layer_ids=[3, 31, 59], has_last_hidden_state=last, model_path="/models/kimi",
        model_architecture="DeepseekV3ForCausalLM", sglang_version="0.5.23", tp_size=8,
    )


def raw_bits(tensor: torch.Tensor) -> np.ndarray:
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def write_batches(path, meta, batches):
    with ShardWriter(path, meta) as writer:
        for sample_ids, lengths, aux, last in batches:
            ids = [np.arange(n, dtype=np.int32) + sid for sid, n in zip(sample_ids, lengths)]
            masks = [np.arange(n) % 2 for n in lengths]
            writer.append(sample_ids, ids, masks, raw_bits(aux), None if last is None else raw_bits(last))
        return writer.finalize()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_round_trip_is_bit_exact(tmp_path, dtype):
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
    info = write_batches(tmp_path / "shard.parquet", metadata(dtype), batches)

    assert info.rows == 6 and info.tokens == 28
    assert info.bytes == (tmp_path / "shard.parquet").stat().st_size
    assert info.sha256 == hashlib.sha256((tmp_path / "shard.parquet").read_bytes()).hexdigest()
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
    info = write_batches(tmp_path / "s.parquet", metadata(last=False), [([0], [3], aux, None)])
    meta = read_metadata(info.path)
    assert meta == metadata(last=False)
    kv = pq.read_schema(info.path).metadata
    assert kv[b"layer_ids"] == b"[2, 30, 58]" and kv[b"layers_to_capture"] == b"[3, 31, 59]"
    assert kv[b"format_version"] == b"1" and kv[b"dtype"] == b"bfloat16" and kv[b"tp_size"] == b"8"
    names = pq.read_schema(info.path).names
    assert names == ["sample_id", "input_ids", "loss_mask", "aux_hidden_states"]
    assert ShardReader(info.path)[0].last_hidden_state is None


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
        write_batches(path, metadata(last=False), [([7], [3], aux, None)])
    assert not path.exists()
    assert not path.with_name(temp_file_name(path.name)).exists()


def test_unfinalized_writer_leaves_no_file(tmp_path):
    path = tmp_path / "s.parquet"
    with ShardWriter(path, metadata(last=False)) as writer:
        writer.append([0], [np.arange(2)], [np.ones(2)], raw_bits(torch.zeros(2, 3 * HIDDEN, dtype=torch.bfloat16)))
        assert path.with_name(temp_file_name(path.name)).exists()
    assert list(tmp_path.iterdir()) == []


def test_rows_per_group():
    assert choose_rows_per_group(88 * 2**20) == 2  # two 2K-token Kimi samples per 256 MiB group
    assert choose_rows_per_group(10**9) == 1
    assert choose_rows_per_group(1000, target_bytes=10**6) == 1000


def test_reader_refuses_other_format_versions(tmp_path):
    meta = metadata(last=False)
    bad = ShardMetadata(**{**meta.__dict__, "format_version": 99})
    aux = torch.zeros(1, 3 * HIDDEN, dtype=torch.bfloat16)
    info = write_batches(tmp_path / "s.parquet", bad, [([0], [1], aux, None)])
    with pytest.raises(ValueError, match="format_version 99"):
        ShardReader(info.path)
