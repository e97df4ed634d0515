"""jobs.verify on runs written by the real ShardWriter and Manifest (no model, no Ray): every problem
is found and listed, one line each; and the writer's extract.on_nonfinite policy."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import typing

import numpy as np
import pytest

from extractor.config import ExtractConfig
from jobs.planning.content import expected_metadata
from jobs.rundir.summary import INVALID_ROWS_FILE
from jobs.verify import main as verify_main
from runtime.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_VERIFY_FAILED
from storage import ShardMetadata, ShardReader, ShardWriter, nonfinite, shard_file_name
from storage.manifest import DONE, FAILED, LOCAL, SINK, Manifest
from storage.nonfinite import NonFiniteStates
from storage.schema import NonfiniteAction
from storage.verify import verify_run

HIDDEN = 32
LAYERS = [1, 2, 3]
ROWS = 4
NAN_BF16 = np.int16(0x7FC0)
from tests.conftest import REPO_ROOT
from tests.helpers import flip_middle, python_env


def metadata(state_dtype="bfloat16", layer_ids=LAYERS) -> ShardMetadata:
    return ShardMetadata(
        dtype="bfloat16", state_dtype=state_dtype, hidden_size=HIDDEN, layer_ids=list(layer_ids),
        layers_to_capture=[k + 1 for k in layer_ids], drafter_layer_ids=list(layer_ids), last_hidden_state="post_norm",
        model_path="/models/tiny", model_architecture="LlamaForCausalLM", sglang_version="0.5.23", tp_size=1,
    )


def content(meta: ShardMetadata) -> dict:
    return {"model.path": meta.model_path, "model.dtype": meta.dtype, "model.tp_size": meta.tp_size,
            "extract.layers": meta.layer_ids, "extract.last_hidden_state": meta.last_hidden_state,
            "output.state_dtype": "model" if meta.state_dtype == meta.dtype else meta.state_dtype}


def bf16_bits(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.int16)


def write_shard(path, meta, sample_ids, nan_samples=(), on_nonfinite="fail", flag=True):
    """One shard of samples of 30 + id % 5 tokens; ``nan_samples`` get a NaN in layer 2 (flagged unless not ``flag``)."""
    rng = np.random.default_rng(sample_ids[0])
    lengths = [30 + sid % 5 for sid in sample_ids]
    tokens = sum(lengths)
    aux = bf16_bits(rng.standard_normal((tokens, len(meta.layer_ids) * HIDDEN)))
    last = bf16_bits(rng.standard_normal((tokens, HIDDEN)))
    finite = np.ones((len(sample_ids), len(meta.layer_ids) + 1), dtype=bool)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for row, sid in enumerate(sample_ids):
        if sid in nan_samples:
            aux[starts[row] + 1, HIDDEN + 3] = NAN_BF16  # layer 2 is the second captured layer
            finite[row, 1] = False
    with ShardWriter(path, meta, on_nonfinite) as writer:
        writer.append(sample_ids, [np.arange(n, dtype=np.int32) + sid for sid, n in zip(sample_ids, lengths)],
                      [np.ones(n, np.uint8) for n in lengths], aux, last, finite=finite if flag else None)
        return writer.finalize()


def record(manifest: Manifest, index: int, info) -> None:
    manifest.update(index, state=DONE, file=shard_file_name(index), rows=info.rows, tokens=info.tokens,
                    bytes=info.bytes, checksum=info.checksum, location=LOCAL, nonfinite=list(info.nonfinite))


def write_run(out, shards=3, meta=None, invalid=(), **shard_options):
    """A run of ``shards`` shards of ROWS kept samples each; ``invalid`` sample ids were left out of the input."""
    meta = meta or metadata()
    out.mkdir(exist_ok=True)
    kept = [i for i in range(shards * ROWS + len(invalid)) if i not in invalid]
    plan = [(i, i * ROWS, (i + 1) * ROWS) for i in range(shards)]
    manifest = Manifest.open(out, content(meta), plan)
    for index, start, stop in plan:
        record(manifest, index, write_shard(out / shard_file_name(index), meta, kept[start:stop], **shard_options))
    manifest.close()
    if invalid:
        (out / INVALID_ROWS_FILE).write_text("".join(
            json.dumps({"sample_id": i, "file": "in.jsonl", "file_row": i, "reason": "empty"}) + "\n" for i in invalid))
    return manifest


def verify(out, deep=False):
    """storage.verify's report, with what the manifest's content says every file must record, as jobs.verify has it."""
    return verify_run(out, deep=deep, expected_metadata=expected_metadata)


def verify_lines(out, *extra, capsys) -> tuple[int, list[str]]:
    code = verify_main([f"output.dir={out}", *extra])
    return code, capsys.readouterr().out.strip().splitlines()


def test_a_whole_run_verifies_and_skipped_rows_are_not_missing(tmp_path, capsys):
    write_run(tmp_path, invalid=(2, 9))
    code, lines = verify_lines(tmp_path, "--deep", capsys=capsys)
    assert code == EXIT_OK, lines
    assert lines[-1].startswith(f"OK: 3 files of 3 shards: {3 * ROWS} samples")


def test_every_problem_is_listed_one_line_each(tmp_path, capsys):
    manifest = write_run(tmp_path, shards=6)
    flip_middle(tmp_path / shard_file_name(0))                                    # corrupted in place
    (tmp_path / shard_file_name(1)).unlink()                                      # gone
    manifest = Manifest.open(tmp_path, manifest.content, [])
    manifest.update(2, rows=ROWS + 1, tokens=1)                                   # the manifest disagrees
    info = write_shard(tmp_path / shard_file_name(3), metadata(), [12, 13, 13, 99])  # ids wrong, hash right
    record(manifest, 3, info)
    info = write_shard(tmp_path / shard_file_name(4), metadata(layer_ids=[0, 1, 2]), [16, 17, 18, 19])
    record(manifest, 4, info)                                                     # another run's metadata
    manifest.update(5, state=FAILED, error="RuntimeError: boom")
    manifest.close()
    shutil.copy(tmp_path / shard_file_name(2), tmp_path / "shard-00042.parquet")  # not the manifest's
    (tmp_path / ".shard-00005.parquet.tmp").write_bytes(b"partial")

    code, lines = verify_lines(tmp_path, capsys=capsys)
    assert code == EXIT_VERIFY_FAILED
    problems = "\n".join(lines)
    expected = [
        r"shard-00000.parquet: checksum xxh3_128:\w+ differs from the manifest's xxh3_128:\w+; the file changed .* shards=\[0\]",
        r"shard-00001.parquet: missing: the manifest lists shard 1 as done here and no consumer declared it "
        r"consumed .*: it was lost; rerun the job.s command: it extracts the shard again",
        rf"shard-00002.parquet: {ROWS} rows, the manifest recorded {ROWS + 1}; .*shards=\[2\]",
        r"shard-00002.parquet: \d+ tokens, the manifest recorded 1;",
        r"shard-00003.parquet: 1 sample ids are written more than once: \[13\]",
        r"shard-00003.parquet: 2 sample ids of the shard's planned rows are missing: \[14, 15\]",
        r"shard-00003.parquet: 1 sample ids that are not this shard's: \[99\]",
        r"shard-00004.parquet: metadata differs from .*shard-00000.parquet: layer_ids=\[0, 1, 2\] here, \[1, 2, 3\] there",
        r"shard-00005.parquet: a shard file the manifest does not list as done here",
        r"shard-00005.parquet: shard 5 failed after 0 attempts and has no file: RuntimeError: boom; .*shards=failed",
        r"\.shard-00005.parquet.tmp: a temp file",
        r"shard-00042.parquet: a shard file the manifest does not list as done here",
        r"to write the shards with problems again: rerun the job's command with shards=\[0,1,2,3,4,5\]",
    ]
    for pattern in expected:
        assert any(re.search(pattern, line) for line in lines), (pattern, problems)
    # the counts are of what is there: 4 files found of the 5 done shards (shard 1's is gone)
    assert re.search(r"^FAILED: \d+ problems in .* \(4 files of 6 shards \(1 not found\): ", lines[-2]), lines[-2]
    assert lines[-2].startswith(f"FAILED: {len(expected) - 1} problems"), problems  # the lines above, no others
    # the page checksums: the project's reader refuses the flipped file instead of returning wrong states
    with pytest.raises(ValueError, match=r"CRC checksum verification failed.*shards=\[0\]"):
        list(ShardReader(tmp_path / shard_file_name(0)))


def test_files_must_record_what_the_manifests_content_says(tmp_path, capsys):
    """The content's layers and state dtype (``model``: the model's own) against every file's metadata."""
    stored = dict(content(metadata()), **{"extract.layers": [0, 1, 2], "output.state_dtype": "float8_e4m3fn"})
    manifest = Manifest.open(tmp_path, stored, [(0, 0, ROWS)])
    record(manifest, 0, write_shard(tmp_path / shard_file_name(0), metadata(), [0, 1, 2, 3]))
    manifest.close()
    code, lines = verify_lines(tmp_path, capsys=capsys)
    assert code == EXIT_VERIFY_FAILED
    assert "shard-00000.parquet: metadata does not match the run's manifest: " in lines[0]
    assert "layer_ids=[1, 2, 3] in the file, [0, 1, 2] in the manifest" in lines[0]
    assert "state_dtype='bfloat16' in the file, 'float8_e4m3fn' in the manifest" in lines[0]
    assert expected_metadata(content(metadata()))["state_dtype"] == "bfloat16"


