"""headwise.statistics.concatenate, the statistics of several calls of a layer as one: the per-key sum of
``key_weight`` in the calls' own precision against the float64 sum written out here, and bad ``queries``
refused naming what was expected and what was given.

Shapes:
    b: batch, h: heads, n: a call's query rows (lse, entropy, max_weight) or keys (key_weight).
"""

from __future__ import annotations

import pytest
import torch

from headwise.statistics import concatenate


def test_key_weight_of_calls_of_different_dtypes_sums_in_the_promoted_dtype():
    g = torch.Generator().manual_seed(0)
    first = torch.rand(1, 2, 2, generator=g)  # float32
    later = torch.rand(1, 2, 3, generator=g, dtype=torch.float64) / 3  # not exact in float32
    want = torch.zeros(1, 2, 3, dtype=torch.float64)
    want[..., :2] += first.double()
    want += later
    torch.testing.assert_close(concatenate("key_weight", [first, later], [2, 1]), want, rtol=0, atol=0)
    joined = concatenate("lse", [first, later])  # joined along the rows, as torch.cat promotes
    torch.testing.assert_close(joined, torch.cat([first.double(), later], 2), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["key_weight", "lse"])
@pytest.mark.parametrize("queries", [[3], [3, 1, 1, 1]], ids=["shorter", "longer"])
def test_queries_of_another_length_than_the_calls_are_refused_naming_both(name, queries):
    calls = [torch.ones(1, 2, 3), torch.ones(1, 2, 4), torch.ones(1, 2, 5)]
    want = rf"{name}: queries must hold one s_q per call, 3 for 3 calls, but holds {len(queries)}: "
    with pytest.raises(ValueError, match=want + rf"\[{', '.join(map(str, queries))}\]$"):
        concatenate(name, calls, queries)


@pytest.mark.parametrize("queries, why", [([3, 1.0], r"queries\[1\] is float \(1\.0\)"),
                                          ([True, 1], r"queries\[0\] is bool \(True\)"),
                                          (torch.tensor([3, 1]), "a list of ints.*got Tensor")])
def test_queries_that_are_not_ints_are_refused_naming_the_entry(queries, why):
    with pytest.raises(TypeError, match=rf"key_weight: queries must be .*{why}"):
        concatenate("key_weight", [torch.ones(1, 1, 3), torch.ones(1, 1, 4)], queries)
