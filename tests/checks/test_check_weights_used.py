"""softmax_sanity's question whether the output is made of the weights the layer returns: each head's context (W_O's
input) in the normal call must be its returned weights times its values, w @ v. Layers whose fast path computes
something else while their weights path returns a correct softmax fail; correct layers pass. The references are
float64 computations written here from the formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headwise import MultiHeadAttention
from headwise.checks import check

from tests.checks.check_gallery import QKNormRef, RefAttention


class FastPathOtherScale(RefAttention):
    """Its normal call runs SDPA with scale 1/d_head; the weights it returns for inspection are recomputed with the
    right 1/sqrt(d_head), and the return-weights call's output comes from the same fast path."""

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        q, k, v = self.project(x)
        allowed = None
        if causal:
            allowed = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        if mask is not None:
            allowed = mask if allowed is None else allowed & mask
        y = self.out_proj(self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                                    scale=1 / self.d_head)))
        if not return_weights:
            return y
        scores = q @ k.transpose(-2, -1) * self.scale()
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return y, scores.softmax(-1)


class FastPathUnnormalised(RefAttention):
    """Its output uses exp(scores) @ v, without the softmax's denominator; the weights it returns are a softmax."""

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        q, k, v = self.project(x)
        scores = self.masked_scores(q, k, mask=mask, causal=causal)
        y = self.out_proj(self.merge(scores.exp() @ v))
        return (y, scores.softmax(-1)) if return_weights else y


