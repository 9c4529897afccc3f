"""batch_independence: changing any one sample leaves every other sample's outputs as they were, so a layer that
reads one fixed sample (a batch-1 buffer broadcast over the batch) is caught whichever sample that is."""

from __future__ import annotations

import pytest
import torch

from headwise.checks import check

from tests.checks.check_gallery import RefAttention


class ValuesOfOneSample(RefAttention):
    """Every sample's values are computed from sample ``source`` (a batch-1 value buffer broadcast over the
    batch); queries and keys are each sample's own."""

    def __init__(self, source: int) -> None:
        super().__init__()
        self.source = source

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        q = self.split(self.q_proj(x), self.n_heads)
        k = self.split(self.k_proj(x), self.n_kv_heads)[:, self.kv_head_of()]
        shared = x[self.source].expand_as(x)  # (b, s, d): the bug
        v = self.split(self.v_proj(shared), self.n_kv_heads)[:, self.kv_head_of()]
        scores = q @ k.transpose(-2, -1) * self.scale()
        if causal:
            scores = scores.masked_fill(self.causal_blocked(x.shape[1], x.device), float("-inf"))
        if mask is not None:
            scores = self.apply_padding(scores, mask)
        w = self.softmax(scores)
        y = self.out_proj(self.merge(w @ v))
        return (y, w) if return_weights else y


@pytest.mark.parametrize("batch,source", [(3, 0), (3, 1), (3, 2), (4, 0), (4, 2), (4, 3)])
def test_a_layer_reading_one_samples_values_fails_whichever_sample_it_reads(batch, source):
    torch.manual_seed(0)
    layer = ValuesOfOneSample(source).double().eval()
    # the leak, shown with plain calls: changing sample `source` moves the others, changing any other sample moves
    # nothing but itself
    x = torch.randn(batch, 8, 32, dtype=torch.float64)
    with torch.no_grad():
        y = layer(x)
        for j in range(batch):
            x2 = x.clone()
            x2[j] = torch.randn(8, 32, dtype=torch.float64)
            y2 = layer(x2)
            others = [i for i in range(batch) if i != j]
            if j == source:
                assert (y2[others] - y[others]).abs().amax(dim=(1, 2)).min() > 1e-3
            else:
                torch.testing.assert_close(y2[others], y[others], rtol=0, atol=1e-12)
    torch.manual_seed(0)
    report = check(ValuesOfOneSample(source), batch=batch)
    result = report["batch_independence"]
    assert result.failed and not report.ok, str(report)
    cex = result.counterexample
    assert cex["changed_sample"] == source and cex["sample"] != source
    assert f"changing sample {source} changed sample {cex['sample']}" in cex["summary"]


def test_a_correct_layer_passes_with_every_sample_changed_in_turn():
    torch.manual_seed(0)
    result = check(RefAttention(), batch=4, properties=["batch_independence"])["batch_independence"]
    assert result.passed and result.detail == "changed each of the 4 samples in turn"
