"""The pieces of examples/surgery_curve.py (the full run takes a minute; docs/surgery.md shows its output):
its rank correlation against SciPy, its data file, and its BERT regrouping against the headwise GQA layer."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
stats = pytest.importorskip("scipy.stats")

from examples.surgery_curve import fidelity, regrouped, sentences, spearman  # noqa: E402
from headwise.interop import from_hf  # noqa: E402
from headwise.surgery import to_gqa  # noqa: E402
from tests.interop.tiny_models import build  # noqa: E402


def test_spearman_and_fidelity_against_scipy():
    a, b = torch.randn(40, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a.numpy(), b.numpy()).statistic, abs=1e-12)
    emb = torch.nn.functional.normalize(torch.randn(6, 8), dim=1)
    cos, rho, acc = fidelity(emb, emb)
    assert cos == pytest.approx(1.0) and rho == pytest.approx(1.0)
    best = (emb @ emb.T).fill_diagonal_(-2).argmax(1)
    assert acc == pytest.approx(float((best == torch.tensor([1, 0, 3, 2, 5, 4])).double().mean()))


def test_sentences_are_paraphrase_pairs():
    text = sentences()
    assert 40 <= len(text) <= 60 and len(text) % 2 == 0 and len(set(text)) == len(text)


@pytest.mark.parametrize("groups", ["consecutive", "similarity"])
def test_regrouped_bert_computes_the_headwise_gqa_layer(groups):
    model = build("bert")
    reg = regrouped(model, 2, groups)
    x = torch.randn(2, 5, 20)
    for before, after in zip(model.encoder.layer, reg.encoder.layer):
        want = to_gqa(from_hf(before.attention), 2, groups=groups)
        torch.testing.assert_close(from_hf(after.attention)(x), want(x))
