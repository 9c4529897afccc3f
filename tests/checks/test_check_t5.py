"""headwise.check on the T5 family's self-attention: unscaled scores plus a relative position bias. A correct layer is
never reported failed; one holding its bias cannot be permuted (not verified, saying why) and its scale is fitted on
the scores less the bias, which the module itself returns as the reference."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from headwise.checks import adapt, check  # noqa: E402

SELF = "layer.0.SelfAttention"


def _model(kind: str = "t5"):
    sizes = dict(vocab_size=32, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=2)
    cfg = transformers.UMT5Config(**sizes) if kind == "umt5" else transformers.T5Config(**sizes)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = (transformers.UMT5Model if kind == "umt5" else transformers.T5Model)(cfg).eval()
    with torch.no_grad():  # a bias far from zero, so that a fit ignoring it could not pass
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.mul_(20)
    return model


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_a_layer_without_its_own_bias_passes_with_no_scale(stack):
    module = _model().get_submodule(f"{stack}.block.1.{SELF}")
    report = check(module)
    assert report.ok, str(report)
    assert "scale 1 (the T5 family does not scale its scores) fitted on every head" in report["softmax_sanity"].detail


@pytest.mark.parametrize("kind", ["t5", "umt5"])
@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_a_layer_with_its_relative_bias_fails_nothing_and_says_what_it_cannot_permute(kind, stack):
    module = _model(kind).get_submodule(f"{stack}.block.0.{SELF}")
    ref = _model(kind).get_submodule(f"{stack}.block.0.{SELF}").double()
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    with torch.no_grad():  # the reference: log w - q . k of the module's own eager weights, within each row
        w = ref(x, output_attentions=True)[-1]  # (1, h, s, s)
        q, k = (proj(x).view(1, 8, 4, 4).transpose(1, 2) for proj in (ref.q, ref.k))  # (1, h, s, d_kv)
        bias = w.log() - q @ k.transpose(-2, -1)
        got = adapt(module).position_bias(8).double()
    assert got.abs().max() > 1
    torch.testing.assert_close(got - got.mean(-1, keepdim=True), bias - bias.mean(-1, keepdim=True))
    report = check(module)
    assert report.failed == [], str(report)
    assert report.not_verified == ["permutation_equivariance"]
    assert "relative position bias" in report["permutation_equivariance"].detail
    assert "fitted on every head (less its relative position bias)" in report["softmax_sanity"].detail


@pytest.mark.parametrize("block", [0, 1])
def test_a_t5_layer_scaling_its_scores_fails(block):
    module = _model().get_submodule(f"encoder.block.{block}.{SELF}")
    module.scaling = 0.5  # T5's own forward passes it to the interface
    report = check(module)
    assert report.failed == ["softmax_sanity"], str(report)
    cex = report["softmax_sanity"].counterexample
    assert abs(cex["fitted_scale"] - 0.5) < 1e-6 and cex["expected_scale"] == 1.0
