"""Layers whose forward takes ``**kwargs`` (a subclass or a wrapper passing them on): headwise.check offers them
the keywords of headwise's convention and uses each one the layer is seen to honour, so such a layer is checked
like the layer it wraps; a keyword it swallows is left out, and the layer is checked as it really behaves."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise.checks import CallableAdapter, ModuleAdapter, check

from tests.checks.check_gallery import GALLERY, RefAttention, plain_callable


def _passing_kwargs_on(cls):
    """``cls`` with ``forward(self, x, **kw)`` passing everything on: the same layer."""

    class PassesKwargsOn(cls):
        def forward(self, x, **kw):
            return super().forward(x, **kw)

    PassesKwargsOn.__name__ = f"KwargsOf{cls.__name__}"
    return PassesKwargsOn


def _verdicts(report):
    return [(r.name, r.verdict, r.detail) for r in report.results]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_a_subclass_passing_kwargs_on_is_checked_like_its_base_layer(causal, n_kv_heads):
    torch.manual_seed(0)
    base = headwise.MultiHeadAttention(32, 4, n_kv_heads=n_kv_heads)
    wrapped = _passing_kwargs_on(headwise.MultiHeadAttention)(32, 4, n_kv_heads=n_kv_heads)
    wrapped.load_state_dict(base.state_dict())
    x = torch.randn(2, 8, 32)
    with torch.no_grad():  # the same function, called directly
        torch.testing.assert_close(wrapped(x, causal=causal), base(x, causal=causal), rtol=0, atol=0)
    expected, got = check(base, causal=causal), check(wrapped, causal=causal)
    assert expected.ok and got.ok, str(got)
    assert _verdicts(got) == _verdicts(expected)
    assert [r.deviation for r in got.results] == [r.deviation for r in expected.results]


@pytest.mark.parametrize("bug", sorted(GALLERY))
def test_each_gallery_bug_behind_a_kwargs_forward_still_fails(bug):
    cls, causal, expected = GALLERY[bug]
    torch.manual_seed(0)
    report = check(_passing_kwargs_on(cls)(), causal=causal)
    if bug == "padding_mask_ignored":
        # a forward that swallows mask= is a layer without a mask, as far as any caller can see: padding is not
        # checked, and the report says why
        padding = report["padding_invariance"]
        assert padding.verdict == "skipped" and "took mask= and ignored it" in padding.detail
        assert report.failed == [] and report["softmax_sanity"].passed
        return
    assert set(report.failed) == expected, str(report)


class IgnoresCausal(RefAttention):
    """Never causal: its **kwargs forward drops causal= and passes the rest on."""

    def forward(self, x, **kw):
        kw.pop("causal", None)
        return super().forward(x, **kw)


class IgnoresCausalByName(RefAttention):
    """The same layer, taking causal= by name and ignoring it."""

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        return super().forward(x, mask=mask, return_weights=return_weights)


def test_a_kwargs_forward_that_swallows_causal_fails_causality():
    torch.manual_seed(0)
    layer = IgnoresCausal().double()
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 5] += 1.0
    with torch.no_grad():  # asked to be causal, it still lets token 5 change token 0
        assert (layer(x2, causal=True)[:, 0] - layer(x, causal=True)[:, 0]).abs().max() > 1e-3
    torch.manual_seed(0)
    reference = check(IgnoresCausalByName(), causal=True)
    torch.manual_seed(0)
    report = check(IgnoresCausal(), causal=True)
    assert set(report.failed) == set(reference.failed) == {"causality", "softmax_sanity"}, str(report)
    assert "took causal= and ignored it" in report["causality"].counterexample["summary"]


class CausalOnly(RefAttention):
    """Always causal: its **kwargs forward drops causal= and masks the future itself."""

    def forward(self, x, **kw):
        kw.pop("causal", None)
        return super().forward(x, causal=True, **kw)


class CausalOnlyByName(RefAttention):
    def forward(self, x, *, mask=None, return_weights=False):
        return super().forward(x, mask=mask, causal=True, return_weights=return_weights)


def test_a_causal_only_kwargs_forward_is_checked_in_the_causal_form():
    torch.manual_seed(0)
    reference = check(CausalOnlyByName(), causal=True)
    torch.manual_seed(0)
    report = check(CausalOnly(), causal=True)
    assert reference.ok and report.ok, str(report)
    assert [(r.name, r.verdict, r.deviation) for r in report.results] == \
        [(r.name, r.verdict, r.deviation) for r in reference.results]
    assert report["permutation_equivariance"].detail.startswith("causal: ")


def _refusing_wrapper(x, **kw):
    return plain_callable(x, **kw)  # plain_callable takes no keywords: a TypeError for any of them


def test_keywords_a_wrapper_cannot_pass_on_are_left_out():
    plain, wrapped = check(plain_callable, d_model=16), check(_refusing_wrapper, d_model=16)
    assert [(r.name, r.verdict, r.deviation) for r in wrapped.results] == \
        [(r.name, r.verdict, r.deviation) for r in plain.results]
    assert wrapped.verdict.startswith("NOT VERIFIED")


def _flags(adapter):
    return adapter.accepts_mask, adapter.accepts_causal, adapter.exposes_weights, adapter.unconfirmed


def test_the_callers_adapter_keeps_its_flags():
    torch.manual_seed(0)
    module_adapter = ModuleAdapter(_passing_kwargs_on(RefAttention)())
    ref = RefAttention().double().eval()

    def function(x, **kw):  # not a module: checked in place, without a copy (in float64, which it runs in)
        return ref(x, **kw)

    function_adapter = CallableAdapter(function, d_model=32)
    for adapter, ok in ((module_adapter, True), (function_adapter, False)):
        before = _flags(adapter)
        assert before == (False, False, False, frozenset({"mask", "causal", "return_weights"}))
        report = check(adapter)
        assert report.ok is ok and report["softmax_sanity"].passed, str(report)  # the copy used the keywords
        assert _flags(adapter) == before


class InvertedMaskKw(RefAttention):
    """Its **kwargs mask= has the opposite convention (True = masked out)."""

    def forward(self, x, **kw):
        if kw.get("mask") is not None:
            kw["mask"] = ~kw["mask"]
        return super().forward(x, **kw)


class NoMaskByName(RefAttention):
    """The same layer as a caller that never passes a mask sees it."""

    def forward(self, x, *, causal=False, return_weights=False):
        return super().forward(x, causal=causal, return_weights=return_weights)


class WithoutMask(ModuleAdapter):
    """A user's adapter: don't pass my mask, it means the opposite."""

    def __init__(self, module):
        super().__init__(module)
        self.accepts_mask = False


def _seen_masks(adapter):
    """Every mask= the layer's working copy receives during check(adapter), by a plain pre-hook on its class."""
    seen = []
    cls = type(adapter.module)
    original = cls.forward

    def recording(self, x, **kw):
        seen.append(kw.get("mask"))
        return original(self, x, **kw)

    cls.forward = recording
    try:
        report = check(adapter)
    finally:
        cls.forward = original
    return report, seen


