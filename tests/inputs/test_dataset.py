"""The input: Parquet and JSONL read alike, each bad row named with its file and row, at scale (many files, globs,
HF save_to_disk, URLs, true row numbers), skip mode, rows on demand."""

from __future__ import annotations

import json
import logging
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from inputs import files as input_files
from inputs.dataset import InvalidRow, open_tokenized_dataset

VOCAB = 1000


def make_rows(count: int, seed: int, masks: bool = True) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        ids = rng.integers(0, VOCAB, int(rng.integers(1, 12))).tolist()
        row = {"input_ids": ids}
        if masks:
            row["loss_mask"] = rng.integers(0, 2, len(ids)).tolist()
        rows.append(row)
    return rows


def write_parquet(path, rows, **options):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, **options)
    return path


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def all_rows(dataset):
    ids, masks = dataset.rows(0, len(dataset))
    return [{"input_ids": i.tolist(), "loss_mask": m.tolist()} for i, m in zip(ids, masks)]


def with_masks(rows):
    return [{"input_ids": r["input_ids"], "loss_mask": r.get("loss_mask") or [1] * len(r["input_ids"])} for r in rows]


@pytest.fixture
def three_files(tmp_path):
    """A directory of three files in three formats, plus things that are not data."""
    parts = [make_rows(7, 1), make_rows(5, 2, masks=False), make_rows(9, 3)]
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    write_parquet(data / "a.parquet", parts[0], row_group_size=3)
    write_jsonl(data / "b.jsonl", parts[1])
    write_parquet(data / "sub" / "c.parquet", parts[2], row_group_size=4)
    (data / "_SUCCESS").write_text("")
    (data / ".a.parquet.crc").write_text("x")
    (data / "README.md").write_text("not data")
    return data, [row for part in parts for row in part]


def test_directory_of_files_in_sorted_order_with_rows_across_boundaries(three_files):
    data, rows = three_files
    dataset = open_tokenized_dataset(str(data), VOCAB, 100)
    assert len(dataset) == 21 and dataset.sample_ids.tolist() == list(range(21))
    assert dataset.lengths.dtype == np.int64 and dataset.lengths.tolist() == [len(r["input_ids"]) for r in rows]
    assert all_rows(dataset) == with_masks(rows)
    # every window, including ones that cross row groups and files, gives the same rows
    expected = with_masks(rows)
    for start in range(0, 21, 2):
        for stop in (start, start + 1, start + 5, 21):
            stop = min(stop, 21)
            ids, masks = dataset.rows(start, stop)
            assert [i.tolist() for i in ids] == [r["input_ids"] for r in expected[start:stop]]
            assert [m.tolist() for m in masks] == [r["loss_mask"] for r in expected[start:stop]]
            assert all(i.dtype == np.int32 for i in ids) and all(m.dtype == np.uint8 for m in masks)
            # the driver's form: the same rows as a few flat arrays
            tokens, flat_masks = dataset.flat_rows(start, stop)
            assert len(tokens) == stop - start and tokens.offsets.tolist() == np.cumsum([0] + [len(i) for i in ids]).tolist()
            assert [i.tolist() for i in tokens.samples()] == [i.tolist() for i in ids]
            assert flat_masks.tolist() == [bit for m in masks for bit in m.tolist()]
            assert tokens.ids.dtype == np.int32 and flat_masks.dtype == np.uint8
    with pytest.raises(IndexError):
        dataset.rows(20, 22)
    with pytest.raises(IndexError):
        dataset.flat_rows(20, 22)


def test_glob_and_file_url(three_files):
    data, rows = three_files
    by_glob = open_tokenized_dataset(str(data / "**" / "*.parquet"), VOCAB, 100)
    assert all_rows(by_glob) == with_masks(rows[:7] + rows[12:])
    by_url = open_tokenized_dataset(f"file://{data}", VOCAB, 100)
    assert all_rows(by_url) == with_masks(rows)
    assert by_url.fingerprint == open_tokenized_dataset(str(data), VOCAB, 100).fingerprint
    with pytest.raises(ValueError, match="no file matches"):
        open_tokenized_dataset(str(data / "*.csv"), VOCAB, 100)


