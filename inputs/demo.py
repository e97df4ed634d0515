"""The embedded demo: a tiny random-weight checkpoint and a synthetic tokenized dataset.

Both are made locally (transformers ``save_pretrained``, fixed seed,
safetensors), so the job runs end to end on a machine with no model hub.
The tests build their models with the same functions.

``kimi_k25`` is Kimi-K2.5's published layout at toy size: a
``KimiK25ForConditionalGeneration`` config.json with the DeepSeek-V3 language
model under ``text_config`` and a MoonViT under ``vision_config``, the language
model's tensors under ``language_model.``, and a random vision tower and
projector. Transformers has no class for it, so config.json and the
safetensors are written here directly.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.checks import choices
from inputs.config import DemoArch
from inputs.demo_chat import DEMO_VOCAB_SIZE, build_chat_tokenizer

logger = logging.getLogger(__name__)


# Kimi-K2.5's MoonViT (27 blocks of width 1152 as released) at toy size. The released config.json
# carries only the vt_* names (the projector reads them); SGLang's MoonViT reads the plain names and
# falls back to the released shape's defaults, so a smaller tower needs both.
TINY_MOONVIT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
TINY_POS_EMB = 4  # init_pos_emb_height and _width (64 as released)
KIMI_PATCH_SIZE = 14
KIMI_MERGE_KERNEL = (2, 2)


def _tiny_config(arch: str, num_layers: int, hidden_size: int, dtype: str, q_lora_rank: int | None):
    import transformers

    common = dict(
        vocab_size=DEMO_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=hidden_size // 4, **common)
    if arch in ("deepseek_v3", "kimi_k25"):  # kimi_k25: its language model
        return transformers.DeepseekV3Config(
            **_deepseek_v3_shape(q_lora_rank), **{**common, "num_key_value_heads": 4, "max_position_embeddings": 131072}
        )
    raise ValueError(f"demo.arch={arch!r}: use one of {', '.join(choices(DemoArch))}")


def _deepseek_v3_shape(q_lora_rank: int | None) -> dict:
    """Kimi-K2.5's architecture at toy width: MLA, MoE with a shared expert, a first dense layer."""
    return dict(
        moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        routed_scaling_factor=2.5, n_group=2, topk_group=1, norm_topk_prob=True, first_k_dense_replace=1,
        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        rope_interleave=True, rms_norm_eps=1e-6,
        # SGLang's DeepSeek rope is yarn-only (its CPU rope builder asserts deepseek_yarn); real
        # DeepSeek-V3 and Kimi configs carry such a section.
        rope_parameters=dict(
            rope_type="yarn", rope_theta=50000.0, factor=32.0, original_max_position_embeddings=4096,
            beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        ),
        # Read by SGLang, not by HF (which hard-codes sigmoid scoring and noaux_tc).
        scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
    )


def _randomize_constant_inits(model, generator) -> None:
    """Norm weights init to 1 and the router bias to 0; make them random so that tests
    comparing engines notice a missing or misplaced one."""
    import torch

    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "e_score_correction_bias" in name:
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))


def build_tiny_model(
    directory: str | Path, arch: str = "llama", num_layers: int = 8, hidden_size: int = 64,
    dtype: str = "float32", seed: int = 0, q_lora_rank: int | None = 32,
) -> Path:
    """Save a random-weight checkpoint of ``arch`` (fixed seed) and return its directory.

    ``q_lora_rank`` applies to deepseek_v3 and kimi_k25 (None: full-rank query projection).
    ``kimi_k25`` holds the very tensors ``deepseek_v3`` saves with the same arguments.
    """
    import torch
    import transformers

    directory = Path(directory)
    if arch == "kimi_k25":
        with tempfile.TemporaryDirectory(prefix="kimi-k25-language-model-") as language_model:
            build_tiny_model(language_model, "deepseek_v3", num_layers, hidden_size, dtype, seed, q_lora_rank)
            return wrap_in_kimi_k25(language_model, directory, seed)
    config = _tiny_config(arch, num_layers, hidden_size, dtype, q_lora_rank)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    _randomize_constant_inits(model, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def wrap_in_kimi_k25(language_model: str | Path, directory: str | Path, seed: int = 0) -> Path:
    """Save the DeepSeek-V3 checkpoint ``language_model`` inside Kimi-K2.5's published layout.

    Weight names are the released checkpoint's: ``language_model.`` + the bare
    model's names, ``vision_tower.encoder.blocks.N.{wqkv,wo,norm0,norm1,mlp.fc0,mlp.fc1}``,
    ``mm_projector.{pre_norm,proj.0,proj.2}`` (SGLang's kimi_k25.py load_weights maps them).
    """
    import torch
    from safetensors.torch import load_file, save_file

    language_model, directory = Path(language_model), Path(directory)
    text_config = json.loads((language_model / "config.json").read_text())
    tensors = {}
    for path in sorted(language_model.glob("*.safetensors")):
        tensors.update({f"language_model.{name}": t for name, t in load_file(path).items()})
    dtype = getattr(torch, text_config.get("dtype") or text_config.get("torch_dtype") or "float32")
    tensors.update(_tiny_moonvit_tensors(text_config["hidden_size"], dtype, torch.Generator().manual_seed(seed + 2)))
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(_kimi_k25_config(text_config), indent=2) + "\n")
    return directory


