"""jobs.prepare as users run it, on real files: formats, the Parquet the extraction job reads, every bad-row
case with its message and exit code, max_length, the output directory's rules (refusals, resume, nothing
half-written). The command's own main() runs in this process (real subprocesses check the exit code and the
memory of one huge row); the model is the demo's tiny Llama with a ChatML tokenizer trained here
(conversations.demo), built once for the module.

Then what follows jobs.prepare: regeneration through the real engine (sglang.Engine in a Ray actor, on CPU)
answers the prompts again, a prepare killed after its first published shard resuming from the shards it had
answered, a prompt longer than the engine takes (or one it refuses) being its row's reason and not the run's
failure (the tiny model's answers are noise, the mechanics are real; benchmarks.regenerate shows SmolLM2's). The
extraction job reading what jobs.prepare wrote, conversation_id column included: tests/jobs/test_pipeline.py, on
its three commands' run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from conversations.demo import build_chat_model, write_conversations
from conversations.output import RECORD_FILE, REGENERATED_DIR, SKIPPED_FILE
from extractor.generator import EngineLimits, GeneratorSpec, _engine_args
from inputs.dataset import open_tokenized_dataset
from inputs.demo import build_tiny_model, prepare_demo
from inputs.demo_chat import CHATML, demo_conversations
from jobs.prepare import main
from runtime.errors import EXIT_BAD_INPUT, EXIT_BUDGET_EXHAUSTED, EXIT_OK, EXIT_SIGNAL_BASE
from testbeds.chat_templates import QWEN3
from tests.conftest import REPO_ROOT
from tests.helpers import fill_disk, python_env, small_disk

SKIP_HINT = "-- data.on_invalid=skip leaves such rows out and lists them in"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model", CHATML)


@pytest.fixture(scope="module")
def tokenizer(model):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model))


def prepare(capsys, model: Path, data: Path, out: Path, *overrides: str) -> tuple[int, str]:
    """Run the command; returns its exit code and what it printed on stderr (a refusal's ``error:`` line)."""
    capsys.readouterr()
    code = main([f"model.path={model}", f"data.path={data}", f"output.dir={out}", *overrides])
    return code, capsys.readouterr().err


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def parts_table(out: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(path) for path in sorted(out.glob("part-*.parquet")))


def answers_of(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    runs, current = [], []
    for token, bit in zip(ids, [*mask]):
        if bit:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_sharegpt_jsonl_becomes_the_parquet_the_extraction_job_reads(capsys, model, tokenizer, tmp_path):
    rows = demo_conversations(30, seed=3)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "tokens"
    code, errors = prepare(capsys, model, data, out, "output.shard_size=8")
    assert code == EXIT_OK, errors
    assert sorted(p.name for p in out.iterdir()) == [RECORD_FILE] + [f"part-0000{i}.parquet" for i in range(4)]
    table = parts_table(out)
    assert table.schema.names == ["conversation_id", "id", "input_ids", "loss_mask"]
    assert table.column("conversation_id").to_pylist() == list(range(30))
    assert table.column("id").to_pylist() == [row["id"] for row in rows]  # ShareGPT's own conversation ids
    for row, ids, mask in zip(rows, table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
        messages = [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]), "content": t["value"]}
                    for t in row["conversations"]]
        assert ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
        assert answers_of(tokenizer, ids, mask) == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    # what jobs.extract opens and checks, with the model's vocabulary and context
    dataset = open_tokenized_dataset(str(out), vocab_size=512, max_length=4096)
    assert len(dataset) == 30 and dataset.invalid == []
    ids, masks = dataset.rows(0, 30)
    assert [list(x) for x in ids] == table.column("input_ids").to_pylist()
    assert [list(x) for x in masks] == table.column("loss_mask").to_pylist()
    # the same in two worker processes
    code, errors = prepare(capsys, model, data, tmp_path / "tokens-2", "output.shard_size=8", "workers=2")
    assert code == EXIT_OK, errors
    assert parts_table(tmp_path / "tokens-2") == table
    record = json.loads((out / RECORD_FILE).read_text())
    assert record == {**json.loads((tmp_path / "tokens-2" / RECORD_FILE).read_text()), **{
        key: record[key] for key in ("output_path", "started_at", "finished_at", "seconds", "conversations_per_second",
                                     "command", "workers", "wall_seconds")}}
    assert [phase for phase, _ in record["wall_seconds"]["phases"]] == ["reading the inputs", "tokenizing and publishing"]
    assert (record["workers"], json.loads((tmp_path / "tokens-2" / RECORD_FILE).read_text())["workers"]) == (1, 2)
    assert record["state"] == "complete"
    assert record["counts"] == {"conversations": 30, "kept": 30, "skipped": 0, "skipped_by_kind": {}, "truncated": 0,
                                "assistant_turns": sum(len(r["conversations"]) // 2 for r in rows)}
    assert record["tokens"]["total"] == sum(len(x) for x in table.column("input_ids").to_pylist())
    assert record["tokens"]["masked"] == sum(sum(x) for x in table.column("loss_mask").to_pylist())
    assert record["tokenizer"]["stop_tokens"] == {"<|im_end|>": 2} and len(record["tokenizer"]["chat_template_sha256"]) == 64
    assert record["tokens"]["lengths"]["max"] == max(len(x) for x in table.column("input_ids").to_pylist())


def test_openai_parquet_hf_save_to_disk_and_a_glob(capsys, model, tokenizer, tmp_path):
    import datasets

    messages = [[{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
                for i in range(6)]
    pq.write_table(pa.table({"messages": messages[:3]}), tmp_path / "a.parquet")
    datasets.Dataset.from_dict({"messages": messages}).save_to_disk(str(tmp_path / "hf"))
    code, errors = prepare(capsys, model, tmp_path / "a.parquet", tmp_path / "out-parquet")
    assert code == EXIT_OK, errors
    code, errors = prepare(capsys, model, tmp_path / "hf", tmp_path / "out-hf")
    assert code == EXIT_OK, errors
    assert parts_table(tmp_path / "out-hf").column("input_ids").to_pylist() == [
        tokenizer.apply_chat_template(m, tokenize=True)["input_ids"] for m in messages]
    # a glob over a ShareGPT and an OpenAI file: each file's schema detected, ids run on across them
    write_jsonl(tmp_path / "g1.jsonl", demo_conversations(2))
    write_jsonl(tmp_path / "g2.jsonl", [{"messages": m} for m in messages[:2]])
    code, errors = prepare(capsys, model, f"file://{tmp_path}/g*.jsonl", tmp_path / "out-glob")  # an fsspec URL
    assert code == EXIT_OK, errors
    assert parts_table(tmp_path / "out-glob").column("conversation_id").to_pylist() == [0, 1, 2, 3]
    # a format named wrongly: every row says what it lacks
    code, errors = prepare(capsys, model, tmp_path / "g1.jsonl", tmp_path / "out-named", "data.format=openai")
    assert code == EXIT_BAD_INPUT
    assert "g1.jsonl row 0 (line 1) (conversation_id 0): no 'messages' field (its keys: 'id', 'conversations')" in errors


GOOD = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}
BAD_ROWS = {
    "not JSON": ('{"conversations": [', "not valid JSON (Expecting value: line 1 column 20 (char 19))"),
    "missing field": ({"id": 7}, "no 'conversations' field (its keys: 'id'); a sharegpt row holds"),
    "turns not a list": ({"conversations": "Hi"}, "conversations must be a list of turns, got str"),
    "system not a string": ({"system": ["Be brief."], "conversations": [{"from": "human", "value": "Hi"},
                                                                      {"from": "gpt", "value": "Hello."}]},
                            "its 'system' is list, not a string"),
    "missing role": ({"conversations": [{"value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
                     "conversations[0] has no 'from' (its role)"),
    "unknown role": ({"conversations": [{"from": "narrator", "value": "Once"}, {"from": "gpt", "value": "Upon."}]},
                     "conversations[0] has the unknown role 'narrator' (known: user/human, assistant/gpt, system, and "
                     "tool/function/ipython/observation/function_call under data.other_roles)"),
    "tool role under fail": ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "tool", "value": "{}"},
                                                {"from": "gpt", "value": "Ok."}]},
                             "conversations[1] has the role 'tool': data.other_roles=drop leaves such turns out, keep "
                             "renders them (never in the loss mask)"),
    "empty turn": ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "  \n"}]},
                   "conversations[1] (gpt) is empty"),
    "missing text": ({"conversations": [{"from": "human"}, {"from": "gpt", "value": "Hello."}]},
                     "conversations[0] (human): has no text"),
    "ends with the user": ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."},
                                              {"from": "human", "value": "Bye"}]},
                           "ends with a user turn, not the assistant's answer (the text the drafter learns from); drop "
                           "the trailing turn, or use regenerate=true to have the target answer it"),
    "unrenderable: end token in an answer": (
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello.<|im_end|>"}]},
        "assistant turn 1 holds the text '<|im_end|>', which the tokenizer reads as the end-of-turn token"),
    "unrenderable: refused by the template": (
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "human", "value": "Hey"},
                           {"from": "gpt", "value": "Hello."}]},
        "the chat template cannot render it: TemplateError: Conversation roles must alternate user/assistant"),
}
ALTERNATING = (  # Llama-2/Mistral templates refuse non-alternating roles like this
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def alternating(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "alternating.jinja"
    path.write_text(ALTERNATING)
    return path


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_fails_with_file_row_and_reason(case, capsys, model, alternating, tmp_path):
    row, reason = BAD_ROWS[case]
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD, row, GOOD])
    out = tmp_path / "out"
    code, errors = prepare(capsys, model, data, out, f"model.chat_template={alternating}")
    assert code == EXIT_BAD_INPUT
    assert f"{data} row 1 (line 2) (conversation_id 1): {reason}" in errors
    assert f"{SKIP_HINT} {out / SKIPPED_FILE}" in errors
    # nothing under a final name, no temp file left behind: only the running record
    assert sorted(p.name for p in out.iterdir()) == [RECORD_FILE]
    assert json.loads((out / RECORD_FILE).read_text())["state"] == "running"


