"""The ``jobs.prepare`` config: dataclass defaults < YAML file (``--config``) < ``key=value`` overrides.

Built by ``jobs.config.build_config`` like the extraction job's: each section checks its own keys in
``__post_init__`` and a mistake is one ``ConfigError`` line (exit code 2) before anything is read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Literal

from common.checks import check_choice, check_int, check_number, check_seconds, is_int
from extractor.config import SGLangModelConfig
from inputs.config import OnInvalid
from runtime.cluster.config import RayConfig

ConversationFormat = Literal["auto", "sharegpt", "openai"]
OtherRoles = Literal["fail", "drop", "keep"]
"""What happens to a turn of another role (tool, function, ipython, observation, function_call):
the row is invalid (fail), the turn is left out (drop), or it is rendered, never in the loss mask (keep)."""
OnTooLong = Literal["truncate", "drop"]


@dataclasses.dataclass
class PrepareModelConfig(SGLangModelConfig):
    """``jobs.prepare``'s ``model`` section: the SGLang model keys (all but path, download and trust_remote_code serve
    regeneration only) and the chat's own."""

    chat_template: str = ""
    """A Jinja chat-template file to render with instead of the checkpoint's own (the file SGLang is given with
    --chat-template when it serves, if any). Empty: the tokenizer's template."""
    chat_template_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra variables for the chat template, as apply_chat_template's keyword arguments and SGLang's
    --chat-template-kwargs take them (e.g. {enable_thinking: false} for Qwen3's)."""
    stop_tokens: List[str] = dataclasses.field(default_factory=list)
    """Tokens that end an assistant turn: the loss mask ends with the first of them in each answer, and
    regeneration stops at them. Empty: the tokenizer's eos token and generation_config.json's eos_token_id."""
    cuda_graph: bool = True
    """Regeneration on CUDA: SGLang captures decode CUDA graphs (faster); false if capture fails on the stack."""
    max_total_tokens: int = 0
    """Regeneration: KV-cache tokens SGLang holds; 0: from mem_fraction_static on CUDA, 32768 on CPU."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("model.max_total_tokens", self.max_total_tokens, 0,
                  "0: from mem_fraction_static on CUDA, 32768 on CPU")
        if any(not token for token in self.stop_tokens):
            raise ValueError(f"model.stop_tokens={self.stop_tokens!r}: an empty token; name tokens like <|im_end|>")


@dataclasses.dataclass
class ConversationDataConfig:
    path: str = ""
    """Conversations: a .jsonl, .parquet or .arrow file, a directory or glob of them, an HF datasets
    save_to_disk directory, or an fsspec URL (s3://...)."""
    format: ConversationFormat = "auto"
    """auto | sharegpt (conversations: [{from, value}]) | openai (messages: [{role, content}]). auto: per file,
    from its columns (Parquet, Arrow) or its first record that has either field (JSONL)."""
    other_roles: OtherRoles = "fail"
    """Turns of another role (tool, function, ipython, observation, function_call; in any case): fail (the row is
    invalid), drop (the turn is left out) or keep (rendered under its role, never in the loss mask)."""
    on_invalid: OnInvalid = "fail"
    """A bad row (missing field, unknown role, empty turn, text not UTF-8, not ending with an assistant turn, not
    renderable): fail (stop, naming file, row and reason; exit 2) or skip (leave it out, listed in
    output.dir/_skipped_rows.jsonl)."""
    max_length: int = 0
    """Longest tokenized conversation kept; 0: the model's max_position_embeddings (what jobs.extract accepts)."""
    on_too_long: OnTooLong = "truncate"
    """A conversation longer than max_length: truncate (keep its first max_length tokens; dropped if no assistant
    token is left) or drop (leave it out, listed in _skipped_rows.jsonl)."""
    storage_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments for data.path's fsspec filesystem (e.g. client_kwargs for an S3 endpoint)."""

    def __post_init__(self) -> None:
        check_choice("data.format", self.format, ConversationFormat)
        check_choice("data.other_roles", self.other_roles, OtherRoles)
        check_choice("data.on_invalid", self.on_invalid, OnInvalid)
        check_int("data.max_length", self.max_length, 0, "a token count; 0: the model's max_position_embeddings")
        check_choice("data.on_too_long", self.on_too_long, OnTooLong)


@dataclasses.dataclass
class PrepareOutputConfig:
    dir: str = ""
    """Directory the tokenized Parquet parts go to (give it to jobs.extract as data.path), with _prepare.json.
    Empty in the demo: demo.dir/tokens."""
    shard_size: int = 5000
    """Conversations per part file; also the unit regeneration resumes by."""

    def __post_init__(self) -> None:
        check_int("output.shard_size", self.shard_size, 1, "conversations per part")


@dataclasses.dataclass
class GenerationConfig:
    max_new_tokens: int = 1024
    """Longest regenerated answer, in tokens (less where the prompt leaves less of the context)."""
    temperature: float = 0.0
    """0: greedy. Above 0: sampled."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1: off)."""
    top_k: int = -1
    """Sample among the k likeliest tokens (-1: off)."""
    seed: int = 0
    """SGLang's random seed. Sampled answers also depend on which requests the engine batches together,
    which follows the answers' timing: a rerun samples others (greedy answers do not change)."""

    def __post_init__(self) -> None:
        check_int("generation.max_new_tokens", self.max_new_tokens, 1)
        check_number("generation.temperature", self.temperature, 0, "0: greedy")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"generation.top_p={self.top_p!r}: must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"generation.top_k={self.top_k!r}: must be -1 (off) or an integer >= 1")
        check_int("generation.seed", self.seed, 0)

    def sampling_params(self) -> dict[str, Any]:
        """SGLang's sampling params for one answer (without its max_new_tokens and stop tokens)."""
        return {"temperature": float(self.temperature), "top_p": float(self.top_p), "top_k": self.top_k}


@dataclasses.dataclass
class PrepareProgressConfig:
    interval_s: float = 10.0
    """Without a terminal, a progress line (conversations, rate, ETA) this often, and before the first pass the
    stage (also at each new stage); with one, a live line with the stage, then a tqdm bar."""

    def __post_init__(self) -> None:
        check_seconds("progress.interval_s", self.interval_s, positive=True)


@dataclasses.dataclass
class PrepareDemoConfig:
    dir: str = "eagle3-demo"
    """With model.path and data.path empty: where the demo writes its tiny chat model and conversations."""
    num_conversations: int = 48
    """Conversations the demo writes."""

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("demo.dir is empty: name the directory the demo builds its model and data in")
        check_int("demo.num_conversations", self.num_conversations, 1)


@dataclasses.dataclass
class PrepareConfig:
    model: PrepareModelConfig = dataclasses.field(default_factory=PrepareModelConfig)
    data: ConversationDataConfig = dataclasses.field(default_factory=ConversationDataConfig)
    output: PrepareOutputConfig = dataclasses.field(default_factory=PrepareOutputConfig)
    workers: int = 0
    """Processes that render and tokenize shards at once; 0: one per CPU this process may use (at most 16, and
    one per 20,000 conversations), never more than there are shards. 1: in this process."""
    regenerate: bool = False
    """The target answers every prompt again through SGLang (generation.*), and those answers are tokenized:
    the drafter learns the target's own distribution. Resumable per shard (output.shard_size)."""
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    progress: PrepareProgressConfig = dataclasses.field(default_factory=PrepareProgressConfig)
    demo: PrepareDemoConfig = dataclasses.field(default_factory=PrepareDemoConfig)

    def __post_init__(self) -> None:
        if bool(self.model.path) != bool(self.data.path):
            raise ValueError(
                "set both model.path (the checkpoint with the tokenizer) and data.path (the conversations), "
                "or neither for the demo"
            )
        check_int("workers", self.workers, 0, "0: one per CPU")
        if not self.is_demo and not self.output.dir:
            raise ValueError("output.dir is empty: name the directory the tokenized Parquet goes to")

    @property
    def is_demo(self) -> bool:
        return not self.model.path and not self.data.path
