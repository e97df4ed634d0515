"""The prepare run: conversations in, tokenized parts and the side record out, shard by shard.

Rows stream through in shards of ``output.shard_size`` conversations (shard k holds conversation
ids [k*size, (k+1)*size)); the run holds a few shards' rows and tokens at a time (one, or two per
tokenizer worker), whatever the size of the input. Every row is accounted for: kept, invalid (failing the run, or skipped and listed),
or too long (truncated, or dropped and listed).

With ``regenerate=true`` a first pass has the target answer the shards not answered yet
(``conversations.regenerate``), and the tokenizing pass reads those answers instead of the
input's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from conversations import output as out_dir
from conversations.config import PrepareConfig
from conversations.progress import Progress
from conversations.reader import MAX_CHARS_PER_TOKEN, ConversationRow, count_rows, read_conversations
from conversations.template import ChatTemplate
from conversations.tokenize import (
    ShardOutcome,
    TokenizeSpec,
    Totals,
    refuse,
    resolve_workers,
    tokenize_shards,
)
from extractor.checkpoint import read_checkpoint_info
from extractor.generator import GeneratorSpec
from extractor.serving import ServingSettings, with_serving
from inputs.files import InputFile, resolve_files
from runtime.display.stages import StageLine
from storage import checksum

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Inputs:
    """What the run reads before it touches output.dir."""

    config: PrepareConfig
    chat: ChatTemplate
    fs: Any
    files: list[InputFile]
    total: int
    max_length: int
    out: Path
    digests: list[str] = dataclasses.field(default_factory=list)
    """Per input file, the checksum of its bytes (``storage.checksum``, xxh3_128): a file edited in place at the
    same size is another input."""
    serving: Optional[ServingSettings] = None
    """``model.serving`` as the installed SGLang parsed it, with regenerate=true (its values are in ``config.model``)."""

    @property
    def shards(self) -> int:
        return math.ceil(self.total / self.config.output.shard_size)

    def regeneration_content(self) -> Optional[dict[str, Any]]:
        """Everything that changes the regenerated answers: a resume must match it exactly."""
        config = self.config
        if not config.regenerate:
            return None
        generation = dataclasses.asdict(config.generation)
        server_args = self.server_args()
        return {**self._input_content(), "model.path": config.model.path, "model.dtype": config.model.dtype,
                **{f"generation.{key}": value for key, value in generation.items()},
                **({"model.serving": server_args} if server_args else {})}

    def server_args(self) -> dict[str, Any]:
        """The serving command's settings the engine applies (beyond the model.* keys)."""
        return self.serving.server_args_for(self.config.model) if self.serving else {}

    def generator_spec(self, device: str) -> GeneratorSpec:
        """The engine regeneration runs (``device`` resolved on the Ray cluster)."""
        model = self.config.model
        return GeneratorSpec(
            model_path=model.path, dtype=model.dtype, device=device, tp_size=model.tp_size,
            attention_backend=model.attention_backend, cuda_graph=model.cuda_graph,
            mem_fraction_static=model.mem_fraction_static,
            max_total_tokens=model.max_total_tokens, trust_remote_code=model.trust_remote_code,
            seed=self.config.generation.seed, server_args=self.server_args(), download=model.download,
        )

    def content(self) -> dict[str, Any]:
        """Everything that changes the parts' contents."""
        return {**self._input_content(), "data.max_length": self.max_length, "data.on_too_long": self.config.data.on_too_long,
                "regenerate": self.regeneration_content()}

    def _input_content(self) -> dict[str, Any]:
        data = self.config.data
        return {
            "input.files": [[file.name, file.size] for file in self.files],
            out_dir.INPUT_DIGESTS: self.digests,
            "data.format": data.format, "data.other_roles": data.other_roles,
            "output.shard_size": self.config.output.shard_size,
            "tokenizer_sha256": self.chat.tokenizer_sha256, "chat_template_sha256": self.chat.template_sha256,
            "model.chat_template_kwargs": self.chat.template_kwargs,
            "stop_token_ids": sorted(self.chat.stop_ids),
        }


def read_inputs(config: PrepareConfig) -> Inputs:
    """Tokenizer, template, the input files and their row count, all checked; nothing is written."""
    model, serving = with_serving(config.model) if config.regenerate else (config.model, None)
    if serving is not None:
        config = dataclasses.replace(config, model=model)
        for line in serving.describe():
            logger.info("%s", line)
    model = config.model
    chat = ChatTemplate.load(model.path, model.chat_template, model.trust_remote_code, model.stop_tokens,
                             model.chat_template_kwargs)
    context = read_checkpoint_info(model.path).max_position_embeddings
    max_length = config.data.max_length or context
    if max_length > context:
        raise ValueError(f"data.max_length={max_length} exceeds the model's max_position_embeddings {context}: "
                         "jobs.extract would refuse such rows; use at most that, or 0 for it")
    fs, files = resolve_files(config.data.path, config.data.storage_options)
    total = sum(count_rows(fs, file) for file in files)
    if total == 0:
        raise ValueError(f"data.path={config.data.path}: the files hold no rows")
    digests = [checksum.of_remote(fs, file.path, checksum.DEFAULT_ALGORITHM) for file in files]
    return Inputs(config, chat, fs, files, total, max_length, Path(config.output.dir), digests, serving)