def test_skip_lists_every_bad_row_and_accounts_for_all(capsys, model, alternating, tmp_path):
    rows = [GOOD]
    for row, _ in BAD_ROWS.values():
        rows += [row, GOOD]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "out"
    code, errors = prepare(capsys, model, data, out, "data.on_invalid=skip", "output.shard_size=5",
                           f"model.chat_template={alternating}")
    assert code == EXIT_OK, errors
    skipped = [json.loads(line) for line in (out / SKIPPED_FILE).read_text().splitlines()]
    assert [entry["conversation_id"] for entry in skipped] == list(range(1, len(rows), 2))
    for entry, (_, reason) in zip(skipped, BAD_ROWS.values()):
        assert reason in entry["reason"] and entry["kind"] == "invalid"
        assert entry["file"] == str(data) and entry["line"] == entry["file_row"] + 1
    assert parts_table(out).column("conversation_id").to_pylist() == list(range(0, len(rows), 2))
    counts = json.loads((out / RECORD_FILE).read_text())["counts"]
    assert counts["conversations"] == len(rows) == counts["kept"] + counts["skipped"]
    assert counts["skipped_by_kind"] == {"invalid": len(BAD_ROWS)}


def with_text_not_utf8(path: Path) -> Path:
    """A Parquet or Arrow file of GOOD, a row whose answer is Latin-1 (not UTF-8), GOOD; its strings unchecked."""
    turns = [[{"from": b"human", "value": b"Hi"}, {"from": b"gpt", "value": answer}]
             for answer in (b"Hello.", b"caf\xe9", b"Hello.")]
    as_bytes, as_strings = (pa.list_(pa.struct([("from", kind), ("value", kind)]))
                            for kind in (pa.binary(), pa.string()))
    table = pa.table({"conversations": pa.array(turns, as_bytes).view(as_strings)})
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    else:
        with pa.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table)
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_table_row_of_text_not_utf8_is_named_or_skipped_as_a_jsonl_row_is(suffix, capsys, model, tmp_path):
    data = with_text_not_utf8(tmp_path / f"chat{suffix}")
    reason = "holds text that is not valid UTF-8 ('utf-8' codec can't decode byte 0xe9 in position 3"
    code, errors = prepare(capsys, model, data, tmp_path / "refused")
    assert code == EXIT_BAD_INPUT
    assert f"{data} row 1 (conversation_id 1): {reason}" in errors
    out = tmp_path / "out"
    code, errors = prepare(capsys, model, data, out, "data.on_invalid=skip")
    assert code == EXIT_OK, errors
    [entry] = [json.loads(line) for line in (out / SKIPPED_FILE).read_text().splitlines()]
    assert (entry["conversation_id"], entry["file_row"], entry["kind"]) == (1, 1, "invalid")
    assert entry["reason"].startswith(reason)
    assert parts_table(out).column("conversation_id").to_pylist() == [0, 2]


