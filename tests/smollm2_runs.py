"""SmolLM2-135M-Instruct (real trained weights) for the tests: the checkpoint, a small chat dataset
tokenized with its own chat template, and extraction runs of the real ``python -m jobs.extract``
command, each made once per test session even when several pytest-xdist workers ask for it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.smollm2 import checkpoint_dir
from tests.conftest import REPO_ROOT

CHATS = (
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name three primary colors.", "Red, yellow and blue."),
    ("Translate 'good morning' into Spanish.", "Buenos días."),
    ("What is 12 times 7?", "12 times 7 is 84."),
    ("Write a haiku about the sea.", "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."),
    ("Why is the sky blue?", "Sunlight scatters off air molecules, and blue light scatters the most."),
    ("Give me a synonym for happy.", "Joyful."),
    ("How do I reverse a list in Python?", "Use my_list.reverse() in place, or my_list[::-1] for a reversed copy."),
)
"""Single-turn chats; their answers are hand-written (the acceptance benchmark uses the target's own)."""

EXTRACT_TIMEOUT_S = 600
POST_NORM_LAYERS = [1, 14, 26]
"""The acceptance benchmark's layers (low, mid, high of 30)."""
PRE_NORM_LAYERS = [0, 13, 25]
"""One lower: the layers whose outputs are HF hidden_states[1, 14, 26], the states arm B of the
acceptance benchmark trains on."""


def shared_dir(tmp_path_factory) -> Path:
    """A directory every xdist worker of this session sees (the session's temp root), or this
    process's own temp root without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def made_once(path: Path) -> Iterator[bool]:
    """Hold ``path``'s lock; yields True when ``path`` still has to be made (by the caller, in the
    with block), False when another worker made it. It counts as made once the block ends without an
    exception (a marker beside it), so a worker whose attempt failed leaves the next one to retry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    done = path.parent / f".{path.name}.done"
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        needed = not done.exists()
        yield needed
        if needed:
            done.touch()


def tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(checkpoint_dir()))


def render(chat_tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """The chat's ids by the model's own chat template, and a loss mask over the answer's tokens (from
    the end of the rendered generation prompt, which must be a prefix of the whole conversation's ids)."""
    messages = [{"role": "user", "content": prompt}]
    head = list(chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"])
    full = list(chat_tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}],
                                                   tokenize=True, return_dict=True)["input_ids"])
    assert full[: len(head)] == head, "the generation prompt is not a prefix of the conversation"
    return full, [0] * len(head) + [1] * (len(full) - len(head))


def chat_dataset(tmp_path_factory) -> Path:
    """``CHATS`` as the Parquet ``jobs.extract`` reads (``input_ids``, ``loss_mask``)."""
    path = shared_dir(tmp_path_factory) / "smollm2-chats.parquet"
    with made_once(path) as needed:
        if needed:
            chat_tokenizer = tokenizer()
            rows = [render(chat_tokenizer, prompt, answer) for prompt, answer in CHATS]
            pq.write_table(pa.table({"input_ids": [ids for ids, _ in rows], "loss_mask": [m for _, m in rows]}), path)
    return path


def session_ray_address() -> str:
    """The GCS address of this test process's Ray cluster (conftest's ``ray_cluster``): the runs join it
    (``ray.address``) rather than each starting a cluster of its own, which on the loaded 2-core machine
    costs seconds of CPU and has timed out."""
    import ray

    return ray.get_runtime_context().gcs_address


def extraction_run(tmp_path_factory, name: str, overrides: Sequence[str]) -> Path:
    """The output.dir of ``python -m jobs.extract`` on SmolLM2 (CPU, float32) over ``chat_dataset``
    with ``overrides``, run once per session under ``name``, on this process's Ray cluster."""
    model, data = checkpoint_dir(), chat_dataset(tmp_path_factory)
    out = shared_dir(tmp_path_factory) / f"smollm2-run-{name}"
    with made_once(out) as needed:
        if needed:
            command = [sys.executable, "-m", "jobs.extract", f"model.path={model}", f"data.path={data}",
                       f"output.dir={out}", "model.device=cpu", "model.dtype=float32",
                       "output.min_free_bytes=1GB", f"ray.address={session_ray_address()}", *overrides]
            env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
            result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                    timeout=EXTRACT_TIMEOUT_S)
            # a failed attempt leaves its output.dir: the next attempt's run resumes it
            assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"
    return out


def post_norm_run(tmp_path_factory) -> Path:
    """Layers [1, 14, 26] with the post-norm final state: the acceptance benchmark's arm A, on CPU."""
    return extraction_run(tmp_path_factory, "post_norm",
                          [f"extract.layers={POST_NORM_LAYERS}", "extract.last_hidden_state=post_norm"])


def pre_norm_run(tmp_path_factory) -> Path:
    """Layers [0, 13, 25] (arm B's states) with the pre-norm final state."""
    return extraction_run(tmp_path_factory, "pre_norm",
                          [f"extract.layers={PRE_NORM_LAYERS}", "extract.last_hidden_state=pre_norm"])
