"""Per-head statistics (lse, entropy, max_weight, key_weight) captured by headwise.trace, against float64
statistics of a materialised pattern written from their definitions (tests/trace/stats_reference.py): on split
heads through the layer's attend seam (masks, padding, dead rows, sliding windows, GQA/MQA, softcap, sinks),
on a bare layer's forward and KV-cache decoding, and on patched GPT-2, Llama, Gemma 2 and all-MiniLM-L6-v2.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import math

import pytest
import torch

import headwise
from headwise import masks as hwm
from headwise import plan as hwp
from headwise.statistics import STATISTICS, concatenate
from headwise.statistics.chunks import chunked_statistics
from tests.reference import allowed_and_additive
from tests.trace.stats_reference import close, from_pattern, reference_statistics

ALL = STATISTICS


def _qkv(b: int, h: int, h_kv: int, s_q: int, s_kv: int, d: int = 8, d_v: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h_kv, s_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h_kv, s_kv, d_v or d, generator=g, dtype=torch.float64)
    return q * 1.5, k, v  # sharper rows than unit scores give


def _window(s: int, w: int) -> torch.Tensor:
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    return ((j <= i) & (j > i - w)).view(1, 1, s, s)


def _padding() -> torch.Tensor:
    keep = torch.ones(2, 11, dtype=torch.bool)
    keep[0, :3] = False  # left padding: under causal masking rows 0..2 of sequence 0 read nothing
    keep[1, 8:] = False  # right padding
    return hwm.padding_mask(keep=keep)  # (b, 1, 1, s_kv)


def _float_mask() -> torch.Tensor:
    m = torch.randn(2, 4, 11, 11, dtype=torch.float64)
    m[0, 1, :, 4] = -math.inf
    m[1, :, 6] = -math.inf  # a row that reads nothing
    return m


# name -> (b, h, h_kv, s_q, s_kv, attend keywords)
CASES = {
    "mha": (2, 4, 4, 11, 11, {}),
    "causal": (2, 4, 4, 11, 11, dict(causal=True)),
    "gqa, padding, causal": (2, 6, 2, 11, 11, dict(mask=_padding(), causal=True)),
    "mqa, padding": (2, 4, 1, 11, 11, dict(mask=_padding())),
    "sliding window": (1, 4, 2, 11, 11, dict(mask=_window(11, 3))),
    "softcap": (2, 4, 2, 11, 11, dict(causal=True, softcap=2.0)),
    "sinks per head": (2, 4, 2, 11, 11, dict(causal=True, sinks=torch.randn(4, dtype=torch.float64))),
    "sinks per row, padding": (2, 4, 2, 11, 11, dict(mask=_padding(), sinks=torch.randn(2, 4, 11, 1,
                                                                                      dtype=torch.float64))),
    "a sink far above every key": (2, 4, 2, 11, 11, dict(causal=True, sinks=torch.tensor([800.0, 0.0, -5.0, 120.0],
                                                                                        dtype=torch.float64))),
    "float mask with -inf": (2, 4, 4, 11, 11, dict(mask=_float_mask())),
    "causal s_q > s_kv": (2, 4, 2, 11, 7, dict(causal=True)),
    "cross s_q < s_kv": (2, 4, 2, 5, 13, dict(causal=True)),
}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 query rows, so that every case crosses a chunk boundary."""
    monkeypatch.setattr(hwp, "STATISTICS_CHUNK_BYTES", 1)


@pytest.mark.parametrize("case", list(CASES))
def test_statistics_at_the_attend_seam_equal_float64_of_the_pattern(case, small_chunks):
    b, h, h_kv, s_q, s_kv, kw = CASES[case]
    attn = headwise.MultiHeadAttention(8 * h, h, h_kv, dtype=torch.float64).eval()
    q, k, v = _qkv(b, h, h_kv, s_q, s_kv)
    with torch.no_grad(), headwise.trace(attn, capture=ALL + ("z",)) as t:
        z, _ = attn.attend(q, k, v, **kw)
    want_z, want = reference_statistics(q, k, v, scale=attn.config.scale, **kw)
    close({n: getattr(t[0], n) for n in ALL}, want)
    torch.testing.assert_close(z, want_z)
    with torch.no_grad():
        plain, _ = attn.attend(q, k, v, **kw)  # untraced: the fused path, or the eager one for softcap/sinks
    torch.testing.assert_close(z, plain)


