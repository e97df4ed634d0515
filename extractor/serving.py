"""The SGLang server's own settings as the extractor's input (``model.serving``).

A drafter is served beside a target whose numerics the server's settings decide (quantization,
kv-cache dtype, backends, the TP/EP layout...). ``parse_serving`` reads the server's command with the
installed SGLang's own parser, so a flag is known, refused or defaulted exactly as ``sglang serve``
would; every field it sets to other than SGLang's default is then applied (the default, so that a
difference is reported, never hidden), a ``model.*`` key (``MODEL_FIELDS``), set by the extractor
(``EXTRACTOR_FIELDS``), the drafter's (``speculative_*``) or left out (``LEFT_OUT``): docs/serving.md.

Importing this module loads no SGLang: the driver imports it, and ``parse_serving`` imports SGLang's
argument parser (``ServingParser``; where the releases differ: ``extractor.sglang_compat``) when called.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import importlib.metadata
import io
import itertools
import json
import logging
import os
import re
import shlex
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from extractor.checkpoint import read_config, text_config
from extractor.config import serving_command
from extractor.sglang_compat import config_merger, quiet_import_noise, server_args_fields

logger = logging.getLogger(__name__)

MODEL_FIELDS = ("dtype", "tp_size", "attention_backend", "context_length", "load_format", "trust_remote_code", "device")
"""ServerArgs fields that are also ``model.*`` keys of the same name and meaning: the serving command's value wins."""

DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""SGLang's --dtype spellings of the extractor's dtypes."""

EXTRACTOR_FIELDS = {
    "model_path": "model.path names the checkpoint on this machine",
    "skip_tokenizer_init": "the extractor reads token ids, it loads no tokenizer",
    "disable_cuda_graph": "batches of whole samples vary in shape and run eagerly, as a server's prefill does",
    "disable_radix_cache": "nothing is cached between batches: every sample is computed from its first token",
    "chunked_prefill_size": "each batch is one forward over whole samples, never split into chunks",
    "max_total_tokens": "the KV pool holds the largest batch (extract.max_tokens_per_batch)",
    "max_running_requests": "the request pool holds extract.max_samples_per_batch samples",
    "mem_fraction_static": "model.mem_fraction_static sizes the extractor's memory",
    "nccl_port": "the extractor's ranks meet on a loopback port of their own",
    "host": "the extractor serves nothing",
    "enable_return_aux_hidden_states": "the extractor's capture mode",
    "return_aux_hidden_state_layer_ids": "the extractor's capture mode (extract.layers)",
    "speculative_algorithm": "the extractor's capture mode (SGLang 0.5.23 captures through its EAGLE-3 hooks)",
}
"""What the extractor sets in its own ServerArgs, and why a serving value gives way (``runner_server_args``)."""


@dataclasses.dataclass(frozen=True)
class Category:
    name: str
    reason: str
    pattern: str
    """Regular expression that matches whole field names."""


DRAFTER = Category(
    "the drafter", "speculative decoding: the drafter the server runs beside the target and how it drafts, not "
    "the target's forward (jobs.check_serving checks the drafter against the run)",
    r"speculative_.*|spec_.*|enable_multi_layer_eagle|decoupled_spec_.*",
)

PLACEMENT = Category(
    "placement", "replicas and pipeline stages: a data-parallel replica runs the whole model as one TP group "
    "(model.dp_size says how many groups the extractor runs), a pipeline stage runs whole layers; neither changes "
    "what a layer computes (with --enable-dp-attention, --dp-size changes the attention layout and is applied)",
    r"dp_size|pp_.*",
)

LEFT_OUT = (
    Category("network", "where the server listens and how its processes and nodes find each other",
             r"host|port|.*_port|.*_ports|dist_init_addr|dist_timeout|nnodes|node_rank|.*_urls?|.*_endpoints?|"
             r"ssl_.*|enable_ssl_refresh|enable_http2|http2_.*|enable_http_worker_reuseport|grpc_.*|smg_.*|"
             r"fastapi_root_path|sidecar.*|use_ray|.*_ib_device"),
    Category("access", "API keys and what requests may carry", r".*api_key|allowed_media_domains|trust_request_.*"),
    Category("observability", "logging, metrics, tracing, profiling and debug dumps: what the server reports",
             r"log_.*|.*_log_.*|.*_logging|.*_loggers?|.*metric.*|.*trace.*|otlp_.*|.*_buckets|show_time_cost|"
             r"crash_dump_folder|debug_tensor_dump_.*|enable_profile_.*|.*nvtx.*|kv_events_config|"
             r"gc_warning_threshold_secs|.*_report.*|collect_tokens_histogram|bucket_.*|kv_canary.*|.*dump.*|.*publish.*|"
             r"expert_distribution_.*"),
    Category("text in and out", "tokenizer, chat templates, reasoning and tool-call parsers, constrained "
             "decoding, streaming and response fields: the extractor reads the token ids jobs.prepare wrote",
             r".*tokenizer.*|.*chat_template.*|completion_template|reasoning_parser|tool_call_parser|tool_server|"
             r".*thinking.*|stream_.*|incremental_streaming_output|constrained_json_.*|grammar_backend|"
             r"disable_outlines_disk_cache|served_model_name|weight_version|return_input_ids|return_output_ids|"
             r"file_storage_path|enable_response_store|enable_streaming_session|batch_notify_size|asr_.*|"
             r"enable_return_.*|return_.*|allow_auto_truncate"),
    Category("sampling", "how the next token is drawn from the logits; the states come before the logits",
             r".*sampling.*|.*watermark.*|enable_custom_logit_processor"),
    Category("scheduling and memory", "which requests share a forward, in what order, when, and how much memory "
             "the pools and caches take: the extractor packs its own batches of whole samples and caches nothing "
             "between them",
             r"schedule_.*|.*priority.*|max_running_requests|max_total_tokens|max_prefill_tokens|"
             r"max_queued_requests|prefill_max_requests|mem_fraction_static|chunked_prefill_size|"
             r"enable_dynamic_chunking|enable_mixed_chunk|.*prefill_delayer.*|min_free_slots_delay|"
             r"num_continuous_decode_steps|prefill_decode_interval.*|scheduler_recv_interval|retraction_policy|"
             r"load_balance_method|.*radix.*|.*hicache.*|enable_hierarchical_cache|.*lmcache.*|.*flexkv.*|"
             r"swa_full_tokens_ratio|mamba_full_memory_ratio|max_mamba_cache_size|disable_overlap_schedule|"
             r"_.*_explicitly_set|cpu_offload_gb|offload_.*|enable_memory_saver|.*weights_cpu_backup|"
             r"num_reserved_decode_tokens|optimistic_prefill_attempts"),
    Category("graph capture", "CUDA-graph and torch.compile capture of fixed-shape batches (the server's decode "
             "steps): the extractor's batches run eagerly, as a server's prefill does",
             r".*cuda_graph.*|enable_cudagraph_gc|.*torch_compile.*"),
    Category("deployment", "prefill/decode and encoder disaggregation, multiplexing: which server runs which part; "
             "the language model's forward is the same",
             r"disaggregation_.*|.*pdmux.*|enable_pd_role_switch|encoder_.*|.*_to_encoder|language_only|"
             r"language_model_only"),
    Category("process", "watchdogs, timeouts, garbage collection, GPU numbering, NUMA binding, warm-up requests and "
             "how weights are read from disk: how the process runs, not what it computes",
             r".*watchdog.*|.*_timeout|.*_timeout_secs|gc_threshold|base_gpu_id|gpu_id_step|numa_node|"
             r"custom_sigquit_handler|sleep_on_idle|skip_server_warmup|warmups|download_dir|"
             r"weight_loader_(disable_mmap|drop_cache_after_load|prefetch_.*)|delete_ckpt_after_loading|"
             r"checkpoint_engine_wait_weights_before_ready|enable_p2p_check|pre_warm_nccl|model_checksum|"
             r"remote_instance_weight_loader_.*|weight_cache_.*|startup_weight_load_mode|modelexpress_config"),
    Category("multimodal inputs", "media fetching and image, audio and video processing: the extractor's samples "
             "are text tokens", r"mm_.*|.*_mm_.*|image_processor_backend|media_.*|disable_fast_image_processor"),
    Category("LoRA adapters", "adapters a request may name; the extractor's requests name none, so the base model "
             "runs (merge an adapter into the checkpoint to extract its states)", r".*lora.*"),
)
"""Categories of ServerArgs fields that never enter the target's forward over a batch of token ids.

