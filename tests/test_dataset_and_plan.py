"""Input checks name the row and file; shard plan and batch packing."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.dataset import load_tokenized_dataset
from jobs.plan import pack_batches, plan_shards


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_parquet_and_jsonl_read_the_same(tmp_path):
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5], "loss_mask": [1, 1]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "d.jsonl", rows)
    for name in ("d.parquet", "d.jsonl"):
        data = load_tokenized_dataset(str(tmp_path / name), vocab_size=10, max_length=100)
        assert [ids.tolist() for ids in data.input_ids] == [[1, 2, 3], [4, 5]]
        assert [m.tolist() for m in data.loss_masks] == [[0, 1, 1], [1, 1]]
        assert data.lengths.tolist() == [3, 2]


def test_missing_loss_mask_means_all_ones(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}])
    assert load_tokenized_dataset(str(path), 10, 100).loss_masks[0].tolist() == [1, 1]


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"input_ids": []}, "row 1: input_ids must be a non-empty list"),
        ({"input_ids": [1, 99]}, "row 1: token id 99 is outside the model's vocabulary"),
        ({"input_ids": [1, -3]}, "row 1: token id -3 is outside"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "row 1: loss_mask has 1 entries, input_ids has 2"),
        ({"input_ids": [1, 2], "loss_mask": [1, 5]}, "row 1: loss_mask must hold only 0 and 1"),
        ({"input_ids": list(range(9))}, "row 1: 9 tokens exceed the context length 8"),
    ],
)
def test_bad_rows_are_named(tmp_path, bad_row, message):
    good = {"input_ids": [1, 2], "loss_mask": [1, 1]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, {"loss_mask": None, **bad_row}, good])
    with pytest.raises(ValueError, match=message) as error:
        load_tokenized_dataset(str(path), vocab_size=10, max_length=8)
    assert str(path) in str(error.value)


def test_missing_column_and_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"tokens": [1]}])
    with pytest.raises(ValueError, match="no 'input_ids' column"):
        load_tokenized_dataset(str(path), 10, 10)
    with pytest.raises(ValueError, match="no such file"):
        load_tokenized_dataset(str(tmp_path / "nope.parquet"), 10, 10)


def test_plan_shards_covers_every_row_once():
    shards = plan_shards(10, 4)
    assert [(s.index, s.start, s.stop) for s in shards] == [(0, 0, 4), (1, 4, 8), (2, 8, 10)]
    with pytest.raises(ValueError, match="shard_size"):
        plan_shards(10, 0)


def test_pack_batches_keeps_order_and_budget():
    lengths = np.array([3, 4, 2, 10, 1, 1, 1])
    batches = pack_batches(lengths, max_tokens=8, max_samples=2)
    assert batches == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    # every sample exactly once, in order; the 10-token sample runs alone
    assert [i for start, stop in batches for i in range(start, stop)] == list(range(7))
    for start, stop in batches:
        assert lengths[start:stop].sum() <= 8 or stop - start == 1
    assert pack_batches(np.array([5, 5, 5]), max_tokens=100, max_samples=100) == [(0, 3)]
