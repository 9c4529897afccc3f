"""headwise.check against the gallery of broken layers: each fails exactly the properties its bug breaks."""

from __future__ import annotations

import json
import math

import pytest
import torch

import headwise
from headwise.checks import PROPERTY_NAMES, CallableAdapter, Report, check

from tests.checks.check_gallery import GALLERY, CausalOffByOne, FlattenNoTranspose, RefAttention, ScaleOverDHead


def _make(cls):
    torch.manual_seed(0)
    return cls()


@pytest.mark.parametrize("bug", sorted(GALLERY))
def test_each_bug_fails_exactly_its_properties(bug):
    cls, causal, expected = GALLERY[bug]
    report = check(_make(cls), causal=causal)
    assert set(report.failed) == expected, str(report)
    assert not report.ok
    for r in report.results:
        if r.failed:
            assert r.counterexample and r.counterexample["summary"], r
        elif r.name not in ("causality",):  # every other property applies to these layers
            assert r.passed, r
    assert (report["causality"].verdict == "skipped") is (not causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_correct_reference_passes_everything(causal, n_kv_heads):
    torch.manual_seed(0)
    report = check(RefAttention(32, 4, n_kv_heads), causal=causal)
    assert report.ok, str(report)
    skipped = {r.name for r in report.results if r.verdict == "skipped"}
    assert skipped == (set() if causal else {"causality"})


def test_counterexamples_point_at_the_bug():
    rep = check(_make(FlattenNoTranspose))
    cex = rep["head_independence"].counterexample
    assert cex["perturbed"] == "W_Q" and cex["changed_heads"] != cex["expected_heads"] == [cex["head"]]
    rep = check(_make(CausalOffByOne), causal=True)
    cex = rep["causality"].counterexample
    assert (cex["changed_token"], cex["output_token"]) == (1, 0)  # the smallest: token 1 leaks into token 0
    rep = check(_make(ScaleOverDHead))
    cex = rep["softmax_sanity"].counterexample
    assert math.isclose(cex["fitted_scale"], 1 / 8, rel_tol=1e-6)  # d_head = 32 / 4
    assert "1/d_head" in cex["summary"]
    bugged = GALLERY["gqa_kv_heads_shared_wrongly"][0]
    cex = check(_make(bugged))["head_independence"].counterexample
    assert (cex["changed_heads"], cex["expected_heads"]) == ([0, 2], [0, 1])  # h % h_kv vs h // g


def test_plain_callable_is_enough_for_properties_1_to_3():
    flat, ref, peek = _make(FlattenNoTranspose), _make(RefAttention), _make(CausalOffByOne)
    rep = check(lambda x: flat(x), d_model=32)
    assert rep.failed == ["permutation_equivariance"]
    assert {r.name for r in rep.results if r.verdict == "skipped"} == {
        "causality", "padding_invariance", "softmax_sanity", "head_independence", "dtype_stability"}
    rep = check(lambda x: flat.double()(x) if x.dtype == torch.float64 else flat.float()(x), d_model=32)
    assert rep.failed == ["permutation_equivariance"] and rep["dtype_stability"].passed and rep.dtype == "float64"
    rep = check(lambda x: peek(x, causal=True), d_model=32, causal=True)
    assert rep.failed == ["causality"]
    # causal only: its causal form runs (permuting the tokens before the last output leaves that output alone)
    assert rep["permutation_equivariance"].passed and rep["permutation_equivariance"].detail.startswith("causal:")
    rep = check(lambda x: ref(x, causal=True), d_model=32, causal=True)
    assert rep["causality"].passed and "no cache path" in rep["causality"].detail
    # nothing failed, but a plain function exposes no weights and no heads: not verified, never OK
    assert not rep.ok and rep.not_verified == ["softmax_sanity", "head_independence"]
    assert rep.verdict.startswith("NOT VERIFIED: core properties could not run: softmax_sanity (the layer")
    # the layer is float32 inside: the function cannot take float64, so the check runs in float32
    assert rep.dtype == "float32" and rep["dtype_stability"].verdict == "skipped"


def test_causal_claim_is_checked_not_trusted():
    ref = _make(RefAttention)
    rep = check(lambda x: ref(x), d_model=32, causal=True)  # claims causal, is not
    assert "causality" in rep.failed


def test_report_is_deterministic_and_serialisable():
    a = check(_make(FlattenNoTranspose), seed=3).to_dict()
    b = check(_make(FlattenNoTranspose), seed=3).to_dict()
    a.pop("seconds"), b.pop("seconds")
    assert a == b
    assert json.loads(json.dumps(a)) == a
    assert [r["name"] for r in a["results"]] == list(PROPERTY_NAMES)
    alone = check(_make(FlattenNoTranspose), seed=3, properties=["head_independence"]).to_dict()["results"]
    assert alone == [r for r in a["results"] if r["name"] == "head_independence"]  # each property stands alone
    text = str(check(_make(RefAttention)))
    assert text.splitlines()[0].endswith("OK; 7 properties: 6 ran (6 passed, 0 failed), 1 skipped"), text
    assert "head_independence" in text


def test_selected_properties_and_report_access():
    rep = check(_make(RefAttention), properties=["batch_independence", "softmax_sanity"])
    assert [r.name for r in rep.results] == ["batch_independence", "softmax_sanity"] and rep.ok
    with pytest.raises(KeyError, match="causality"):
        rep["causality"]
    assert not Report("x", 4, "float64", 0, []).ok  # nothing checked is not a pass


def test_the_layer_passed_in_is_not_changed():
    layer = _make(RefAttention)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    check(layer)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    assert layer.q_proj.weight.dtype == torch.float32


def test_custom_adapter_is_used_as_is():
    ref = _make(RefAttention)
    adapter = CallableAdapter(lambda x: ref(x), d_model=32)
    rep = check(adapter)
    assert rep.layer == "<lambda>" and not rep.failed
    assert rep.not_verified == ["softmax_sanity", "head_independence"] and not rep.ok  # a bare f(x) exposes neither


@pytest.mark.parametrize("call,match", [
    (lambda: check(lambda x: x), "d_model"),
    (lambda: check(_make(RefAttention), d_model=16), "d_model=16"),
    (lambda: check(_make(RefAttention), properties=["nope"]), "unknown properties"),
    (lambda: check(_make(RefAttention), properties=["softmax_sanity", "causality", "softmax_sanity"]),
     r"properties must name each property once, got \['softmax_sanity', 'causality', 'softmax_sanity'\]"),
    (lambda: check(lambda x: x[..., :3], d_model=8), r"shape \(b, s, d_model\)"),
    (lambda: check(lambda x: x @ torch.ones(5, 5), d_model=8), "fails on x"),
    (lambda: check(_make(RefAttention), seq_len=1), "seq_len"),
    (lambda: check(42), "callable"),
])
def test_bad_input_raises_clear_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_headwise_check_is_the_function():
    assert headwise.check is headwise.checks.check


@pytest.mark.xdist_group("subprocess")
def test_import_headwise_and_checking_a_headwise_layer_need_no_transformers():
    import subprocess
    import sys

    code = ("import sys, headwise; f = headwise.check; "
            "assert f(headwise.MultiHeadAttention(8, 2), causal=True).ok; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_property_names_are_the_properties():
    from headwise.checks.properties import PROPERTIES
    from headwise.checks.report import CORE_PROPERTIES

    assert PROPERTY_NAMES == tuple(PROPERTIES) and set(CORE_PROPERTIES) <= set(PROPERTIES)


def test_a_causal_only_layer_is_verified_by_permuting_a_prefix():
    ref = _make(RefAttention)
    rep = check(lambda x, **kw: ref(x, causal=True, **kw), d_model=32, causal=True,
                properties=["permutation_equivariance", "causality", "batch_independence"])
    assert rep["permutation_equivariance"].passed and rep["causality"].passed
    assert rep["permutation_equivariance"].detail.startswith("causal: permuting tokens 0..6")
    assert rep.not_verified == [] and rep.ok
    # at seq_len=2 there is no prefix to permute: not verified, and causality does not stand in for it
    rep = check(lambda x, **kw: ref(x, causal=True, **kw), d_model=32, causal=True, seq_len=2,
                properties=["permutation_equivariance", "causality", "batch_independence"])
    assert rep["permutation_equivariance"].verdict == "skipped" and rep["causality"].passed
    assert rep.not_verified == ["permutation_equivariance"] and not rep.ok


# -- the weights judged are the ones the output uses; a causal layer reads its prefix as a set -------------
class FastPathOverDHead(RefAttention):
    """Correct when asked for weights; its usual (fused) path scales by 1/d_head."""

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        if return_weights:
            return super().forward(x, mask=mask, causal=causal, return_weights=True)
        q, k, v = (self.split(p(x), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        allowed = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device)
        if causal:
            allowed = allowed.tril()
        if mask is not None:
            allowed = allowed & mask
        z = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1 / self.d_head)
        return self.out_proj(self.merge(z))


class CausalOnlyShiftedValues(RefAttention):
    """Causal only (no causal= keyword), and each value is v_t + v_(t-1): the output depends on token order."""

    def forward(self, x, *, return_weights=False):
        q, k, v = (self.split(p(x), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        v = v + torch.cat([torch.zeros_like(v[:, :, :1]), v[:, :, :-1]], 2)
        scores = (q @ k.transpose(-2, -1) * self.scale()).masked_fill(self.causal_blocked(x.shape[1], x.device),
                                                                      float("-inf"))
        w = scores.softmax(-1)
        y = self.out_proj(self.merge(w @ v))
        return (y, w) if return_weights else y


class CausalOnlyRef(RefAttention):
    """The reference, causal only."""

    def forward(self, x, *, return_weights=False):
        return super().forward(x, causal=True, return_weights=return_weights)


def test_a_fast_path_with_a_wrong_scale_fails_softmax_sanity():
    layer = _make(FastPathOverDHead).double().eval()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():  # the two paths really differ (and the weights path is the reference)
        assert not torch.allclose(layer(x), layer(x, return_weights=True)[0])
        torch.testing.assert_close(layer(x, return_weights=True)[0], RefAttention.forward(layer, x))
    for causal in (False, True):
        report = check(_make(FastPathOverDHead), causal=causal)
        assert report.failed == ["softmax_sanity"], str(report)
        cex = report["softmax_sanity"].counterexample
        assert "return-weights call" in cex["summary"] and cex["deviation"] > report["softmax_sanity"].tolerance
    assert "outputs match the weights path" in check(_make(RefAttention))["softmax_sanity"].detail


def test_a_causal_only_layer_that_shifts_its_values_fails_permutation_equivariance():
    layer = _make(CausalOnlyShiftedValues).double().eval()
    x, perm = torch.randn(1, 8, 32, dtype=torch.float64), torch.tensor([3, 0, 6, 1, 5, 2, 4, 7])
    with torch.no_grad():  # its last output does change when the tokens before it are permuted
        assert not torch.allclose(layer(x)[0, -1], layer(x[:, perm])[0, -1])
    report = check(_make(CausalOnlyShiftedValues), causal=True)
    # its contexts mix each value with the one before: they are not its weights times v_proj's values either
    assert report.failed == ["permutation_equivariance", "softmax_sanity"], str(report)
    assert "w @ v" in report["softmax_sanity"].counterexample["summary"]
    assert "changed the output at token 7" in report["permutation_equivariance"].counterexample["summary"]
    report = check(_make(CausalOnlyRef), causal=True)  # the correct causal-only layer passes that form
    assert report.ok and report["permutation_equivariance"].detail.startswith("causal: permuting tokens 0..6")


class Float32Softmax(RefAttention):
    """Correct, with its softmax in float32 whatever the input dtype (softmax(dtype=torch.float32))."""

    def softmax(self, scores):
        return scores.softmax(-1, dtype=torch.float32).to(scores.dtype)


class Float32SoftmaxOverDHead(Float32Softmax):
    def scale(self):
        return 1 / self.d_head


class Float16Softmax(RefAttention):
    def softmax(self, scores):
        return scores.half().softmax(-1).to(scores.dtype)


def test_a_float32_softmax_is_judged_with_float32_tolerances():
    layer = _make(Float32Softmax).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with torch.no_grad():  # float32 numbers: the rows miss 1 by float32 rounding, more than float64's
        w = layer(x, return_weights=True)[1]
        torch.testing.assert_close(w, w.float().double(), rtol=0, atol=0)
        q, k = layer.split(layer.q_proj(x), 4), layer.split(layer.k_proj(x), 4)
        ref = (q @ k.transpose(-2, -1) / math.sqrt(8)).softmax(-1)  # the float64 formula
        torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7)
        assert float((w.sum(-1) - 1).abs().max()) > 1e-12
    for causal in (False, True):
        assert check(_make(Float32Softmax), causal=causal).ok
        report = check(_make(Float32SoftmaxOverDHead), causal=causal)  # a wrong scale is still caught
        assert report.failed == ["softmax_sanity"] and "1/d_head" in report["softmax_sanity"].counterexample["summary"]
    report = check(_make(Float16Softmax))  # float16 rounding is more than the check forgives; it says by how much
    summary = report["softmax_sanity"].counterexample["summary"]
    assert report.failed == ["softmax_sanity"] and "sum to 1, not 1" not in summary and "off by" in summary


@pytest.mark.parametrize("kw,error,match", [
    ({"seed": 1.5}, TypeError, r"seed must be an int, got 1.5 \(float\)"),
    ({"seed": "0"}, TypeError, r"seed must be an int, got '0' \(str\)"),
    ({"seed": True}, TypeError, "seed must be an int"),
    ({"seed": 2 ** 64 - 2}, ValueError, r"seed must be an int in \[0, 2\*\*63 - 1\], got 18446744073709551614"),
    ({"seed": -1}, ValueError, r"seed must be an int in \[0, 2\*\*63 - 1\], got -1"),
    ({"causal": "no"}, TypeError, r"causal must be True, False or None, got 'no' \(str\)"),
    ({"causal": 1}, TypeError, "causal must be True, False or None, got 1"),
    ({"properties": "causality"}, TypeError, r"properties must be a list of property names .* got the str"),
    ({"properties": 3}, TypeError, "properties must be a list of property names, got int"),
    ({"properties": [None]}, ValueError, r"unknown properties \[None\]"),
    ({"properties": []}, ValueError, r"properties must name at least one property \(from \['permutation_equivariance'"
                                     r".*got \[\]"),
    ({"properties": ()}, ValueError, r"properties must name at least one property .* got \(\)"),
])
def test_arguments_of_the_wrong_kind_are_refused_naming_them(kw, error, match):
    with pytest.raises(error, match=match):
        check(_make(RefAttention), **kw)


def test_the_largest_seed_runs():
    report = check(_make(RefAttention), seed=2 ** 63 - 1, properties=["batch_independence"])
    assert report.ok and report.seed == 2 ** 63 - 1


class Float32SoftmaxScaledOff(Float32Softmax):
    """A float32 softmax whose scale is 0.5% off 1/sqrt(d_head)."""

    def scale(self):
        return 1.005 / math.sqrt(self.d_head)


def test_a_float32_softmax_with_a_scale_half_a_percent_off_fails():
    layer = _make(Float32SoftmaxScaledOff).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with torch.no_grad():  # the layer really computes 1.005/sqrt(d_h), per the float64 formula
        q, k = layer.split(layer.q_proj(x), 4), layer.split(layer.k_proj(x), 4)
        ref = (q @ k.transpose(-2, -1) * 1.005 / math.sqrt(8)).softmax(-1)
        torch.testing.assert_close(layer(x, return_weights=True)[1], ref, rtol=1e-6, atol=1e-7)
    report = check(_make(Float32SoftmaxScaledOff))
    assert report.failed == ["softmax_sanity"], str(report)
    assert report["softmax_sanity"].counterexample["fitted_scale"] == pytest.approx(1.005 / math.sqrt(8), rel=1e-4)


class DrawsFromTheGlobalRNG(RefAttention):
    """Dropout on its weights whatever the mode: it draws from torch's global generator."""

    def softmax(self, scores):
        return torch.nn.functional.dropout(scores.softmax(-1), 0.1, training=True)


def test_the_global_rng_is_left_alone_and_the_same_seed_gives_the_same_report():
    layer = _make(DrawsFromTheGlobalRNG)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = check(layer, seed=3).to_dict()
    torch.testing.assert_close(torch.get_rng_state(), state, rtol=0, atol=0)
    torch.manual_seed(123)  # another global state: the report depends on seed= only
    second = check(layer, seed=3).to_dict()
    assert [(r["name"], r.get("deviation")) for r in first["results"]] == \
        [(r["name"], r.get("deviation")) for r in second["results"]]


def test_the_callers_hooks_do_not_fire_on_the_checks_calls():
    layer = _make(RefAttention)
    seen = []
    layer.register_forward_hook(lambda mod, args, out: seen.append(out))
    layer.q_proj.register_forward_pre_hook(lambda mod, args: seen.append(args))
    x = torch.randn(1, 3, 32)
    reference = layer(x)
    assert len(seen) == 2
    assert check(layer).ok
    assert len(seen) == 2  # the check ran a copy without them
    torch.testing.assert_close(layer(x), reference)


def test_a_layer_that_cannot_be_copied_is_refused_naming_why():
    import threading

    layer = _make(RefAttention)
    layer.lock = threading.Lock()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(TypeError, match=r"copy of RefAttention .*deepcopy of it failed: TypeError: cannot pickle"):
        check(layer)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


def test_a_causal_claim_given_to_check_leaves_the_callers_adapter_as_it_was():
    from headwise.checks import ModuleAdapter

    adapter = ModuleAdapter(headwise.MultiHeadAttention(16, 4))
    assert check(adapter, causal=True)["causality"].passed
    assert adapter.claims_causal is False
    assert check(adapter)["causality"].verdict == "skipped"  # the layer's own claim: not causal
