"""A 4-bit target SGLang serves as it serves Kimi-K2.5: every Linear of a bf16 Llama checkpoint rounded to INT4
weights (symmetric, group 32, round-to-nearest), written as a compressed-tensors W4A16 checkpoint.

    python -m benchmarks.acceptance.quantize_int4 BF16_DIR OUT_DIR

SGLang's compressed-tensors W4A16 linear path is GPTQ-Marlin only (``CompressedTensorsWNA16``; SGLang 0.5.17
has no other kernel for it), and Marlin takes a layer only when its input size is a multiple of 128 and its
output size of 64 (``marlin_utils.verify_marlin_supports_shape``). So each Linear is rounded to the INT4 grid,
and stored:

- packed (compressed-tensors ``pack-quantized``, written by compressed_tensors' own compressor) where Marlin
  takes its shape: SGLang serves it with Marlin;
- otherwise listed in the config's ``ignore`` and stored as its dequantized values in bf16, the numbers Marlin
  would compute with (compressed_tensors' own decompression of the packed layer): SGLang serves it unquantized.

The whole model computes with 4-bit weights either way; the embedding and ``lm_head`` (tied to it) stay bf16.
The directory appears whole, under a temporary name renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

BITS = 4
GROUP_SIZE = 32
"""Kimi-K2.5's group size."""
MARLIN_MIN_N, MARLIN_MIN_K = 64, 128
"""GPTQ-Marlin's tile: output and input sizes it takes are multiples of these (SGLang's marlin_utils)."""
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""A Llama decoder layer's Linears (``model.layers.N.{self_attn,mlp}.NAME``)."""
SGLANG_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""The Linears SGLang's Llama fuses into one, by the fused one's name. Its compressed-tensors config matches
``ignore`` against the fused names (the Llama model declares no mapping back to the checkpoint's), so a fused
Linear whose parts are all ignored is listed under its fused name as well."""
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "chat_template.jinja")
"""The files of the bf16 checkpoint the quantized one carries unchanged (those present)."""


def marlin_takes(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> bool:
    """Whether SGLang's GPTQ-Marlin kernel takes a Linear of this shape (one partition: tensor parallel 1)."""
    return out_features % MARLIN_MIN_N == 0 and in_features % MARLIN_MIN_K == 0 and in_features % group_size == 0


def scheme() -> QuantizationScheme:
    """W4A16: INT4 weights, symmetric, per group of 32 input columns, static; activations unquantized."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=BITS, type="int", symmetric=True, strategy="group", group_size=GROUP_SIZE, dynamic=False))


def rtn_qparams(weight: torch.Tensor, args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest's scales and zero points, per output row and group: compressed_tensors' own
    ``calculate_qparams`` on each group's min and max (scale = max|w| / 7.5, zero 0), in the weight's dtype."""
    from compressed_tensors.quantization.utils import calculate_qparams

    groups = weight.reshape(weight.shape[0], -1, GROUP_SIZE)
    return calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), args)


