"""Captures are the tensors the forward used: their gradients equal what plain hooks on the unpatched model
see (GPT-2, Llama with GQA), and on a bare layer what the layer's own projections see."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import MultiHeadAttention

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402


def loss_of(out):
    return (out.logits[:, :, 7] - out.logits[:, :, 11]).square().sum()


def test_gpt2_gradients_of_q_k_v_pattern_z_equal_hooks_on_the_unpatched_model():
    model = ref.gpt2("eager")
    plain = ref.twin(model)
    patch(model)
    kw = {**ref.inputs(model), "use_cache": False}
    b, s, h, d_h = 2, 6, 4, 6
    seen = {}
    handles = []
    for li, block in enumerate(plain.transformer.h):
        handles.append(block.attn.c_attn.register_forward_hook(
            lambda m, a, out, li=li: seen.__setitem__(("qkv", li), out)))
        handles.append(block.attn.c_proj.register_forward_pre_hook(
            lambda m, a, li=li: seen.__setitem__(("z", li), a[0])))
    out = plain(**kw, output_attentions=True)
    wanted = [seen[("qkv", li)] for li in range(2)] + [seen[("z", li)] for li in range(2)] + list(out.attentions)
    grads = torch.autograd.grad(loss_of(out), wanted)
    for hd in handles:
        hd.remove()
    with headwise.trace(model, capture=("q", "k", "v", "pattern", "z")) as t:
        got = model(**kw)
    captured = [t[li].get(w) for w in ("q", "k", "v", "pattern", "z") for li in range(2)]
    g = dict(zip([(w, li) for w in ("q", "k", "v", "pattern", "z") for li in range(2)],
                 torch.autograd.grad(loss_of(got), captured)))
    for li in range(2):
        per_site = grads[li].view(b, s, 3, h, d_h)  # c_attn's output: [q | k | v], each (b, s, h, d_h)
        for j, w in enumerate("qkv"):
            torch.testing.assert_close(g[(w, li)], per_site[:, :, j].transpose(1, 2))  # (b, h, s, d_h)
        torch.testing.assert_close(g[("z", li)], grads[2 + li].view(b, s, h, d_h))
        torch.testing.assert_close(g[("pattern", li)], grads[4 + li])


def test_llama_gqa_gradients_of_z_and_v_equal_hooks_on_the_unpatched_model():
    model = ref.llama("sdpa")
    plain = ref.twin(model)
    patch(model)
    kw = {**ref.inputs(model), "use_cache": False}
    seen = {}
    for li, layer in enumerate(plain.model.layers):
        layer.self_attn.v_proj.register_forward_hook(lambda m, a, out, li=li: seen.__setitem__(("v", li), out))
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, li=li: seen.__setitem__(("z", li), a[0]))
    grads = torch.autograd.grad(loss_of(plain(**kw)), [seen[(w, li)] for w in "vz" for li in range(2)])
    with headwise.trace(model, capture=("v", "z")) as t:
        got = model(**kw)
    g = torch.autograd.grad(loss_of(got), [t[li].get(w) for w in "vz" for li in range(2)])
    for li in range(2):
        torch.testing.assert_close(g[li], grads[li].view(2, 6, 2, 4).transpose(1, 2))  # (b, h_kv, s, d_h)
        torch.testing.assert_close(g[2 + li], grads[2 + li].view(2, 6, 6, 4))  # (b, s, h, d_h)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_bare_layer_gradients_of_every_capture(n_kv_heads):
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, n_kv_heads).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    direction = torch.randn(2, 5, 16, dtype=torch.float64)
    seen = {}
    handles = [getattr(attn, name).register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out))
               for name in ("q_proj", "k_proj", "v_proj")]
    handles.append(attn.out_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0])))
    want = torch.autograd.grad((attn(x, causal=True) * direction).sum(), [seen[n] for n in ("q_proj", "k_proj",
                                                                                           "v_proj", "z")])
    for hd in handles:  # the traced run has a plain W_O: its output is the sum of the captured results
        hd.remove()
    with headwise.trace(attn, capture=("q", "k", "v", "z", "result")) as t:
        y = attn(x, causal=True)
    r = t[0]
    gq, gk, gv, gz, gr = torch.autograd.grad((y * direction).sum(), [r.q, r.k, r.v, r.z, r.result])
    torch.testing.assert_close(gq, want[0].view(2, 5, 4, 4).transpose(1, 2))
    torch.testing.assert_close(gk, want[1].view(2, 5, n_kv_heads, 4).transpose(1, 2))
    torch.testing.assert_close(gv, want[2].view(2, 5, n_kv_heads, 4).transpose(1, 2))
    torch.testing.assert_close(gz, want[3].view(2, 5, 4, 4))
    torch.testing.assert_close(gr, direction[:, :, None].expand(2, 5, 4, 16))  # y = sum of results + bias