@pytest.mark.parametrize("case", ["gqa, padding, causal", "causal s_q > s_kv", "float mask with -inf"])
def test_key_weight_sums_to_the_rows_that_read_something(case):
    b, h, h_kv, s_q, s_kv, kw = CASES[case]
    q, k, v = _qkv(b, h, h_kv, s_q, s_kv, seed=3)
    _, got = chunked_statistics(q, k, v, scale=0.3, mask=kw.get("mask"), causal=kw.get("causal", False))
    readable, _ = allowed_and_additive(b, h, s_q, s_kv, kw.get("mask"), kw.get("causal", False))
    reading = readable.any(-1)  # (b, h, s_q)
    assert not reading.all()  # the case has rows that read nothing
    torch.testing.assert_close(got["key_weight"].sum(-1), reading.sum(-1).double())
    dead = ~reading
    assert torch.equal(got["lse"][dead], torch.full_like(got["lse"][dead], -math.inf))
    for name in ("entropy", "max_weight"):
        assert torch.equal(got[name][dead], torch.zeros_like(got[name][dead]))
    assert torch.isfinite(got["lse"][reading]).all()


def test_a_layer_asked_only_for_statistics_never_runs_the_eager_path(monkeypatch):
    attn = headwise.MultiHeadAttention(32, 4, 2).eval()
    x = torch.randn(2, 40, 32)
    sinks = torch.randn(4)
    with torch.no_grad():
        plain = attn(x, causal=True)
        q, k, v = attn.project_qkv(x)
        eager, _ = attn.attend(q, k, v, causal=True, softcap=3.0, sinks=sinks)  # softcap and sinks: eager path

    def refused(*args, **kwargs):
        raise AssertionError("the eager path ran")

    monkeypatch.setattr(headwise.functional, "softmax_attention", refused)
    with torch.no_grad(), headwise.trace(attn, capture=ALL) as t:
        traced = attn(x, causal=True)
        capped, _ = attn.attend(q, k, v, causal=True, softcap=3.0, sinks=sinks)
    assert t.materializes_probabilities == []
    torch.testing.assert_close(traced, plain)
    torch.testing.assert_close(capped, eager)
    with torch.no_grad():
        info = attn.explain_dispatch(x, causal=True, statistics=ALL)
    assert (info.backend, info.kernel, info.materializes_probabilities) == ("statistics", "chunks", False)
    assert any("never the 2*4*40*40 pattern" in r for r in info.reasons), info.reasons


def test_under_autograd_the_call_keeps_its_path_and_the_statistics_come_beside_it():
    attn = headwise.MultiHeadAttention(24, 4, 2, dtype=torch.float64)
    x = torch.randn(2, 9, 24, dtype=torch.float64, requires_grad=True)
    with headwise.trace(attn, capture=ALL + ("q", "k", "v")) as t:
        y = attn(x, causal=True)
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    r = t[0]
    _, want = reference_statistics(r.q.detach(), r.k.detach(), r.v.detach(), scale=attn.config.scale, causal=True)
    close({n: getattr(r, n) for n in ALL}, want)
    assert not any(getattr(r, n).requires_grad for n in ALL)
    info = attn.explain_dispatch(x, causal=True, statistics=("entropy",))
    assert info.plan.statistics_via is hwp.Statistics.BESIDE and info.backend == "sdpa"


def test_statistics_with_the_pattern_come_beside_the_eager_path():
    attn = headwise.MultiHeadAttention(24, 4, dtype=torch.float64).eval()
    x = torch.randn(1, 7, 24, dtype=torch.float64)
    with torch.no_grad(), headwise.trace(attn, capture=ALL + ("pattern", "q", "k")) as t:
        attn(x, causal=True)
    r = t[0]
    scores = r.q @ r.k.transpose(-2, -1) * attn.config.scale
    readable = torch.ones(7, 7, dtype=torch.bool).tril().expand(1, 4, 7, 7)
    close({n: getattr(r, n) for n in ALL}, from_pattern(r.pattern, scores, readable))


