"""The ``model`` and ``extract`` sections of the job config; each checks its own keys when built."""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any, Literal, Mapping, Optional

from common.checks import check_choice, check_int, check_number, is_int
from storage.schema import FINAL_STATES, ModelDtype, NonfiniteAction

CopyBy = Literal["copy_engine", "kernel"]

Device = Literal["auto", "cpu", "cuda"]
Engine = Literal["sglang", "synthetic"]
# extract.last_hidden_state=true/false, as OmegaConf hands a boolean to a str field: post_norm or none.
_BOOLEAN_FINAL_STATES = {"true": "post_norm", "false": "none"}


def serving_command(serving: Any) -> Optional[tuple[str, ...]]:
    """``model.serving`` as command-line words (``()``: none given); None for a mapping of ServerArgs fields.
    Raises ValueError for any other shape."""
    if serving is None or serving == "" or serving == [] or serving == {}:
        return ()
    if isinstance(serving, Mapping):
        return None
    if isinstance(serving, str):
        try:
            words = shlex.split(serving)
        except ValueError as error:
            raise ValueError(f"model.serving={serving!r}: cannot split it into words like a shell ({error})") from None
    elif isinstance(serving, (list, tuple)) and all(
            isinstance(word, (str, int, float)) and not isinstance(word, bool) for word in serving):
        words = [str(word) for word in serving]
    else:
        raise ValueError(
            f"model.serving={serving!r}: give the SGLang server's command line as one string "
            "('--quantization fp8 --tp-size 8'), a list of its words, or a mapping of ServerArgs fields "
            "({quantization: fp8, tp_size: 8})"
        )
    # A pasted command starts with its program (``python -m sglang.launch_server``, ``sglang serve``);
    # every ServerArgs flag is a long option.
    first_flag = next((index for index, word in enumerate(words) if word.startswith("--")), len(words))
    return tuple(words[first_flag:])


@dataclasses.dataclass
class SGLangModelConfig:
    """The ``model`` keys of every command that runs SGLang on a checkpoint (the extractor, jobs.prepare's
    regeneration), checked here once; each command's own ``model`` keys extend it."""

    path: str = ""
    """The checkpoint: a local HF checkpoint directory (for jobs.prepare, with its tokenizer and chat template), or a
    Hugging Face hub id (org/name; see download). Empty, with data.path empty too: the demo (a tiny random model)."""
    download: bool = True
    """A hub id as path: fetch what the local Hugging Face cache lacks of it first (huggingface_hub's download into
    HF_HUB_CACHE, once, on the machine the command runs on), then read it there; HF_HUB_OFFLINE=1 or false: the cache
    only, and an id not in it is refused with the command that downloads it. jobs.plan fetches its config.json only."""
    dtype: ModelDtype = "bfloat16"
    """SGLang's compute dtype, which jobs.extract also stores the states in: bfloat16 | float16 | float32."""
    device: Device = "auto"
    """auto | cpu | cuda. auto picks cuda when the Ray cluster has tp_size GPUs."""
    tp_size: int = 1
    """Tensor-parallel ranks of the SGLang engine, one process each; on GPU, this many GPUs of one node."""
    attention_backend: str = ""
    """SGLang attention backend; empty picks torch_native on CPU and flashinfer on CUDA."""
    mem_fraction_static: float = 0.8
    """Fraction of GPU memory SGLang may hold for weights + KV cache (GPU only)."""
    trust_remote_code: bool = False
    """Let loading run Python code shipped with the checkpoint (auto_map classes, pickled .bin weights, a tokenizer's
    own code as Kimi-K2.5's tiktoken tokenizer needs). Off: never."""
    serving: Any = None
    """The SGLang server's settings the states (jobs.prepare: the regenerated answers) must match (docs/serving.md):
    its command line as one string ('--quantization fp8 --kv-cache-dtype fp8_e4m3 --tp-size 8'; a leading `sglang
    serve` or `python -m sglang.launch_server` is dropped), a list of its words, or a mapping of ServerArgs fields
    ({quantization: fp8}). The installed SGLang parses it; what changes the numerics is applied and recorded with the
    output, the rest is left out and logged (ports, keys, logging, scheduling, the drafter). Its --dtype, --tp-size,
    --attention-backend, --device, --trust-remote-code (and jobs.extract's --context-length, --load-format) decide the
    model.* keys of the same name (a conflicting one is refused); without --dtype, SGLang's auto dtype for the
    checkpoint."""

    def __post_init__(self) -> None:
        serving_command(self.serving)
        check_choice("model.device", self.device, Device)
        check_choice("model.dtype", self.dtype, ModelDtype)
        check_int("model.tp_size", self.tp_size, 1, "one rank per GPU")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(
                f"model.mem_fraction_static={self.mem_fraction_static!r}: must be in (0, 1], the share of "
                "GPU memory SGLang may hold"
            )


