"""From shards to a trainer: the dataset over a run, the SpecForge and speculators exports, one pre-norm run
serving both, docs/training.md's training example. Three real runs of the job on a tiny Llama's layout, built
once: bf16 post-norm and bf16 pre-norm through SGLang, fp8 pre-norm from the synthetic engine; the sample with
id 5 is an invalid row the runs skip, so sample ids have a gap."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from inputs.demo import build_synthetic_dataset
from jobs import export as export_job
from jobs.config import load_config
from jobs.extract import run
from storage import ShardReader
from storage.manifest import DONE, SINK, Manifest, read_manifest
from tests.conftest import REPO_ROOT
from tests.helpers import (
    HIDDEN,
    bits,
    flip_middle,
    imported_by,
    job_config,
    same,
    specforge_files,
    specforge_item,
    speculators_dataset,
)
from training import peer_formats
from training.dataset import HiddenStatesDataset, collate
from training.destination import Destination
from training.peer_formats import SPECFORGE_MAX_LEN

SKIPPED_ROW = 5
SAMPLES = 21
"""Rows of the input; one is skipped, so the runs hold 20 samples: two ranks share them evenly."""
LAYERS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = build_synthetic_dataset(tmp_path_factory.mktemp("train-data") / "data.parquet", num_samples=SAMPLES,
                                   min_len=16, max_len=96, seed=3)
    table = pq.read_table(path).to_pylist()
    table[SKIPPED_ROW]["input_ids"][0] = 99999  # outside the vocabulary: data.on_invalid=skip leaves it out
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


@pytest.fixture(scope="module")
def runs(ray_cluster, llama_fp32, data, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train-runs")
    settings = {
        "post": ["extract.last_hidden_state=post_norm"],
        "pre": [],  # the default: pre_norm
        # what the fp8 tests read is the stored fp8 values and their scales, not the model's states: the synthetic
        # states of the model's layout, quantized by the same host copy (no SGLang start; tests/jobs/test_job.py
        # stores the model's fp8 states)
        "fp8": ["extract.last_hidden_state=pre_norm", "output.state_dtype=float8_e4m3fn", "model.engine=synthetic"],
    }
    for name, extra in settings.items():  # one writer: which writer wrote a shard is not what these tests read
        summary = run(job_config(llama_fp32, data, root / name, "model.dtype=bfloat16", "data.on_invalid=skip",
                                 "output.num_writers=1", *extra))
        assert summary["shards_failed"] == {} and summary["samples"] == SAMPLES - 1
    return {name: root / name for name in settings}


def shard_samples(run_dir: Path, raw_fp8: bool = False) -> dict:
    samples = {}
    for path in sorted(run_dir.glob("shard-*.parquet")):
        samples.update((s.sample_id, s) for s in ShardReader(path, raw_fp8=raw_fp8))
    return samples


def export(run_dir, to: str, dest, *extra: str) -> int:
    return export_job.main([f"output.dir={run_dir}", f"to={to}", f"dest={dest}", *extra])


# -- the dataset ------------------------------------------------------------------------------------

def test_dataset_gives_every_sample_as_the_shards_hold_it(runs):
    expected = shard_samples(runs["post"])
    dataset = HiddenStatesDataset(runs["post"])
    assert len(dataset) == SAMPLES - 1 and [f.rows for f in dataset.index.files] == [8, 8, 4]
    assert sum(f.rows for f in dataset.index.files) == len(dataset)
    ids = [dataset[i]["sample_id"] for i in range(len(dataset))]
    assert ids == sorted(expected) and SKIPPED_ROW not in ids
    for i in reversed(range(len(dataset))):  # out of order: every lookup finds its row group
        item, sample = dataset[i], expected[ids[i]]
        assert list(item) == ["sample_id", "input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"]
        assert same(item["input_ids"], sample.input_ids) and same(item["loss_mask"], sample.loss_mask)
        assert item["aux_hidden_states"].shape == (len(sample.input_ids), LAYERS * HIDDEN)
        assert same(item["aux_hidden_states"], sample.aux_hidden_states)
        assert same(item["last_hidden_state"], sample.last_hidden_state)
    # reads of one row group share its cached buffers (no copy); collate copies, so a batch can be written into
    assert dataset[0]["aux_hidden_states"].data_ptr() == dataset[0]["aux_hidden_states"].data_ptr()
    collate([dataset[0], dataset[1]])["aux_hidden_states"].add_(1)
    assert same(dataset[0]["aux_hidden_states"], expected[ids[0]].aux_hidden_states)
    # what a DataLoader worker receives: the index, no open file or Arrow table
    blob = pickle.dumps(dataset)
    assert len(blob) < 8_000 and b"ParquetFile" not in blob and b"pyarrow.lib.Table" not in blob
    copy = pickle.loads(blob)
    assert same(copy[7]["aux_hidden_states"], dataset[7]["aux_hidden_states"])

    raw = HiddenStatesDataset(runs["fp8"], raw_fp8=True)[0]
    assert raw["aux_hidden_states"].dtype == torch.float8_e4m3fn and raw["aux_hidden_states_scales"].shape[1] == LAYERS
    dequantized = HiddenStatesDataset(runs["fp8"])[0]
    assert dequantized["aux_hidden_states"].dtype == torch.bfloat16 and "aux_hidden_states_scales" not in dequantized


def test_a_damaged_shard_is_named_by_the_dataset(runs, tmp_path):
    """A shard whose page fails its CRC: reading its samples raises a ValueError naming the file, the shard, the
    sample ids of the row group and the commands that restore it."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs["post"], run_dir)
    flip_middle(run_dir / "shard-00001.parquet")
    dataset = HiddenStatesDataset(run_dir)
    with pytest.raises(ValueError) as raised:
        [dataset[index] for index in range(len(dataset))]
    message = str(raised.value)
    assert re.match(re.escape(str(run_dir / "shard-00001.parquet")) + r" \(shard 1, row group \d+: sample ids \d+\.\.\d+\): "
                    "cannot be read", message), message
    assert f"python -m jobs.verify output.dir={run_dir}`" in message and "with shards=[1]" in message, message