def test_decoding_with_a_cache_concatenates_rows_and_sums_key_weights():
    attn = headwise.MultiHeadAttention(24, 4, 2, dtype=torch.float64).eval()
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    cache = attn.new_cache(2, 12)
    with torch.no_grad(), headwise.trace(attn, capture=ALL) as whole:
        attn(x, causal=True)
    with torch.no_grad(), headwise.trace(attn, capture=ALL) as steps:
        attn(x[:, :4], cache=cache)
        for i in range(4, 9):
            attn(x[:, i:i + 1], cache=cache)
    assert len(steps[0].calls) == 6 and [c["key_weight"].shape[-1] for c in steps[0].calls] == [4, 5, 6, 7, 8, 9]
    close({n: getattr(steps[0], n) for n in ALL}, {n: getattr(whole[0], n).double() for n in ALL})


def test_key_weight_of_a_cache_that_drops_keys_is_refused_with_the_calls_named():
    with pytest.raises(ValueError, match=r"read \[5, 3\] keys.*\.calls\[i\]\['key_weight'\]"):
        concatenate("key_weight", [torch.ones(1, 1, 5), torch.ones(1, 1, 3)])


@pytest.mark.parametrize("name", ["lse", "key_weight"])
def test_concatenate_refuses_no_calls_and_calls_that_are_not_b_h_n(name):
    with pytest.raises(ValueError, match=rf"{name}: calls must hold at least one call's \(b, h, n\) tensor, got none"):
        concatenate(name, [])
    for calls, i, got in (([torch.ones(2, 3)], 0, r"\(2, 3\)"), ([torch.ones(2, 3), torch.ones(2, 3)], 0, r"\(2, 3\)"),
                          ([torch.ones(1, 1, 3), torch.ones(1, 1, 1, 3)], 1, r"\(1, 1, 1, 3\)"),
                          ([torch.ones(1, 1, 3), [1.0]], 1, "list")):
        want = rf"{name}: every call must be a \(b, h, n\) tensor, but call {i} is {got}$"
        with pytest.raises(ValueError, match=want):
            concatenate(name, calls)


def test_key_weight_of_a_rolling_window_that_stopped_growing_is_refused():
    # keys 2, 3, 4 then 4 again for one new query: the window dropped its oldest key
    calls = [torch.ones(1, 1, n) for n in (2, 3, 4, 4)]
    with pytest.raises(ValueError, match=r"read \[2, 3, 4, 4\] keys.*\.calls\[i\]\['key_weight'\]"):
        concatenate("key_weight", calls, [2, 1, 1, 1])


def test_key_weight_of_keys_read_again_or_recomputed_sums_per_position():
    a, b = torch.rand(1, 1, 3, dtype=torch.float64), torch.rand(1, 1, 3, dtype=torch.float64)
    torch.testing.assert_close(concatenate("key_weight", [a, b], [2, 1]), a + b)  # cross-attention: same keys
    c = torch.rand(1, 1, 4, dtype=torch.float64)  # a step, then a full recompute from position 0
    want = torch.cat([a, a.new_zeros(1, 1, 1)], -1) + c
    torch.testing.assert_close(concatenate("key_weight", [a, c], [3, 4]), want)


def test_cross_attention_decoding_sums_key_weight_over_the_same_keys():
    attn = headwise.MultiHeadAttention(24, 4, dtype=torch.float64).eval()
    x, enc = torch.randn(1, 5, 24, dtype=torch.float64), torch.randn(1, 6, 24, dtype=torch.float64)
    with torch.no_grad(), headwise.trace(attn, capture=("key_weight",)) as whole:
        attn(x, context=enc)
    with torch.no_grad(), headwise.trace(attn, capture=("key_weight",)) as steps:
        attn(x[:, :3], context=enc)
        attn(x[:, 3:4], context=enc)
        attn(x[:, 4:], context=enc)
    torch.testing.assert_close(steps[0].key_weight, whole[0].key_weight)


def test_bad_statistic_names_are_refused_with_the_choices():
    attn = headwise.MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match="not capturable; choose from.*'entropy'"):
        headwise.trace(attn, capture=("entropie",))
    with pytest.raises(ValueError, match=r"\['lse2'\] are not statistics; choose from"):
        attn.explain_dispatch(torch.randn(1, 3, 16), statistics=("lse2",))
    with pytest.raises(TypeError, match="statistics takes names"):
        attn.explain_dispatch(torch.randn(1, 3, 16), statistics=3)