def test_deep_finds_nan_the_manifest_does_not_flag(tmp_path, capsys):
    write_run(tmp_path, nan_samples={5}, on_nonfinite="keep")
    code, lines = verify_lines(tmp_path, "--deep", capsys=capsys)
    assert code == EXIT_OK, lines
    assert "note: shard 1: 1 samples with NaN/Inf states written, flagged (extract.on_nonfinite=keep): [5]" in lines

    other = tmp_path / "unflagged"
    write_run(other, nan_samples={5, 10}, flag=False)
    assert verify(other).ok  # the bytes are as written: only reading the states finds the NaN
    code, lines = verify_lines(other, "--deep", capsys=capsys)
    assert code == EXIT_VERIFY_FAILED
    assert [line.split(":")[0][-19:] for line in lines[:2]] == ["shard-00001.parquet", "shard-00002.parquet"]
    assert "aux_hidden_states of 1 samples holds NaN/Inf the manifest does not flag: [5]" in lines[0]


def test_deep_checks_fp8_values_and_scales(tmp_path):
    meta = metadata(state_dtype="float8_e4m3fn")
    tokens = 5
    values = np.zeros((tokens, 3 * HIDDEN), np.uint8)
    scales = np.ones((tokens, 3), np.float32)
    last, last_scales = np.zeros((tokens, HIDDEN), np.uint8), np.ones((tokens, 1), np.float32)
    manifest = Manifest.open(tmp_path, content(meta), [(0, 0, 1), (1, 1, 2)])
    for index, (bad_values, bad_scales) in enumerate([(True, False), (False, True)]):
        aux, aux_scales = values.copy(), scales.copy()
        if bad_values:
            aux[2, 3] = 0x7F  # an fp8 NaN
        if bad_scales:
            aux_scales[1, 0] = np.inf
        with ShardWriter(tmp_path / shard_file_name(index), meta) as writer:
            writer.append([index], [np.arange(tokens, dtype=np.int32)], [np.ones(tokens, np.uint8)],
                          aux, last, aux_scales, last_scales)
            record(manifest, index, writer.finalize())
    manifest.close()
    problems = [str(p) for p in verify(tmp_path, deep=True).problems]
    assert len(problems) == 2, problems
    assert "shard-00000.parquet: aux_hidden_states of 1 samples holds NaN/Inf" in problems[0]
    assert "shard-00001.parquet: aux_hidden_states_scales of 1 samples holds NaN/Inf" in problems[1]


