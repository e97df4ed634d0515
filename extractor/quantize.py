"""fp8 (e4m3) quantization of captured states, on the device that computed them.

Each token's slice of each layer gets its own float32 scale, ``amax / 448``
(448 is float8_e4m3fn's largest finite value), so that its largest element
maps to +-448 and ``state ~= fp8 value * scale``. A slice of zeros has scale 0
and quantizes to zeros (never NaN). The cast rounds to nearest even.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def quantize_fp8(states: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``states`` [T, groups*H] -> (fp8 [T, groups*H], float32 scales [T, groups]).

    Works a group at a time so that the float32 temporary is [T, H], not the whole batch.
    """
    tokens, width = states.shape
    if width % groups:
        raise ValueError(f"states of width {width} do not split into {groups} equal groups")
    hidden = width // groups
    quantized = torch.empty((tokens, width), dtype=FP8_DTYPE, device=states.device)
    scales = torch.empty((tokens, groups), dtype=torch.float32, device=states.device)
    for group in range(groups):
        columns = slice(group * hidden, (group + 1) * hidden)
        values = states[:, columns].float()
        amax = values.abs().amax(dim=1, keepdim=True)
        scale = amax / FP8_MAX
        scales[:, group : group + 1] = scale
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        # Out of place: for float32 states ``.float()`` is the caller's tensor itself.
        quantized[:, columns] = (values / divisor).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scales


def dequantize_fp8(quantized: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 [T, G*H] and float32 scales [T, G] -> states [T, G*H] in ``dtype``."""
    tokens, groups = scales.shape
    values = quantized.view(tokens, groups, -1).float() * scales.unsqueeze(-1)
    return values.view(tokens, -1).to(dtype)


def fp8_relative_errors(states: torch.Tensor, groups: int) -> list[float]:
    """Per group: ||dequantize(quantize(x)) - x|| / ||x|| over the whole batch, in float32.

    A group at a time, so that the float32 temporaries are [T, H]."""
    hidden = states.shape[1] // groups
    errors = []
    for group in range(groups):
        original = states[:, group * hidden : (group + 1) * hidden]
        quantized, scales = quantize_fp8(original, 1)
        difference = dequantize_fp8(quantized, scales, torch.float32).sub_(original.float())
        norm = original.float().norm().clamp_min(torch.finfo(torch.float32).tiny)
        errors.append((difference.norm() / norm).item())
    return errors