def test_empty_calls_give_the_statistics_of_rows_that_read_nothing():
    attn = headwise.MultiHeadAttention(16, 4).eval()
    with torch.no_grad(), headwise.trace(attn, capture=ALL) as t:
        attn.attend(torch.randn(2, 4, 3, 4), torch.randn(2, 4, 0, 4), torch.randn(2, 4, 0, 4))
    assert torch.equal(t[0].lse, torch.full((2, 4, 3), -math.inf))
    assert t[0].key_weight.shape == (2, 4, 0) and not t[0].entropy.any()


# -- patched models -------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _gemma2():
    from tests.interop.test_hf_interface_trace import build

    return build("gemma2", "eager")  # softcap 2.0 and a sliding window of 3 on alternate layers


def _family(name: str):
    if name == "gemma2":
        return _gemma2(), {"input_ids": torch.tensor([[1, 5, 7, 3, 9, 11, 4], [2, 4, 6, 8, 10, 12, 3]]),
                           # right padding: under Gemma 2's eager rule a padded query row still reads a real key
                           "attention_mask": torch.tensor([[1] * 7, [1, 1, 1, 1, 1, 0, 0]])}
    from tests.interop.tiny_models import build, inputs

    return build(name), inputs(s=7)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_patched_families_equal_float64_of_their_own_pattern(family):
    model, batch = _family(family)
    model = headwise.interop.patch(model.double())
    with torch.no_grad(), headwise.trace(model, capture=ALL) as fused:
        out = model(**batch).logits
    assert fused.materializes_probabilities == []
    with torch.no_grad(), headwise.trace(model, capture=("pattern", "q", "k")) as eager:
        want_out = model(**batch).logits
    torch.testing.assert_close(out, want_out)
    _compare_layers(model, fused, eager)


def _compare_layers(model, fused, eager) -> None:  # type: ignore[no-untyped-def]
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    for i, (name, layer) in enumerate(headwise.interop.layers(model)):
        r = eager[i]
        g = r.q.shape[1] // r.k.shape[1]
        scale = getattr(model.get_submodule(name), "scaling", layer.config.scale)
        scores = r.q @ r.k.repeat_interleave(g, 1).transpose(-2, -1) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        readable = r.pattern > 0  # float64 weights underflow nowhere in these small models
        close({n: getattr(fused[i], n) for n in ALL}, from_pattern(r.pattern, scores, readable), rtol=1e-6, atol=1e-8)


def test_patched_minilm_with_padding_equals_float64_of_its_own_pattern():
    from headwise.viz import load_minilm

    tokenizer, model = load_minilm()
    model = headwise.interop.patch(model.double())
    batch = tokenizer(["A man is playing a guitar on the stage tonight.", "A woman reads."], return_tensors="pt",
                      padding=True)
    with torch.no_grad(), headwise.trace(model, capture=ALL) as fused:
        model(**batch)
    with torch.no_grad(), headwise.trace(model, capture=("pattern", "q", "k")) as eager:
        model(**batch)
    _compare_layers(model, fused, eager)
    real = batch["attention_mask"].bool()
    # every row reads the real tokens of its sentence only: the key weights of padding are 0, and the weights
    # of the real keys add up to the number of rows (padding rows read the real tokens too)
    kw = fused[0].key_weight  # (b, h, s)
    assert not kw[1][:, ~real[1]].any()
    torch.testing.assert_close(kw.sum(-1), torch.full_like(kw.sum(-1), float(real.shape[1])))


def test_generate_concatenates_like_z_and_key_weight_is_each_keys_total():
    from tests.interop.tiny_models import build

    model = headwise.interop.patch(build("llama").double())
    ids = torch.tensor([[5, 9, 3, 12, 7]])
    with torch.no_grad(), headwise.trace(model, capture=ALL) as t:
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert len(t[0].calls) == 4  # the prompt, then one call per new token but the last
    seen = out[:, :-1]  # every token the model read
    with torch.no_grad(), headwise.trace(model, capture=ALL) as forced:
        model(seen)
    for i in range(len(t)):
        close({n: getattr(t[i], n) for n in ALL}, {n: getattr(forced[i], n).double() for n in ALL},
              rtol=1e-6, atol=1e-8)
    assert t[0].lse.shape == (1, model.config.num_attention_heads, seen.shape[1])