# -- shards -------------------------------------------------------------------------------------


def shards_of(rows: Iterator[ConversationRow], size: int) -> Iterator[tuple[int, list[ConversationRow]]]:
    """Consecutive rows, ``size`` at a time, with the shard's index."""
    shard: list[ConversationRow] = []
    for row in rows:
        shard.append(row)
        if len(shard) == size:
            yield row.conversation_id // size, shard
            shard = []
    if shard:
        yield shard[0].conversation_id // size, shard


def input_rows(inputs: Inputs, regenerate: bool) -> Iterator[ConversationRow]:
    data = inputs.config.data
    return read_conversations(inputs.fs, inputs.files, data.format, data.other_roles, regenerate,
                              inputs.max_length * MAX_CHARS_PER_TOKEN)


# -- tokenizing ---------------------------------------------------------------------------------


def tokenize_all(inputs: Inputs, shard_rows: Iterator[tuple[int, list[ConversationRow]]], content_hash: str,
                 workers: int) -> tuple[Totals, out_dir.SkippedRows, list[dict[str, Any]]]:
    """Every shard into a part under its temp name; published by the caller once all are written."""
    config, out = inputs.config, inputs.out
    spec = TokenizeSpec(
        max_length=inputs.max_length, on_too_long=config.data.on_too_long, fail=config.data.on_invalid == "fail",
        out=str(out), content_sha256=content_hash,
    )
    skipped = out_dir.SkippedRows(out)
    totals = Totals()
    parts: list[dict[str, Any]] = []
    progress = Progress("tokenize", inputs.total, config.progress.interval_s)

    def take(outcome: ShardOutcome) -> None:
        totals.merge(outcome.totals)
        for conversation_id, source, kind, reason in outcome.skipped:
            skipped.add(conversation_id, source, kind, reason)
        if outcome.part is not None:
            parts.append(outcome.part)
        progress.update(outcome.totals.conversations)

    if workers > 1:
        logger.info("tokenizing %d shards in %d worker processes", inputs.shards, workers)
    try:
        tokenize_shards(spec, inputs.chat, shard_rows, workers, take)
    except BaseException:
        skipped.discard()
        out_dir.remove_own_temp_files(out)  # parts of this run, and any a worker was writing
        raise
    finally:
        progress.close()
    return totals, skipped, parts


# -- regenerating -------------------------------------------------------------------------------


def check_before_regenerating(inputs: Inputs, todo: set[int]) -> None:
    """Under data.on_invalid=fail, a bad input row fails the run before any model is loaded."""
    if inputs.config.data.on_invalid != "fail":
        return
    for row in input_rows(inputs, regenerate=True):
        if row.reason is not None and row.conversation_id // inputs.config.output.shard_size in todo:
            raise refuse(row, row.reason, inputs.out)


def regenerate_all(inputs: Inputs, todo: set[int], stages: StageLine) -> dict[str, Any]:
    """Answers for the shards in ``todo``, each published as soon as it and those before it are answered; returns
    the stats (``seconds``: from the first shard sent to the last published, the engine's start-up not counted).
    ``stages`` says so while Ray starts and the model loads; the bar follows."""
    # Here, not at the top: a prepare without regeneration never imports Ray (half a second of its start).
    import ray

    from conversations.regenerate import shards_at_once, start_regenerator
    from runtime.cluster.session import ray_session, resolve_device

    config = inputs.config
    model = config.model
    done_before = (inputs.shards - len(todo)) * config.output.shard_size
    stats = {"shards": 0, "answers": 0, "generated_tokens": 0, "seconds": 0.0, "cut_at_max_new_tokens": 0}
    started = time.perf_counter()
    stages.show("starting Ray")
    with ray_session(config.ray.address):
        device = resolve_device(model.device, model.tp_size)
        actor = start_regenerator(inputs.generator_spec(device), inputs.chat, config.generation.sampling_params(),
                                  config.generation.max_new_tokens, config.output.shard_size)
        at_once = shards_at_once(config.output.shard_size)
        stages.show("loading the model")
        progress: Optional[Progress] = None
        pending: list[tuple[int, list[ConversationRow], Any]] = []
        try:
            stats["sglang_version"] = ray.get(actor.sglang_version.remote())  # the engine is up
            stages.close()
            stages.timeline.enter("regenerating")
            progress = Progress("regenerate", inputs.total, config.progress.interval_s,
                                already=min(done_before, inputs.total))
            logger.info("regenerating %d of %d shards on %s (tp %d)", len(todo), inputs.shards, device, model.tp_size)
            generating = time.perf_counter()
            for shard, rows in shards_of(input_rows(inputs, regenerate=True), config.output.shard_size):
                if shard not in todo:
                    continue
                valid = [(row.conversation_id, row.messages) for row in rows if row.messages is not None]
                pending.append((shard, rows, actor.regenerate.remote(valid)))
                if len(pending) > at_once:  # the actor answers that many; the next waits in its queue
                    _publish_answers(inputs, *pending.pop(0), stats, progress)
            for answered in pending:
                _publish_answers(inputs, *answered, stats, progress)
            stats["seconds"] = time.perf_counter() - generating
            stages.timeline.enter("closing the engine")
            try:
                ray.get(actor.close.remote(), timeout=60)  # a clean engine shutdown
            except Exception as error:  # the engine goes with the actor either way
                logger.warning("closing the SGLang engine: %s", error)
        finally:
            # Also on a failure or a signal: the shards in flight are not waited for (what was published stays),
            # and the engine's own processes end with the actor's.
            if progress is not None:
                progress.close()
            ray.kill(actor)
            stages.timeline.enter("stopping Ray")
    stats["wall_seconds"] = round(time.perf_counter() - started, 1)
    stats["tokens_per_second"] = round(stats["generated_tokens"] / max(stats["seconds"], 1e-9), 1)
    return stats


