"""The query chunks of the statistics' chunked pass: how many rows the plan gives a chunk
(:func:`headwise.plan.statistics_rows`, a pure function of the shape), held to the bound docs/statistics.md
states (a chunk's scores, ``rows * b * h * s_kv`` floats, within :data:`headwise.plan.STATISTICS_CHUNK_BYTES`
wherever one row fits), and the statistics of chunks of any number of rows against float64 statistics of the
pattern (tests/trace/stats_reference.py).

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from headwise import plan as hwp
from headwise.plan import STATISTICS_CHUNK_BYTES, statistics_rows
from headwise.statistics import STATISTICS
from headwise.statistics.chunks import chunked_statistics
from tests.trace.stats_reference import close, reference_statistics

# From short contexts to 1M keys, from one head to 128, batches of 1 to 16; float32 and float64 scores.
_SHAPES = list(itertools.product((1, 2, 16), (1, 12, 32, 64, 128), (1, 7, 4096, 131072),
                                 (1, 100, 8192, 32768, 131072, 2**20), (4, 8)))


def test_a_chunks_scores_stay_within_the_budget_wherever_one_row_fits():
    for b, h, s_q, s_kv, itemsize in _SHAPES:
        rows = statistics_rows(b, h, s_q, s_kv, itemsize)
        per_row = b * h * s_kv * itemsize  # bytes of one query row's scores
        shape = f"b={b} h={h} s_q={s_q} s_kv={s_kv} itemsize={itemsize}: {rows} rows"
        assert 1 <= rows <= s_q, shape
        if per_row > STATISTICS_CHUNK_BYTES:
            assert rows == 1, shape  # the least a chunk can hold
            continue
        assert rows * per_row <= STATISTICS_CHUNK_BYTES, shape
        # as many rows as fit (in multiples of 8 once 8 fit), so that a chunk's products run at full speed
        fit = STATISTICS_CHUNK_BYTES // per_row
        assert rows == min(s_q, fit // 8 * 8 if fit >= 8 else fit), shape


@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, sinks=torch.tensor([2.0, -1.0, 0.5, 9.0]))],
                         ids=["causal", "causal with sinks"])
def test_chunks_of_fewer_than_8_rows_equal_float64_of_the_pattern(rows, kw, monkeypatch):
    g = torch.Generator().manual_seed(0)
    b, h, h_kv, s_q, s_kv, d = 2, 4, 2, 11, 13, 8
    q = torch.randn(b, h, s_q, d, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(b, h_kv, s_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h_kv, s_kv, d, generator=g, dtype=torch.float64)
    kw = {**kw, "sinks": kw["sinks"].double()} if "sinks" in kw else kw
    # a budget of exactly `rows` rows of float64 scores: the plan's own choice, not a rows= override
    monkeypatch.setattr(hwp, "STATISTICS_CHUNK_BYTES", rows * b * h * s_kv * 8)
    assert hwp.statistics_rows(b, h, s_q, s_kv, 8) == rows
    z, got = chunked_statistics(q, k, v, scale=0.4, names=STATISTICS, **kw)
    want_z, want = reference_statistics(q, k, v, scale=0.4, **kw)
    close(got, want)
    torch.testing.assert_close(z, want_z)