def test_hf_save_to_disk_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = make_rows(2500, 4)
    hf = datasets.Dataset.from_list(rows)
    # 2 files of Arrow IPC streams, each of several record batches (save_to_disk writes 1000 rows a batch)
    hf.save_to_disk(str(tmp_path / "hf"), num_shards=2)
    assert len(list((tmp_path / "hf").glob("data-*.arrow"))) == 2
    dataset = open_tokenized_dataset(str(tmp_path / "hf"), VOCAB, 100)
    assert all_rows(dataset) == rows
    assert dataset.fingerprint == open_tokenized_dataset(str(write_jsonl(tmp_path / "same.jsonl", rows)), VOCAB, 100).fingerprint
    ids, _ = dataset.rows(995, 1255)  # across a record batch and the file boundary (1250)
    assert [i.tolist() for i in ids] == [r["input_ids"] for r in rows[995:1255]]

    datasets.DatasetDict({"train": hf}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match="DatasetDict .* point data.path at one split, e.g. .*/dict/train"):
        open_tokenized_dataset(str(tmp_path / "dict"), VOCAB, 100)
    assert len(open_tokenized_dataset(str(tmp_path / "dict" / "train"), VOCAB, 100)) == 2500


def test_remote_files_through_fsspec(tmp_path, s3_server):  # noqa: F811
    import datasets
    import s3fs

    rows = make_rows(1200, 5)
    write_parquet(tmp_path / "a.parquet", rows[:500], row_group_size=100)
    write_jsonl(tmp_path / "b.jsonl", rows[500:700])
    datasets.Dataset.from_list(rows[700:]).save_to_disk(str(tmp_path / "hf"))
    fs = s3fs.S3FileSystem(**s3_server)
    fs.put(str(tmp_path / "a.parquet"), "eagle3-test/input/a.parquet")
    fs.put(str(tmp_path / "b.jsonl"), "eagle3-test/input/b.jsonl")
    fs.put(str(tmp_path / "hf") + "/", "eagle3-test/input/c", recursive=True)
    local = open_tokenized_dataset(str(tmp_path / "a.parquet"), VOCAB, 100)
    assert all_rows(open_tokenized_dataset("s3://eagle3-test/input/a.parquet", VOCAB, 100,
                                           storage_options=s3_server)) == all_rows(local)
    everything = open_tokenized_dataset("s3://eagle3-test/input/*", VOCAB, 100, storage_options=s3_server)
    assert everything.invalid == [] and len(everything) == 700
    hf_remote = open_tokenized_dataset("s3://eagle3-test/input/c", VOCAB, 100, storage_options=s3_server)
    ids, masks = hf_remote.rows(450, 500)
    assert [i.tolist() for i in ids] == [r["input_ids"] for r in rows[1150:1200]]
    bad = [dict(row) for row in rows[:500]]
    bad[250] = {"input_ids": [VOCAB], "loss_mask": [1]}
    fs.put(str(write_parquet(tmp_path / "bad.parquet", bad, row_group_size=100)), "eagle3-test/bad/d.parquet")
    with pytest.raises(ValueError, match=r"s3://eagle3-test/bad/d.parquet row 250 \(sample id 250\): token id"):
        open_tokenized_dataset("s3://eagle3-test/bad/d.parquet", VOCAB, 100, storage_options=s3_server)


@pytest.mark.parametrize("value", ["2.7", "3.0"])
def test_jsonl_float_id_is_refused_with_file_row_and_line(tmp_path, value):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n\n{"input_ids": [3]}\n{"input_ids": [1, ' + value + ']}\n')
    with pytest.raises(ValueError, match=rf"{path} row 2 \(line 4, sample id 2\): input_ids holds the float "
                                         rf"{value} at position 1: token ids must be integers; floats are refused "
                                         r"even when integral \(3.0\)"):
        open_tokenized_dataset(str(path), VOCAB, 100)


def test_parquet_float_column_is_refused_even_under_skip(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"input_ids": [1.0, 2.0]}, {"input_ids": [3.0]}])
    for mode in ("fail", "skip"):
        with pytest.raises(ValueError, match=rf"{path}: column 'input_ids' has type list<element: double>: "
                                             "token ids must be integers; floats are refused even when integral"):
            open_tokenized_dataset(str(path), VOCAB, 100, on_invalid=mode)
    mask = write_parquet(tmp_path / "m.parquet", [{"input_ids": [1, 2], "loss_mask": [1.0, 0.0]}])
    with pytest.raises(ValueError, match="column 'loss_mask' has type list<element: double>"):
        open_tokenized_dataset(str(mask), VOCAB, 100)


