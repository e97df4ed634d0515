"""A batch's states copied to pinned host memory by a kernel (``extract.copy_by=kernel``), not by the copy engine.

With unified addressing the GPU reaches pinned host memory at its host address, so a kernel's stores can write
the host buffer themselves. The copy engine then stays free for SGLang's small reads in the next forward, which
otherwise wait behind the states' copy (``extractor.host_copy``); the price is a few SMs' share while the copy
runs, bounded by the kernel's fixed grid (``CTAS`` blocks, each striding over the words). Bit-exact: the bytes are
moved as 32-bit words (or single bytes when the size is not a multiple of 4), never as floats.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CTAS = 16
"""Blocks of the copy: at most this many of the GPU's SMs hold one while a copy runs (132 on the H200)."""
BLOCK = 4096
"""Words each block moves per step."""


@triton.jit
def copy_words_kernel(source, target, words, BLOCK: tl.constexpr, CTAS: tl.constexpr):
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, words, CTAS * BLOCK):  # int64: no wrap past 2**31
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < words
        tl.store(target + offsets, tl.load(source + offsets, mask=inside), mask=inside)


def copy_words(target: torch.Tensor, source: torch.Tensor) -> None:
    """Launch the copy of ``source``'s bytes into ``target`` (both contiguous, as many bytes) on the current
    stream."""
    if not (target.is_contiguous() and source.is_contiguous()) or target.nbytes != source.nbytes:
        raise ValueError(f"a kernel copy needs contiguous tensors of equal size: {tuple(target.shape)} "
                         f"{target.dtype} <- {tuple(source.shape)} {source.dtype}")
    word = torch.int32 if source.nbytes % 4 == 0 else torch.uint8
    words = source.nbytes // word.itemsize
    if words:
        copy_words_kernel[(CTAS,)](source.reshape(-1).view(word), target.reshape(-1).view(word), words,
                                   BLOCK=BLOCK, CTAS=CTAS)


def copy_to_pinned(host: torch.Tensor, states: torch.Tensor) -> None:
    """Launch the copy of device ``states`` into the pinned ``host`` tensor of their dtype and shape, on the current
    stream; the caller keeps ``host`` until the stream has passed the copy."""
    if host.dtype != states.dtype:  # the copy engine would convert; this moves bytes
        raise TypeError(f"a kernel copy moves bytes: {states.dtype} states into a {host.dtype} buffer")
    copy_words(device_view(host), states.contiguous())


def warm_up() -> None:
    """Compile, before the first batch, the kernel's variants a batch's tensors need: Triton specializes on a word
    count's divisibility by 16 and on a count of 1 (32-bit words: the states, divisible; the flags and fp8 scales,
    any; one word: a one-token batch's flags or scale) and on the word size (bytes: flags of a size not a multiple
    of 4)."""
    buffers = [torch.empty(count, dtype=dtype, pin_memory=True) for dtype, count in (
        (torch.int32, 16), (torch.int32, 20), (torch.int32, 1), (torch.uint8, 7), (torch.uint8, 1))]
    for host in buffers:
        copy_words(device_view(host), torch.zeros_like(host, device="cuda"))
    torch.cuda.synchronize()  # the stores land before the buffers go


def device_view(host: torch.Tensor) -> torch.Tensor:
    """A contiguous pinned host tensor as a CUDA tensor over the same memory (CUDA's unified addressing)."""
    if not host.is_pinned() or not host.is_contiguous():
        raise ValueError("a kernel copy writes into contiguous pinned host memory only")
    return torch.as_tensor(_CudaArray(host), device="cuda")


class _CudaArray:
    """``__cuda_array_interface__`` over a pinned host tensor's bytes: how torch wraps memory it did not allocate.
    The CUDA tensor keeps this object, and so the host tensor, alive while it lives, not while a kernel writes
    through it: the caller keeps the host memory until the copy's event has fired (``HostCopier``'s pool gives a
    buffer back only after its copy has been waited for)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": (host.nbytes,), "typestr": "|u1", "data": (host.data_ptr(), False), "version": 3,
            "strides": None,
        }