def test_shards_in_the_sink_are_checked_where_they_are(tmp_path, capsys):
    out, sink = tmp_path / "out", tmp_path / "sink"
    manifest = write_run(out, shards=2)
    sink.mkdir()
    manifest = Manifest.open(out, manifest.content, [])
    for index in (0, 1):
        name = shard_file_name(index)
        shutil.move(out / name, sink / name)
        manifest.update(index, location=SINK, sink_url=f"file://{sink / name}")
    manifest.close()
    assert verify_lines(out, "--deep", capsys=capsys)[0] == EXIT_OK
    flip_middle(sink / shard_file_name(1))
    code, lines = verify_lines(out, capsys=capsys)
    assert code == EXIT_VERIFY_FAILED
    assert lines[0].startswith(f"file://{sink / shard_file_name(1)}: checksum ")


def test_writer_fails_skips_or_keeps_nonfinite_samples(tmp_path):
    # the config section offers what the writer does: one list of the actions
    assert typing.get_type_hints(ExtractConfig)["on_nonfinite"] is NonfiniteAction
    assert nonfinite.ACTIONS == typing.get_args(NonfiniteAction) == ("fail", "skip", "keep")
    with pytest.raises(NonFiniteStates, match=r"shard-00000.parquet: sample 2 has NaN/Inf in layer 2 \(and 1 more"):
        write_shard(tmp_path / shard_file_name(0), metadata(), [0, 1, 2, 3], nan_samples={2, 3})
    assert not list(tmp_path.iterdir())  # nothing published, no temp file left

    lengths = {sid: 30 + sid % 5 for sid in range(4)}
    skipped = write_shard(tmp_path / "skip.parquet", metadata(), [0, 1, 2, 3], nan_samples={2}, on_nonfinite="skip")
    assert (skipped.rows, skipped.tokens) == (3, sum(lengths.values()) - lengths[2])
    assert ShardReader(skipped.path).sample_ids() == [0, 1, 3]
    assert skipped.nonfinite == ({"sample_id": 2, "action": "skipped", "reason": "NaN/Inf in layer 2"},)

    kept = write_shard(tmp_path / "keep.parquet", metadata(), [0, 1, 2, 3], nan_samples={2}, on_nonfinite="keep")
    assert (kept.rows, kept.tokens) == (4, sum(lengths.values()))
    assert [s["action"] for s in kept.nonfinite] == ["kept"]
    assert ShardReader(kept.path)[2].aux_hidden_states.isnan().any()


@pytest.mark.parametrize("command", ["jobs.verify", "jobs.status"])
def test_a_truncated_manifest_is_named_with_what_to_do(tmp_path, command):
    """A ``.manifest.json`` cut short (not by the job, which writes it whole): one line naming the file and what to
    do, exit 2, no traceback."""
    write_run(tmp_path)
    manifest = tmp_path / ".manifest.json"
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    result = subprocess.run([sys.executable, "-m", command, f"output.dir={tmp_path}"], cwd=REPO_ROOT,
                            env=python_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == EXIT_BAD_INPUT, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {manifest} is damaged: not whole JSON"), result.stderr
    assert "restore it from a backup" in errors[0]
