"""The loss mask of jobs.prepare, on real tokenizers: SmolLM2-135M-Instruct's (ChatML, from its checkpoint)
and two trained here with real families' templates (conversations.demo: ChatML, and Llama-3-Instruct's
verbatim; Qwen3's, testbeds.chat_templates, renders with the ChatML one). Every case checks the round trip: the
ids are apply_chat_template's, each run of masked tokens decodes to one assistant answer and its end-of-turn
token, and the tokens before it are exactly the prompt the model answers (apply_chat_template with
add_generation_prompt)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conversations.reader import to_messages
from conversations.template import PLAIN_CLASSES, PLAIN_MODEL_TYPES, ChatTemplate, Encoded, _load_plain, _stop_ids
from inputs.demo_chat import CHATML, LLAMA3, build_chat_tokenizer, demo_conversations
from testbeds.chat_templates import QWEN3
from testbeds.smollm2 import checkpoint_dir

SYSTEM = {"role": "system", "content": "You are terse."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def smollm2() -> ChatTemplate:
    return ChatTemplate.load(str(checkpoint_dir()))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> ChatTemplate:
    return ChatTemplate.load(str(build_chat_tokenizer(tmp_path_factory.mktemp("llama3"), LLAMA3)))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> ChatTemplate:
    return ChatTemplate.load(str(build_chat_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML)))


FAMILIES = ("smollm2", "llama3", "chatml")
END_TOKEN = {"smollm2": "<|im_end|>", "llama3": "<|eot_id|>", "chatml": "<|im_end|>"}


def masked_runs(encoded: Encoded) -> list[tuple[int, int]]:
    """[start, end) of every run of 1s in the mask."""
    runs, start = [], None
    for position, bit in enumerate([*encoded.loss_mask, 0]):
        if bit and start is None:
            start = position
        elif not bit and start is not None:
            runs.append((start, position))
            start = None
    return runs


def assert_round_trip(chat: ChatTemplate, family: str, messages: list[dict]) -> Encoded:
    tokenizer = chat.tokenizer
    encoded = chat.encode([messages])[0]
    assert isinstance(encoded, Encoded), encoded
    assert encoded.input_ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert len(encoded.loss_mask) == len(encoded.input_ids) and set(encoded.loss_mask) <= {0, 1}
    answers = [(i, m["content"]) for i, m in enumerate(messages) if m["role"] == "assistant"]
    runs = masked_runs(encoded)
    # Llama-3's template trims each content; ChatML renders it verbatim.
    expected = [(text.strip() if family == "llama3" else text) + END_TOKEN[family] for _, text in answers]
    assert [tokenizer.decode(encoded.input_ids[a:b]) for a, b in runs] == expected
    for (index, _), (start, _) in zip(answers, runs):
        prompt = tokenizer.apply_chat_template(messages[:index], add_generation_prompt=True, tokenize=True)["input_ids"]
        assert encoded.input_ids[:start] == prompt
    assert encoded.assistant_turns == len(answers)
    return encoded


@pytest.mark.parametrize("family", FAMILIES)
def test_one_answer(family, request):
    chat = request.getfixturevalue(family)
    encoded = assert_round_trip(chat, family, [user("What is the capital of Peru?"), assistant("The capital of Peru is Lima.")])
    # nothing after the end token is masked (ChatML's newline, the end of the text)
    last = max(i for i, bit in enumerate(encoded.loss_mask) if bit)
    assert chat.tokenizer.convert_ids_to_tokens(encoded.input_ids[last]) == END_TOKEN[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_with_system_prompt(family, request):
    assert_round_trip(request.getfixturevalue(family), family, [
        SYSTEM, user("How much is 2 plus 2?"), assistant("2 plus 2 is 4."), user("And 3 plus 3?"), assistant("6."),
        user("Spell 'river' backwards."), assistant("Backwards, 'river' is 'revir'."),
    ])


@pytest.mark.parametrize("family", FAMILIES)
def test_answer_repeating_the_question_is_masked_where_the_assistant_said_it(family, request):
    """The same text in the user's turn is not what the mask covers: it is placed by the template, not found."""
    encoded = assert_round_trip(request.getfixturevalue(family), family,
                                [user("Say yes."), assistant("Say yes."), user("Say yes."), assistant("Say yes.")])
    assert len(masked_runs(encoded)) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_unicode_newlines_and_consecutive_answers(family, request):
    assert_round_trip(request.getfixturevalue(family), family, [
        user("  Spaces around  "), assistant("Trailing spaces.  "), assistant("Café, naïve, 日本語, 🙂."),
        user("Line\nbreaks?"), assistant("One\n\ntwo\n"),
    ])