@pytest.mark.parametrize("how", ["subclass", "instance"])
def test_a_mask_flag_the_adapter_sets_to_false_is_kept_and_no_mask_is_passed(how):
    torch.manual_seed(0)
    layer = InvertedMaskKw()
    reference_layer = NoMaskByName()
    reference_layer.load_state_dict(layer.state_dict())
    if how == "subclass":
        adapter = WithoutMask(layer)
    else:
        adapter = ModuleAdapter(layer)
        adapter.accepts_mask = False
    assert "mask" not in adapter.unconfirmed and {"causal", "return_weights"} <= adapter.unconfirmed
    report, seen = _seen_masks(adapter)
    assert seen and all(m is None for m in seen)
    expected = check(reference_layer)
    assert report.ok and expected.ok, str(report)
    assert [(r.name, r.verdict, r.deviation) for r in report.results] == \
        [(r.name, r.verdict, r.deviation) for r in expected.results]
    assert report["padding_invariance"].detail == "the layer takes no padding mask"


def test_a_flag_the_adapter_sets_to_true_is_used_without_probing():
    torch.manual_seed(0)
    adapter = ModuleAdapter(_passing_kwargs_on(RefAttention)())
    adapter.accepts_mask = True
    assert adapter.unconfirmed == {"causal", "return_weights"}
    assert check(adapter)["padding_invariance"].passed


class CacheHelperWrapper(RefAttention):
    """A causal layer with a new_cache helper (for another API) whose **kwargs go to a callee without cache=."""

    def new_cache(self, b, s):
        return {}

    def forward(self, x, *, mask=None, causal=False, return_weights=False, **kw):
        return super().forward(x, mask=mask, causal=causal, return_weights=return_weights, **kw)


class NoCacheHelper(RefAttention):
    def forward(self, x, *, mask=None, causal=False, return_weights=False, **kw):
        return super().forward(x, mask=mask, causal=causal, return_weights=return_weights, **kw)


def test_a_cache_keyword_the_layer_refuses_is_left_out():
    torch.manual_seed(0)
    layer = CacheHelperWrapper()
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache'"):
        layer(torch.randn(1, 2, 32), cache=layer.new_cache(1, 2))
    reference = NoCacheHelper()
    reference.load_state_dict(layer.state_dict())
    report, expected = check(layer, causal=True), check(reference, causal=True)
    assert report.ok and expected.ok, str(report)
    assert [(r.name, r.verdict, r.detail, r.deviation) for r in report.results] == \
        [(r.name, r.verdict, r.detail, r.deviation) for r in expected.results]
    assert report["causality"].detail.endswith("no cache path to compare")


class BrokenMaskKw(RefAttention):
    """Honours mask= through **kwargs, but its mask code raises (``error``)."""

    error: type = RuntimeError

    def forward(self, x, **kw):
        if kw.pop("mask", None) is not None:
            raise self.error("mask of the wrong shape")
        return super().forward(x, **kw)


class BrokenMaskByName(RefAttention):
    error: type = RuntimeError

    def forward(self, x, *, mask=None, causal=False, return_weights=False):
        if mask is not None:
            raise self.error("mask of the wrong shape")
        return super().forward(x, causal=causal, return_weights=return_weights)


@pytest.mark.parametrize("error", [RuntimeError, TypeError, SystemExit])
def test_a_kwargs_keyword_whose_code_raises_fails_as_it_does_by_name(error):
    torch.manual_seed(0)
    layer = type("Broken", (BrokenMaskKw,), {"error": error})()
    named = type("Broken", (BrokenMaskByName,), {"error": error})()
    named.load_state_dict(layer.state_dict())
    report, expected = check(layer), check(named)
    assert not report.ok and {"padding_invariance", "softmax_sanity"} <= set(report.failed)
    assert [(r.name, r.verdict, r.detail, r.deviation) for r in report.results] == \
        [(r.name, r.verdict, r.detail, r.deviation) for r in expected.results]
    assert report["padding_invariance"].detail == f"the layer raised {error.__name__}"