def test_a_parquet_row_of_null_conversations_is_named_null(capsys, model, tmp_path):
    data = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"conversations": [GOOD["conversations"], None], "id": ["a", "b"]}), data)
    code, errors = prepare(capsys, model, data, tmp_path / "out")
    assert code == EXIT_BAD_INPUT
    assert f"{data} row 1 (conversation_id 1): its 'conversations' is null; a sharegpt row holds" in errors


def test_qwen3s_template_keeps_rows_of_one_answer_and_refuses_rows_of_several(capsys, model, tokenizer, tmp_path):
    """Qwen3's chat template rewrites earlier answers once later turns follow: the command starts, keeps the rows of
    one answer with their exact masks, and refuses each row of several, naming it (or skips and lists it)."""
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3)
    several = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."},
                                 {"from": "human", "value": "Bye?"}, {"from": "gpt", "value": "Bye."}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD, several, GOOD])
    args = (f"model.chat_template={template}", "model.chat_template_kwargs={enable_thinking: false}")
    reason = "the chat template renders the prompt before assistant turn 1 differently once later turns follow"
    code, errors = prepare(capsys, model, data, tmp_path / "refused", *args)
    assert code == EXIT_BAD_INPUT
    assert f"{data} row 1 (line 2) (conversation_id 1): {reason}" in errors
    out = tmp_path / "out"
    code, errors = prepare(capsys, model, data, out, *args, "data.on_invalid=skip")
    assert code == EXIT_OK, errors
    [entry] = [json.loads(line) for line in (out / SKIPPED_FILE).read_text().splitlines()]
    assert entry["conversation_id"] == 1 and entry["reason"].startswith(reason)
    table = parts_table(out)
    assert table.column("conversation_id").to_pylist() == [0, 2]
    for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
        assert answers_of(tokenizer, ids, mask) == ["Hello.<|im_end|>"]