def test_dataset_refuses_to_mix_runs_and_names_the_setting(runs, tmp_path):
    both = HiddenStatesDataset([runs["post"], runs["post"]])
    assert len(both) == 2 * (SAMPLES - 1) and both.run_of(0) == 0 and both.run_of(len(both) - 1) == 1
    with pytest.raises(ValueError, match=r"has last_hidden_state='post_norm' but .* has last_hidden_state='pre_norm'"):
        HiddenStatesDataset([runs["post"], runs["pre"]])
    with pytest.raises(ValueError, match=r"state_dtype='bfloat16' but .* state_dtype='float8_e4m3fn'"):
        HiddenStatesDataset([runs["pre"], runs["fp8"]])
    mixed = tmp_path / "mixed"  # shard files of two runs in one directory, no manifest
    mixed.mkdir()
    shutil.copy(runs["post"] / "shard-00000.parquet", mixed / "shard-00000.parquet")
    shutil.copy(runs["post"] / "shard-00001.parquet", mixed / "shard-00001.parquet")
    assert len(HiddenStatesDataset(mixed)) == 16  # listed without a manifest
    shutil.copy(runs["pre"] / "shard-00002.parquet", mixed / "shard-00002.parquet")
    with pytest.raises(ValueError, match="last_hidden_state='pre_norm'.*different runs"):
        HiddenStatesDataset(mixed)
    shutil.copy(runs["post"] / "shard-00000.parquet", mixed / "shard-00002.parquet")
    with pytest.raises(ValueError, match="hold the same sample ids"):
        HiddenStatesDataset(mixed)
    with pytest.raises(ValueError, match=r"speculators stores the verifier's final state before .* "
                                         r"extract.last_hidden_state=pre_norm \(it serves both trainers\) into a new output.dir"):
        HiddenStatesDataset(runs["post"], view="speculators")
    with pytest.raises(ValueError, match="raw_fp8=True but .* stored bfloat16"):
        HiddenStatesDataset(runs["pre"], raw_fp8=True)