def _reference_contexts(layer: RefAttention, x: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_O's input in the normal call, the returned weights times v_proj's values), float64, split into heads."""
    got = []
    handle = layer.out_proj.register_forward_pre_hook(lambda mod, args: got.append(args[0]))
    try:
        with torch.no_grad():
            layer(x, causal=causal)
            _, w = layer(x, causal=causal, return_weights=True)
            v = layer.split(layer.v_proj(x), layer.n_kv_heads)[:, layer.kv_head_of()]  # (b, h, s, d_h)
    finally:
        handle.remove()
    return layer.split(got[0], layer.n_heads), w @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cls", [FastPathOtherScale, FastPathUnnormalised])
def test_a_fast_path_that_does_not_use_its_returned_weights_fails(cls, causal):
    torch.manual_seed(0)
    layer = cls().double().eval()
    x = torch.randn(3, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # both calls give one output: comparing outputs alone shows nothing
        torch.testing.assert_close(layer(x, causal=causal), layer(x, causal=causal, return_weights=True)[0])
    ctx, w_v = _reference_contexts(layer, x, causal)
    assert (ctx - w_v).abs().max() > 1e-2  # the output is not out_proj(merge(w @ v))
    torch.manual_seed(0)
    report = check(cls(), causal=causal)
    assert report.failed == ["softmax_sanity"], str(report)
    r = report["softmax_sanity"]
    cex = r.counterexample
    assert "w @ v" in cex["summary"] and r.deviation > r.tolerance
    # the counterexample's deviation is the reference's, at the head, sample and token it names
    torch.manual_seed(0)
    same = cls().double().eval()
    ctx, w_v = _reference_contexts(same, report_x(3, 8, 32), causal)
    diff = (ctx - w_v).abs()[cex["batch"], cex["head"], cex["token"]].max()
    torch.testing.assert_close(torch.tensor(cex["deviation"], dtype=torch.float64), diff)


def report_x(b: int, s: int, d: int) -> torch.Tensor:
    """The check's input for seed 0: the first draw of its seeded generator."""
    return torch.randn(b, s, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.parametrize("layer", [
    lambda: RefAttention(32, 4, 2),
    lambda: nn.MultiheadAttention(32, 4, batch_first=True),
    lambda: MultiHeadAttention(32, 4, n_kv_heads=2),
], ids=["reference-gqa", "torch", "headwise"])
@pytest.mark.parametrize("causal", [False, True])
def test_correct_layers_have_contexts_equal_to_their_weights_times_values(layer, causal):
    torch.manual_seed(0)
    report = check(layer(), causal=causal)
    assert report.ok, str(report)
    assert "contexts are the weights times the values" in report["softmax_sanity"].detail


def test_a_correct_layer_whose_w_o_is_called_functionally_is_not_failed():
    class FunctionalWO(RefAttention):
        def forward(self, x, *, mask=None, causal=False, return_weights=False):
            q, k, v = self.project(x)
            w = self.masked_scores(q, k, mask=mask, causal=causal).softmax(-1)
            # W_O as F.linear on its weight: out_proj itself never runs
            y = F.linear(self.merge(w @ v), self.out_proj.weight, self.out_proj.bias)
            return (y, w) if return_weights else y

    torch.manual_seed(0)
    layer = FunctionalWO()
    with torch.no_grad():  # the same function as the reference
        x = torch.randn(2, 5, 32)
        torch.testing.assert_close(layer(x), RefAttention.forward(layer, x))
    report = check(layer)
    assert report.failed == [], str(report)
    assert report.not_verified == ["head_independence"]
    assert "out_proj never ran as a module" in report["head_independence"].detail
    assert "raised" not in report["head_independence"].detail
    assert "contexts not compared" in report["softmax_sanity"].detail


def test_an_adapter_exposing_heads_but_no_values_says_the_contexts_were_not_compared():
    from headwise.checks import ModuleAdapter

    class NoValues(ModuleAdapter):
        def values(self, x):
            return None

    torch.manual_seed(0)
    report = check(NoValues(FastPathOtherScale()))
    assert "contexts not compared with the weights (the adapter exposes no values)" in \
        report["softmax_sanity"].detail, str(report)



class ValueNorm(RefAttention):
    """Correct attention whose values pass a per-head RMSNorm (learned, not the identity) before the weights read
    them."""

    def __init__(self) -> None:
        super().__init__()
        self.v_norm = nn.RMSNorm(self.d_head, eps=1e-6)
        with torch.no_grad():
            self.v_norm.weight.copy_(1 + torch.rand(self.d_head))

    def project(self, x):
        q = self.split(self.q_proj(x), self.n_heads)
        k = self.split(self.k_proj(x), self.n_kv_heads)[:, self.kv_head_of()]
        v = self.v_norm(self.split(self.v_proj(x), self.n_kv_heads))[:, self.kv_head_of()]
        return q, k, v


class Gated(RefAttention):
    """Correct attention with a per-head sigmoid output gate before W_O, computed from the layer's input (as
    Qwen3-Next gates its attention output)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(self.d_model, self.n_heads * self.d_head)

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        self._g = torch.sigmoid(self.split(self.gate(x), self.n_heads))  # (b, h, s, d_h)
        return super().forward(x, mask=mask, causal=causal, return_weights=return_weights)

    def mix_heads(self, ctx):
        return ctx * self._g


def _rms(t: torch.Tensor, norm: nn.RMSNorm) -> torch.Tensor:
    return t / (t.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt() * norm.weight


@pytest.mark.parametrize("cls", [ValueNorm, Gated])
def test_layers_with_steps_between_values_and_w_o_are_not_verified_and_say_why(cls):
    torch.manual_seed(0)
    layer = cls().double().eval()
    x = report_x(3, 8, 32)
    ctx, w_v = _reference_contexts(layer, x, False)  # W_O's input, and w @ v_proj's values
    with torch.no_grad():  # the reference: the layer is correct, its contexts are its formula's
        _, w = layer(x, return_weights=True)
        v = layer.split(x @ layer.v_proj.weight.T + layer.v_proj.bias, layer.n_kv_heads)  # (b, h, s, d_h)
        if cls is ValueNorm:
            want = w @ _rms(v, layer.v_norm)
        else:
            want = (w @ v) * torch.sigmoid(layer.split(x @ layer.gate.weight.T + layer.gate.bias, layer.n_heads))
    torch.testing.assert_close(ctx, want)
    step = "v_norm" if cls is ValueNorm else "gate"
    torch.manual_seed(0)
    report = check(cls())
    # correct, but the check cannot tell its step from a fast path that ignores the weights: not shown, not failed
    assert report.failed == [] and report.not_verified == ["softmax_sanity"], str(report)
    detail = report["softmax_sanity"].detail
    # the first head, sample and token differ from w @ v (a convex combination of v_proj's values) by the reference's
    assert f"contexts not verified: the layer has {step} between its values and W_O, and head 0's context differs " \
           f"from w @ v by {float((ctx - w_v)[0, 0, 0].abs().max()):.3g}" in detail, detail
    assert "contexts are the weights times the values" not in detail


class FastPathOtherScaleWithBias(FastPathOtherScale):
    """FastPathOtherScale with an output bias parameter of its own: a step the check cannot see through, which must
    not turn its failure into a pass."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(32))

    def forward(self, x, *, mask=None, causal=False, return_weights=False):  # type: ignore[no-untyped-def]
        out = super().forward(x, mask=mask, causal=causal, return_weights=return_weights)
        return (out[0] + self.bias, out[1]) if return_weights else out + self.bias


def test_a_wrong_fast_path_beside_a_step_of_its_own_is_never_passed():
    torch.manual_seed(0)
    report = check(FastPathOtherScaleWithBias())
    assert not report.ok and "softmax_sanity" in report.failed + report.not_verified, str(report)


class QKNormFastPathOtherScale(FastPathOtherScale, QKNormRef):
    """QK-norms on q and k, and a fast path with scale 1/d_head beside a weights path with 1/sqrt(d_head): its
    norms act before the scores, not between its values and W_O, so its contexts are compared."""

    def __init__(self) -> None:
        super().__init__(lambda d_h: nn.RMSNorm(d_h, eps=1e-6))


def test_a_qk_norm_layer_whose_fast_path_uses_another_scale_still_fails_the_contexts_comparison():
    torch.manual_seed(0)
    layer = QKNormFastPathOtherScale().double().eval()
    x = report_x(3, 8, 32)
    ctx, w_v = _reference_contexts(layer, x, False)
    with torch.no_grad():  # the reference: the contexts are softmax(q . k / d_h) @ v, not the returned w @ v
        q = _rms(layer.split(x @ layer.q_proj.weight.T + layer.q_proj.bias, 4), layer.q_norm)
        k = _rms(layer.split(x @ layer.k_proj.weight.T + layer.k_proj.bias, 4), layer.k_norm)
        v = layer.split(x @ layer.v_proj.weight.T + layer.v_proj.bias, 4)
    torch.testing.assert_close(ctx, (q @ k.transpose(-2, -1) / 8).softmax(-1) @ v)
    torch.manual_seed(0)
    report = check(QKNormFastPathOtherScale())
    assert report.failed == ["softmax_sanity"], str(report)
    cex = report["softmax_sanity"].counterexample
    assert "w @ v" in cex["summary"]
    diff = (ctx - w_v).abs()[cex["batch"], cex["head"], cex["token"]].max()
    torch.testing.assert_close(torch.tensor(cex["deviation"], dtype=torch.float64), diff)