@dataclasses.dataclass
class ModelConfig(SGLangModelConfig):
    """``jobs.extract``'s ``model`` section: the SGLang model keys and the extractor's own."""

    dp_size: int = 0
    """Data-parallel extractor groups, each tp_size GPUs of one node with its own writers there. 0: as many as
    the cluster holds (GPUs // tp_size per node on GPU; one per node on CPU)."""
    context_length: Optional[int] = None
    """Longest sample the runner accepts; default: the model's max_position_embeddings."""
    load_format: str = "auto"
    """SGLang load format; `dummy` builds random weights from config.json alone (benchmarks)."""
    engine: Engine = "sglang"
    """sglang | synthetic. synthetic runs no model: random states of the checkpoint's shape, copied from
    device memory like real ones, to measure what the pipeline (object store, writers, disk) carries."""
    synthetic_tokens_per_s: float = 0.0
    """With engine=synthetic: the rate the states are produced at; 0 = as fast as the host copy goes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("model.dp_size", self.dp_size, 0, "0: as many groups as the cluster holds")
        if self.context_length is not None and (not is_int(self.context_length) or self.context_length < 1):
            raise ValueError(
                f"model.context_length={self.context_length!r}: must be a positive token count, or unset "
                "for the model's max_position_embeddings"
            )
        if not self.load_format:
            raise ValueError("model.load_format is empty: use auto (or an SGLang load format such as dummy)")
        check_choice("model.engine", self.engine, Engine)
        check_number("model.synthetic_tokens_per_s", self.synthetic_tokens_per_s, 0, "0: unpaced")


@dataclasses.dataclass
class ExtractConfig:
    layers: Optional[list[int]] = None
    """Canonical ids (output of decoder layer k, 0-based): [2,30,58] or 2,30,58. Default [2, N//2, N-3]."""
    last_hidden_state: str = "pre_norm"
    """Also store a final hidden state per token: pre_norm (the residual stream entering the final norm; speculators'
    verifier state; SpecForge's export applies the final norm to it, so the run serves both trainers), post_norm
    (after the final norm, SGLang's own; serves SpecForge only) or none. true/false mean post_norm/none."""
    max_tokens_per_batch: int = 16384
    """Token budget of one packed EXTEND batch; a longer sample runs alone."""
    max_samples_per_batch: int = 256
    """Cap on requests in one batch (sizes SGLang's request pool)."""
    on_nonfinite: NonfiniteAction = "fail"
    """A sample whose states hold NaN/Inf (checked on the device, per layer): fail (its shard fails, naming the
    sample, shard and layer), skip (left out; listed in the manifest and .summary.json) or keep (written, flagged
    in the manifest)."""
    max_restarts: int = 3
    """Times in a row the extractor is started again after it dies (its process or a TP rank) with no batch extracted
    in between; beyond: exit 4, rerun resumes. A batch extracted starts the count anew: rare faults over a long run
    never add up."""
    max_attempts: int = 3
    """Tries per shard in one run when faults (a dead extractor or writer) cut it short (uploads: output.upload_attempts)."""
    copy_piece_mb: int = 4
    """GPU: copy a batch's states to the host in pieces of this many MB, each once the one before has landed, so
    that SGLang's small reads in the next forward wait for one piece, not the whole batch (0: the whole batch at once;
    on the H200, 4 MB: 0.968 of bare prefill where the whole batch gave 0.941, docs/benchmarks.md)."""
    copy_by: CopyBy = "copy_engine"
    """GPU: what moves a batch's states to the host: copy_engine (the GPU's DMA engine, in copy_piece_mb pieces) or
    kernel (a Triton kernel on 16 SMs storing into the pinned host buffer itself, the batch whole, leaving the copy
    engine to SGLang's own reads; copy_piece_mb unused; on the H100 bit-exact and no faster than 4 MB pieces: 0.979
    against 0.983 of bare prefill, docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.layers is not None and (
            not self.layers or not all(is_int(k) and k >= 0 for k in self.layers)
        ):
            raise ValueError(
                f"extract.layers={self.layers!r}: give canonical layer ids as a non-empty list of "
                "integers >= 0 like [2,30,58], or leave it unset for [2, N//2, N-3]"
            )
        check_int("extract.max_tokens_per_batch", self.max_tokens_per_batch, 1)
        check_int("extract.max_samples_per_batch", self.max_samples_per_batch, 1)
        check_choice("extract.on_nonfinite", self.on_nonfinite, NonfiniteAction, (
            "fail stops the shard at a NaN/Inf sample, skip leaves such samples out, keep writes them flagged"))
        check_int("extract.max_restarts", self.max_restarts, 0, "0: never restart")
        check_int("extract.max_attempts", self.max_attempts, 1)
        check_int("extract.copy_piece_mb", self.copy_piece_mb, 0, "0: the whole batch at once")
        check_choice("extract.copy_by", self.copy_by, CopyBy, (
            "copy_engine copies with the GPU's DMA engine, kernel with a kernel storing into the host buffer"))
        kind = _BOOLEAN_FINAL_STATES.get(str(self.last_hidden_state).lower(), self.last_hidden_state)
        if kind not in FINAL_STATES:
            raise ValueError(
                f"extract.last_hidden_state={self.last_hidden_state!r}: use one of {', '.join(FINAL_STATES)} "
                "(post_norm: after the model's final norm; pre_norm: the residual stream entering it)"
            )
        self.last_hidden_state = kind