def test_other_roles_drop_and_keep(capsys, model, tokenizer, tmp_path):
    row = {"conversations": [{"from": "human", "value": "Weather?"}, {"from": "function_call", "value": "get()"},
                             {"from": "Observation", "value": "Sunny."},  # other role names in any case, as aliases
                             {"from": "gpt", "value": "It is sunny."}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [row])
    for policy, roles in (("drop", ["user", "assistant"]), ("keep", ["user", "function_call", "observation", "assistant"])):
        code, errors = prepare(capsys, model, data, tmp_path / policy, f"data.other_roles={policy}")
        assert code == EXIT_OK, errors
        table = parts_table(tmp_path / policy)
        messages = [{"role": role, "content": text} for role, text in
                    zip(roles, ["Weather?", "get()", "Sunny."][: len(roles) - 1] + ["It is sunny."])] if policy == "keep" \
            else [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "It is sunny."}]
        ids, mask = table.column("input_ids")[0].as_py(), table.column("loss_mask")[0].as_py()
        assert ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
        assert answers_of(tokenizer, ids, mask) == ["It is sunny.<|im_end|>"]


def test_max_length_truncates_or_drops(capsys, model, tmp_path):
    long_answer = " ".join(["The capital of France is Paris."] * 12)
    rows = [GOOD, {"conversations": [{"from": "human", "value": "Tell me."}, {"from": "gpt", "value": long_answer}]},
            {"conversations": [{"from": "human", "value": " ".join(["Why?"] * 40)}, {"from": "gpt", "value": "Because."}]}]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    code, errors = prepare(capsys, model, data, tmp_path / "truncate", "data.max_length=48")
    assert code == EXIT_OK, errors
    table = parts_table(tmp_path / "truncate")
    assert table.column("conversation_id").to_pylist() == [0, 1]  # the third keeps no answer token in 48
    lengths = [len(x) for x in table.column("input_ids").to_pylist()]
    assert lengths[1] == 48 and lengths[0] < 48 and table.column("loss_mask")[1].as_py()[-1] == 1
    record = json.loads((tmp_path / "truncate" / RECORD_FILE).read_text())
    assert record["counts"]["truncated"] == 1 and record["counts"]["skipped_by_kind"] == {"too_long": 1}
    assert "more than data.max_length=48: no assistant token is left" in record["skipped"]["first"][0]["reason"]

    code, errors = prepare(capsys, model, data, tmp_path / "drop", "data.max_length=48", "data.on_too_long=drop")
    assert code == EXIT_OK, errors
    assert parts_table(tmp_path / "drop").column("conversation_id").to_pylist() == [0]
    skipped = [json.loads(line) for line in (tmp_path / "drop" / SKIPPED_FILE).read_text().splitlines()]
    assert [(s["conversation_id"], s["kind"]) for s in skipped] == [(1, "too_long"), (2, "too_long")]
    code, errors = prepare(capsys, model, data, tmp_path / "over", "data.max_length=5000")
    assert code == EXIT_BAD_INPUT and "data.max_length=5000 exceeds the model's max_position_embeddings 4096" in errors


def test_a_full_disk_under_output_dir_stops_with_exit_3_and_the_rerun_completes(capsys, model, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD] * 3)
    with small_disk(tmp_path / "disk", "1m") as disk:
        fill_disk(disk / "filler")
        out = disk / "out"
        code, errors = prepare(capsys, model, data, out)
        assert code == EXIT_BUDGET_EXHAUSTED, errors
        assert f"error: the disk under {out} is full (OSError: [Errno 28] No space left on device" in errors, errors
        assert "Free space there, then rerun the same command: it resumes" in errors and "Traceback" not in errors
        (disk / "filler").unlink()
        code, errors = prepare(capsys, model, data, out)
        assert code == EXIT_OK, errors
        assert parts_table(out).column("conversation_id").to_pylist() == [0, 1, 2]


def test_output_directory_rules(capsys, model, tmp_path):
    data = write_conversations(tmp_path / "chat.jsonl", 10)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code, errors = prepare(capsys, model, data, foreign)
    assert code == EXIT_BAD_INPUT and "holds notes.txt and no _prepare.json: it is not a jobs.prepare output" in errors
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]

    out = tmp_path / "out"
    assert prepare(capsys, model, data, out)[0] == EXIT_OK
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert prepare(capsys, model, data, out)[0] == EXIT_OK  # complete, same settings: nothing to do
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    code, errors = prepare(capsys, model, data, out, "data.max_length=100")
    assert code == EXIT_BAD_INPUT
    assert "holds a complete prepare of other inputs or settings (differs in: data.max_length)" in errors
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before

    # a run that was killed: record running, a temp part, a stale part of ours from a larger shard count
    record = json.loads((out / RECORD_FILE).read_text())
    (out / RECORD_FILE).write_text(json.dumps({**record, "state": "running"}))
    (out / "part-00000.parquet").rename(out / "part-00007.parquet")
    (out / ".part-00003.parquet.tmp").write_bytes(b"half")
    (out / "part-00009.parquet").write_bytes(b"not ours, not parquet")
    code, errors = prepare(capsys, model, data, out)
    assert code == EXIT_BAD_INPUT and "holds part-00009.parquet, which jobs.prepare did not write" in errors
    (out / "part-00009.parquet").unlink()
    assert prepare(capsys, model, data, out)[0] == EXIT_OK
    assert sorted(p.name for p in out.iterdir()) == [RECORD_FILE, "part-00000.parquet"]


