"""The host copy's pieces: row ranges that cover a batch exactly once, in order, about the size asked for (on a GPU
each is queued once the one before has landed; the states' bytes are compared there by
``benchmarks.capture_profile`` with the device's own); the kernel that copies instead, byte for byte."""

from __future__ import annotations

import subprocess
import sys

import pytest

from extractor.host_copy import pieces
from tests.conftest import REPO_ROOT
from tests.helpers import python_env


@pytest.mark.parametrize("rows,row_bytes,piece_bytes", [
    (16384, 28672, 16 << 20), (16384, 28672, 0), (7, 100, 250), (5, 100, 1), (1, 10, 1 << 20), (3, 8, 24)])
def test_pieces_cover_the_rows_once_in_order(rows, row_bytes, piece_bytes):
    ranges = pieces(rows, row_bytes, piece_bytes)
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(end == start for (_, end), (start, _) in zip(ranges, ranges[1:]))
    assert all(end > start for start, end in ranges)
    if piece_bytes == 0:
        assert ranges == [(0, rows)]
    else:  # each piece at most the size asked for (but a row), all but the last exactly that
        per = max(1, piece_bytes // row_bytes)
        assert all(end - start == per for start, end in ranges[:-1]) and ranges[-1][1] - ranges[-1][0] <= per


def test_a_batch_of_deepseek_width_goes_in_pieces_of_16_mb():
    assert len(pieces(16384, 2 * 7168 * 2, 16 << 20)) == 29  # 585 rows (16.8 MB) a piece


KERNEL_COPY = """
import sys
import torch
from extractor.kernel_copy import BLOCK, CTAS, copy_words

generator = torch.Generator().manual_seed(0)
bits = torch.randint(-2**15, 2**15, (37, 3 * 64), dtype=torch.int16, generator=generator)
bits[0, :4] = torch.tensor([0x7FC1, 0x7F81, -32767, 0x0001], dtype=torch.int16)  # NaNs with payloads, a denormal
cases = {
    "bf16 states": bits.view(torch.bfloat16),
    "fp8 bytes, odd size": torch.randint(0, 256, (13, 7), dtype=torch.uint8, generator=generator),
    "finite flags": torch.rand(37, 3, generator=generator) > 0.5,
    "more words than the grid's stride": torch.randint(-2**31, 2**31 - 1, (CTAS * BLOCK * 2 + 5,),
                                                       dtype=torch.int32, generator=generator),
    "fp32 scales": torch.randn(37, 3, generator=generator),
    "empty": torch.empty(0, 64, dtype=torch.bfloat16),
}
for name, source in cases.items():
    target = torch.full((source.nbytes,), 0xAB, dtype=torch.uint8)  # a host buffer's bytes, as the GPU sees them
    copy_words(target, source)
    assert torch.equal(target, source.reshape(-1).view(torch.uint8)), name
for target, source in ((torch.empty(5, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8)),
                       (torch.empty(8, 8, dtype=torch.uint8), torch.empty(8, 16, dtype=torch.uint8)[:, ::2])):
    try:
        copy_words(target, source)
    except ValueError as refused:
        assert "contiguous tensors of equal size" in str(refused)
    else:
        sys.exit(f"not refused: {tuple(target.shape)} <- {tuple(source.shape)}")
print("copied", len(cases))
"""


def test_the_kernel_copy_moves_every_byte_unchanged_through_tritons_interpreter():
    """``extract.copy_by=kernel``'s Triton kernel, run on CPU by Triton's interpreter: bf16 states with NaN payloads and
    denormals, fp8 bytes of an odd size, the finite flags, more words than one pass of its fixed grid, scales, an empty
    batch; byte for byte. On a GPU it stores into the pinned host buffer itself (not run here: no GPU)."""
    result = subprocess.run([sys.executable, "-c", KERNEL_COPY], cwd=REPO_ROOT, env=python_env(TRITON_INTERPRET="1"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "copied 6" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("word", ["*i32", "*u8"])
def test_the_kernel_copy_compiles_for_the_h200(word):
    """Triton lowers the kernel for sm_90 with no GPU here; scripts/test.sh runs this on SGLang 0.5.17's Triton too,
    the one the GPU node has."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from extractor.kernel_copy import BLOCK, CTAS, copy_words_kernel

    source = ASTSource(copy_words_kernel, constexprs={"BLOCK": BLOCK, "CTAS": CTAS}, signature={
        "source": word, "target": word, "words": "i32", "BLOCK": "constexpr", "CTAS": "constexpr"})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"] and f"st.global.b{8 if word == '*u8' else 32}" in compiled.asm["ptx"]
