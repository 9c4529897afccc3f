"""A failed property reports the measure that failed against its own limit: softmax_sanity's row is the relative
error of the fitted scale, or the largest weight on a masked key (limit 0), not the rows' sums when those were
fine. The references are computed here from the formula and from the layer's own float64 weights."""

from __future__ import annotations

import math

import pytest
import torch

from headwise.checks import check

from tests.checks.check_gallery import CausalOffByOne, NoScale, PaddingIgnored, ScaleOverDHead

D_HEAD = 8  # the gallery's d_model 32 over 4 heads


@pytest.mark.parametrize("cls,used", [(ScaleOverDHead, 1 / D_HEAD), (NoScale, 1.0)])
def test_a_wrong_scale_reports_its_relative_error_against_the_scale_limit(cls, used):
    torch.manual_seed(0)
    r = check(cls())["softmax_sanity"]
    assert r.failed
    expected = 1 / math.sqrt(D_HEAD)
    assert math.isclose(r.deviation, abs(used / expected - 1), rel_tol=1e-6)
    assert r.tolerance == pytest.approx(1e-8)  # 10 x float64's rtol of 1e-9
    assert r.counterexample["limit"] == r.tolerance and r.deviation > r.tolerance
    assert f"limit {r.tolerance:.2g}" in r.counterexample["summary"]


def _leaked(layer, x: torch.Tensor, keep: torch.Tensor, causal: bool) -> float:
    """The largest weight the layer's own float64 weights give a key the check masks, in rows with a readable
    key."""
    s = x.shape[1]
    with torch.no_grad():
        _, w = layer.double()(x, mask=keep[:, None, None, :], causal=causal, return_weights=True)  # (b, h, s, s)
    allowed = keep[:, None, None, :].expand_as(w)
    if causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).tril()
    w = w.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    return float(w.masked_fill(allowed, 0.0).max())


@pytest.mark.parametrize("cls,causal", [(CausalOffByOne, True), (PaddingIgnored, False)])
def test_weight_on_a_masked_key_reports_that_weight_against_zero(cls, causal):
    torch.manual_seed(0)
    r = check(cls(), causal=causal)["softmax_sanity"]
    assert r.failed and r.detail.startswith("masked entries are not 0")
    # the check's input and padding (docs: sample 1 right-padded, sample 2 left-padded): s // 3 and s // 4 keys
    x = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    keep = torch.ones(3, 8, dtype=torch.bool)
    keep[1, 8 - 8 // 3:], keep[2, :8 // 4] = False, False
    torch.manual_seed(0)
    assert r.tolerance == 0.0
    assert r.deviation == pytest.approx(_leaked(cls(), x, keep, causal), rel=1e-12)
    assert r.deviation >= r.counterexample["weight"] > 0