def test_dataloader_workers_collate_and_two_ranks(runs):
    dataset = HiddenStatesDataset(runs["post"])
    expected = shard_samples(runs["post"])
    seen = []
    for rank, workers in ((0, 2), (1, 0)):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=7, drop_last=True)
        # spawn: each worker unpickles the dataset and opens the files itself
        loader = DataLoader(dataset, batch_size=3, sampler=sampler, collate_fn=collate, num_workers=workers,
                            multiprocessing_context="spawn" if workers else None)
        ranks_ids = []
        for batch in loader:
            longest = int(batch["lengths"].max())
            assert batch["aux_hidden_states"].shape == (len(batch["lengths"]), longest, LAYERS * HIDDEN)
            for row, (sample_id, length) in enumerate(zip(batch["sample_ids"].tolist(), batch["lengths"].tolist())):
                sample = expected[sample_id]
                assert same(batch["input_ids"][row, :length], sample.input_ids)
                assert same(batch["aux_hidden_states"][row, :length], sample.aux_hidden_states)
                assert same(batch["last_hidden_state"][row, :length], sample.last_hidden_state)
                assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (longest - length)
                assert not batch["aux_hidden_states"][row, length:].any() and not batch["loss_mask"][row, length:].any()
            ranks_ids.append(batch["sample_ids"].tolist())
        seen.append({i for ids in ranks_ids for i in ids})
    assert not seen[0] & seen[1], "the two ranks share samples"
    assert seen[0] | seen[1] == set(expected) and len(seen[0]) == len(seen[1]) == (SAMPLES - 1) // 2


# -- SpecForge --------------------------------------------------------------------------------------

def test_specforge_export_round_trip_and_resume(runs, tmp_path, capsys):
    dest = tmp_path / "specforge"
    assert export(runs["post"], "SpecForge", dest) == 0
    expected = shard_samples(runs["post"])
    files = specforge_files(dest)
    assert sorted(files) == sorted(str(dest / f"rows_0-2000/data_{i}.ckpt") for i in expected)
    for sample_id, sample in expected.items():
        data = torch.load(dest / f"rows_0-2000/data_{sample_id}.ckpt", weights_only=False, mmap=True)
        assert list(data) == ["input_ids", "loss_mask", "hidden_state", "aux_hidden_state"]
        length = len(sample.input_ids)
        assert data["input_ids"].dtype == data["loss_mask"].dtype == torch.int64
        assert data["input_ids"].shape == data["loss_mask"].shape == (length,)
        assert data["hidden_state"].shape == (1, length, HIDDEN) and data["aux_hidden_state"].shape == (1, length, LAYERS * HIDDEN)
        assert same(data["hidden_state"][0], sample.last_hidden_state)  # post-norm, nothing shifted
        assert same(data["aux_hidden_state"][0], sample.aux_hidden_states)
        assert data["input_ids"].tolist() == sample.input_ids.tolist() and data["loss_mask"].tolist() == sample.loss_mask.tolist()
    # the dataset's SpecForge view is SpecForge's own items over the files, in its order (paths sorted as strings:
    # data_10 before data_2), with max_len cutting samples
    view = HiddenStatesDataset(runs["post"], view="specforge", max_len=40)
    assert [view.sample(index).sample_id for index in range(len(view))][:4] == [0, 1, 10, 11]
    assert len(view) == len(files)
    for index, path in enumerate(files):
        mine, theirs = view[index], specforge_item(path, 40)
        assert path.endswith(f"/data_{view.sample(index).sample_id}.ckpt")
        assert list(mine) == list(theirs)
        assert all(same(mine[key], theirs[key]) for key in theirs), index

    # resume: a lost file and a temp file a killed export left; the rest is not rewritten
    (dest / "rows_0-2000/data_3.ckpt").unlink()
    (dest / "rows_0-2000/.data_4.ckpt.tmp").write_bytes(b"partial")
    (dest / ".export_state.json").write_text((dest / ".export_state.json").read_text().replace('"complete": true', '"complete": false'))
    before = {path: os.stat(path).st_mtime_ns for path in files if not path.endswith("data_3.ckpt")}
    capsys.readouterr()
    assert export(runs["post"], "specforge", dest) == 0
    assert f"1 written, {SAMPLES - 2} already there" in capsys.readouterr().out
    assert {path: os.stat(path).st_mtime_ns for path in before} == before
    assert not (dest / "rows_0-2000/.data_4.ckpt.tmp").exists() and (dest / "rows_0-2000/data_3.ckpt").exists()
    assert export(runs["post"], "specforge", dest) == 0
    assert "nothing to do" in capsys.readouterr().out


