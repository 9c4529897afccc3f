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
    assert rep["permutation_equivariance"].verdict == "skipped"  # causal only: order is its function
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


def test_a_causal_layer_is_verified_by_causality_instead_of_permutation():
    ref = _make(RefAttention)
    rep = check(lambda x, **kw: ref(x, causal=True, **kw), d_model=32, causal=True,
                properties=["permutation_equivariance", "causality", "batch_independence"])
    assert rep["permutation_equivariance"].verdict == "skipped" and rep["causality"].passed
    assert rep.not_verified == [] and rep.ok
