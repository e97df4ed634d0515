"""Conversations -> tokens -> states: the extraction job (SGLang's ModelRunner) reads what jobs.prepare wrote,
conversation_id column included. The model is the demo's tiny random Llama with a ChatML tokenizer of its
vocabulary (jobs.conversations.demo)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.config import build_config
from jobs.conversations.config import PrepareConfig
from jobs.conversations.demo import build_chat_model, write_conversations
from jobs.inputs.demo_chat import CHATML
from jobs.driver.job import run as extract
from jobs.prepare import prepare
from tests.helpers import job_config, read_all


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model", CHATML)


def parts_table(out: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(path) for path in sorted(out.glob("part-*.parquet")))


def test_prepared_conversations_extract_to_states(ray_cluster, model, tmp_path):
    data = write_conversations(tmp_path / "chat.jsonl", 20, seed=5)
    tokens = tmp_path / "tokens"
    prepare(build_config(PrepareConfig, None, [f"model.path={model}", f"data.path={data}", f"output.dir={tokens}",
                                                "output.shard_size=8"], prog="test"))
    summary = extract(job_config(model, tokens, tmp_path / "states", "model.dtype=float32"))
    assert summary["samples"] == 20
    prepared = parts_table(tokens)
    samples = read_all(tmp_path / "states")
    assert sorted(samples) == list(range(20))  # sample id = row across the parts = conversation_id here
    for sample_id, sample in samples.items():
        assert sample.input_ids.tolist() == prepared.column("input_ids")[sample_id].as_py()
        assert sample.loss_mask.tolist() == prepared.column("loss_mask")[sample_id].as_py()
        assert sample.aux_hidden_states.shape[0] == len(sample.input_ids)
