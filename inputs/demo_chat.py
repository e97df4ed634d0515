"""The demo's chat: two chat-template families, the conversations the demos use, and a chat tokenizer trained here.

No model hub: the tokenizer is a byte-level BPE trained on this module's own sentences with the
``tokenizers`` library, sized to the demo model's vocabulary (every id the random model can
generate decodes), and saved with a chat template. Two template families, each a copy of a real
one with its own special tokens:

- ``chatml``: ChatML as SmolLM2-135M-Instruct and Qwen2.5 ship it (``<|im_start|>role\\n...<|im_end|>\\n``,
  eos ``<|im_end|>``);
- ``llama3``: Meta-Llama-3-8B-Instruct's template verbatim (``<|begin_of_text|>``, role headers between
  ``<|start_header_id|>``/``<|end_header_id|>``, turns closed by ``<|eot_id|>``, contents ``trim``-med;
  eos ``<|eot_id|>``, generation_config eos ``[<|end_of_text|>, <|eot_id|>]``).

The tests use both as the second template family beside SmolLM2's real tokenizer. The extraction demo's model
gets the ChatML one (``inputs.demo``), the prepare demo's too (``conversations.demo``).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

DEMO_VOCAB_SIZE = 512
"""The tiny demo models' vocabulary, which the demo tokenizer is trained to."""

CHATML = "chatml"
LLAMA3 = "llama3"
FAMILIES = (CHATML, LLAMA3)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TemplateFamily:
    specials: tuple[str, ...]
    template: str
    bos: str
    eos: str
    generation_eos: tuple[str, ...]
    """generation_config.json's eos_token_id, as the real family's instruct model ships it."""


TEMPLATES = {
    CHATML: TemplateFamily(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), CHATML_TEMPLATE, "<|im_start|>", "<|im_end|>",
                    ("<|im_end|>",)),
    LLAMA3: TemplateFamily(("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                    LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>", ("<|end_of_text|>", "<|eot_id|>")),
}

_COUNTRIES = [("France", "Paris"), ("Italy", "Rome"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
              ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Norway", "Oslo"), ("Chile", "Santiago"), ("India", "New Delhi")]
_THINGS = ["the sea", "a library", "the moon", "a garden", "the mountains", "a river", "the city", "a forest"]
_SYSTEM = ["You are a helpful assistant.", "Answer briefly and kindly.", "You are a careful tutor who explains things."]


def _question_and_answer(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        country, capital = rng.choice(_COUNTRIES)
        return f"What is the capital of {country}?", f"The capital of {country} is {capital}."
    if kind == 1:
        a, b = rng.randrange(2, 50), rng.randrange(2, 50)
        return f"How much is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 2:
        thing = rng.choice(_THINGS)
        return (f"Write one sentence about {thing}.",
                f"{thing[0].upper() + thing[1:]} is calm in the morning, and full of quiet sounds by night.")
    word = rng.choice(["hello", "river", "garden", "music", "window", "planet"])
    return f"Spell the word '{word}' backwards.", f"Backwards, '{word}' is '{word[::-1]}'."


def demo_conversations(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """ShareGPT rows: one to three exchanges, a third of them with a system prompt."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        turns = []
        if index % 3 == 0:
            turns.append({"from": "system", "value": rng.choice(_SYSTEM)})
        for _ in range(1 + rng.randrange(3)):
            question, answer = _question_and_answer(rng)
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        rows.append({"id": f"demo-{index}", "conversations": turns})
    return rows


def _corpus() -> list[str]:
    rng = random.Random(1)
    lines = [text for row in demo_conversations(400, seed=2) for text in (t["value"] for t in row["conversations"])]
    words = sorted({word for line in lines for word in line.split()})
    lines += [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    return lines


def build_chat_tokenizer(directory: str | Path, family: str = CHATML, vocab_size: int = DEMO_VOCAB_SIZE) -> Path:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens and save it with ``family``'s chat template
    into ``directory`` (tokenizer.json, tokenizer_config.json, chat_template.jinja); returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = TEMPLATES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(spec.specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the demo corpus trains {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=spec.bos, eos_token=spec.eos,
                                   pad_token=spec.eos, unk_token=spec.specials[0])
    fast.chat_template = spec.template
    directory = Path(directory)
    fast.save_pretrained(str(directory))
    eos_ids = [fast.convert_tokens_to_ids(token) for token in spec.generation_eos]
    config = directory / "generation_config.json"
    generation = json.loads(config.read_text()) if config.exists() else {}
    generation.update(bos_token_id=fast.bos_token_id, eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids)
    config.write_text(json.dumps(generation, indent=2) + "\n")
    return directory