def _publish_answers(inputs: Inputs, shard: int, rows: list[ConversationRow], ref: Any, stats: dict[str, Any],
                     progress: Progress) -> None:
    import ray

    answered, shard_stats = ray.get(ref)
    by_id = {record["conversation_id"]: record for record in answered}
    records = []
    for row in rows:
        record = by_id.get(row.conversation_id) or {"conversation_id": row.conversation_id, "invalid": row.reason}
        records.append({**record, "source": dataclasses.asdict(row.source), "id": row.row_id})
    out_dir.write_regenerated(inputs.out, shard, records)
    stats["shards"] += 1
    for key in ("answers", "generated_tokens", "cut_at_max_new_tokens"):
        stats[key] += shard_stats[key]
    progress.update(len(rows))


def regenerated_shards(inputs: Inputs) -> Iterator[tuple[int, list[ConversationRow]]]:
    from conversations.regenerate import regenerated_rows

    for shard in range(inputs.shards):
        path = inputs.out / out_dir.REGENERATED_DIR / out_dir.regenerated_name(shard)
        yield shard, list(regenerated_rows(out_dir.read_regenerated(path)))


# -- the run ------------------------------------------------------------------------------------


def tokenize_and_publish(inputs: Inputs, stages: StageLine) -> dict[str, Any]:
    """Regenerate (if asked), tokenize, publish; returns the side record (also written as _prepare.json). ``stages``
    shows what happens until the first bar."""
    config, out = inputs.config, inputs.out
    content = inputs.content()
    content_hash = out_dir.content_sha256(content)
    record: dict[str, Any] = {
        "format": out_dir.RECORD_FORMAT, "state": out_dir.RUNNING, "content": content,
        "regeneration": inputs.regeneration_content(), "started_at": out_dir.now(), "command": " ".join(sys.argv),
        "model_path": config.model.path, "output_path": str(out), "tokenizer": inputs.chat.describe(),
        "input": {"path": config.data.path, "files": [dataclasses.asdict(file) for file in inputs.files]},
    }
    out_dir.remove_own_temp_files(out)
    out_dir.write_record(out, record)
    started = time.perf_counter()
    if config.regenerate:
        answered = {int(path.stem.split("-")[1]) for path in out_dir.list_regenerated(out)}
        todo = set(range(inputs.shards)) - answered
        if answered:
            logger.info("%d of %d shards were regenerated by an earlier run: resuming", len(answered), inputs.shards)
        if todo:
            check_before_regenerating(inputs, todo)
            record["regeneration_stats"] = regenerate_all(inputs, todo, stages)
        shard_rows = regenerated_shards(inputs)
    else:
        shard_rows = shards_of(input_rows(inputs, regenerate=False), config.output.shard_size)
    workers = resolve_workers(config.workers, inputs.shards, inputs.total)
    stages.close()
    stages.timeline.enter("tokenizing and publishing")
    totals, skipped, parts = tokenize_all(inputs, shard_rows, content_hash, workers)
    if not parts:
        skipped.discard()
        raise ValueError(f"data.path={config.data.path}: no conversation was kept (all {totals.conversations} "
                         f"left out, e.g. {skipped.first[0]['reason'] if skipped.first else '?'})")
    out_dir.publish_parts(out, [part["shard"] for part in parts])
    skipped.publish()
    seconds = time.perf_counter() - started
    record.update(
        state=out_dir.COMPLETE, finished_at=out_dir.now(), seconds=round(seconds, 2), workers=workers,
        conversations_per_second=round(totals.conversations / max(seconds, 1e-9), 1),
        counts={"conversations": totals.conversations, "kept": totals.kept, "skipped": skipped.count,
                "skipped_by_kind": skipped.by_kind, "truncated": totals.truncated,
                "assistant_turns": totals.assistant_turns},
        tokens={"total": totals.tokens, "masked": totals.masked_tokens, "lengths": totals.length_stats(),
                "max_length": inputs.max_length},
        skipped={"file": out_dir.SKIPPED_FILE if skipped.count else None, "first": skipped.first},
        parts=parts, wall_seconds=stages.timeline.seconds(),
    )
    out_dir.write_record(out, record)
    return record