Narrow on purpose: a field they do not match is applied (and recorded), so a
field a later SGLang adds is reported as a difference rather than hidden."""


def classify(field: str, given: Mapping[str, Any]) -> tuple[str, str]:
    """(kind, why) of a ServerArgs field the command ``given`` sets: applied | model | drafter | extractor | left out."""
    if field in MODEL_FIELDS:
        return "model", f"model.{field}"
    if re.fullmatch(DRAFTER.pattern, field):
        return "drafter", f"{DRAFTER.name}: {DRAFTER.reason}"
    if field in EXTRACTOR_FIELDS:
        return "extractor", EXTRACTOR_FIELDS[field]
    if re.fullmatch(PLACEMENT.pattern, field) and not (field == "dp_size" and given.get("enable_dp_attention")):
        return "left out", f"{PLACEMENT.name}: {PLACEMENT.reason}"
    for category in LEFT_OUT:
        if re.fullmatch(category.pattern, field):
            return "left out", f"{category.name}: {category.reason}"
    return "applied", ""


@dataclasses.dataclass(frozen=True)
class ServingSettings:
    """A serving command as the installed SGLang parses it, sorted by what the extractor does with each field."""

    words: tuple[str, ...]
    """The command's flags and values, as parsed (a leading program such as ``sglang serve`` dropped)."""
    sglang_version: str
    given: dict[str, Any]
    """Every ServerArgs field the command sets to other than SGLang's default (JSON values)."""
    flags: dict[str, str]
    """The flag that sets each given field (``--kv-cache-dtype`` for kv_cache_dtype), for messages."""
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    """SGLang's default of every ServerArgs field with a flag: what a server runs where the command says nothing."""
    ignored: dict[str, str] = dataclasses.field(default_factory=dict)
    """Flags SGLang's parser takes but its ServerArgs has no field for (SGLang ignores them too) -> why."""

    def value(self, field: str) -> Any:
        """What the server runs with: the command's value, else SGLang's default."""
        return self.given[field] if field in self.given else self.defaults.get(field)

    def of_kind(self, kind: str) -> dict[str, Any]:
        return {field: value for field, value in self.given.items() if classify(field, self.given)[0] == kind}

    @property
    def applied(self) -> dict[str, Any]:
        """What the extractor passes to its ServerArgs beyond the ``model.*`` keys: the run's ``model.serving`` content."""
        return dict(sorted(self.of_kind("applied").items()))

    def server_args_for(self, model: Any) -> dict[str, Any]:
        """What an engine built from ``model`` (a config with some of ``MODEL_FIELDS``) is given beyond its own keys:
        the applied fields, and the model fields it has no key for (jobs.prepare's engine takes no context_length)."""
        missing = {field: value for field, value in self.of_kind("model").items() if not hasattr(model, field)}
        return dict(sorted({**self.applied, **missing}.items()))

    def describe(self) -> list[str]:
        """Log lines: what is applied, what the model keys take, what gives way and what is left out, with why."""
        lines = [f"serving settings (SGLang {self.sglang_version}): applied: {self.shown(self.applied) or 'none'}"]
        if self.of_kind("model"):
            lines.append(f"serving settings for model.* keys: {self.shown(self.of_kind('model'))}")
        groups: dict[str, list[str]] = {}
        for field, value in self.given.items():
            kind, why = classify(field, self.given)
            if kind == "extractor":
                groups.setdefault(f"set by the extractor instead ({why})", []).append(self.shown({field: value}))
            elif kind == "drafter":
                groups.setdefault(f"left out ({why})", []).append(self.shown({field: value}))
            elif kind == "left out":  # the values stay out of the log: API keys and passwords are among them
                groups.setdefault(f"left out ({why})", []).append(self.flag(field))
        lines += [f"{why}: {' '.join(flags)}" for why, flags in groups.items()]
        lines += [f"ignored: {flag} ({why})" for flag, why in self.ignored.items()]
        return lines

    def shown(self, fields: Mapping[str, Any]) -> str:
        """``--flag value`` for each field, as a command line would say it."""
        return " ".join(self.flag(field) if value is True else f"{self.flag(field)} {_shown(value)}"
                        for field, value in fields.items())

    def flag(self, field: str) -> str:
        return self.flags.get(field) or "--" + field.replace("_", "-")