def test_generate_under_a_rolling_sliding_window_refuses_the_key_weight_sum():
    cfg = transformers.MistralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                     num_hidden_layers=1, intermediate_size=64, vocab_size=50, sliding_window=4,
                                     pad_token_id=0)
    torch.manual_seed(0)
    model = headwise.interop.patch(transformers.MistralForCausalLM(cfg).eval())
    with torch.no_grad(), headwise.trace(model, capture=("key_weight", "lse")) as t:
        model.generate(input_ids=torch.tensor([[5, 9]]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    lengths = [c["key_weight"].shape[-1] for c in t[0].calls]
    assert lengths[-1] == lengths[-2]  # the window rolled
    with pytest.raises(ValueError, match="rolling sliding-window"):
        t[0].key_weight
    assert t[0].lse.shape[-1] == 2 + len(lengths) - 1  # the rows still concatenate


def test_statistics_of_calls_with_different_batch_sizes_are_refused_naming_both_shapes():
    with pytest.raises(ValueError, match=r"call 0 is \(2, 1, 3\) and call 1 is \(1, 1, 3\)"):
        concatenate("key_weight", [torch.ones(2, 1, 3), torch.ones(1, 1, 3)])
    with pytest.raises(ValueError, match=r"call 0 is \(1, 1, 3\) and call 1 is \(2, 1, 3\)"):
        concatenate("key_weight", [torch.ones(1, 1, 3), torch.ones(2, 1, 3)])
    attn = headwise.MultiHeadAttention(8, 2).eval()
    with torch.no_grad(), headwise.trace(attn, capture=("key_weight", "lse")) as t:
        attn(torch.randn(2, 3, 8))
        attn(torch.randn(1, 3, 8))
    for name in ("key_weight", "lse"):
        with pytest.raises(ValueError, match=r"call 0 is \(2, 2, 3\) and call 1 is \(1, 2, 3\)"):
            t[0].get(name)
    assert [c["key_weight"].shape[0] for c in t[0].calls] == [2, 1]  # each call's own stays readable


def test_statistics_with_a_mask_compile_in_one_graph_to_the_eager_numbers():
    from torch._dynamo.testing import CompileCounter

    attn = headwise.MultiHeadAttention(16, 4, dtype=torch.float64).eval()
    q, k, v = _qkv(2, 4, 4, 5, 5, d=4)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[..., 0] = False  # a key no row reads
    mask[1, :, 2] = False  # a row that reads nothing
    _, want = reference_statistics(q, k, v, scale=attn.config.scale, mask=mask)
    for capture in (("lse", "key_weight"), ALL):
        torch._dynamo.reset()
        counter = CompileCounter()
        with torch.no_grad(), headwise.trace(attn, capture=capture) as compiled:
            torch.compile(lambda q, k, v: attn.attend(q, k, v, mask=mask), backend=counter, fullgraph=True)(q, k, v)
        assert counter.frame_count == 1
        close({n: compiled[0].get(n) for n in capture}, {n: want[n] for n in capture})
    torch._dynamo.reset()


def test_compiled_decode_steps_capture_key_weight_and_pattern_over_the_whole_cache_buffer():
    # One graph serves every position, so a compiled step reads the whole buffer: its captures span max_len,
    # equal to one causal pass on the written positions and zero past them (docs/statistics.md, "Compiled").
    from headwise import DecodeStep

    torch._dynamo.reset()
    attn = headwise.MultiHeadAttention(24, 4, 2, dtype=torch.float64).eval()
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    cache = attn.new_cache(2, 12)
    with torch.no_grad(), headwise.trace(attn, capture=("key_weight", "pattern")) as whole:
        attn(x, causal=True)
    with torch.no_grad(), headwise.trace(attn, capture=("key_weight", "pattern")) as steps:
        attn(x[:, :4], cache=cache)
        step = torch.compile(DecodeStep(attn, cache), backend="eager", fullgraph=True, dynamic=False)
        for i in range(4, 9):
            step(x[:, i:i + 1])
    key_weight, pattern = steps[0].key_weight, steps[0].calls[-1]["pattern"]
    assert key_weight.shape == (2, 4, 12) and pattern.shape == (2, 4, 1, 12)
    torch.testing.assert_close(key_weight[..., :9], whole[0].key_weight)
    torch.testing.assert_close(pattern[..., :9], whole[0].pattern[:, :, 8:9])
    assert not key_weight[..., 9:].any() and not pattern[..., 9:].any()
    torch._dynamo.reset()
