"""Which final state each trainer reads, and the model's final RMSNorm applied at export, so that one run
with the pre-norm final state serves both trainers.

speculators reads the final state before the model's final norm, SpecForge after it. The norm cannot
be undone, but it can be applied: a pre-norm run (the default) gives SpecForge its post-norm state
through the checkpoint's own final norm, with SGLang's own arithmetic (``RMSNorm.forward_native``,
SGLang 0.5.17-0.5.23), one rounding to the model dtype at the end:

    x = state.float(); x = x * rsqrt(mean(x**2, -1) + eps); out = (x * weight).to(dtype)

Bit for bit in float32, at most a unit or two in the last place in bf16; only models whose final norm
is that plain RMSNorm (``PLAIN_RMSNORM``). Where the weight and eps come from, and the measured
difference: docs/training.md ("One run for both trainers"). Nothing here imports torch or safetensors
until a norm is loaded: ``jobs.plan`` asks what a run will serve.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

    from storage.schema import ShardMetadata

SPECFORGE = "specforge"
SPECULATORS = "speculators"
FORMATS = (SPECFORGE, SPECULATORS)

FINAL_STATE = {SPECFORGE: "post_norm", SPECULATORS: "pre_norm"}
"""The final state each trainer's files hold."""
_FINAL_STATE_USE = {
    SPECFORGE: "SpecForge trains against the final state after the model's final norm (its trainer applies "
               "only lm_head)",
    SPECULATORS: "speculators stores the verifier's final state before its final norm (its trainer applies "
                 "the norm, then lm_head)",
}
AS_STORED = "as stored"
PLAIN_RMSNORM = frozenset({"LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})
"""Language models (SGLang's class names) whose final norm is SGLang's plain ``RMSNorm`` (weight times the
normalised state, no offset), checked against SGLang 0.5.23's model files: llama.py, qwen3.py (through
qwen2.py), deepseek_v2.py."""
WEIGHT_NAMES = ("model.norm.weight", "language_model.model.norm.weight")
"""Where checkpoints keep the final norm's weight: a causal LM's, then a multimodal wrapper's language model's."""
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class FinalNormSource:
    """Where a checkpoint keeps its final norm: read without loading anything."""

    model_path: str
    weight_name: str
    weight_file: str
    eps: float

    def describe(self) -> str:
        return f"{self.weight_name} of {self.model_path}, eps {self.eps:g}"


class FinalNorm:
    """The final norm of one checkpoint, ready to apply to pre-norm states of the model dtype."""

    def __init__(self, source: FinalNormSource, dtype: "torch.dtype") -> None:
        """Reads the weight; a ValueError (before anything is written) when the file does not give it."""
        from safetensors import SafetensorError, safe_open

        self.source = source
        self.dtype = dtype
        try:
            with safe_open(source.weight_file, framework="pt") as weights:
                # As SGLang holds it: a parameter of the model dtype.
                self.weight = weights.get_tensor(source.weight_name).to(dtype)
        except (OSError, SafetensorError) as error:
            raise ValueError(
                f"cannot read the final norm's weight {source.weight_name} from {source.weight_file} ({error}); "
                "name a complete copy of the checkpoint with model_path=DIR"
            ) from None

    def __call__(self, states: "torch.Tensor") -> "torch.Tensor":
        """[T, H] pre-norm states of the model dtype -> the post-norm states SGLang computes from them."""
        import torch

        if states.dtype != self.dtype or states.shape[-1] != self.weight.shape[0]:
            raise ValueError(
                f"states of {tuple(states.shape)} {states.dtype}: the final norm of {self.source.model_path} takes "
                f"{self.dtype} states of hidden size {self.weight.shape[0]}"
            )
        x = states.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.source.eps)
        return (x * self.weight).to(self.dtype)


def find_final_norm(model_path: str, architecture: str) -> FinalNormSource:
    """The checkpoint's final norm (``architecture``: the language model's SGLang class), or a ValueError that
    says why it cannot be applied at export and what to extract instead."""
    if architecture not in PLAIN_RMSNORM:
        raise ValueError(
            f"the final norm of {architecture} is not one this export applies (it knows "
            f"{', '.join(sorted(PLAIN_RMSNORM))}); extract with extract.last_hidden_state=post_norm for SpecForge"
        )
    directory = Path(model_path)
    config_file = directory / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(
            f"cannot read the checkpoint's config.json ({error}): the final norm is applied with the checkpoint's "
            "own weight; name the checkpoint with model_path=DIR"
        ) from None
    eps = config.get("rms_norm_eps", (config.get("text_config") or {}).get("rms_norm_eps"))
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise ValueError(f"{config_file} has no rms_norm_eps (nor its text_config): not a checkpoint whose final "
                         "norm this export knows; extract with extract.last_hidden_state=post_norm for SpecForge")
    names = _weight_files(directory)
    name = next((candidate for candidate in WEIGHT_NAMES if candidate in names), None)
    if name is None:
        raise ValueError(
            f"{model_path} holds none of {', '.join(WEIGHT_NAMES)}: the final norm's weight is not where this "
            "export looks; extract with extract.last_hidden_state=post_norm for SpecForge"
        )
    return FinalNormSource(str(directory), name, str(directory / names[name]), float(eps))


def _weight_files(directory: Path) -> dict[str, str]:
    """Every weight name of the checkpoint and the file holding it: from its index, else from the files' headers."""
    index = directory / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} holds no *.safetensors: the final norm's weight is read from the checkpoint's "
                         "safetensors; name the checkpoint with model_path=DIR")
    names: dict[str, str] = {}
    for path in files:
        names.update(dict.fromkeys(_header_names(path), path.name))
    return names


