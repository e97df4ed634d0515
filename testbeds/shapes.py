"""Model shapes the benchmarks build from a config.json alone (SGLang's ``load_format=dummy``).

``KIMI_K25`` is Kimi-K2.5's published config.json (moonshotai/Kimi-K2.5): the
multimodal wrapper, a DeepSeek-V3 language model under ``text_config`` (61
layers, hidden 7168, MLA, 384 routed experts, top-8) whose routed experts are
INT4 (compressed-tensors ``pack-quantized``, groups of 32, symmetric; the
``ignore`` list keeps attention, shared experts, the dense MLP and lm_head in
bf16), and a MoonViT under ``vision_config`` (SGLang never hands the vision
tower the quantization config). ``kimi_k25_reduced`` keeps that layout, width,
attention and all 384 experts per layer (the routing and the INT4 MoE kernel's
work per token are the real model's) and cuts the depth to fit one H200.
"""

from __future__ import annotations

import copy
from typing import Any

LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "hidden_act": "silu",
}
# DeepSeek-V3 / Kimi-K2.5 width (7168, MLA, top-8 routing) at reduced depth and 64 experts, to fit one GPU.
DEEPSEEK_V3_REDUCED: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 4, "first_k_dense_replace": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 64, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "moe_layer_freq": 1, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "hidden_act": "silu", "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}

KIMI_K25_INT4_EXPERTS: dict[str, Any] = {
    "config_groups": {
        "group_0": {
            "input_activations": None, "output_activations": None, "targets": ["Linear"],
            "weights": {
                "actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
KIMI_K25: dict[str, Any] = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "auto_map": {
        "AutoConfig": "configuration_kimi_k25.KimiK25Config",
        "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    },
    "bos_token_id": 163584, "dtype": "bfloat16", "eos_token_id": 163585, "ignore_index": -100,
    "media_placeholder_token_id": 163605, "model_type": "kimi_k25", "pad_token_id": 163839,
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001, "bos_token_id": 163584, "dtype": "bfloat16", "eos_token_id": 163585, "ep_size": 1,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
        "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 262144,
        "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1,
        "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
        "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
        "pad_token_id": 163839, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "quantization_config": KIMI_K25_INT4_EXPERTS, "rms_norm_eps": 1e-05,
        "rope_parameters": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "rope_theta": 50000.0, "rope_type": "yarn", "type": "yarn",
        },
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "use_cache": True,
        "v_head_dim": 128, "vocab_size": 163840,
    },
    "tie_word_embeddings": False, "use_unified_vision_chunk": True,
    "video_placeholder": "<|kimi_k25_video_placeholder|>",
    "vision_config": {
        "init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64, "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool", "mm_hidden_size": 1152, "mm_projector_type": "patchmerger", "model_type": "",
        "patch_size": 14, "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
        "text_hidden_size": 7168, "video_attn_type": "spatial_temporal", "vt_hidden_size": 1152,
        "vt_intermediate_size": 4304, "vt_num_attention_heads": 16, "vt_num_hidden_layers": 27,
    },
}

# One H200 (141 GB): 1 dense + 9 MoE layers of 384 INT4 experts. Weights: embeddings + lm_head 4.7 GB,
# the dense layer 1.0 GB, each MoE layer 9.5 GB of INT4 experts (+ scales) + 0.3 GB bf16 attention and
# shared expert: ~94 GB, inside SGLang's mem_fraction_static 0.8 (113 GB) with room for the KV pool;
# a 16K-token batch needs a few GB of activations (MoE buffers ~1 GB, MLA prefill q/k/v ~1.2 GB).
KIMI_K25_REDUCED_LAYERS = 10


def kimi_k25_reduced() -> dict[str, Any]:
    config = copy.deepcopy(KIMI_K25)
    config["text_config"]["num_hidden_layers"] = KIMI_K25_REDUCED_LAYERS
    return config


SHAPES = {"llama8b": LLAMA_8B, "deepseek_v3_reduced": DEEPSEEK_V3_REDUCED, "kimi_k25_reduced": kimi_k25_reduced()}


def weight_bytes(config: dict[str, Any]) -> int:
    """Bytes of a shape's language-model weights as SGLang holds them: the embeddings, lm_head, attention and MLPs
    in the config's 16-bit dtype; routed experts packed where its quantization config says so (bits per weight
    plus one 16-bit scale per group). Norms, router gates and a vision tower (under 1% here) are left out."""
    text = config.get("text_config", config)
    hidden, layers, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    heads = text["num_attention_heads"]
    params = 2 * vocab * hidden  # embeddings and lm_head (untied in every shape here)
    if "kv_lora_rank" not in text:  # Llama: grouped-query attention, a gated MLP in every layer
        kv_width = text["num_key_value_heads"] * hidden // heads
        params += layers * (2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * text["intermediate_size"])
        return 2 * params
    qk_head = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]  # DeepSeek-V3: MLA, then dense or MoE MLPs
    q_lora, kv_lora = text["q_lora_rank"], text["kv_lora_rank"]
    attention = (hidden * q_lora + q_lora * heads * qk_head + hidden * (kv_lora + text["qk_rope_head_dim"])
                 + kv_lora * heads * (text["qk_nope_head_dim"] + text["v_head_dim"]) + heads * text["v_head_dim"] * hidden)
    dense, moe = text["first_k_dense_replace"], layers - text["first_k_dense_replace"]
    expert = 3 * hidden * text["moe_intermediate_size"]
    params += layers * attention + dense * 3 * hidden * text["intermediate_size"] + moe * text["n_shared_experts"] * expert
    quantized = text.get("quantization_config", {}).get("config_groups", {}).get("group_0", {}).get("weights")
    bytes_per_expert_weight = quantized["num_bits"] / 8 + 2 / quantized["group_size"] if quantized else 2
    return round(2 * params + moe * text["n_routed_experts"] * expert * bytes_per_expert_weight)
