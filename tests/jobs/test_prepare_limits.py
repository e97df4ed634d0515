"""jobs.prepare as real processes on one huge conversation: refused with its size named, the run's memory that
of the other rows; and the ShareGPT ids the prepared Parquet keeps.

Peak RSS is the kernel's figure for the command (``ru_maxrss`` of the children of a small wrapper process):
memory, unlike time, is deterministic enough for a bound, here far from both sides (on the 2-core machine
the few small rows peaked at 1.0 GB, and tokenizing one 9 MB message added 1.2 GB to that).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.conversations.demo import build_chat_model
from jobs.inputs.demo_chat import CHATML, demo_conversations
from jobs.conversations.output import SKIPPED_FILE
from jobs.errors import EXIT_BAD_INPUT, EXIT_OK
from jobs.prepare import main
from tests.conftest import REPO_ROOT
from tests.helpers import python_env

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


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_huge_conversation_is_refused_naming_its_size_and_costs_no_memory(capsys, tmp_path):
    model = build_chat_model(tmp_path / "model", CHATML)
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