def _shown(value: Any) -> str:
    return shlex.quote(value) if isinstance(value, str) else json.dumps(value)


def parse_serving(serving: Any) -> Optional[ServingSettings]:
    """``model.serving`` parsed by the installed SGLang (None when empty); ValueError names what SGLang refuses."""
    words = serving_command(serving)
    if words == ():
        return None
    refuse_unknown_flags(serving)
    return _parse_cached(words if words is not None else json.dumps(dict(serving), sort_keys=True))


def known_flags_file(version: str) -> Path:
    """Where the flags of SGLang ``version``'s ``sglang serve`` parser are kept once it has been built."""
    cache = Path(os.environ.get("EAGLE3_CACHE_DIR") or Path.home() / ".cache" / "eagle3-extract")
    return cache / "serving-flags" / f"sglang-{version}.json"


def refuse_unknown_flags(serving: Any) -> None:
    """A flag of the serving command that the installed SGLang's parser has none of, refused as that parser refuses it
    but without importing SGLang (seconds), from the flags it had when it was last built here. Nothing is
    refused before the parser has been built once, nor a flag that begins one of its flags (argparse takes
    abbreviations), nor a command with --config (the file's options join it)."""
    words = serving_command(serving)
    if not words or "--config" in words:
        return
    try:
        version = importlib.metadata.version("sglang")
        known = set(json.loads(known_flags_file(version).read_text()))
    except (importlib.metadata.PackageNotFoundError, OSError, ValueError):
        return
    for index, word in enumerate(words):
        flag = word.split("=", 1)[0]
        if word.startswith("--") and not any(option.startswith(flag) for option in known):
            values = list(itertools.takewhile(lambda later: not later.startswith("-"), words[index + 1:]))
            close = difflib.get_close_matches(flag, sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"model.serving: SGLang {version} refuses the serving command: unrecognized arguments: "
                             f"{' '.join([word, *values])}{hint}")


@functools.lru_cache(maxsize=8)
def _parse_cached(command: tuple[str, ...] | str) -> ServingSettings:
    """Parsed once per process: the driver, the dry run and the regeneration all ask."""
    parser = ServingParser()
    return parser.parse(parser.words_of(json.loads(command)) if isinstance(command, str) else command)


def resolved_dtype(settings: Optional[ServingSettings], checkpoint_config: Mapping[str, Any]) -> Optional[str]:
    """The dtype the server computes in: its --dtype, or what SGLang's ``auto`` picks for this checkpoint."""
    if settings is None:
        return None
    dtype = str(settings.given.get("dtype", "auto")).lower()
    if dtype == "auto":
        return auto_dtype(checkpoint_config)
    return DTYPE_ALIASES.get(dtype, dtype)


