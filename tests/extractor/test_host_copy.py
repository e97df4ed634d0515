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
from extractor.kernel_copy import BLOCK, CTAS, copy_to_pinned, copy_words

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
try:
    copy_to_pinned(torch.empty(4, dtype=torch.bfloat16), torch.empty(4, dtype=torch.float16))
except TypeError as refused:
    assert "moves bytes: torch.float16 states into a torch.bfloat16 buffer" in str(refused)
else:
    sys.exit("float16 states copied as bytes into a bfloat16 buffer")
print("copied", len(cases))
"""


def test_the_kernel_copy_moves_every_byte_unchanged_through_tritons_interpreter():
    """``extract.copy_by=kernel``'s Triton kernel, run on CPU by Triton's interpreter: bf16 states with NaN payloads and
    denormals, fp8 bytes of an odd size, the finite flags, more words than one pass of its fixed grid, scales, an empty
    batch; byte for byte; states of another dtype than their buffer refused. On a GPU it stores into the pinned host
    buffer itself (not run here: no GPU)."""
    result = subprocess.run([sys.executable, "-c", KERNEL_COPY], cwd=REPO_ROOT, env=python_env(TRITON_INTERPRET="1"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "copied 6" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("word,stores", [("*i32", "st.global.v4.b32"), ("*u8", "st.global")])
def test_the_kernel_copy_compiles_for_the_h200(word, stores):
    """Triton lowers the kernel for sm_90 with no GPU here, as a launch specializes it (pointers and word count
    divisible by 16: the states' 32-bit words go as 16-byte stores); scripts/test.sh runs this on SGLang 0.5.17's
    Triton too, the one the GPU node has."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from extractor.kernel_copy import BLOCK, CTAS, copy_words_kernel

    aligned = {(argument,): [["tt.divisibility", 16]] for argument in range(3)} if word == "*i32" else {}
    source = ASTSource(copy_words_kernel, constexprs={"BLOCK": BLOCK, "CTAS": CTAS}, attrs=aligned, signature={
        "source": word, "target": word, "words": "i32", "BLOCK": "constexpr", "CTAS": "constexpr"})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"] and stores in compiled.asm["ptx"]


def test_a_copy_that_was_never_queued_fails_its_batch_instead_of_handing_on_old_bytes(monkeypatch):
    """On a GPU the next forward's thread queues the copies deferred before it, oldest first; if queueing one fails,
    the exception is that thread's, and the batches whose copies never went would otherwise wait on events never
    recorded (a wait that returns at once) and hand on whatever their reused buffer held. Each such batch's owner
    gets an error instead, and its buffer goes back. The device is what cannot run here: a stand-in copy stream whose
    queueing fails, around the real copier's bookkeeping."""
    import numpy as np
    import torch

    from extractor.host_copy import HostCopier, PendingCopy, _DeferredCopy
    from extractor.timing import StageTimes

    class NeverFired:
        def synchronize(self):
            raise AssertionError("waited on an event no copy will record")

    copier = HostCopier("cpu", torch.bfloat16, max_tokens=4, layers=1, hidden_size=8, last_hidden_state=False,
                        fp8=False, count=2, times=StageTimes())
    copier._stream = object()  # as on CUDA: copies are deferred to the next forward's start
    owners = []
    for _ in range(2):
        buffer = copier._free.get()
        pending = PendingCopy(copier, buffer, np.array([4]), done=NeverFired())
        copier._deferred.append(_DeferredCopy(pending, NeverFired(), NeverFired(), None, 4, []))
        owners.append(pending)

    def failing_queue(copy):
        raise torch.OutOfMemoryError("no room for the copy")

    monkeypatch.setattr(copier, "_queue", failing_queue)
    with pytest.raises(torch.OutOfMemoryError), copier._turns:  # its callers hold the lock
        copier._release_deferred()
    for pending in owners:
        with pytest.raises(RuntimeError, match="never copied to the host") as raised:
            with pending:
                pass
        assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    assert copier._deferred == [] and copier._free.qsize() == 2