def compress_linear(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One Linear's packed tensors (``weight_packed``, ``weight_scale``, ``weight_shape``) by compressed_tensors'
    pack-quantized compressor."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    linear = scheme()
    scale, zero_point = rtn_qparams(weight, linear.weights)
    # the weight in float32: w / scale is then the exact ratio, rounded once to the grid (in bf16 it would be
    # rounded to bf16 first, and a ratio near a half step could land on the other side)
    return PackedQuantizationCompressor.compress(
        {"weight": weight.float(), "weight_scale": scale, "weight_zero_point": zero_point.to(torch.int8)}, linear)


def decompress_linear(packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight compressed_tensors' decompressor makes of one Linear's packed tensors."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor.decompress(packed, scheme())["weight"]


def is_linear(name: str) -> bool:
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in LINEAR_SUFFIXES


def quantize_state_dict(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every decoder Linear rounded to INT4: packed where Marlin takes it, dequantized (bf16) elsewhere; the other
    tensors unchanged. Returns the tensors to store and the Linears stored dequantized (the config's ignore)."""
    out, ignored = {}, []
    for name, tensor in weights.items():
        if not is_linear(name):
            out[name] = tensor
            continue
        if tensor.shape[1] % GROUP_SIZE:
            raise ValueError(f"{name}: {tensor.shape[1]} input columns are not whole groups of {GROUP_SIZE}; this "
                             "quantizer needs every Linear's input size to be a multiple of the group size")
        packed = compress_linear(tensor)
        module = name.removesuffix(".weight")
        if marlin_takes(*tensor.shape):
            out.update({f"{module}.{key}": value.contiguous() for key, value in packed.items()})
        else:
            out[name] = decompress_linear(packed).to(tensor.dtype).contiguous()
            ignored.append(module)
    return out, ignored


def ignore_list(ignored: list[str]) -> list[str]:
    """``lm_head``, the Linears stored dequantized, and the SGLang-fused Linears all of whose parts are; a
    ValueError when only some parts of one are (SGLang needs one scheme per fused Linear)."""
    fused = []
    for module in dict.fromkeys(name.rsplit(".", 1)[0] for name in ignored):
        for name, parts in SGLANG_FUSED.items():
            stored = [f"{module}.{part}" in ignored for part in parts]
            if any(stored) and not all(stored):
                raise ValueError(f"{module}: Marlin takes some of {', '.join(parts)} and not the others; SGLang "
                                 f"serves them as one {name} with one scheme")
            if all(stored):
                fused.append(f"{module}.{name}")
    return ["lm_head", *ignored, *fused]


def quantization_config(ignored: list[str]) -> QuantizationConfig:
    """compressed-tensors' config of the checkpoint: one W4A16 group over every Linear, pack-quantized, the
    Linears Marlin cannot take (``ignore_list``) ignored."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    return QuantizationConfig(config_groups={"group_0": scheme()}, format="pack-quantized",
                              quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore_list(ignored))


def write_quantized(source: Path, out: Path) -> list[str]:
    """The quantized checkpoint of ``source`` written into the empty directory ``out``; returns what it stores
    dequantized."""
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import load_file, save_file

    from testbeds.smollm2 import WEIGHTS_FILE, write_index

    files = sorted(source.glob("*.safetensors"))
    if [path.name for path in files] != [WEIGHTS_FILE]:
        raise ValueError(f"{source} holds {[path.name for path in files]}; this quantizer reads one {WEIGHTS_FILE} "
                         "(a checkpoint as python -m testbeds.smollm2 writes it)")
    tensors, ignored = quantize_state_dict(load_file(str(files[0])))
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    os.chmod(out / WEIGHTS_FILE, 0o644)  # safetensors writes 0600; a job running as another user reads it
    write_index(out)
    shutil.copy2(source / "config.json", out / "config.json")
    ModelCompressor(quantization_config=quantization_config(ignored)).update_config(str(out))
    for name in COPIED:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    return ignored


def build_int4(source: Path, out: Path) -> Path:
    """The INT4 checkpoint of ``source`` at ``out`` unless it is already there (its config names the
    quantization); refuses an ``out`` that holds something else."""
    source, out = Path(source).absolute(), Path(out).absolute()
    if is_int4_checkpoint(out):
        return out
    if out.exists():
        raise ValueError(f"{out} exists but is not an INT4 checkpoint this quantizer wrote; move it away or choose "
                         "another directory")
    if not (source / "config.json").is_file():
        raise ValueError(f"{source} is no checkpoint (no config.json): build it first (python -m testbeds.smollm2)")
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        os.chmod(temp, 0o755)
        write_quantized(source, temp)
        os.rename(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return out


def is_int4_checkpoint(directory: Path) -> bool:
    config = directory / "config.json"
    if not config.is_file():
        return False
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return quantization.get("quant_method") == "compressed-tensors" and quantization.get("format") == "pack-quantized"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.acceptance.quantize_int4", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="the bf16 checkpoint (python -m testbeds.smollm2 --out DIR)")
    parser.add_argument("out", help="the INT4 checkpoint's directory (made; kept if it is already one)")
    args = parser.parse_args(argv)
    try:
        path = build_int4(Path(args.source), Path(args.out))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