def test_errors_count_rows_from_the_start_of_the_file(tmp_path, monkeypatch):
    """Regression: the row was counted from the start of a record batch (row 123456 shown as 18599)."""
    rows = make_rows(30_000, 6)
    rows[23_456]["input_ids"] = [5, VOCAB + 1]
    # one row group of 30,000 rows, read in blocks of 8,192: the bad row is in the third block
    parquet = write_parquet(tmp_path / "d.parquet", rows)
    assert pq.ParquetFile(parquet).metadata.num_row_groups == 1
    first = write_parquet(tmp_path / "0.parquet", make_rows(100, 7))
    with pytest.raises(ValueError, match=rf"{parquet} row 23456 \(sample id 23456\): token id {VOCAB + 1} is outside"):
        open_tokenized_dataset(str(parquet), VOCAB, 100)
    # in a directory, the sample id counts the rows of the files before it; the file row does not
    with pytest.raises(ValueError, match=rf"{parquet} row 23456 \(sample id 23556\)"):
        open_tokenized_dataset(str(tmp_path / "*.parquet"), VOCAB, 100)
    assert first.exists()
    # JSONL read in many small blocks: row and line still count from the start of the file
    monkeypatch.setattr(input_files, "JSONL_BLOCK_BYTES", 4096)
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=rf"{jsonl} row 23456 \(line 23457, sample id 23456\): token id"):
        open_tokenized_dataset(str(jsonl), VOCAB, 100)