def test_the_command_exits_2_naming_the_row(model, tmp_path, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD, {"id": 1}])
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-m", "jobs.prepare", f"model.path={model}", f"data.path={data}",
                             f"output.dir={tmp_path / 'out'}"], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-2000:]
    assert f"{data} row 1 (line 2) (conversation_id 1): no 'conversations' field" in result.stderr
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    help_text = capsys.readouterr().out
    assert exited.value.code == 0 and help_text.startswith("usage: ")
    for key in ("model.chat_template", "data.format", "data.other_roles", "data.on_invalid", "data.max_length",
                "data.on_too_long", "output.dir", "output.shard_size", "regenerate", "generation.max_new_tokens",
                "generation.temperature"):
        assert f"  {key} = " in help_text, key


NOT_IMPORTED = ("import sys; from jobs.prepare import main; code = main(sys.argv[2:]); "
                "print(code, sorted(m for m in sys.modules if m.split('.')[0] in sys.argv[1].split(',')))")
"""Runs the command in a fresh interpreter, then names the modules of the given packages it imported."""


def test_the_command_imports_neither_torch_nor_ray(model, tmp_path):
    """Without regeneration the command is reading, rendering and writing: torch (which AutoTokenizer's import
    brings, seconds of the start) and Ray are never imported. The demo model's tokenizer_config.json names
    TokenizersBackend, as SmolLM2's own checkpoint names GPT2Tokenizer: both load without AutoTokenizer."""
    data = write_jsonl(tmp_path / "chat.jsonl", demo_conversations(6, seed=4))
    result = subprocess.run([sys.executable, "-c", NOT_IMPORTED, "torch,ray,sglang", f"model.path={model}",
                             f"data.path={data}", f"output.dir={tmp_path / 'out'}", "workers=1"],
                            cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == f"{EXIT_OK} []", result.stdout + result.stderr


def test_the_demo_starts_from_conversations(capsys, tmp_path):
    assert main([f"demo.dir={tmp_path / 'demo'}", "demo.num_conversations=12"]) == EXIT_OK
    printed = capsys.readouterr().out
    model, tokens = tmp_path / "demo" / "model-llama-chatml", tmp_path / "demo" / "tokens"
    assert f"12 of 12 conversations in {tokens} (1 parts)" in printed
    assert f"next: python -m jobs.extract model.path={model} data.path={tokens} output.dir=" in printed
    assert len(open_tokenized_dataset(str(tokens), vocab_size=512, max_length=4096)) == 12


def test_the_extraction_demos_model_prepares_and_a_checkpoint_without_a_tokenizer_is_named(capsys, tmp_path):
    """jobs.extract's demo model (model-llama-seed0 under demo.dir) has a chat tokenizer: jobs.prepare takes it. A
    checkpoint without tokenizer files is refused saying so, without suggesting trust_remote_code."""
    model, _ = prepare_demo(tmp_path / "demo", "llama", num_samples=4, seed=0)
    data = write_conversations(tmp_path / "chat.jsonl", 6)
    code, errors = prepare(capsys, model, data, tmp_path / "tokens")
    assert code == EXIT_OK, errors
    assert len(open_tokenized_dataset(str(tmp_path / "tokens"), vocab_size=512, max_length=4096)) == 6

    bare = build_tiny_model(tmp_path / "bare", arch="llama", num_layers=1)
    code, errors = prepare(capsys, bare, data, tmp_path / "bare-tokens")
    assert code == EXIT_BAD_INPUT and f"model.path={bare}: no tokenizer there (none of tokenizer.json" in errors, errors
    assert "trust_remote_code" not in errors


@pytest.mark.extended
def test_scale_benchmark_smoke(model, tmp_path):
    """benchmarks.prepare_scale end to end on a few thousand conversations (no rate is asserted)."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.prepare_scale", "--conversations", "1000", "--model", str(model),
         "--work-dir", str(tmp_path), "--out", str(tmp_path / "results.json"), "--set", "output.shard_size=500"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["conversations"] == results["kept"] == 1000 and results["parts"] == 2
    assert results["tokenize_conversations_per_s"] > 0 and results["peak_rss_bytes"] >= results["peak_uss_bytes"] > 0
    assert "peak RSS" in result.stdout


def test_an_input_edited_in_place_at_the_same_size_is_another_input(model, tmp_path):
    """A conversations file changed in place, same size (a word of an answer swapped for another as long): the
    rerun (a real process: nothing of the first run's is in its memory) does not take the complete output for it
    ("nothing to do" with stale tokens): it is refused, naming the input's checksum; the file as it was is still
    "nothing to do"."""
    data = write_conversations(tmp_path / "chat.jsonl", 10)
    out = tmp_path / "out"

    def prepare_process() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "jobs.prepare", f"model.path={model}", f"data.path={data}",
                               f"output.dir={out}"], cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True,
                              timeout=600)

    assert main([f"model.path={model}", f"data.path={data}", f"output.dir={out}"]) == EXIT_OK  # the first, here
    original = data.read_bytes()
    rows = [json.loads(line) for line in original.decode().splitlines()]
    turn = rows[3]["conversations"][-1] if "conversations" in rows[3] else rows[3]["messages"][-1]
    word = max((turn.get("value") or turn.get("content")).split(), key=len)
    edited = original.replace(word.encode(), word[::-1].encode() if word[::-1] != word else word.upper().encode(), 1)
    assert edited != original and len(edited) == len(original)
    data.write_bytes(edited)
    refused = prepare_process()
    assert refused.returncode == EXIT_BAD_INPUT, refused.stdout + refused.stderr[-3000:]
    assert "holds a complete prepare of other inputs or settings (differs in: input.digests)" in refused.stderr
    data.write_bytes(original)
    again = prepare_process()
    assert again.returncode == EXIT_OK and "nothing to do" in again.stdout, again.stdout + again.stderr[-3000:]


HUGE_CHARS = 10_000_000
ROOM = 300 * 2**20
"""What the huge row may add to the peak: a fraction of what tokenizing it took (1.2 GB)."""
PEAK_OF_CHILDREN = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"
)


def prepare_peak(*args: str) -> tuple[int, int, str]:
    """``python -m jobs.prepare ARGS``: its exit code, its peak RSS in bytes, what it printed on stderr."""
    result = subprocess.run([sys.executable, "-c", PEAK_OF_CHILDREN, sys.executable, "-m", "jobs.prepare", *args],
                            cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=600)
    return result.returncode, int(result.stdout.split()[-1]) * 1024, result.stderr


def test_a_huge_conversation_is_refused_naming_its_size_and_costs_no_memory(capsys, model, tmp_path):
    rows = demo_conversations(8, seed=1)  # ShareGPT rows with their own ids: demo-0 .. demo-7
    answer = ("The capital of France is Paris. " * (HUGE_CHARS // 32 + 1))[:HUGE_CHARS]
    huge = {"id": "huge-1", "conversations": [{"from": "human", "value": "Tell me."}, {"from": "gpt", "value": answer}]}
    small = write_jsonl(tmp_path / "small.jsonl", rows)
    with_huge = write_jsonl(tmp_path / "with-huge.jsonl", [*rows[:4], huge, *rows[4:]])

    code, base, errors = prepare_peak(f"model.path={model}", f"data.path={small}", f"output.dir={tmp_path / 'a'}")
    assert code == EXIT_OK, errors[-2000:]
    code, peak, errors = prepare_peak(f"model.path={model}", f"data.path={with_huge}", f"output.dir={tmp_path / 'b'}",
                                      "data.on_invalid=skip")
    assert code == EXIT_OK, errors[-2000:]
    print(f"peak RSS: {base / 2**20:.0f} MiB for the small rows, {peak / 2**20:.0f} MiB with the huge one")
    assert peak - base < ROOM, f"{(peak - base) / 2**20:.0f} MiB more for one row"
    skipped = [json.loads(line) for line in (tmp_path / "b" / SKIPPED_FILE).read_text().splitlines()]
    assert [(s["conversation_id"], s["kind"]) for s in skipped] == [(4, "invalid")]
    assert f"its turns hold {HUGE_CHARS + len('Tell me.'):,} characters, more than 65,536" in skipped[0]["reason"]
    assert "data.max_length=4,096" in skipped[0]["reason"]
    table = pa.concat_tables(pq.read_table(path) for path in sorted((tmp_path / "b").glob("part-*.parquet")))
    assert table.column("id").to_pylist() == [row["id"] for row in rows]  # each kept row's own ShareGPT id
    assert table.column("conversation_id").to_pylist() == [0, 1, 2, 3, 5, 6, 7, 8]

    # By default (data.on_invalid=fail) the row stops the command, named with its size
    assert main([f"model.path={model}", f"data.path={with_huge}", f"output.dir={tmp_path / 'c'}"]) == EXIT_BAD_INPUT
    assert f"with-huge.jsonl row 4 (line 5) (conversation_id 4): its turns hold {HUGE_CHARS + 8:,} characters" in \
        capsys.readouterr().err


ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def start_prepare(model: Path, data: Path, out: Path, log: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), RAY_AUTH_MODE="disabled")
    with open(log, "a") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "jobs.prepare", f"model.path={model}", f"data.path={data}", f"output.dir={out}",
             f"ray.address={ray.get_runtime_context().gcs_address}", *overrides],
            cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)


def test_regeneration_resumes_after_a_kill(ray_cluster, model, tokenizer, tmp_path):
    rows = demo_conversations(12, seed=7)
    rows[5]["conversations"][-1]["from"] = "narrator"  # invalid before any answer: listed, never sent to SGLang
    # The regenerator answers every shard at once: the last shard's twelve exchanges (answered one after the other)
    # keep it going well after the first shard is published, so the run is stopped with a shard left to answer.
    rows[10]["conversations"] = [turn for _ in range(12) for turn in rows[10]["conversations"][-2:]]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out, log = tmp_path / "out", tmp_path / "prepare.log"
    # The engine runs the server's settings: its dtype, and an override of the model's config
    serving = """--dtype float32 --json-model-override-args='{"rms_norm_eps":0.001}' --port 30001"""
    args = ("regenerate=true", "output.shard_size=4", "generation.max_new_tokens=8", "data.on_invalid=skip",
            f"model.serving={serving}")

    first = start_prepare(model, data, out, log, *args)
    answered = out / REGENERATED_DIR / "part-00000.jsonl"
    deadline = time.monotonic() + 400
    while not answered.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert answered.exists(), log.read_text()[-3000:]
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == EXIT_SIGNAL_BASE + signal.SIGTERM, log.read_text()[-3000:]
    before = {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in (out / REGENERATED_DIR).glob("*.jsonl")}
    assert 1 <= len(before) < 3, sorted(before)  # stopped with a shard left to answer
    assert not list(out.glob("part-*.parquet"))  # no tokens are published before the run completes
    assert json.loads((out / RECORD_FILE).read_text())["state"] == "running"

    second = start_prepare(model, data, out, log, *args)
    assert second.wait(timeout=600) == EXIT_OK, log.read_text()[-3000:]
    text = log.read_text()
    assert f"{len(before)} of 3 shards were regenerated by an earlier run: resuming" in text
    files = sorted((out / REGENERATED_DIR).glob("*.jsonl"))
    assert [f.name for f in files] == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    for name, (content, mtime) in before.items():  # answered shards are not answered again
        path = out / REGENERATED_DIR / name
        assert path.read_bytes() == content and path.stat().st_mtime_ns == mtime

    records = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert [r["conversation_id"] for r in records] == list(range(12))
    assert records[5]["invalid"].startswith("conversations[") and "unknown role 'narrator'" in records[5]["invalid"]
    table = parts_table(out)
    kept = {cid: i for i, cid in enumerate(table.column("conversation_id").to_pylist())}
    for record, row in zip(records, rows):
        if "invalid" in record:
            continue
        original = [{"role": ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]]
        messages = record["messages"]
        # the same prompts, in the same places; every answer the target's own, at most max_new_tokens long
        assert [m["role"] for m in messages] == [m["role"] for m in original]
        assert [m for m in messages if m["role"] != "assistant"] == [m for m in original if m["role"] != "assistant"]
        assert len(record["answers"]) == sum(m["role"] == "assistant" for m in original)
        assert all(a["tokens"] <= 8 and a["finish_reason"] in ("stop", "length") for a in record["answers"])
        if record["conversation_id"] not in kept:
            continue  # an answer step 1 refused (e.g. one holding the end token's text): skipped and listed
        index = kept[record["conversation_id"]]
        ids, mask = table.column("input_ids")[index].as_py(), table.column("loss_mask")[index].as_py()
        assert ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
        runs, current = [], []
        for token, bit in zip(ids, mask):
            if bit:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        runs += [current] if current else []
        assert [tokenizer.decode(run) for run in runs] == [m["content"] + "<|im_end|>" for m in messages
                                                           if m["role"] == "assistant"]
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["state"] == "complete" and record["regeneration_stats"]["shards"] == 3 - len(before)
    assert record["regeneration"]["model.dtype"] == "float32"
    assert record["regeneration"]["model.serving"] == {"json_model_override_args": '{"rms_norm_eps":0.001}'}
    assert "applied: --json-model-override-args '{\"rms_norm_eps\":0.001}'" in text
    counts = record["counts"]
    assert counts["conversations"] == 12 == counts["kept"] + counts["skipped"]
    # on CPU the engine's scheduler sleeps while it has nothing to run, not polling on a core the others need
    assert _engine_args(GeneratorSpec(str(model), "float32", "cpu"))["sleep_on_idle"] is True


ENGINE_PROMPT_LIMIT = 4090
"""SGLang's scheduler refuses a prompt of min(context - 1, KV cache - 1) - 5 tokens or more: 4090 for the tiny
model's context of 4096 (its KV cache on CPU holds more)."""


def question_of(tokenizer, prompt_tokens: int) -> str:
    """A question whose prompt for its answer (rendered with the generation prompt) is ``prompt_tokens`` long."""
    def length(text: str) -> int:
        messages = [{"role": "user", "content": text}]
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])

    question = "a" * (prompt_tokens - length(""))  # one token per letter with this tokenizer
    assert length(question) == prompt_tokens
    return question


