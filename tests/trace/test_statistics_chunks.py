"""The query chunks of the statistics' chunked pass: how many rows the plan gives a chunk
(:func:`headwise.plan.statistics_rows`, a pure function of the shape), held to the bound docs/statistics.md
states (a chunk's scores, ``rows * b * h * s_kv`` floats, within :data:`headwise.plan.STATISTICS_CHUNK_BYTES`
wherever 8 rows fit; 8 rows otherwise). The statistics of chunks against float64 statistics of the pattern are
tests/trace/test_statistics.py's (chunks of 8 rows there).

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import itertools

from headwise.plan import STATISTICS_CHUNK_BYTES, statistics_rows

# From short contexts to 1M keys, from one head to 128, batches of 1 to 16; float32 and float64 scores.
_SHAPES = list(itertools.product((1, 2, 16), (1, 12, 32, 64, 128), (1, 7, 4096, 131072),
                                 (1, 100, 8192, 32768, 131072, 2**20), (4, 8)))


def test_a_chunks_scores_stay_within_the_budget_wherever_8_rows_fit():
    for b, h, s_q, s_kv, itemsize in _SHAPES:
        rows = statistics_rows(b, h, s_q, s_kv, itemsize)
        per_row = b * h * s_kv * itemsize  # bytes of one query row's scores
        shape = f"b={b} h={h} s_q={s_q} s_kv={s_kv} itemsize={itemsize}: {rows} rows"
        assert 1 <= rows <= s_q, shape
        if 8 * per_row > STATISTICS_CHUNK_BYTES:
            assert rows == min(8, s_q), shape  # the floor: fewer rows would read K and V once per row
            continue
        assert rows * per_row <= STATISTICS_CHUNK_BYTES, shape
        # as many rows as fit, in multiples of 8, so that a chunk's products run at full speed
        assert rows == min(s_q, STATISTICS_CHUNK_BYTES // per_row // 8 * 8), shape
