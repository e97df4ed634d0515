"""Input checks name the row and file; shard plan and batch packing."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.inputs.dataset import open_tokenized_dataset
from jobs.planning.shards import pack_batches, plan_shards


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_parquet_and_jsonl_read_the_same(tmp_path):
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5], "loss_mask": [1, 1]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "d.jsonl", rows)
    for name in ("d.parquet", "d.jsonl"):
        data = open_tokenized_dataset(str(tmp_path / name), vocab_size=10, max_length=100)
        input_ids, loss_masks = data.rows(0, len(data))
        assert [ids.tolist() for ids in input_ids] == [[1, 2, 3], [4, 5]]
        assert [m.tolist() for m in loss_masks] == [[0, 1, 1], [1, 1]]
        assert data.lengths.tolist() == [3, 2]


def test_missing_loss_mask_means_all_ones(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}])
    assert open_tokenized_dataset(str(path), 10, 100).rows(0, 1)[1][0].tolist() == [1, 1]


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"input_ids": []}, "input_ids must be a non-empty list"),
        ({"input_ids": [1, 99]}, "token id 99 is outside the model's vocabulary"),
        ({"input_ids": [1, -3]}, "token id -3 is outside"),
        ({"input_ids": [1, None]}, "input_ids holds a null at position 1"),
        ({"input_ids": "1 2"}, "input_ids must be a list of integers, got str"),
        ({"input_ids": [1, True]}, "input_ids holds bool True at position 1"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "loss_mask has 1 entries, input_ids has 2"),
        ({"input_ids": [1, 2], "loss_mask": [1, 5]}, "loss_mask must hold only 0 and 1"),
        ({"input_ids": [1, 2], "loss_mask": [1, 1.0]}, "loss_mask holds the float 1.0 at position 1"),
        ({"input_ids": list(range(9))}, "9 tokens exceed the context length 8"),
    ],
)
def test_bad_rows_are_named(tmp_path, bad_row, message):
    good = {"input_ids": [1, 2], "loss_mask": [1, 1]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, {"loss_mask": None, **bad_row}, good])
    with pytest.raises(ValueError, match=rf"{path} row 1 \(line 2, sample id 1\): {message}"):
        open_tokenized_dataset(str(path), vocab_size=10, max_length=8)
    parquet = tmp_path / "d.parquet"
    if all(isinstance(v, list) and all(type(x) is int for x in v) for v in bad_row.values()):
        pq.write_table(pa.Table.from_pylist([good, {"loss_mask": None, **bad_row}, good]), parquet)
        with pytest.raises(ValueError, match=rf"{parquet} row 1 \(sample id 1\): {message}"):
            open_tokenized_dataset(str(parquet), vocab_size=10, max_length=8)


def test_missing_column_and_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"tokens": [1]}])
    with pytest.raises(ValueError, match="input_ids is missing"):
        open_tokenized_dataset(str(path), 10, 10)
    pq.write_table(pa.table({"tokens": [[1]]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match="d.parquet: no 'input_ids' column"):
        open_tokenized_dataset(str(tmp_path / "d.parquet"), 10, 10)
    with pytest.raises(ValueError, match="no such file"):
        open_tokenized_dataset(str(tmp_path / "nope.parquet"), 10, 10)


def test_plan_shards_covers_every_row_once():
    lengths = np.array([3, 4, 2, 10, 1, 1, 1, 5, 6, 7])
    shards = plan_shards(lengths, 4, max_tokens_per_batch=8, max_samples_per_batch=2)
    assert [(s.index, s.start, s.stop, s.tokens) for s in shards] == [(0, 0, 4, 19), (1, 4, 8, 8), (2, 8, 10, 13)]
    assert [s.batches for s in shards] == [((0, 2), (2, 3), (3, 4)), ((0, 2), (2, 4)), ((0, 1), (1, 2))]
    with pytest.raises(ValueError, match="shard_size"):
        plan_shards(lengths, 0, 8, 2)


def greedy_reference(lengths, max_tokens, max_samples):
    """The packing rule, one sample at a time."""
    batches, start, tokens = [], 0, 0
    for i, length in enumerate(lengths.tolist()):
        if i > start and (tokens + length > max_tokens or i - start >= max_samples):
            batches.append((start, i))
            start, tokens = i, 0
        tokens += length
    return batches + ([(start, len(lengths))] if len(lengths) else [])


def test_plan_packs_like_the_greedy_rule():
    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths = rng.integers(1, 60, int(rng.integers(0, 80)))
        max_tokens, max_samples, shard_size = int(rng.integers(1, 200)), int(rng.integers(1, 9)), int(rng.integers(1, 30))
        shards = plan_shards(lengths, shard_size, max_tokens, max_samples)
        assert [(s.start, s.stop) for s in shards] == [
            (start, min(start + shard_size, len(lengths))) for start in range(0, len(lengths), shard_size)]
        for shard in shards:
            assert list(shard.batches) == greedy_reference(lengths[shard.start : shard.stop], max_tokens, max_samples)
            assert shard.tokens == int(lengths[shard.start : shard.stop].sum())


def test_pack_batches_keeps_order_and_budget():
    lengths = np.array([3, 4, 2, 10, 1, 1, 1])
    batches = pack_batches(lengths, max_tokens=8, max_samples=2)
    assert batches == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    # every sample exactly once, in order; the 10-token sample runs alone
    assert [i for start, stop in batches for i in range(start, stop)] == list(range(7))
    for start, stop in batches:
        assert lengths[start:stop].sum() <= 8 or stop - start == 1
    assert pack_batches(np.array([5, 5, 5]), max_tokens=100, max_samples=100) == [(0, 3)]