def test_a_prompt_longer_than_the_engine_takes_is_its_rows_reason_not_the_runs(ray_cluster, model, tokenizer,
                                                                               tmp_path):
    rows = demo_conversations(3, seed=3)
    for index, prompt_tokens in ((1, ENGINE_PROMPT_LIMIT), (2, ENGINE_PROMPT_LIMIT - 1)):  # refused; the longest taken
        rows[index]["conversations"] = [{"from": "human", "value": question_of(tokenizer, prompt_tokens)},
                                        {"from": "gpt", "value": "Yes."}]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    out, log = tmp_path / "out", tmp_path / "prepare.log"
    args = ("regenerate=true", "generation.max_new_tokens=8")
    reason = (f"after regeneration: its prompt for answer 1 has {ENGINE_PROMPT_LIMIT} tokens, more than the "
              f"{ENGINE_PROMPT_LIMIT - 1} the engine takes")

    # data.on_invalid=fail: every prompt is answered, then the row is named
    first = start_prepare(model, data, out, log, *args)
    assert first.wait(timeout=600) == EXIT_BAD_INPUT, log.read_text()[-3000:]
    assert f"{data} row 1 (line 2) (conversation_id 1): {reason}" in log.read_text()
    records = [json.loads(line) for line in (out / REGENERATED_DIR / "part-00000.jsonl").read_text().splitlines()]
    assert [sorted(record) for record in records] == [["answers", "conversation_id", "id", "messages", "source"],
                                                     ["conversation_id", "id", "invalid", "source"],
                                                     ["answers", "conversation_id", "id", "messages", "source"]]
    assert records[1]["invalid"].startswith(reason)

    # data.on_invalid=skip: the answers are read back, the row is left out and listed
    second = start_prepare(model, data, out, log, *args, "data.on_invalid=skip")
    assert second.wait(timeout=600) == EXIT_OK, log.read_text()[-3000:]
    assert "1 of 1 shards were regenerated by an earlier run: resuming" in log.read_text()
    skipped = [json.loads(line) for line in (out / SKIPPED_FILE).read_text().splitlines()]
    assert [(entry["conversation_id"], entry["file_row"], entry["kind"]) for entry in skipped] == [(1, 1, "invalid")]
    assert skipped[0]["reason"].startswith(reason)
    assert parts_table(out).column("conversation_id").to_pylist() == [0, 2]


