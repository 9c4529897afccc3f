"""batch_independence: each sample's output in the batch is its output run alone, so a layer that reads another
sample (a batch-1 buffer broadcast over the batch, a batch mean) fails, whichever sample it reads, and the report
names a sample whose change moves another; the work stays linear in the batch."""

from __future__ import annotations

import pytest
import torch

from headwise.checks import check

from tests.checks.check_gallery import PaddingIgnored, RefAttention


class ValuesOfOneSample(RefAttention):
    """Every sample's values are computed from sample ``source`` (a batch-1 value buffer broadcast over the
    batch); queries and keys are each sample's own."""

    def __init__(self, source: int) -> None:
        super().__init__()
        self.source = source

    def value_input(self, x):
        # (b, s, d): the bug; modulo the batch, so that a sample run alone reads itself (and the layer runs)
        return x[self.source % x.shape[0]].expand_as(x)


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


def test_a_correct_layer_passes_with_each_sample_run_alone():
    torch.manual_seed(0)
    result = check(RefAttention(), batch=4, properties=["batch_independence"])["batch_independence"]
    assert result.passed and result.detail == "each of the 4 samples run alone gave its output in the batch"


SAMPLES_RUN: list[int] = []


class CountsSamples(RefAttention):
    """RefAttention that records the batch of every call (the check runs a copy: recorded module-wide)."""

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        SAMPLES_RUN.append(x.shape[0])
        return super().forward(x, mask=mask, causal=causal, return_weights=return_weights)


def test_batch_independence_runs_the_layer_on_each_sample_a_bounded_number_of_times():
    torch.manual_seed(0)
    batch = 64
    SAMPLES_RUN.clear()
    result = check(CountsSamples(), batch=batch, properties=["batch_independence"])["batch_independence"]
    assert result.passed
    # the property runs the full batch and each sample alone; adapting the layer adds two full runs
    assert SAMPLES_RUN.count(1) == batch and sum(SAMPLES_RUN) <= 4 * batch, SAMPLES_RUN


class MeanOfBatch(RefAttention):
    """Adds the batch mean of the input to every sample's values: every sample leaks into every other one."""

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        return super().forward(x + x.mean(0, keepdim=True), mask=mask, causal=causal, return_weights=return_weights)


def test_a_layer_mixing_every_sample_fails_naming_a_sample_whose_change_moves_another():
    torch.manual_seed(0)
    layer = MeanOfBatch().double().eval()
    x = torch.randn(5, 8, 32, dtype=torch.float64)
    report = check(layer, batch=5)
    result = report["batch_independence"]
    assert result.failed, str(report)
    cex = result.counterexample
    i, j = cex["sample"], cex["changed_sample"]
    assert i != j
    x2 = x.clone()
    x2[j] = torch.randn(8, 32, dtype=torch.float64)
    with torch.no_grad():  # the named change does move the named sample, with plain calls
        assert (layer(x2)[i] - layer(x)[i]).abs().max() > 1e-3


def _padding_moves(layer, x, keep, sample, token, own):
    """How far real ``token`` of ``sample`` moves when padded tokens are replaced, plain calls: the sample's own
    padded tokens (``own``) or those of every other sample."""
    rows = torch.arange(keep.shape[0])[:, None]
    changed = ~keep & ((rows == sample) if own else (rows != sample))
    x2 = torch.where(changed[..., None], torch.randn_like(x), x)
    mask = keep[:, None, None, :]
    with torch.no_grad():
        return float((layer(x2, mask=mask)[sample, token] - layer(x, mask=mask)[sample, token]).abs().max())


@pytest.mark.parametrize("layer_type,own", [(MeanOfBatch, False), (PaddingIgnored, True)])
def test_padding_invariance_names_whose_padded_tokens_moved_the_sample(layer_type, own):
    torch.manual_seed(0)
    cex = check(layer_type(), properties=["padding_invariance"])["padding_invariance"].counterexample
    bi, ti = cex["batch"], cex["token"]
    # the check's padding: sample 0 none, sample 1 on the right, sample 2 on the left
    keep = torch.ones(3, 8, dtype=torch.bool)
    keep[1, 6:], keep[2, :2] = False, False
    assert cex["keep"] == keep[bi].int().tolist()
    layer = layer_type().double().eval()
    x = torch.randn(3, 8, 32, dtype=torch.float64)
    assert _padding_moves(layer, x, keep, bi, ti, own) > 1e-3
    assert _padding_moves(layer, x, keep, bi, ti, not own) < 1e-12
    if own:
        assert f"changing padded tokens of sample {bi} changed real token {ti} of sample {bi}" in cex["summary"]
    else:
        assert (f"changing padded tokens of other samples (sample {bi} has none: a leak across the batch) changed "
                f"real token {ti} of sample {bi}") in cex["summary"]


class ScaledByBatch(RefAttention):
    """Each sample's output is its own, scaled by (1 + factor * batch size): no sample reads another."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        out = super().forward(x, mask=mask, causal=causal, return_weights=return_weights)
        scale = 1 + self.factor * x.shape[0]
        return (out[0] * scale, out[1]) if return_weights else out * scale


@pytest.mark.parametrize("factor,fails", [(1e-13, False), (1e-3, True)])
def test_an_output_that_varies_with_the_batch_size_fails_only_beyond_the_tolerance(factor, fails):
    torch.manual_seed(0)
    result = check(ScaledByBatch(factor), batch=4, properties=["batch_independence"])["batch_independence"]
    assert result.failed is fails, str(result)
    if fails:
        assert result.detail == "a sample's output depends on the batch size"
        assert "changing the other samples moves nothing" in result.counterexample["summary"]
    else:
        assert 0 < result.deviation <= result.tolerance


class ReadsSampleTwo(RefAttention):
    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        return super().forward(x + x[2], mask=mask, causal=causal, return_weights=return_weights)


def test_a_layer_indexing_a_fixed_sample_fails_on_a_sample_run_alone():
    torch.manual_seed(0)
    result = check(ReadsSampleTwo(), batch=3, properties=["batch_independence"])["batch_independence"]
    assert result.failed and result.detail == "the layer raised IndexError", str(result)
