"""softmax_sanity's scale fit on a user's layer, whose q and k the check rebuilds from q_proj and k_proj. A layer with
only its projections is rebuilt whole, so weights that are not a softmax of that scaled q . k fail (keys taken from
v_proj, squared scores); a layer with a QK-norm of its own may make its scores from other q and k, so a misfit there
leaves the scale, and the property, not verified: never a pass, never a failure. The references are float64
computations written here from the formula, on the check's input and padding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headwise.checks import ModuleAdapter, check

from tests.checks.check_gallery import QKNormRef, RefAttention

B, S, D = 3, 8, 32  # the check's defaults for these layers: batch 3, seq_len 8, the gallery's d_model


class KeysFromValues(RefAttention):
    """Bug: its keys are v_proj's output (k_proj is never used)."""

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        q, _, v = self.project(x)
        return self.attend(q, v, v, mask=mask, causal=causal, return_weights=return_weights)


class SquaredScores(RefAttention):
    """Bug: a softmax of the signed squares of the scaled scores."""

    def softmax(self, scores):
        return (scores.sign() * scores ** 2).softmax(-1)


class UserQKNorm(QKNormRef):
    """A correct layer of the user's own with per-head RMSNorms (learned, not the identity) on q and k."""

    def __init__(self) -> None:
        super().__init__(lambda d_h: nn.RMSNorm(d_h, eps=1e-6))
        with torch.no_grad():
            self.q_norm.weight.copy_(1 + torch.rand(self.d_head))
            self.k_norm.weight.copy_(1 + torch.rand(self.d_head))


def _check_input() -> tuple[torch.Tensor, torch.Tensor]:
    """The check's input for seed 0 (the first draw of its seeded generator) and its padding (docs: sample 1
    right-padded by s // 3, sample 2 left-padded by s // 4)."""
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, S - S // 3:], keep[2, :S // 4] = False, False
    return x, keep


def _heads(t: torch.Tensor, d_h: int) -> torch.Tensor:
    b, s, _ = t.shape
    return t.view(b, s, -1, d_h).transpose(1, 2)  # (b, h, s, d_h)


def _proj(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    return x @ lin.weight.T + lin.bias


def _rms(t: torch.Tensor, norm: nn.RMSNorm) -> torch.Tensor:
    return t / (t.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt() * norm.weight


def _residual(logw: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor) -> float:
    """The relative residual of the least-squares fit log w = c * scores + (a constant per row), over the allowed
    entries: rows centred, then one slope.

    Shapes: (b, s, s) each"""
    n = allowed.sum(-1, keepdim=True)
    lw = torch.where(allowed, logw, 0.0)
    sc = torch.where(allowed, scores, 0.0)
    lw = torch.where(allowed, lw - lw.sum(-1, keepdim=True) / n, 0.0)
    sc = torch.where(allowed, sc - sc.sum(-1, keepdim=True) / n, 0.0)
    c = (lw * sc).sum() / (sc * sc).sum()
    return float((lw - c * sc).norm() / lw.norm())


def _projection_misfit(layer: RefAttention, head: int) -> float:
    """How far head ``head``'s log-weights (the layer's own, float64, on the check's input) are from linear in q . k
    rebuilt from q_proj and k_proj, with the K/V head that fits best."""
    layer = layer.double().eval()
    x, keep = _check_input()
    with torch.no_grad():
        _, w = layer(x, mask=keep[:, None, None, :], return_weights=True)  # (b, h, s, s)
        q = _heads(_proj(x, layer.q_proj), layer.d_head)  # (b, h, s, d_h)
        k = _heads(_proj(x, layer.k_proj), layer.d_head)  # (b, h_kv, s, d_h)
    allowed = keep[:, None, :].expand(B, S, S)
    return min(_residual(w[:, head].log(), q[:, head] @ k[:, g].transpose(-2, -1), allowed)
               for g in range(k.shape[1]))


@pytest.mark.parametrize("cls", [KeysFromValues, SquaredScores])
def test_weights_that_are_no_softmax_of_the_projections_q_k_fail_on_a_layer_with_only_its_projections(cls):
    torch.manual_seed(0)
    layer = cls()
    assert ModuleAdapter(layer).qk_steps == ()  # nothing beyond q_proj, k_proj, v_proj, out_proj
    # the reference: its weights are the formula's of the bug, not a softmax of q . k / sqrt(d_h)
    x, _ = _check_input()
    ref = layer.double().eval()
    with torch.no_grad():
        _, w = ref(x, return_weights=True)
        q = _heads(_proj(x, ref.q_proj), 8)  # (b, h, s, d_h)
        k = _heads(_proj(x, ref.v_proj if cls is KeysFromValues else ref.k_proj), 8)  # (b, h, s, d_h)
        scores = q @ k.transpose(-2, -1) / 8 ** 0.5
    torch.testing.assert_close(w, (scores if cls is KeysFromValues else scores.sign() * scores ** 2).softmax(-1))
    torch.manual_seed(0)
    report = check(cls())
    assert report.failed == ["softmax_sanity"], str(report)
    r = report["softmax_sanity"]
    assert r.detail.startswith("weights are not a softmax of scaled q . k")
    # the misfit reported is the reference's, for the head named, far above its limit
    torch.manual_seed(0)
    assert r.deviation == pytest.approx(_projection_misfit(cls(), r.counterexample["head"]), rel=1e-6)
    assert r.deviation > 100 * r.tolerance


def test_a_users_qk_norm_layer_whose_rebuilt_q_k_misfit_is_not_verified_naming_its_norms():
    torch.manual_seed(0)
    layer = UserQKNorm()
    assert ModuleAdapter(layer).qk_steps == ("q_norm", "k_norm")
    # the reference: a correct softmax of its normalised q . k / sqrt(d_h), which q_proj . k_proj does not explain
    x, keep = _check_input()
    ref = layer.double().eval()
    with torch.no_grad():
        _, w = ref(x, mask=keep[:, None, None, :], return_weights=True)
        q = _rms(_heads(_proj(x, ref.q_proj), 8), ref.q_norm)
        k = _rms(_heads(_proj(x, ref.k_proj), 8), ref.k_norm)
    scores = (q @ k.transpose(-2, -1) / 8 ** 0.5).masked_fill(~keep[:, None, None, :], float("-inf"))
    torch.testing.assert_close(w, scores.softmax(-1))
    torch.manual_seed(0)
    misfit = _projection_misfit(UserQKNorm(), 0)
    assert misfit > 1e-3  # far above the fit's limit (1e3 * rtol = 1e-6): the fit cannot tell
    torch.manual_seed(0)
    report = check(UserQKNorm())
    r = report["softmax_sanity"]
    assert r.verdict == "skipped" and report.failed == [], str(report)
    assert not report.ok and report.verdict.startswith("NOT VERIFIED"), str(report)
    assert r.detail.startswith("scale not checked: head 0's log-weights are not linear in q . k as rebuilt")
    assert f"relative residual {misfit:.2g}" in r.detail and "the layer has q_norm, k_norm" in r.detail
    # what did hold is said too
    assert "rows sum to 1, masked entries exactly 0" in r.detail
    assert "contexts are the weights times the values" in r.detail