ENGINE_REFUSES = """
import dataclasses, json, sys
from conversations.regenerate import Regenerator
from conversations.template import ChatTemplate
from extractor.generator import GeneratorSpec
model, conversations = sys.argv[1], json.loads(sys.argv[2])
regenerator = Regenerator(GeneratorSpec(model, "float32", "cpu"), ChatTemplate.load(model), {"temperature": 0.0},
                          max_new_tokens=4)
try:
    limits = regenerator.generator.limits
    regenerator.generator.limits = dataclasses.replace(limits, max_prompt_tokens=limits.max_prompt_tokens + 1)
    records, stats = regenerator.regenerate([(i, c) for i, c in enumerate(conversations)])
finally:
    regenerator.close()
print(json.dumps({"limits": dataclasses.asdict(limits), "records": records, "stats": stats}))
"""
"""The engine in a process of its own: SGLang's Engine leaves process-wide state behind it (a SIGQUIT handler that
ends the whole process tree, multiprocessing's start method), which ended a test worker's later Ray clusters."""


def test_a_request_the_engine_refuses_is_that_conversations_reason(model, tokenizer):
    """A refusal of the engine's own (SGLang's ValueError for one request) ends that conversation, never its shard.
    Here the regenerator's check of the engine's limit is loosened by one token so that the engine refuses; the
    shard's first prompts go as one request, which the engine refuses whole: each is asked again on its own."""
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    long = [{"role": "user", "content": question_of(tokenizer, ENGINE_PROMPT_LIMIT)}, short[1]]
    result = subprocess.run([sys.executable, "-c", ENGINE_REFUSES, str(model), json.dumps([short, long, short])],
                            cwd=REPO_ROOT, env=python_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    records, stats = answer["records"], answer["stats"]
    assert EngineLimits(**answer["limits"]) == EngineLimits(max_prompt_tokens=ENGINE_PROMPT_LIMIT - 1, context_length=4096)
    assert [record["conversation_id"] for record in records] == [0, 1, 2]
    assert records[1] == {"conversation_id": 1, "invalid": (
        f"after regeneration: the engine refused its prompt for answer 1: Input length ({ENGINE_PROMPT_LIMIT} tokens) "
        f"exceeds the maximum allowed length ({ENGINE_PROMPT_LIMIT} tokens). Use a shorter input or enable "
        "--allow-auto-truncate.")}
    for record in (records[0], records[2]):
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"] and len(record["answers"]) == 1
    assert stats["answers"] == 2
