"""The precision per-head statistics promise (float32, float64 for float64 inputs) holds under ``torch.autocast``:
the statistics of a layer run under a bfloat16 autocast are the float32 statistics of the bfloat16 q, k and v it
attended with, against float64 statistics of the pattern written from their definitions
(tests/trace/stats_reference.py), on the chunked path, beside the eager path and compiled.

Shapes:
    b: batch, s: sequence length, h: query heads, h_kv: key/value heads.
"""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import plan as hwp
from headwise.statistics import STATISTICS
from tests.trace.stats_reference import reference_statistics

ALL = STATISTICS


def _layer_and_input() -> tuple[headwise.MultiHeadAttention, torch.Tensor]:
    torch.manual_seed(0)
    attn = headwise.MultiHeadAttention(32, 4, 2).eval()
    return attn, torch.randn(2, 40, 32) * 3  # (b, s, d): sharp rows, whose bfloat16 scores are far off float32


def _assert_float32_of(record, attn: headwise.MultiHeadAttention) -> None:  # type: ignore[no-untyped-def]
    assert record.q.dtype == torch.bfloat16  # the layer did run under the autocast
    _, want = reference_statistics(record.q, record.k, record.v, scale=attn.config.scale, causal=True)
    for name in ALL:
        got = record.get(name)
        assert got.dtype == torch.float32, name
        # float32 against the float64 formula at the float32 defaults (bfloat16 products are off by ~1e-2)
        torch.testing.assert_close(got, want[name].float(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("extra", [(), ("pattern",)], ids=["chunks", "beside the eager path"])
def test_statistics_under_autocast_are_float32_of_the_autocast_heads(extra):
    attn, x = _layer_and_input()
    with torch.no_grad():
        info = attn.explain_dispatch(x, causal=True, statistics=ALL, return_weights=bool(extra))
    want_via = hwp.Statistics.BESIDE if extra else hwp.Statistics.CHUNKS
    assert info.plan.statistics_via is want_via
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
            headwise.trace(attn, capture=ALL + ("q", "k", "v") + extra) as t:
        attn(x, causal=True)
    _assert_float32_of(t[0], attn)


def test_statistics_under_autocast_of_a_compiled_layer_are_float32_in_one_graph():
    from torch._dynamo.testing import CompileCounter

    attn, x = _layer_and_input()
    torch._dynamo.reset()
    counter = CompileCounter()
    step = torch.compile(lambda x: attn(x, causal=True), backend=counter, fullgraph=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
            headwise.trace(attn, capture=ALL + ("q", "k", "v")) as t:
        step(x)
    assert counter.frame_count == 1
    _assert_float32_of(t[0], attn)
    torch._dynamo.reset()