def serving_model_values(settings: Optional[ServingSettings], checkpoint_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model.*`` keys the serving command decides: those it sets, and the dtype it computes in."""
    if settings is None:
        return {}
    values = settings.of_kind("model")
    values["dtype"] = resolved_dtype(settings, checkpoint_config)
    return values


def effective_model(model: Any, settings: Optional[ServingSettings], checkpoint_config: Mapping[str, Any]) -> Any:
    """``model`` (a config dataclass with some of ``MODEL_FIELDS``) with the serving command's values.

    A key still at its default takes the serving value; one set to another value is refused, naming both.
    """
    values = serving_model_values(settings, checkpoint_config)
    defaults = {field.name: field.default for field in dataclasses.fields(model)}
    changes = {}
    for key, value in values.items():
        if key not in defaults:
            continue
        current = getattr(model, key)
        if current == value:
            continue
        if current != defaults[key]:
            said = f"{settings.flag(key)} {_shown(value)}" if key in settings.given else (
                f"{value} (no --dtype: SGLang's auto picks the checkpoint's dtype)")
            raise ValueError(
                f"model.{key}={current!r}, but the serving command (model.serving) runs {said}: the serving "
                f"command decides it; drop model.{key} or make the two agree"
            )
        changes[key] = value
    if not changes:
        return model
    try:
        return dataclasses.replace(model, **changes)
    except ValueError as error:
        raise ValueError(f"model.serving: {error}") from None


def with_serving(model: Any) -> tuple[Any, Optional[ServingSettings]]:
    """``model`` (a config dataclass with ``serving`` and ``path``) with its serving command's values in its keys
    (``effective_model`` against the checkpoint's config), and the command as the installed SGLang parsed it (None,
    and ``model`` as it is, when there is none)."""
    serving = parse_serving(model.serving)
    if serving is None:
        return model, None
    return effective_model(model, serving, text_config(read_config(model.path))), serving


def runner_server_args(spec: Any, nccl_port: int, capture_only: bool) -> dict[str, Any]:
    """The ServerArgs the extractor's ModelRunner is built with: the serving command's applied fields, then its
    own (``EXTRACTOR_FIELDS`` and the model keys) on top. ``spec`` is an ``extractor.types.EngineSpec``."""
    own: dict[str, Any] = dict(
        model_path=spec.model_path,
        device=spec.device,
        dtype=spec.dtype,
        tp_size=spec.tp_size,
        attention_backend=spec.attention_backend or None,  # None: SGLang's own choice
        load_format=spec.load_format,
        trust_remote_code=spec.trust_remote_code,
        context_length=spec.context_length,
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        disable_radix_cache=True,
        chunked_prefill_size=-1,
        max_total_tokens=spec.max_tokens_per_batch,
        max_running_requests=spec.max_samples_per_batch,
        mem_fraction_static=spec.mem_fraction_static,
        nccl_port=nccl_port,
        host="127.0.0.1",
    )
    if spec.device == "cpu":
        own["disable_custom_all_reduce"] = True  # there is none on CPU (the serving value is kept on GPU)
    if capture_only:
        # 0.5.23: EAGLE-3 capture hooks on, no drafter loaded, and the logits processor
        # keeps the post-norm final state of every token (LogitsProcessorOutput.last_hidden_states).
        own.update(enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                   return_aux_hidden_state_layer_ids=None)
    return {**dict(spec.server_args), **own}


class _RefusingParser(argparse.ArgumentParser):
    """argparse's complaints as ValueError, never its SystemExit or its usage text."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise ValueError((message or "").strip() or f"SGLang's argument parser exited with status {status}")


class ServingParser:
    """The installed SGLang's own ``sglang serve`` parser (``ServerArgs.add_cli_args``), for ``model.serving``.

    Both releases register every ServerArgs flag there; 0.5.23's ServerArgs is a record of
    namespaced fields (``arg_groups.arg_utils.record_fields``), 0.5.17's a dataclass. No flag is
    required here (the extractor names the model itself), and ``--help`` is an unknown flag.
    """

    def __init__(self) -> None:
        quiet_import_noise()
        import sglang
        from sglang.srt.server_args import ServerArgs

        self.version = sglang.__version__
        self._parser = _RefusingParser(prog="sglang serve", add_help=False)
        ServerArgs.add_cli_args(self._parser)
        self._actions = [action for action in self._parser._actions if action.option_strings]
        for action in self._actions:
            action.required = False
        self._fields = set(server_args_fields(ServerArgs))
        self._defaults = vars(self._parser.parse_args([]))
        self._keep_flags()

    def _keep_flags(self) -> None:
        """The parser's flags, kept for ``refuse_unknown_flags`` (a later check without SGLang)."""
        from storage.atomic import replace_atomically

        flags = sorted(option for action in self._actions for option in action.option_strings)
        path = known_flags_file(self.version)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            replace_atomically(path, json.dumps(flags), temp_suffix=f".{os.getpid()}.tmp")
        except OSError as error:  # a read-only home costs only the early check
            logger.debug("could not keep SGLang's flags in %s: %s", path, error)

    def words_of(self, fields: Mapping[str, Any]) -> tuple[str, ...]:
        """A mapping of ServerArgs fields as the command-line words that set them."""
        words: list[str] = []
        for name, value in fields.items():
            action = self._action(name)
            flag = _long_flag(action)
            if action.nargs == 0:  # store_true, store_false, store_const
                if value == action.const:
                    words.append(flag)
                elif value != action.default:
                    raise ValueError(f"model.serving: {name}={value!r}: {flag} takes no value; give true or false")
            elif isinstance(value, (list, tuple)) and action.nargs not in (None, "?"):
                words += [flag, *(_word(item) for item in value)]
            else:
                words += [flag, _word(value)]
        return tuple(words)

    def _action(self, name: str) -> argparse.Action:
        for action in self._actions:
            if action.dest == name:
                return action
        if name in self._fields:
            raise ValueError(f"model.serving: {name} has no command-line flag in SGLang {self.version}; the "
                             "extractor takes what `sglang serve` takes")
        close = difflib.get_close_matches(name, sorted(self._fields), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"model.serving: {name} is not a ServerArgs field of SGLang {self.version}{hint}")

    def parse(self, words: Sequence[str]) -> ServingSettings:
        """The command as ``sglang serve`` reads it; ValueError with SGLang's own complaint, naming the flag."""
        words = list(words)
        said = io.StringIO()
        try:
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                if "--config" in words:  # as SGLang's prepare_server_args: the file's options join the words
                    words = config_merger()(self._parser).merge_config_with_args(words)
                namespace = self._parser.parse_args(words)
        except ValueError as error:
            raise ValueError(f"model.serving: SGLang {self.version} refuses the serving command: {error}") from None
        except (OSError, SystemExit) as error:
            said_lines = " ".join(filter(None, map(_plain_text, said.getvalue().splitlines())))
            raise ValueError(f"model.serving: SGLang {self.version} cannot read the serving command: "
                             f"{said_lines or error}") from None
        for line in filter(None, (_plain_text(line) for line in said.getvalue().splitlines())):
            logger.warning("SGLang %s on the serving command: %s", self.version, line)
        given, flags, ignored = {}, {}, {}
        for name, value in vars(namespace).items():
            if value == self._defaults.get(name):
                continue
            flag = _long_flag(next(action for action in self._actions if action.dest == name))
            if name not in self._fields:
                if name != "config":
                    ignored[flag] = f"SGLang {self.version} parses it but has no ServerArgs field for it"
                continue
            if not _is_json(value):
                raise ValueError(f"model.serving: {flag} {value!r} cannot be recorded as JSON")
            given[name], flags[name] = json.loads(json.dumps(value)), flag
        defaults = {name: value for name, value in self._defaults.items() if name in self._fields and _is_json(value)}
        return ServingSettings(tuple(words), self.version, given, flags, defaults, ignored)


def _long_flag(action: argparse.Action) -> str:
    return next((option for option in action.option_strings if option.startswith("--")), action.option_strings[0])


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _word(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _plain_text(line: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", line).strip()


def auto_dtype(checkpoint_config: Mapping[str, Any]) -> str:
    """What ``--dtype auto`` computes in for a checkpoint (its text config), by SGLang's own rule."""
    quiet_import_noise()
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    return str(_get_and_verify_dtype(dict(checkpoint_config), "auto")).removeprefix("torch.")
