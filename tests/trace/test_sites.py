"""Edits at every attention site (q, k, v, pattern, z) against a float64 per-head reference written from the
formula (a bare layer, MHA and GQA: one query head's view of its group's K/V edited alone) and against plain
hooks on the unpatched GPT-2; the pattern edit takes the eager path for its layer only."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import MultiHeadAttention

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402
from tests.trace.per_head import per_head_reference  # noqa: E402


@pytest.mark.parametrize("n_kv_heads", [4, 2])
@pytest.mark.parametrize("site", ["q", "k", "v", "pattern", "z"])
def test_each_site_edit_equals_the_float64_per_head_reference(site, n_kv_heads):
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, n_kv_heads).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()  # causal, and row 1 pads its last position
    mask[1, :, :, 4] = False
    fn = lambda t: t.flip(1) * 0.7 + 0.1  # noqa: E731 - reverse the positions, a non-trivial edit
    want = per_head_reference(attn, x, mask, {(1, site): fn})
    with headwise.trace(attn, capture=("z",), edit={(0, 1, site): lambda t, layer, head: fn(t)}) as t:
        got = attn(x, mask=mask)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, per_head_reference(attn, x, mask, {}))  # the edit matters
    with headwise.trace(attn, capture=("z",)) as t_plain:
        attn(x, mask=mask)
    keep = [0, 2, 3]  # the other heads keep their context, head 1's group mates under GQA too
    torch.testing.assert_close(t[0].z[:, :, keep], t_plain[0].z[:, :, keep])


def test_gqa_k_and_v_edits_of_two_heads_of_one_group_stay_their_own():
    torch.manual_seed(1)
    attn = MultiHeadAttention(24, 6, 2).double().eval()
    x = torch.randn(2, 4, 24, dtype=torch.float64)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    want = per_head_reference(attn, x, mask, {(0, "k"): lambda t: 0.5 * t, (2, "v"): lambda t: -t})
    with headwise.trace(attn, capture=("k",), edit={(0, 0, "k"): 0.5, (0, 2, "v"): -1.0}) as t:
        got = attn(x)
    torch.testing.assert_close(got, want)
    assert t[0].k.shape == (2, 6, 4, 4)  # every query head got its own copy of its group's keys


def test_gpt2_q_v_and_pattern_edits_equal_hooks_on_the_unpatched_model():
    model = ref.gpt2("sdpa")
    plain = ref.twin(model)
    patch(model)
    kw = ref.inputs(model)
    d, d_h = 24, 6

    def on_c_attn(m, args, out):  # c_attn's output: [q | k | v], head i at columns i * d_h
        out = out.clone()
        out[..., 1 * d_h:2 * d_h] *= 0.5  # q of head 1
        out[..., 2 * d + 3 * d_h:2 * d + 4 * d_h] = 0  # v of head 3
        return out

    handle = plain.transformer.h[1].attn.c_attn.register_forward_hook(on_c_attn)
    want, _, _ = ref.hooked_run(plain, kw, 4, edit={(0, 2): torch.zeros_like})  # a zero pattern: a zero context
    handle.remove()
    with torch.no_grad(), headwise.trace(model, edit={(1, 1, "q"): 0.5, (1, 3, "v"): "zero",
                                                      (0, 2, "pattern"): "zero"}) as t:
        got = model(**kw)
    torch.testing.assert_close(got.logits, want.logits)
    assert t.materializes_probabilities == ["transformer.h.0.attn"]


def test_a_pattern_edit_runs_the_eager_path_for_its_layer_only(monkeypatch):
    torch.manual_seed(2)
    model = torch.nn.Sequential(MultiHeadAttention(16, 4), MultiHeadAttention(16, 4)).eval()
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad(), headwise.trace(model, edit={(1, 0, "pattern"): 2.0}):
        model(torch.randn(1, 3, 16))
    assert len(calls) == 1  # layer 0 fused, layer 1 eager


def test_bad_sites_are_refused():
    attn = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match="site must be one of"):
        headwise.trace(attn, edit={(0, 1, "result"): "zero"})
    with pytest.raises(ValueError, match="not pattern"):
        headwise.trace(attn, edit={(0, 1, "pattern"): "mean"})
    with pytest.raises(ValueError, match="edit keys are"):
        headwise.trace(attn, edit={(0, 1, "q", 2): "zero"})
    cache = attn.new_cache(1, 4)
    with headwise.trace(attn, edit={(0, 1, "pattern"): 0.5}):
        attn(torch.randn(1, 2, 16), cache=cache)
        with pytest.raises(ValueError, match="needs every value"):
            attn(torch.randn(1, 1, 16), cache=cache)


def test_a_pattern_replacement_needs_the_key_axis_and_broadcasts_only_over_leading_axes():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).double().eval()
    x = torch.randn(2, 3, 16, dtype=torch.float64)  # head 1's pattern slice: (2, 3, 3)
    for shape in ((1,), (3, 1), (2, 3, 1)):  # one value spread over every key is not what the shape says
        with headwise.trace(attn, edit={(0, 1, "pattern"): torch.full(shape, 0.5, dtype=torch.float64)}):
            with pytest.raises(ValueError, match=rf"replacement \({shape[0]},.*n = 3"):
                attn(x)
        assert attn.tracer is None
    mask = torch.ones(2, 1, 3, 3, dtype=torch.bool)
    for shape in ((3,), (1, 3), (1, 1, 3), (3, 3), (2, 1, 3)):
        p = torch.rand(shape, dtype=torch.float64)
        want = per_head_reference(attn, x, mask, {(1, "pattern"): lambda pat: p.expand_as(pat)})
        with torch.no_grad(), headwise.trace(attn, edit={(0, 1, "pattern"): p}):
            got = attn(x)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_returned_weights_are_the_edited_pattern_the_output_was_made_of(n_kv_heads):
    torch.manual_seed(3)
    attn = MultiHeadAttention(16, 4, n_kv_heads).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    fn = lambda p: p.flip(-1) * 0.5  # noqa: E731
    patterns = []
    want = per_head_reference(attn, x, mask, {(1, "pattern"): fn}, patterns)
    with headwise.trace(attn, edit={(0, 1, "pattern"): lambda p, layer, head: fn(p)}):
        y, w = attn(x, return_weights=True)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(w, torch.stack(patterns, 1))  # head 1's row: the edited probabilities


def test_output_attentions_of_a_patched_gpt2_are_the_edited_pattern():
    model = ref.gpt2("eager")
    plain = ref.twin(model)
    patch(model)
    kw = ref.inputs(model)
    # the unpatched model with head 2 of layer 0 zeroed where W_O reads it: a zero pattern's effect
    want, _, _ = ref.hooked_run(plain, kw, 4, edit={(0, 2): torch.zeros_like}, output_attentions=True)
    with torch.no_grad(), headwise.trace(model, edit={(0, 2, "pattern"): "zero"}):
        got = model(**kw, output_attentions=True)
    torch.testing.assert_close(got.logits, want.logits)
    layer0 = want.attentions[0].clone()
    layer0[:, 2] = 0
    torch.testing.assert_close(got.attentions[0], layer0)
    torch.testing.assert_close(got.attentions[1], want.attentions[1])


# PEFT asks transformers a deprecated question; not ours to fix.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("family, target", [("gpt2", "c_proj"), ("llama", "o_proj")])
def test_result_is_refused_while_an_adapter_wraps_w_o_and_sums_to_w_os_output_once_merged(family, target):
    peft = pytest.importorskip("peft")
    base = ref.BUILDERS[family]("sdpa")
    torch.manual_seed(3)
    model = peft.get_peft_model(base, peft.LoraConfig(target_modules=[target], r=2, init_lora_weights=False,
                                                      fan_in_fan_out=family == "gpt2")).eval()
    patch(model)
    kw = ref.inputs(base)
    views = headwise.interop.layers(model)
    with pytest.raises(ValueError, match=r"W_O is wrapped by an adapter \(peft\..*merge_and_unload\(\) first"):
        with headwise.trace(model, capture={0: ("z",), 1: ("result",)}):
            pass
    assert all(v.tracer is None for _, v in views)  # the refused trace left nothing behind
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:  # z needs no W_O: still traced
        model(**kw)
    _, zs, _ = ref.hooked_run(base, kw, 4 if family == "gpt2" else 6)  # base: the model holding the adapters
    for li in range(2):
        torch.testing.assert_close(t[li].z, zs[li])
    merged = model.merge_and_unload()
    want, _, outs = ref.hooked_run(merged, kw, 4 if family == "gpt2" else 6)
    with torch.no_grad(), headwise.trace(merged, capture=("result",)) as t:
        got = merged(**kw)
    torch.testing.assert_close(got.logits, want.logits)
    for li, w_o in enumerate(ref.w_o_modules(merged)):
        bias = ref.w_o(w_o)[1]
        torch.testing.assert_close(t[li].result.sum(2) + (0 if bias is None else bias), outs[li])