def ulps(mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """|mine - theirs| in units in the last place of ``theirs`` (its dtype, its binade), where it is not zero."""
    nonzero = theirs != 0
    a, b = mine.float()[nonzero], theirs.float()[nonzero]
    return (a - b).abs() / (torch.finfo(theirs.dtype).eps * torch.exp2(torch.floor(torch.log2(b.abs()))))


def test_one_pre_norm_run_serves_both_trainers(runs, llama_fp32, tmp_path, capsys, caplog):
    """The default run (pre-norm final state) exported to SpecForge: the checkpoint's final norm applied at export,
    said in the log, the report and the export state; its hidden_state is SGLang's own post-norm state of the same
    sample (the post-norm run) within a unit in the last place, most values bit for bit; the dataset's SpecForge
    view gives the same; consume=true verifies and deletes the shards as it does without the norm."""
    assert load_config([]).extract.last_hidden_state == "pre_norm"
    assert ShardReader(next(runs["pre"].glob("shard-*.parquet"))).metadata.last_hidden_state == "pre_norm"
    dest = tmp_path / "specforge"
    with caplog.at_level(logging.INFO, logger="training.export"):
        assert export(runs["pre"], "specforge", dest) == 0
    norm = f"model.norm.weight of {llama_fp32}, eps 1e-06"
    assert f"the files' hidden_state is the model's final norm ({norm}) applied to it at export" in caplog.text
    assert f"post_norm from the run's pre_norm, the final norm ({norm}) applied at export" in capsys.readouterr().out
    assert json.loads((dest / ".export_state.json").read_text())["final_norm"] == {"weight": "model.norm.weight",
                                                                                   "eps": 1e-06}
    pre, post = shard_samples(runs["pre"]), shard_samples(runs["post"])
    exported, reference = [], []
    for sample_id, sample in pre.items():
        data = torch.load(dest / f"rows_0-2000/data_{sample_id}.ckpt", weights_only=False)
        assert same(data["aux_hidden_state"][0], post[sample_id].aux_hidden_states)  # the same forward
        exported.append(data["hidden_state"][0])
        reference.append(post[sample_id].last_hidden_state)
    mine, theirs = torch.cat(exported), torch.cat(reference)
    assert mine.dtype == theirs.dtype == torch.bfloat16
    equal = (bits(mine) == bits(theirs)).float().mean().item()
    per_token = ((mine.float() - theirs.float()).norm(dim=-1) / theirs.float().norm(dim=-1)).max().item()
    print(f"export vs SGLang's post-norm: {equal:.1%} of values bit for bit, at most {ulps(mine, theirs).max():.0f} "
          f"ulp apart, per token at most {per_token:.2e} (relative L2)")
    assert ulps(mine, theirs).max() <= 2 and equal > 0.5 and per_token < 1e-2
    view = HiddenStatesDataset(runs["pre"], view="specforge")
    for index in range(len(view)):
        sample_id = view.sample(index).sample_id
        data = torch.load(dest / f"rows_0-2000/data_{sample_id}.ckpt", weights_only=False)
        assert same(view[index]["target"][0], data["hidden_state"][0, :SPECFORGE_MAX_LEN])

    consumed = tmp_path / "run-pre"
    shutil.copytree(runs["pre"], consumed)
    assert export(consumed, "specforge", tmp_path / "consumed", "consume=true") == 0
    assert not list(consumed.glob("shard-*.parquet"))
    for path in (tmp_path / "consumed").rglob("*.ckpt"):
        assert same(torch.load(path, weights_only=False)["hidden_state"], torch.load(dest / path.relative_to(
            tmp_path / "consumed"), weights_only=False)["hidden_state"])


# -- speculators ------------------------------------------------------------------------------------

def test_speculators_export_round_trip(runs, tmp_path):
    import datasets

    dest = tmp_path / "speculators"
    assert export(runs["pre"], "speculators", f"file://{dest}") == 0
    expected = shard_samples(runs["pre"])
    order = sorted(expected)  # row i is the i-th sample id: 5 is missing, so hs_5 holds sample 6
    rows = datasets.load_from_disk(str(dest))
    assert rows.column_names == ["input_ids", "loss_mask", "seq_len"] and len(rows) == len(order)
    assert sorted(p.name for p in (dest / "hidden_states").iterdir()) == sorted(f"hs_{i}.safetensors" for i in range(len(order)))
    from safetensors.torch import load_file

    view = HiddenStatesDataset(runs["pre"], view="speculators")
    theirs_dataset = speculators_dataset(dest)
    assert len(theirs_dataset) == len(view) and theirs_dataset.approx_lengths == view.approx_lengths
    counts: dict[int, int] = {}
    for row, sample_id in enumerate(order):
        sample = expected[sample_id]
        tensors = load_file(dest / "hidden_states" / f"hs_{row}.safetensors")
        assert sorted(tensors) == ["hidden_states", "token_ids"]
        length = len(sample.input_ids)
        assert tensors["hidden_states"].shape == (length, LAYERS + 1, HIDDEN) and tensors["hidden_states"].dtype == torch.bfloat16
        assert tensors["token_ids"].dtype == torch.int64 and tensors["token_ids"].tolist() == sample.input_ids.tolist()
        assert same(tensors["hidden_states"][:, :LAYERS].reshape(length, -1), sample.aux_hidden_states)
        assert same(tensors["hidden_states"][:, LAYERS], sample.last_hidden_state)  # pre-norm final state
        assert rows[row]["seq_len"] == length and rows[row]["loss_mask"].dtype == torch.int64
        assert rows[row]["loss_mask"].tolist() == sample.loss_mask.tolist()
        mine, theirs = view[row], theirs_dataset[row]
        assert list(mine) == list(theirs)
        assert all(same(mine[key], theirs[key]) for key in theirs), row
        for token in sample.input_ids[sample.loss_mask == 1].tolist():
            counts[token] = counts.get(token, 0) + 1
    assert torch.load(dest / "token_freq.pt") == counts


def test_speculators_own_dataloader_runs_on_the_dataset(runs, tmp_path, monkeypatch):
    """docs/training.md's block (speculators' _setup_dataloader over the dataset, one line changed) runs; and
    speculators' loader gives the same batches over the dataset as over jobs.export's files, for both splits,
    bit for bit; token_freq.pt is what speculators' own count of the exported dataset gives."""
    import datasets
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    monkeypatch.chdir(tmp_path)
    text = (REPO_ROOT / "docs" / "training.md").read_text()
    block = re.search(r"<!-- speculators example.*?-->\s*```python\n(.*?)```", text, re.DOTALL)
    assert block, "docs/training.md's speculators example block is missing"
    namespace = {"RUN": str(runs["pre"])}
    exec(compile(block.group(1), "docs/training.md (speculators example)", "exec"), namespace)
    batch = namespace["batch"]
    assert batch["hidden_states"].shape == (1, 8192, LAYERS * HIDDEN) and batch["hidden_states"].dtype == torch.bfloat16
    assert len(namespace["train"]) == int(0.9 * (SAMPLES - 1)) and len(namespace["val"]) == (SAMPLES - 1) - 18

    dest = tmp_path / "speculators"
    assert export(runs["pre"], "speculators", dest) == 0
    for split in ("train", "val"):
        mine = HiddenStatesDataset(runs["pre"], view="speculators", train_ratio=0.75, split=split)
        theirs = speculators_dataset(dest, train_ratio=0.75, split=split)
        assert len(mine) == len(theirs) == (15 if split == "train" else 5)
        assert mine.approx_lengths == theirs.approx_lengths
        loaders = [_setup_dataloader(dataset, 160, HIDDEN, num_workers=0, num_target_layers=LAYERS,
                                     preprocess=shift_batch, seed=3) for dataset in (mine, theirs)]
        mine_batches, their_batches = (list(loader) for loader in loaders)
        assert len(mine_batches) == len(their_batches) > 1
        for a, b in zip(mine_batches, their_batches):
            assert list(a) == list(b)
            assert all(same(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    # the split is the order's first int(len * ratio) items, the rest for val, as speculators' ArrowDataset cuts it
    train = HiddenStatesDataset(runs["pre"], view="speculators", train_ratio=0.75)
    val = HiddenStatesDataset(runs["pre"], view="speculators", train_ratio=0.75, split="val")
    assert [train.sample(i).sample_id for i in range(len(train))] + [val.sample(i).sample_id for i in range(len(val))] \
        == sorted(shard_samples(runs["pre"]))

    save_token_frequency_distribution(datasets.load_from_disk(str(dest)), tmp_path / "theirs.pt")
    counted = torch.load(tmp_path / "theirs.pt")
    assert torch.load(dest / "token_freq.pt") == counted == namespace["train"].token_freq()
    assert torch.load(tmp_path / "token_freq.pt") == counted  # what the block saved
    with pytest.raises(ValueError, match="leaves no validation items"):
        HiddenStatesDataset(runs["pre"], view="speculators", split="val")


def test_fp8_export_requantizes_per_token(runs, tmp_path, monkeypatch):
    monkeypatch.setattr(peer_formats, "QUANTIZE_CHUNK_TOKENS", 7)  # samples quantized 7 tokens at a time
    dest = tmp_path / "fp8"
    assert export(runs["fp8"], "speculators", dest) == 0  # fp8 run: fp8 by default
    raw = shard_samples(runs["fp8"], raw_fp8=True)
    from safetensors.torch import load_file

    view = HiddenStatesDataset(runs["fp8"], view="speculators")
    theirs_dataset = speculators_dataset(dest, fp8=True)
    for row, sample_id in enumerate(sorted(raw)):
        sample, length = raw[sample_id], len(raw[sample_id].input_ids)
        tensors = load_file(dest / "hidden_states" / f"hs_{row}.safetensors")
        assert sorted(tensors) == ["hidden_states", "hidden_states_scales", "token_ids"]
        values, scales = tensors["hidden_states"], tensors["hidden_states_scales"]
        assert values.dtype == torch.float8_e4m3fn and values.shape == (length, LAYERS + 1, HIDDEN)
        assert scales.dtype == torch.float32 and scales.shape == (length, 1, 1)
        # one scale per token: the amax over all its layers of the run's values (fp8 x per-layer scale, in float32)
        stored = torch.cat([sample.aux_hidden_states.view(length, LAYERS, HIDDEN).float() * sample.aux_hidden_states_scales[..., None],
                            sample.last_hidden_state.view(length, 1, HIDDEN).float() * sample.last_hidden_state_scales[..., None]], 1)
        assert torch.equal(scales, (stored.abs().amax(dim=(1, 2), keepdim=True) / 448).clamp(min=1e-12))
        # the layer holding a token's largest value converts exactly: same scale, same fp8 values
        per_layer = torch.cat([sample.aux_hidden_states_scales, sample.last_hidden_state_scales], 1)
        largest = per_layer.argmax(dim=1)
        original = torch.cat([sample.aux_hidden_states.view(length, LAYERS, HIDDEN), sample.last_hidden_state.view(length, 1, HIDDEN)], 1)
        picked = torch.arange(length)
        assert torch.equal(bits(values[picked, largest]), bits(original[picked, largest]))
        # everything else: a second rounding, within fp8's error of the first
        error = (values.float() * scales - stored).norm() / stored.norm()
        assert error < 0.05, (row, error)
        theirs, mine = theirs_dataset[row], view[row]
        assert (theirs["hidden_states"].float() - mine["hidden_states"].float()).norm() / mine["hidden_states"].float().norm() < 0.05

    model_dtype = tmp_path / "dequantized"
    assert export(runs["fp8"], "speculators", model_dtype, "fp8=false") == 0
    dequantized = shard_samples(runs["fp8"])
    tensors = load_file(model_dtype / "hidden_states" / "hs_0.safetensors")
    assert tensors["hidden_states"].dtype == torch.bfloat16 and sorted(tensors) == ["hidden_states", "token_ids"]
    assert same(tensors["hidden_states"][:, :LAYERS].reshape(len(dequantized[0].input_ids), -1), dequantized[0].aux_hidden_states)

    from_bf16 = tmp_path / "from-bf16"  # a bf16 run asked for fp8: speculators' own quantization of its states
    assert export(runs["pre"], "speculators", from_bf16, "fp8=true") == 0
    bf16 = shard_samples(runs["pre"])[0]
    tensors = load_file(from_bf16 / "hidden_states" / "hs_0.safetensors")
    both = torch.cat([bf16.aux_hidden_states.view(-1, LAYERS, HIDDEN), bf16.last_hidden_state.view(-1, 1, HIDDEN)], 1).float()
    scale = (both.abs().amax(dim=(1, 2), keepdim=True) / 448).clamp(min=1e-12)
    assert torch.equal(tensors["hidden_states_scales"], scale)
    assert torch.equal(bits(tensors["hidden_states"]), bits((both / scale).to(torch.float8_e4m3fn)))


# -- refusals, before anything is written ---------------------------------------------------------

@pytest.mark.parametrize("run_name, to, extra, message", [
    ("pre", "specforge", ["exact=true"], r"exact=true but .* stored the pre-norm final state: SpecForge trains against "
                                         r"the final state after .* extract.last_hidden_state=post_norm"),
    ("pre", "specforge", ["model_path=/nonexistent"], r"the model's final norm would be applied .* cannot read the "
                                                      r"checkpoint's config.json .* model_path=DIR"),
    ("post", "speculators", [], r"before its final norm .* extract.last_hidden_state=pre_norm"),
    ("fp8", "speculators", ["exact=true"], r"stored fp8 states .* output.state_dtype=model"),
    ("post", "specforge", ["fp8=true"], r"SpecForge reads model-dtype states only"),
    ("post", "blob", [], r"to='blob': use specforge or speculators"),
])
def test_export_refuses_what_the_format_cannot_take(runs, tmp_path, capsys, run_name, to, extra, message):
    dest = tmp_path / "dest"
    assert export(runs[run_name], to, dest, *extra) == 2
    errors = capsys.readouterr().err
    assert re.search(message, errors), errors
    assert not dest.exists()


def test_export_refuses_foreign_or_other_content_and_partial_runs(runs, tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert export(runs["post"], "specforge", foreign) == 2
    assert "holds 1 files (notes.txt" in capsys.readouterr().err and (foreign / "notes.txt").read_text() == "mine"
    dest = tmp_path / "dest"
    assert export(runs["pre"], "speculators", dest) == 0
    assert export(runs["fp8"], "speculators", dest) == 2
    assert "holds an export of something else (run, shards, states differ" in capsys.readouterr().err
    partial = tmp_path / "partial-run"
    shutil.copytree(runs["post"], partial)
    manifest = Manifest.open(partial, read_manifest(partial)["content"], [])
    manifest.update(2, state="failed", error="a test")
    manifest.close()
    assert export(partial, "specforge", tmp_path / "partial") == 2
    errors = capsys.readouterr().err
    assert "2 of 3 shards are read; left out: 1 failed" in errors and "allow_partial=true" in errors
    assert export(partial, "specforge", tmp_path / "partial", "allow_partial=true") == 0
    assert len(specforge_files(tmp_path / "partial")) == 16


def test_dataset_and_export_through_s3(runs, tmp_path, s3_server):  # noqa: F811
    """The run's shards in the sink (the manifest names them by sink_url), the export into S3."""
    import fsspec

    fs = fsspec.filesystem("s3", **s3_server)
    moved = tmp_path / "run"
    shutil.copytree(runs["pre"], moved)
    manifest = Manifest.open(moved, read_manifest(moved)["content"], [])
    for record in manifest.in_state(DONE):
        url = f"s3://eagle3-test/sunk/{record.file}"
        fs.put_file(str(moved / record.file), url)
        (moved / record.file).unlink()
        manifest.update(record.index, location=SINK, sink_url=url)
    manifest.close()
    local = HiddenStatesDataset(runs["pre"])
    remote = HiddenStatesDataset(moved, storage_options=s3_server)
    assert [f.url.split("://")[0] for f in remote.index.files] == ["s3"] * 3
    listed = HiddenStatesDataset("s3://eagle3-test/sunk", storage_options=s3_server)  # no manifest: listed
    for index in (len(local) - 1, 0, 9):
        for other in (remote, listed):
            assert all(same(local[index][k], other[index][k]) for k in ("input_ids", "aux_hidden_states", "last_hidden_state"))

    import json

    assert export(moved, "speculators", "s3://eagle3-test/export", f"output.sink_options={json.dumps(s3_server)}",
                  f"dest_options={json.dumps(s3_server)}") == 0
    names = fs.ls("eagle3-test/export/hidden_states")
    assert len(names) == SAMPLES - 1 and not [n for n in names if n.endswith(".tmp")]
    state = json.loads(fs.cat_file("eagle3-test/export/.export_state.json"))
    assert state["complete"] is True and state["sample_ids"] == [[0, SKIPPED_ROW], [SKIPPED_ROW + 1, SAMPLES]]
    from safetensors.torch import load as load_bytes

    tensors = load_bytes(fs.cat_file("eagle3-test/export/hidden_states/hs_7.safetensors"))
    assert same(tensors["hidden_states"][:, LAYERS], local[7]["last_hidden_state"])
    assert_failed_write_leaves_nothing(Destination("s3://eagle3-test/failed", s3_server), fs.exists)


def assert_failed_write_leaves_nothing(dest: "Destination", exists) -> None:
    """A write that fails half-way (8 MiB in: past S3's first multipart part) publishes no file."""
    def produce(file):
        file.write(b"x" * (8 << 20))
        file.flush()
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        dest.write("rows_0-2000/data_1.ckpt", produce)
    assert not exists(dest.path("rows_0-2000/data_1.ckpt"))
    assert not [path for path in dest.files() if "data_1" in path]
    assert dest.write_bytes("rows_0-2000/data_1.ckpt", b"whole") == 5 and exists(dest.path("rows_0-2000/data_1.ckpt"))


def test_a_failed_write_leaves_no_file(tmp_path):
    assert_failed_write_leaves_nothing(Destination(str(tmp_path / "dest")), os.path.exists)


# -- the training example of docs/training.md ---------------------------------------------------------

def test_docs_training_example_takes_a_step(runs):
    text = (REPO_ROOT / "docs" / "training.md").read_text()
    block = re.search(r"<!-- training example.*?-->\s*```python\n(.*?)```", text, re.DOTALL)
    assert block, "the training example block of docs/training.md is missing"
    namespace = {"RUN": str(runs["post"])}
    exec(compile(block.group(1), "docs/training.md (training example)", "exec"), namespace)
    assert torch.isfinite(namespace["loss"]) and namespace["loss"] > 0
    changed = [not torch.equal(a, b) for a, b in zip(namespace["before"], namespace["drafter"].parameters())]
    assert all(changed), "every drafter weight should move in one step"


def test_dataset_and_export_load_no_engine():
    """A trainer imports the dataset, and an export runs, without SGLang or Ray (or HF datasets until needed)."""
    assert imported_by("training.dataset, jobs.export", ("sglang", "ray", "datasets")) == []