def _kimi_k25_config(text_config: dict) -> dict:
    """The released Kimi-K2.5 config.json's top level around ``text_config``, at toy size."""
    vocab = text_config["vocab_size"]
    vision = TINY_MOONVIT
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        # As released; the code it names is not shipped here and must never be needed:
        # SGLang registers its own KimiK25Config for model_type kimi_k25.
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": text_config.get("bos_token_id"),
        "eos_token_id": text_config.get("eos_token_id"),
        "dtype": text_config.get("dtype") or text_config.get("torch_dtype"),
        "ignore_index": -100,
        "media_placeholder_token_id": vocab - 2,
        "model_type": "kimi_k25",
        "pad_token_id": vocab - 1,
        "text_config": text_config,
        "tie_word_embeddings": False,
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": {
            "init_pos_emb_height": TINY_POS_EMB, "init_pos_emb_time": 4, "init_pos_emb_width": TINY_POS_EMB,
            "merge_kernel_size": list(KIMI_MERGE_KERNEL), "merge_type": "sd2_tpool",
            "mm_hidden_size": vision["hidden_size"], "mm_projector_type": "patchmerger", "model_type": "",
            "patch_size": KIMI_PATCH_SIZE, "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-05, "text_hidden_size": text_config["hidden_size"],
            "video_attn_type": "spatial_temporal",
            **{f"vt_{name}": value for name, value in vision.items()},
            **vision,
        },
    }


def _tiny_moonvit_tensors(text_hidden: int, dtype, generator) -> dict:
    """Random MoonViT + patch-merger projector tensors under the released checkpoint's names."""
    import torch

    width, inner = TINY_MOONVIT["hidden_size"], TINY_MOONVIT["intermediate_size"]
    merged = width * KIMI_MERGE_KERNEL[0] * KIMI_MERGE_KERNEL[1]
    shapes = {
        "vision_tower.patch_embed.proj.weight": (width, 3, KIMI_PATCH_SIZE, KIMI_PATCH_SIZE),
        "vision_tower.patch_embed.proj.bias": (width,),
        "vision_tower.patch_embed.pos_emb.weight": (TINY_POS_EMB, TINY_POS_EMB, width),
        "vision_tower.encoder.final_layernorm.weight": (width,),
        "vision_tower.encoder.final_layernorm.bias": (width,),
        "mm_projector.pre_norm.weight": (width,),
        "mm_projector.pre_norm.bias": (width,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (text_hidden, merged),
        "mm_projector.proj.2.bias": (text_hidden,),
    }
    for block in range(TINY_MOONVIT["num_hidden_layers"]):
        prefix = f"vision_tower.encoder.blocks.{block}"
        shapes.update({
            f"{prefix}.wqkv.weight": (3 * width, width), f"{prefix}.wqkv.bias": (3 * width,),
            f"{prefix}.wo.weight": (width, width), f"{prefix}.wo.bias": (width,),
            f"{prefix}.norm0.weight": (width,), f"{prefix}.norm0.bias": (width,),
            f"{prefix}.norm1.weight": (width,), f"{prefix}.norm1.bias": (width,),
            f"{prefix}.mlp.fc0.weight": (inner, width), f"{prefix}.mlp.fc0.bias": (inner,),
            f"{prefix}.mlp.fc1.weight": (width, inner), f"{prefix}.mlp.fc1.bias": (width,),
        })
    return {name: (0.02 * torch.randn(shape, generator=generator)).to(dtype) for name, shape in shapes.items()}


def build_synthetic_dataset(
    path: str | Path, num_samples: int, vocab_size: int = DEMO_VOCAB_SIZE, min_len: int = 16,
    max_len: int = 256, seed: int = 0,
) -> Path:
    """Write a Parquet dataset of random token ids with a chat-like loss mask (prompt 0, answer 1)."""
    rng = np.random.default_rng(seed)
    input_ids, loss_masks = [], []
    for _ in range(num_samples):
        length = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(1, length))
        input_ids.append(rng.integers(0, vocab_size, length, dtype=np.int32).tolist())
        loss_masks.append([0] * prompt + [1] * (length - prompt))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"input_ids": input_ids, "loss_mask": loss_masks}), path)
    return path


def prepare_demo(directory: str | Path, arch: str, num_samples: int, seed: int) -> tuple[Path, Path]:
    """Model and dataset for the demo run, built once and reused by later runs. The model has a chat tokenizer
    of its vocabulary, so that ``jobs.prepare`` and a trainer take it as they take a real checkpoint."""
    directory = Path(directory)
    model_dir = directory / f"model-{arch}-seed{seed}"
    data_path = directory / f"data-{num_samples}-seed{seed}.parquet"
    if not (model_dir / "config.json").exists():
        logger.info("demo: building a tiny random %s model in %s", arch, model_dir)
        build_tiny_model(model_dir, arch=arch, seed=seed)
    if not (model_dir / "tokenizer.json").exists():
        build_chat_tokenizer(model_dir)
    if not data_path.exists():
        build_synthetic_dataset(data_path, num_samples=num_samples, seed=seed)
    return model_dir, data_path
