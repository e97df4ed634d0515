"""The host copy's pieces: row ranges that cover a batch exactly once, in order, about the size asked for (on a GPU
each is queued once the one before has landed; the states' bytes are compared there by
``benchmarks.capture_profile`` with the device's own)."""

from __future__ import annotations

import pytest

from extractor.host_copy import pieces


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
