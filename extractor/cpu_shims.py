"""CPU-only adjustments SGLang needs to run its ModelRunner on this machine's CPUs.

- ``sgl_kernel``, which PyPI ships for CUDA only: a stand-in module whose one op the EXTEND path
  calls (``assign_req_to_token_pool_cpu``) is plain torch (``install_cpu_shims``).
- NCCL, which SGLang loads whenever torch is a CUDA build, then fails on a CPU device: a
  ``SGLANG_NCCL_SO_PATH`` that does not exist takes SGLang's own "no NCCL here" path (gloo).
- DeepSeek attention (MLA), whose ``torch_native`` backend has no handler: routed to the absorbed-MLA
  method SGLang's own CPU path uses (``register_torch_native_mla``).
- ``torch.compile``, which SGLang applies as a decorator to a few dozen helpers while its modules
  import: each decoration builds inductor's config, importing inductor (about 1.7 of the 16-17 CPU s
  of a tiny model's start), and a helper the CPU path calls (MoE top-k) would be compiled by
  inductor's C++ backend at the first forward. ``TORCHDYNAMO_DISABLE=1`` (unless the environment sets
  it) makes the decorator return the function as it is: it runs eagerly, as the TP ranks already do.

``extractor.engine`` calls these only on ``device=cpu`` without a real ``sgl_kernel``. Checked against
SGLang 0.5.23 (CI) and 0.5.17 (by hand, torch 2.11).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Callable

import torch

SHIM_MODULE_NAME = "sgl_kernel"
NO_NCCL_LIBRARY = "nccl-is-not-used-on-cpu.so"
"""What ``SGLANG_NCCL_SO_PATH`` names on CPU: no such library, so SGLang's tensor-parallel groups use gloo."""


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
) -> None:
    """Write each request's KV-cache slots into its row of ``req_to_token``.

    ``out_cache_loc`` holds the new slots of all requests back to back; request
    i owns ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``.
    Same contract as the C++ op in sgl-kernel's CPU build.
    """
    del max_context_len  # the C++ op uses it for bounds; slicing checks them here
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    cursor = 0
    for row, start, end in zip(rows, starts, ends):
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[cursor : cursor + length]
        cursor += length


def _unavailable(name: str) -> Callable[..., None]:
    def op(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not part of the CPU shim (extractor/cpu_shims.py). "
            "This model or option needs the real sgl-kernel, i.e. a GPU machine."
        )

    op.__name__ = name
    return op


def _build_shim_module() -> types.ModuleType:
    module = types.ModuleType(SHIM_MODULE_NAME)
    module.__doc__ = "CPU stand-in for sgl_kernel, installed by extractor.cpu_shims"
    module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu

    def __getattr__(name: str) -> Callable[..., None]:
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(name)

    module.__getattr__ = __getattr__  # PEP 562: `from sgl_kernel import x` works
    return module


def register_torch_native_mla() -> None:
    """Route DeepSeek MLA attention to absorbed MLA under torch_native; call after importing sglang.

    MLA picks its forward method from a registry keyed by attention backend. ``torch_native`` has no
    entry, and the fallback (the triton handler) picks plain MHA for prefill, which reads the MLA latent
    cache with the wrong width ("Expected size ... [4, 32] but got: [4, 48]"). The registry is read on every forward (deepseek_v2.py ``dispatch_attn_forward_method``),
    so this only has to happen before the first batch.
    """
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: _dispatch_mla_subtype(attn, forward_batch))


def install_cpu_shims() -> None:
    """Make SGLang's CPU engine run here; call before the first sglang import.

    Loading a dense model through the ModelRunner imports a handful of ``sgl_kernel`` names and, on the
    EXTEND path, calls one: ``assign_req_to_token_pool_cpu``. The stand-in implements it in plain torch;
    every other name raises a ``NotImplementedError`` naming the op when called (importing it stays
    harmless: SGLang imports many ops it never uses on CPU).
    """
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ["SGLANG_NCCL_SO_PATH"] = NO_NCCL_LIBRARY
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if SHIM_MODULE_NAME in sys.modules:
        return
    if importlib.util.find_spec(SHIM_MODULE_NAME) is not None:
        return  # a real sgl-kernel is installed; never shadow it
    sys.modules[SHIM_MODULE_NAME] = _build_shim_module()
