"""The EAGLE-3 drafter config a run hands to its trainer, and how SGLang reads one back.

SGLang serves an EAGLE-3 drafter of any target (Kimi-K2.5 included) as
``LlamaForCausalLMEagle3`` (models/llama_eagle3.py): one Llama decoder layer whose
``fc`` takes the concatenated aux states (``target_hidden_size`` x the number of
aux layer ids). Its server reads the aux layer ids from
``eagle_config.eagle_aux_hidden_state_layer_ids`` of the drafter's config.json and
passes them to the target's ``set_eagle3_layers_to_capture``
(model_runner_components/spec_aux_hidden_state.py, 0.5.17 and 0.5.23); without
them it captures its own default layers. vLLM reads a top-level
``eagle_aux_hidden_state_layer_ids`` instead and adds nothing to them.

Light: no SGLang import (``extractor.drafter_check`` asks SGLang).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

DRAFTER_ARCHITECTURE = "LlamaForCausalLMEagle3"
DRAFTER_LAYERS = 1
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
SOURCE_KEY = "eagle3_extract"


def build_drafter_config(
    text_config: dict[str, Any], drafter_layer_ids: Sequence[int], dtype: str, source: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """A complete SGLang EAGLE-3 drafter config for the target whose language model is ``text_config``.

    Sizes come from the target; attention follows it too (for MLA targets such as
    Kimi-K2.5 the drafter gets plain attention with the target's head count and
    value head size, as SpecForge's Kimi-K2.5 template has it). ``draft_vocab_size``
    must be present for SGLang to build the drafter; here it is the full vocabulary
    (a trainer that prunes the vocabulary lowers it). ``source`` (the target's
    architectures, layers, SGLang version) goes under ``SOURCE_KEY``, which SGLang
    and the trainers keep as an inert attribute.
    """
    hidden = int(text_config["hidden_size"])
    heads = int(text_config["num_attention_heads"])
    vocab = int(text_config["vocab_size"])
    rope = text_config.get("rope_parameters") or {}
    return {
        "architectures": [DRAFTER_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "num_hidden_layers": DRAFTER_LAYERS,
        "num_attention_heads": heads,
        "num_key_value_heads": int(text_config.get("num_key_value_heads") or heads),
        "head_dim": _head_dim(text_config, hidden, heads),
        "intermediate_size": int(text_config["intermediate_size"]),
        "hidden_act": text_config.get("hidden_act", "silu"),
        "rms_norm_eps": float(text_config.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(text_config["max_position_embeddings"]),
        "rope_theta": float(text_config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": vocab,
        "draft_vocab_size": vocab,
        "tie_word_embeddings": False,
        "bos_token_id": text_config.get("bos_token_id"),
        "eos_token_id": text_config.get("eos_token_id"),
        "dtype": dtype,
        "eagle_config": {IDS_KEY: list(drafter_layer_ids), "use_aux_hidden_state": True},
        **({SOURCE_KEY: source} if source else {}),
    }


def _head_dim(text_config: dict[str, Any], hidden: int, heads: int) -> int:
    """The drafter's head size: an MLA target's value head size (transformers saves such a config's ``head_dim`` as
    the rope part of a query head, ``qk_rope_head_dim``, so it is not read there), else the target's own."""
    if text_config.get("kv_lora_rank") and text_config.get("v_head_dim"):
        return int(text_config["v_head_dim"])
    return int(text_config.get("head_dim") or hidden // heads)


def sglang_reads(eagle_config: Any) -> tuple[bool, Optional[list[int]]]:
    """``(use_aux_hidden_state, ids)`` as SGLang's server resolves a drafter's ``eagle_config``;
    ids None = SGLang's default layers.

    The same steps as ``_resolve_eagle_aux_hidden_state`` (spec_aux_hidden_state.py):
    aux capture is on unless ``eagle_config.use_aux_hidden_state`` says otherwise,
    and any failure to read the nested key means "no ids".
    """
    use_aux = True
    try:
        use_aux = eagle_config.get("use_aux_hidden_state", True)  # type: ignore[union-attr]
        ids = eagle_config[IDS_KEY]  # type: ignore[index]
    except Exception:
        ids = None
    return bool(use_aux), (list(ids) if ids is not None else None)


def vllm_style_ids(drafter_config: dict[str, Any]) -> Optional[list[int]]:
    """The top-level ids vLLM reads (and SGLang ignores), if the config has them."""
    ids = drafter_config.get(IDS_KEY)
    return list(ids) if ids is not None else None
