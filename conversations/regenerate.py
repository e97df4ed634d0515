"""Regeneration: the target answers every prompt of the conversations again, through SGLang.

For each conversation the assistant turns are replaced, in order, by the target's own answers:
the prompt for an answer is the conversation so far (earlier answers already the target's),
rendered with the chat template and ``add_generation_prompt=True``, exactly as step 1 will render
it; a trailing user turn is answered too. A shard's first prompts go to the engine as one request
(``Generator.submit_batch``), as ``Engine.generate`` sends a batch: its scheduler gets them in one
message, not one message per prompt arriving while it already runs the first ones. Their answers
come back together; each next prompt then goes in as soon as the answer before it is back
(``Generator.submit``), answers back at the same time handled together: the engine's continuous
batching always has work (the other shards' too) instead of waiting at the end of each round for
its slowest answer. With greedy decoding the answers are the ones a batch per round gives.

The engine lives in a Ray actor (``Regenerator``) holding the model's ``tp_size`` GPUs on CUDA, one
CPU on CPU; it answers several shards at a time (``shards_at_once``: enough for more conversations
than SGLang runs at once, at least two). The driver sends it shards, gets each one's regenerated
conversations back in order and publishes them as ``_regenerated/part-NNNNN.jsonl`` while the
next shards are answered: the engine never waits for a shard's slowest answer nor for a shard to
be published, and a killed run resumes from the first shard not published.

A prompt longer than the engine takes (``Generator.limits``, SGLang's own) is not sent, and a request the engine
refuses all the same (its ValueError) is not the shard's failure: either is its conversation's reason to be invalid.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Iterator, Optional, Sequence, Union

import ray

from conversations.reader import ASSISTANT, OPENAI, USER, ConversationRow, RowSource, check_ending, to_messages
from conversations.template import ChatTemplate, Messages
from extractor.generator import FINISH_LENGTH, Generator, GeneratorSpec

logger = logging.getLogger(__name__)

REGENERATOR_CPUS = 1
IN_FLIGHT_CONVERSATIONS = 8192
"""Conversations the engine is given at once, over as many shards as that takes: more than SGLang runs at once
(its default max_running_requests is 2048-4096), so its scheduler always has requests waiting, at a shard's end
too."""
MAX_SHARDS_AT_ONCE = 32
"""Each shard being answered holds one of the actor's threads."""