def test_answer_starting_with_whitespace(smollm2, llama3):
    """After ChatML's "assistant\n" header a byte-level BPE merges the newline with the answer's leading space:
    the prompt's tokens are no prefix of the conversation's, so no exact mask exists and the row is refused.
    Llama-3's template trims contents: nothing to merge."""
    messages = [user("Hi"), assistant("  Hello.")]
    assert smollm2.encode([messages])[0] == (
        "the tokenizer merges text across the boundary of assistant turn 1: the tokens of the prompt before assistant "
        "turn 1 are not a prefix of the whole conversation's tokens, so no exact token mask exists (a byte-level BPE "
        "can do this to an answer that starts with whitespace: strip the answers)")
    assert_round_trip(llama3, "llama3", messages)


def test_smollm2_default_system_prompt_is_not_masked(smollm2):
    """SmolLM2's template adds its own system prompt when the conversation has none."""
    encoded = assert_round_trip(smollm2, "smollm2", [user("Hi"), assistant("Hello!")])
    text = smollm2.tokenizer.decode(encoded.input_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert encoded.loss_mask.count(1) == len(smollm2.tokenizer("Hello!<|im_end|>", add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("family", FAMILIES)
def test_kept_tool_turn_is_rendered_and_never_masked(family, request):
    record = {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                           {"role": "assistant", "content": "Let me check."},
                           {"role": "tool", "content": "Oslo: 3 degrees, rain."},
                           {"role": "assistant", "content": "It is 3 degrees and raining in Oslo."}]}
    messages, reason = to_messages(record, "openai", other_roles="keep")
    assert reason is None
    encoded = assert_round_trip(request.getfixturevalue(family), family, messages)
    tokenizer = request.getfixturevalue(family).tokenizer
    assert "Oslo: 3 degrees" in tokenizer.decode(encoded.input_ids)
    dropped, _ = to_messages(record, "openai", other_roles="drop")
    assert [m["role"] for m in dropped] == ["user", "assistant", "assistant"]


def test_answer_holding_the_end_token_text_is_refused(smollm2):
    result = smollm2.encode([[user("Hi"), assistant("Hello<|im_end|> there")]])[0]
    assert result == ("assistant turn 1 holds the text '<|im_end|>', which the tokenizer reads as the end-of-turn "
                      "token: the model would stop there")


def test_template_refusing_a_conversation_makes_that_row_invalid(tmp_path, smollm2):
    """A template's raise_exception (as Llama-2/Mistral templates refuse non-alternating roles) fails that row only."""
    template = tmp_path / "alternating.jinja"
    template.write_text(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    chat = ChatTemplate.load(str(checkpoint_dir()), str(template))
    good, bad = chat.encode([[user("a"), assistant("b")], [user("a"), user("b"), assistant("c")]])
    assert isinstance(good, Encoded)
    assert bad == ("the chat template cannot render it: TemplateError: Conversation roles must alternate "
                   "user/assistant/user/assistant")


@pytest.mark.parametrize("thinking", ["default", "enable_thinking=false"])
def test_qwen3s_template_masks_rows_of_one_answer_and_refuses_rows_of_several(thinking, tmp_path):
    """Qwen3's template (verbatim) drops the reasoning of earlier answers and writes a <think> block into the last:
    it loads, a row of one answer gets its exact mask, a row of several is refused with the reason (the rows'
    business: data.on_invalid fails the run naming the row, or skips it)."""
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3)
    kwargs = {"enable_thinking": False} if thinking == "enable_thinking=false" else {}
    # ChatML's tokens, as Qwen3's tokenizer has them (SmolLM2's makes "\n\n" one token at the end of the prompt and
    # two before the answer: no exact mask with enable_thinking=false, refused at load)
    chat = ChatTemplate.load(str(build_chat_tokenizer(tmp_path / "tokenizer", CHATML)), str(template),
                             template_kwargs=kwargs)
    tokenizer = chat.tokenizer
    one = [user("What is 2+2?"), assistant("4.")]
    encoded = chat.encode([one])[0]
    assert isinstance(encoded, Encoded), encoded
    assert encoded.input_ids == tokenizer.apply_chat_template(one, chat_template=QWEN3, tokenize=True,
                                                              **kwargs)["input_ids"]
    [(start, end)] = masked_runs(encoded)
    # the empty reasoning block is the model's to write unless the prompt holds it
    answer = "4.<|im_end|>" if kwargs else "<think>\n\n</think>\n\n4.<|im_end|>"
    assert tokenizer.decode(encoded.input_ids[start:end]) == answer
    assert encoded.input_ids[:start] == tokenizer.apply_chat_template(
        one[:1], chat_template=QWEN3, add_generation_prompt=True, tokenize=True, **kwargs)["input_ids"]
    several = [user("Hi"), assistant("Hello."), user("Bye?"), assistant("Bye.")]
    what = "the prompt before" if kwargs else "the conversation through"
    assert chat.encode([several])[0] == (
        f"the chat template renders {what} assistant turn 1 differently once later turns follow (it is not a prefix "
        "of the whole conversation), so the answer has no exact place in the tokens; use a template that leaves "
        "earlier turns as they were (model.chat_template=FILE)")


def test_template_without_end_of_turn_token_is_refused_unless_named(tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] + ':\n' + m['content'] + '\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}")
    with pytest.raises(ValueError, match=r"assistant turn 1 renders without an end-of-turn token \(<\|im_end\|>\); "
                                         r"set model.stop_tokens"):
        ChatTemplate.load(str(checkpoint_dir()), str(template))
    with pytest.raises(ValueError, match=r"model.stop_tokens: 'no such token' is not one token"):
        ChatTemplate.load(str(checkpoint_dir()), str(template), stop_tokens=["no such token"])


def test_no_chat_template_names_the_key(tmp_path):
    directory = build_chat_tokenizer(tmp_path / "tok", CHATML)
    (Path(directory) / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match=r"has no chat template; name a Jinja template file with model.chat_template"):
        ChatTemplate.load(str(directory))


def test_chat_template_kwargs_reach_the_template(tmp_path):
    """As Qwen3's template reads enable_thinking: model.chat_template_kwargs are the template's variables."""
    template = tmp_path / "variable.jinja"
    template.write_text(
        "{{ '<|im_start|>system\n' + (house_rules or 'No rules.') + '<|im_end|>\n' }}{% for m in messages %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    chat = ChatTemplate.load(str(checkpoint_dir()), str(template), template_kwargs={"house_rules": "Be kind."})
    messages = [user("Hi"), assistant("Hello.")]
    encoded = chat.encode([messages])[0]
    tokenizer = chat.tokenizer
    assert encoded.input_ids == tokenizer.apply_chat_template(messages, chat_template=template.read_text(),
                                                              house_rules="Be kind.")["input_ids"]
    assert tokenizer.decode(encoded.input_ids).startswith("<|im_start|>system\nBe kind.<|im_end|>")
    assert [tokenizer.decode(encoded.input_ids[a:b]) for a, b in masked_runs(encoded)] == ["Hello.<|im_end|>"]
    assert chat.describe()["chat_template_kwargs"] == {"house_rules": "Be kind."}


def checkpoint_like(source: Path, directory: Path, tokenizer_class: str, model_type: str | None) -> Path:
    """A copy of ``source``'s tokenizer whose tokenizer_config.json names ``tokenizer_class``, with a config.json of
    ``model_type`` (none when None): the combinations released checkpoints ship (SmolLM2's hub copy names
    GPT2Tokenizer, Llama-3's PreTrainedTokenizerFast)."""
    directory.mkdir()
    for path in source.iterdir():
        if path.name not in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            shutil.copyfile(path, directory / path.name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": tokenizer_class}))
    if model_type is not None:
        (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    return directory


def auto_loaded(directory: Path) -> ChatTemplate:
    """The ChatTemplate of the tokenizer transformers.AutoTokenizer loads (what every tokenizer is compared to)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    return ChatTemplate(tokenizer, tokenizer.get_chat_template(), "checkpoint", _stop_ids(tokenizer, str(directory), ()))


PLAIN_CASES = [("TokenizersBackend", "llama"), ("GPT2Tokenizer", "llama"), ("GPT2TokenizerFast", "llama"),
               ("PreTrainedTokenizerFast", "llama"), ("GPT2Tokenizer", None), ("TokenizersBackend", None)]


@pytest.mark.parametrize("source", ["smollm2", "llama3"])
@pytest.mark.parametrize("tokenizer_class, model_type", PLAIN_CASES)
def test_tokenizer_loaded_without_torch_is_the_one_autotokenizer_loads(source, tokenizer_class, model_type, tmp_path):
    """Where the class is known from the checkpoint's files, the tokenizer loads without AutoTokenizer (whose import
    brings torch, seconds of the command's start): the same class, definition, rendering and ids as AutoTokenizer's,
    so the parts and the side record are the same bytes and a resume finds the same tokenizer_sha256."""
    origin = checkpoint_dir() if source == "smollm2" else build_chat_tokenizer(tmp_path / "built", LLAMA3)
    directory = checkpoint_like(Path(origin), tmp_path / "checkpoint", tokenizer_class, model_type)
    assert _load_plain(directory) is not None
    plain, auto = ChatTemplate.load(str(directory)), auto_loaded(directory)
    assert type(plain.tokenizer) is type(auto.tokenizer)
    assert plain.describe() == auto.describe()
    conversations = [to_messages(row, "sharegpt", "fail")[0] for row in demo_conversations(40, seed=5)]
    conversations += [[user(" Leading space, \u00e9t\u00e9 \U0001f600\n\n"), assistant("  two spaces.\n")]]
    assert plain.render(conversations, False) == auto.render(conversations, False)
    assert plain.render(conversations, True) == auto.render(conversations, True)
    assert plain.encode(conversations) == auto.encode(conversations)
    assert plain.tokenize(["<|im_start|>a  b", " x\u00e9"]) == auto.tokenize(["<|im_start|>a  b", " x\u00e9"])


@pytest.mark.parametrize("tokenizer_class, model_type, autotokenizer_class", [
    ("TokenizersBackend", "qwen2", "Qwen2Tokenizer"),  # transformers overrides the class such checkpoints name
    ("LlamaTokenizerFast", "llama", "LlamaTokenizer"),
])
def test_other_tokenizers_load_through_autotokenizer(tokenizer_class, model_type, autotokenizer_class, tmp_path):
    directory = checkpoint_like(checkpoint_dir(), tmp_path / "checkpoint", tokenizer_class, model_type)
    assert _load_plain(directory) is None
    assert type(ChatTemplate.load(str(directory)).tokenizer).__name__ == autotokenizer_class
    shipped = checkpoint_like(checkpoint_dir(), tmp_path / "remote", "TokenizersBackend", "llama")
    config = json.loads((shipped / "tokenizer_config.json").read_text())
    (shipped / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["x.Tok", None]}}))
    assert _load_plain(shipped) is None  # its own code (as Kimi-K2.5's): AutoTokenizer, with trust_remote_code


def test_plain_model_types_take_the_class_their_tokenizer_config_names():
    """AutoTokenizer takes tokenizer_config.json's class for a model type without a tokenizer class of its own
    and not on its list of hub classes it overrides: what the torch-free load assumes (checked against the
    installed transformers)."""
    from transformers.models.auto import tokenization_auto

    for model_type in filter(None, PLAIN_MODEL_TYPES):
        assert tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type) is None, model_type
        assert model_type not in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, model_type
    for name, loaded in PLAIN_CLASSES.items():
        assert tokenization_auto.tokenizer_class_from_name(name.removesuffix("Fast")).__name__ in (loaded, "PythonBackend")