def test_bad_json_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1]}\n{"input_ids": [1, 2]\n{"input_ids": [3]} {"input_ids": [4]}\n')
    with pytest.raises(ValueError, match=rf"{path} row 1 \(line 2, sample id 1\): not valid JSON"):
        open_tokenized_dataset(str(path), VOCAB, 100)
    dataset = open_tokenized_dataset(str(path), VOCAB, 100, on_invalid="skip")
    assert [(r.file_row, r.reason.split(" (")[0]) for r in dataset.invalid] == [(1, "not valid JSON"), (2, "not valid JSON")]
    assert all_rows(dataset) == [{"input_ids": [1], "loss_mask": [1]}]


def test_skip_mode_records_rows_and_keeps_sample_ids(tmp_path):
    good = make_rows(6, 8)
    first = write_jsonl(tmp_path / "a.jsonl", [good[0], {"input_ids": [1, 2.5]}, good[1], {"input_ids": []}])
    second = write_parquet(tmp_path / "b.parquet", [good[2], {"input_ids": [1, 2], "loss_mask": [1, 7]}, good[3],
                                                    {"input_ids": list(range(20))}, good[4], good[5]])
    with pytest.raises(ValueError, match=rf"{first} row 1 \(line 2, sample id 1\): .* data.on_invalid=skip"):
        open_tokenized_dataset(str(tmp_path), VOCAB, 10)
    dataset = open_tokenized_dataset(str(tmp_path), VOCAB, 10, on_invalid="skip")
    assert dataset.sample_ids.tolist() == [0, 2, 4, 6, 8, 9]
    assert all_rows(dataset) == with_masks(good)
    assert [(r.sample_id, r.file, r.file_row) for r in dataset.invalid] == [
        (1, str(first), 1), (3, str(first), 3), (5, str(second), 1), (7, str(second), 3)]
    reasons = [r.reason for r in dataset.invalid]
    assert reasons[0].startswith("input_ids holds the float 2.5")
    assert reasons[1].startswith("input_ids must be a non-empty list")
    assert reasons[2] == "loss_mask must hold only 0 and 1"
    assert reasons[3].startswith("20 tokens exceed the context length 10")
    assert all(isinstance(r, InvalidRow) for r in dataset.invalid)
    # the same kept rows at other sample ids are other shard contents
    moved = write_jsonl(tmp_path / "moved" / "a.jsonl", good)
    assert open_tokenized_dataset(str(moved), VOCAB, 10).fingerprint != dataset.fingerprint
    with pytest.raises(ValueError, match="data.on_invalid='drop': use fail or skip"):
        open_tokenized_dataset(str(tmp_path), VOCAB, 10, on_invalid="drop")


def test_fingerprint_follows_every_token_and_mask(tmp_path):
    rows = make_rows(50, 9)
    base = open_tokenized_dataset(str(write_parquet(tmp_path / "a.parquet", rows)), VOCAB, 100).fingerprint
    # the same rows in other files, formats and integer widths: the same shard contents
    write_jsonl(tmp_path / "split" / "0.jsonl", rows[:20])
    pq.write_table(pa.Table.from_pylist(rows[20:], schema=pa.schema(
        [("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])), tmp_path / "split" / "1.parquet")
    assert open_tokenized_dataset(str(tmp_path / "split"), VOCAB, 100).fingerprint == base
    for change in ("token", "mask", "boundary"):
        other = [dict(row) for row in rows]
        if change == "token":
            other[37] = {**rows[37], "input_ids": [(rows[37]["input_ids"][0] + 1) % VOCAB, *rows[37]["input_ids"][1:]]}
        elif change == "mask":
            other[37] = {**rows[37], "loss_mask": [1 - rows[37]["loss_mask"][0], *rows[37]["loss_mask"][1:]]}
        else:  # the same tokens, split into rows differently
            other[36] = {"input_ids": rows[36]["input_ids"] + rows[37]["input_ids"][:1],
                         "loss_mask": rows[36]["loss_mask"] + rows[37]["loss_mask"][:1]}
            other[37] = {"input_ids": rows[37]["input_ids"][1:] or [1], "loss_mask": rows[37]["loss_mask"][1:] or [1]}
        path = write_parquet(tmp_path / f"{change}.parquet", other)
        assert open_tokenized_dataset(str(path), VOCAB, 100).fingerprint != base, change


def test_paths_that_hold_no_data_say_so(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is a directory without readable files: it holds nothing"):
        open_tokenized_dataset(str(tmp_path / "empty"), VOCAB, 100)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="is a directory without readable files: it holds notes.txt"):
        open_tokenized_dataset(str(tmp_path / "docs"), VOCAB, 100)
    with pytest.raises(ValueError, match="no such file or directory"):
        open_tokenized_dataset(str(tmp_path / "nope.parquet"), VOCAB, 100)
    with pytest.raises(ValueError, match="unsupported file type"):
        open_tokenized_dataset(str(tmp_path / "docs" / "notes.txt"), VOCAB, 100)


def test_rows_read_only_their_segments_and_the_object_pickles_small(tmp_path, monkeypatch):
    rows = make_rows(4000, 10)
    path = write_parquet(tmp_path / "d.parquet", rows, row_group_size=500)
    dataset = open_tokenized_dataset(str(path), VOCAB, 100)
    reads = []
    original = input_files.read_segment
    monkeypatch.setattr("inputs.dataset.read_segment", lambda fs, file, key, size: reads.append(key) or original(fs, file, key, size))
    ids, _ = dataset.rows(1490, 1510)
    assert reads == [2, 3]  # row groups [1000, 1500) and [1500, 2000) only
    assert [i.tolist() for i in ids] == [r["input_ids"] for r in rows[1490:1510]]
    dataset.rows(1510, 1600)
    assert reads == [2, 3]  # the next batch of an open shard is served from the decoded row group
    clone = pickle.loads(pickle.dumps(dataset))
    assert len(pickle.dumps(dataset)) < 2 * (dataset.sample_ids.nbytes + dataset.lengths.nbytes) + 10_000
    assert [i.tolist() for i in clone.rows(3990, 4000)[0]] == [r["input_ids"] for r in rows[3990:]]


def test_a_file_changed_during_the_run_is_noticed(tmp_path):
    rows = make_rows(20, 11)
    path = write_parquet(tmp_path / "d.parquet", rows)
    dataset = open_tokenized_dataset(str(path), VOCAB, 100)
    rows[3] = {"input_ids": rows[3]["input_ids"] + [1], "loss_mask": rows[3]["loss_mask"] + [1]}
    write_parquet(path, rows)
    with pytest.raises(ValueError, match="changed while the job ran"):
        dataset.rows(0, 5)


def test_job_skips_invalid_rows_lists_them_and_keeps_sample_ids(ray_cluster, llama_fp32, tmp_path):
    from jobs.extract import run
    from jobs.rundir.summary import INVALID_ROWS_FILE
    from tests.helpers import job_config, read_all

    rows = make_rows(12, 12)
    for row in rows:
        row["input_ids"] = [i % 512 for i in row["input_ids"]]  # the tiny model's vocabulary
    rows[2] = {"input_ids": [1, 600]}
    rows[9] = {"input_ids": [1, 2], "loss_mask": [1]}
    data = write_parquet(tmp_path / "data.parquet", rows)
    with pytest.raises(ValueError, match=rf"{data} row 2 \(sample id 2\): token id 600 is outside"):
        run(job_config(llama_fp32, data, tmp_path / "refused"))
    out = tmp_path / "out"
    summary = run(job_config(llama_fp32, data, out, "data.on_invalid=skip"))
    assert summary["samples"] == 10 and summary["shards_failed"] == {}
    assert summary["invalid_rows"]["count"] == 2 and summary["invalid_rows"]["file"] == INVALID_ROWS_FILE
    listed = [json.loads(line) for line in (out / INVALID_ROWS_FILE).read_text().splitlines()]
    assert listed == summary["invalid_rows"]["first"]
    assert [(r["sample_id"], r["file"], r["file_row"]) for r in listed] == [(2, str(data), 2), (9, str(data), 9)]
    stored = read_all(out)
    assert sorted(stored) == [i for i in range(12) if i not in (2, 9)]
    for sample_id, sample in stored.items():
        assert sample.input_ids.tolist() == rows[sample_id]["input_ids"]
        assert sample.loss_mask.tolist() == rows[sample_id]["loss_mask"]


@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_a_conversations_file_is_named_as_such_with_the_command_that_tokenizes_it(tmp_path, mode):
    """jobs.extract reads token ids; a ShareGPT or OpenAI conversations file given to it says what it is and which
    command makes the token ids, whatever data.on_invalid says (once: "input_ids is missing" on every row)."""
    sharegpt = tmp_path / "chat.jsonl"
    sharegpt.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                                {"from": "gpt", "value": "hello"}]}) for _ in range(40)))
    openai = write_parquet(tmp_path / "chat.parquet", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    for path, field in ((sharegpt, "conversations"), (openai, "messages")):
        with pytest.raises(ValueError) as refused:
            open_tokenized_dataset(str(path), VOCAB, 100, on_invalid=mode)
        assert str(refused.value) == (
            f"{path} is a conversations file ('{field}', no 'input_ids'): jobs.extract reads token ids. Tokenize it "
            "first with python -m jobs.prepare model.path=MODEL data.path=FILE output.dir=DIR, then give jobs.extract "
            "data.path=DIR (docs/conversations.md)")


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


def test_a_file_with_no_loss_mask_is_named_once_with_its_columns(tmp_path, monkeypatch, caplog):
    """All ones stays the default, but a mask under another name (loss_masks, labels) would be trained on without a
    word: a file none of whose rows has a loss_mask is named once, whatever its blocks, with the columns it has."""
    monkeypatch.setattr(input_files, "JSONL_BLOCK_BYTES", 64)  # many blocks a file
    data = tmp_path / "data"
    misspelled = write_jsonl(data / "a.jsonl", [{"input_ids": [1, 2], "loss_masks": [0, 1]}] * 8)
    labels = write_parquet(data / "b.parquet", [{"input_ids": [1, 2], "labels": [-100, 2]}] * 8, row_group_size=2)
    write_jsonl(data / "c.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [3], "loss_mask": [0]}])  # some rows have one
    write_parquet(data / "d.parquet", [{"input_ids": [4], "loss_mask": [0]}])
    with caplog.at_level(logging.WARNING, logger="inputs.dataset"):
        dataset = open_tokenized_dataset(str(data), vocab_size=10, max_length=100)
    assert [mask.tolist() for mask in dataset.rows(0, len(dataset))[1]] == [[1, 1]] * 17 + [[0], [0]]
    hint = ("so every token of its rows is trained on; a mask under another name is not read: name that column "
            "loss_mask (docs/format.md)")
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == [
        f"{misspelled}: no row has a loss_mask (its columns: input_ids, loss_masks), {hint}",
        f"{labels}: no row has a loss_mask (its columns: input_ids, labels), {hint}",
    ]
    datasets = pytest.importorskip("datasets")  # an HF save_to_disk directory: Arrow streams
    datasets.Dataset.from_list([{"input_ids": [1, 2], "mask": [0, 1]}]).save_to_disk(str(tmp_path / "hf"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="inputs.dataset"):
        open_tokenized_dataset(str(tmp_path / "hf"), vocab_size=10, max_length=100)
    [record] = caplog.records
    assert "data-00000-of-00001.arrow: no row has a loss_mask (its columns: input_ids, mask)" in record.getMessage()


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