def shards_at_once(shard_size: int) -> int:
    """Shards the regenerator answers at once: ``IN_FLIGHT_CONVERSATIONS`` worth, at least two (the next shard's
    prompts wait in the engine behind the last answers of the one before), at most ``MAX_SHARDS_AT_ONCE``."""
    return min(MAX_SHARDS_AT_ONCE, max(2, -(-IN_FLIGHT_CONVERSATIONS // shard_size)))
AFTER_REGENERATION = "after regeneration: "
"""Starts the reason of a row that became invalid through its regenerated answers."""


@dataclasses.dataclass
class _Conversation:
    """One conversation being answered: the turns copied so far and where it stands in the original."""

    conversation_id: int
    original: Messages
    done: Messages = dataclasses.field(default_factory=list)
    cursor: int = 0
    answers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    reason: Optional[str] = None
    request: Optional[tuple[list[int], dict[str, Any]]] = None
    """The prompt ids and sampling parameters of the answer being asked for."""

    def next_prompt(self) -> Optional[Messages]:
        """The conversation before its next answer, or None when every answer is written."""
        while self.cursor < len(self.original):
            turn = self.original[self.cursor]
            self.cursor += 1
            if turn["role"] == ASSISTANT:
                return self.done
            self.done.append(turn)
        if self.done and self.done[-1]["role"] == USER:  # a trailing question is answered too
            return self.done
        return None

    def answer(self, text: str, finish_reason: str, tokens: int) -> None:
        self.done = [*self.done, {"role": ASSISTANT, "content": text}]
        self.answers.append({"finish_reason": finish_reason, "tokens": tokens})


_Answers = queue.SimpleQueue[tuple[list[_Conversation], concurrent.futures.Future]]
"""Answers back from the engine: the conversations asked, and the future of their completions (a list for the
shard's first request, one completion for each later one)."""


class Regenerator:
    """The actor's body: the chat template and an ``extractor.generator.Generator``."""

    def __init__(self, spec: GeneratorSpec, chat: ChatTemplate, sampling: dict[str, Any], max_new_tokens: int) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

        self.chat = chat  # the driver's own, pickled: prompts render exactly as step 1 renders them
        self.sampling = dict(sampling, stop_token_ids=sorted(self.chat.stop_ids))
        self.max_new_tokens = max_new_tokens
        self._chat_lock = threading.Lock()
        """The tokenizer is not for two threads at once (a fast tokenizer raises "Already borrowed")."""
        self.generator = Generator(spec)

    def sglang_version(self) -> str:
        return self.generator.sglang_version

    def regenerate(self, conversations: Sequence[tuple[int, Messages]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Each conversation with its answers replaced by the target's (or why it could not be), and the
        shard's generation stats. Safe to call from several threads at once (``shards_at_once``)."""
        started = time.perf_counter()
        todo = [_Conversation(conversation_id, messages) for conversation_id, messages in conversations]
        answered: _Answers = queue.SimpleQueue()
        pending = self._ask(todo, answered, first=True)
        generated = 0
        while pending:
            back = [answered.get()]
            while not answered.empty():  # answers back meanwhile: decoded, and their next prompts sent, together
                back.append(answered.get_nowait())
            pending -= len(back)
            done, again = [], []
            for asked, future in back:
                try:
                    completions = future.result()  # any other error of the engine ends the shard
                except ValueError as error:  # SGLang refused the request: its conversation's fault, not the shard's
                    if len(asked) > 1:  # the shard's first request: each prompt again on its own, to find the one
                        again += asked
                    else:
                        asked[0].reason = f"the engine refused its prompt for answer {len(asked[0].answers) + 1}: {error}"
                    continue
                done += zip(asked, completions if isinstance(completions, list) else [completions])
            pending += self._send(again, answered)
            generated += sum(len(completion.output_ids) for _, completion in done)
            with self._chat_lock:
                texts = [self._decode(completion.output_ids) for _, completion in done]
            for (conversation, completion), text in zip(done, texts):
                if isinstance(text, Exception):  # ids the tokenizer has no text for (a model vocab larger than it)
                    conversation.reason = f"the tokenizer cannot decode the answer ({type(text).__name__}: {text})"
                else:
                    conversation.answer(text, completion.finish_reason, len(completion.output_ids))
            pending += self._ask([conversation for conversation, _ in done if conversation.reason is None], answered)
        records = [
            {"conversation_id": c.conversation_id, "invalid": AFTER_REGENERATION + c.reason} if c.reason else
            {"conversation_id": c.conversation_id, "messages": c.done, "answers": c.answers}
            for c in todo
        ]
        seconds = time.perf_counter() - started
        answers = [a for c in todo for a in c.answers]
        stats = {"answers": len(answers), "generated_tokens": generated, "seconds": seconds,
                 "rounds": max((len(c.answers) for c in todo), default=0),
                 "cut_at_max_new_tokens": sum(a["finish_reason"] == FINISH_LENGTH for a in answers)}
        return records, stats

    def _decode(self, ids: list[int]) -> Union[str, Exception]:
        try:
            return self.chat.decode(ids)
        except Exception as error:
            return error

    def _ask(self, conversations: Sequence[_Conversation], answered: _Answers, first: bool = False) -> int:
        """Send each conversation's next prompt to the engine (its answer goes to ``answered``); returns how many
        entries ``answered`` will get. A conversation with no answer left, or whose prompt cannot be answered (one
        longer than the engine takes among them), is done. The answer may fill what the prompt leaves of the
        engine's context, up to ``max_new_tokens``."""
        asking = [(c, prompt) for c in conversations if (prompt := c.next_prompt()) is not None]
        if not asking:
            return 0
        with self._chat_lock:
            ids = self.chat.prompt_ids([prompt for _, prompt in asking])
        limits = self.generator.limits
        sending: list[_Conversation] = []
        for (conversation, _), prompt_ids in zip(asking, ids):
            if isinstance(prompt_ids, str):
                conversation.reason = prompt_ids
            elif len(prompt_ids) > limits.max_prompt_tokens:
                conversation.reason = (
                    f"its prompt for answer {len(conversation.answers) + 1} has {len(prompt_ids)} tokens, more than the "
                    f"{limits.max_prompt_tokens} the engine takes (its context of {limits.context_length} tokens and "
                    "its KV cache, less SGLang's margin): the target cannot answer it")
            else:
                room = min(self.max_new_tokens, limits.context_length - len(prompt_ids))
                conversation.request = (prompt_ids, dict(self.sampling, max_new_tokens=room))
                sending.append(conversation)
        return self._send(sending, answered, first)

    def _send(self, asked: list[_Conversation], answered: _Answers, first: bool = False) -> int:
        """Each conversation's ``request`` to the engine; returns how many entries ``answered`` will get.
        ``first``: the shard's first prompts, one request (the engine's cheapest way in, as ``Engine.generate``: one
        entry); otherwise each prompt its own request (an entry each), so that each conversation goes on as soon as
        its own answer is back."""
        if not asked:
            return 0
        prompts, params = (list(column) for column in zip(*(conversation.request for conversation in asked)))
        if first:
            future = self.generator.submit_batch(prompts, params)
            future.add_done_callback(lambda done: answered.put((asked, done)))
            return 1
        for conversation, future in zip(asked, self.generator.submit(prompts, params)):
            future.add_done_callback(lambda done, c=conversation: answered.put(([c], done)))
        return len(asked)

    def close(self) -> None:
        self.generator.close()


def start_regenerator(spec: GeneratorSpec, chat: ChatTemplate, sampling: dict[str, Any], max_new_tokens: int,
                      shard_size: int) -> Any:
    """The regeneration actor: the model's tp_size GPUs on CUDA (SGLang's engine runs its ranks itself), answering
    ``shards_at_once(shard_size)`` shards at a time."""
    return (
        ray.remote(Regenerator)
        .options(num_gpus=spec.tp_size if spec.device == "cuda" else 0, num_cpus=REGENERATOR_CPUS,
                 max_concurrency=shards_at_once(shard_size))
        .remote(spec, chat, sampling, max_new_tokens)
    )


def regenerated_rows(records: Iterator[dict[str, Any]]) -> Iterator[ConversationRow]:
    """The rows of a regenerated shard file, checked again as step 1 checks input rows."""
    for record in records:
        source = RowSource(**record["source"])
        row_id = record.get("id")
        if "invalid" in record:
            yield ConversationRow(record["conversation_id"], source, None, record["invalid"], row_id)
            continue
        messages, reason = to_messages({"messages": record["messages"]}, OPENAI, other_roles="keep")
        if reason is None and messages is not None:
            reason = check_ending(messages, regenerate=False)
        yield ConversationRow(record["conversation_id"], source, None if reason else messages,
                              AFTER_REGENERATION + reason if reason else None, row_id)