def _header_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file, from its JSON header alone (no torch)."""
    with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
    return [name for name in header if name != "__metadata__"]


def final_norm_for(trainer: str, metadata: "ShardMetadata", run: str, model_path: str = "",
                   exact: bool = False) -> Optional[FinalNormSource]:
    """None when the run's final state is the one ``trainer`` reads; the final norm to apply when the run stored
    the pre-norm state and ``trainer`` reads the post-norm one (``model_path``: the checkpoint, default the run's);
    else a ValueError naming the setting to extract with."""
    stored, wanted = metadata.last_hidden_state, FINAL_STATE[trainer]
    if stored == wanted:
        return None
    if stored == "pre_norm" and not exact:
        try:
            return find_final_norm(model_path or metadata.model_path,
                                   metadata.language_model_architecture or metadata.model_architecture)
        except ValueError as error:
            raise ValueError(f"{run} stored the pre-norm final state, to which the model's final norm would be "
                             f"applied for {trainer}, but {error}") from None
    described = {"none": "no final state", "post_norm": "the post-norm final state",
                 "pre_norm": "the pre-norm final state"}[stored]
    if stored == "pre_norm":  # exact
        raise ValueError(
            f"exact=true but {run} stored {described}: {_FINAL_STATE_USE[trainer]}, which the export would compute "
            "by applying the final norm (in bfloat16 one step from SGLang's own in some values, not bit for bit). Drop "
            f"exact, or extract with extract.last_hidden_state={wanted} into a new output.dir"
        )
    raise ValueError(
        f"{run} stored {described} (extract.last_hidden_state={stored}); {_FINAL_STATE_USE[trainer]}. Rerun the "
        f"extraction with extract.last_hidden_state={FINAL_STATE[SPECULATORS]} (it serves both trainers) into a new "
        "output.dir"
    )


def served_exports(final_state: str, architecture: str, model_path: str) -> dict[str, str]:
    """Trainer -> how a run with this final state (of the checkpoint ``model_path``, whose language model is
    SGLang's ``architecture``) serves its export: ``as stored``, the final norm applied at export (found in the
    checkpoint), or ``no: <why>``."""
    if final_state == "none":
        return dict.fromkeys(FORMATS, "no: the run stores no final state (extract.last_hidden_state=none)")
    if final_state == "post_norm":
        return {SPECFORGE: AS_STORED, SPECULATORS: (
            "no: speculators reads the state before the final norm, which cannot be recovered from the post-norm "
            "state; extract.last_hidden_state=pre_norm serves both")}
    try:
        how = f"the final norm applied at export ({find_final_norm(model_path, architecture).describe()})"
    except ValueError as error:
        how = f"no: {error}"
    return {SPECFORGE: how, SPECULATORS: AS_STORED}
