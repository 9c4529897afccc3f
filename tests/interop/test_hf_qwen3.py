"""Qwen3 (per-head RMSNorm on Q and K, "QK-norm"): patch, generate, heads that apply the norm, from_hf/to_hf.

Peers: the unpatched Qwen3 model, and a float64 per-head reference written from the formula (projection,
per-head RMSNorm, rotary, causal softmax).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from headwise import MultiHeadAttention  # noqa: E402
from headwise.interop import from_hf, layers, patch, to_hf  # noqa: E402
from headwise.interop.hf.qk_norm import QKNormAttention, QKNormHead  # noqa: E402

from tests.interop.tiny_models import build, inputs  # noqa: E402


def left_padded(seed: int = 3) -> dict[str, torch.Tensor]:
    batch = inputs(seed, b=3, s=7)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :1] = 0
    return {"input_ids": batch["input_ids"], "attention_mask": mask}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_generate_and_attentions_identical(impl):
    model = build("qwen3", impl, layer_types=["full_attention", "sliding_attention"], sliding_window=3,
                  use_sliding_window=True)
    batch = left_padded()
    kw = dict(**batch, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    want = model.generate(**kw)
    with torch.no_grad():
        ref = model(**batch, output_attentions=True, output_hidden_states=True)
    patch(model)
    assert torch.equal(model.generate(**kw), want)
    with torch.no_grad():
        got = model(**batch, output_attentions=True, output_hidden_states=True)
    torch.testing.assert_close(got.logits, ref.logits)
    if impl == "eager":  # HF's sdpa returns no weights
        for g, w in zip(got.attentions, ref.attentions, strict=True):
            torch.testing.assert_close(g, w)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_head(module: nn.Module, x: torch.Tensor, h: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Head h of a Qwen3Attention from the formula, float64: q = RMSNorm_q(x W_Q^h + b), k likewise with the
    group's K/V head, rotary (half rotation), causal softmax(q k^T / sqrt(d_h)) v."""
    d_h, group = module.head_dim, module.num_key_value_groups
    rows_q, rows_kv = slice(h * d_h, (h + 1) * d_h), slice((h // group) * d_h, (h // group + 1) * d_h)
    x = x.double()

    def proj(layer: nn.Linear, rows: slice) -> torch.Tensor:
        out = x @ layer.weight.double()[rows].T
        return out if layer.bias is None else out + layer.bias.double()[rows]

    q = rms(proj(module.q_proj, rows_q), module.q_norm.weight.double(), module.q_norm.variance_epsilon)
    k = rms(proj(module.k_proj, rows_kv), module.k_norm.weight.double(), module.k_norm.variance_epsilon)
    v = proj(module.v_proj, rows_kv)
    s = x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d_h, 2, dtype=torch.float64) / d_h)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv  # (s, d_h / 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rot(t: torch.Tensor) -> torch.Tensor:
        t1, t2 = t[..., :d_h // 2], t[..., d_h // 2:]
        return t * cos + torch.cat([-t2, t1], -1) * sin

    scores = rot(q) @ rot(k).transpose(-1, -2) / d_h ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    weights = scores.softmax(-1)
    return weights @ v, weights


def test_each_head_alone_applies_its_qk_norm():
    model = build("qwen3", "eager").double()
    ids = inputs(5)["input_ids"][:1]
    seen = {}
    module = model.model.layers[1].self_attn
    module.register_forward_pre_hook(lambda m, a, kw: seen.update(x=kw["hidden_states"]), with_kwargs=True)
    module.register_forward_hook(lambda m, a, out: seen.update(y=out[0]))
    with torch.no_grad():
        model(input_ids=ids)
    want_y = seen["y"]
    patch(model)
    attn = layers(model)[1][1]
    assert attn.q_norm is module.q_norm and attn.k_norm is module.k_norm
    theta = model.config.rope_parameters["rope_theta"]
    x = seen["x"]
    contexts = []
    for h in range(attn.n_heads):
        head = attn.head(h)
        assert isinstance(head, QKNormHead)
        z, w = head(x, causal=True, return_weights=True)
        want_z, want_w = reference_head(module, x[0], h, theta)
        torch.testing.assert_close(w[0], want_w)
        torch.testing.assert_close(z[0], want_z)
        contexts.append(z)
        plain = MultiHeadAttention.head(attn, h)  # the core's head, which knows no norm: differs
        assert not torch.allclose(plain(x, causal=True), z)
    with torch.no_grad():
        torch.testing.assert_close(attn.out_proj(torch.cat(contexts, -1)), want_y)  # heads + W_O = HF's layer
        torch.testing.assert_close(attn(x, causal=True), want_y)  # the layer alone, its own rotary
    standalone = attn.head(2).detach_copy()
    assert isinstance(standalone, QKNormHead) and standalone.q_norm is not module.q_norm
    torch.testing.assert_close(standalone(x, causal=True), contexts[2])


def test_from_hf_and_to_hf():
    model = build("qwen3", "eager")
    module = model.model.layers[0].self_attn
    attn = from_hf(module)
    assert isinstance(attn, QKNormAttention) and attn.q_norm is not module.q_norm
    torch.testing.assert_close(attn.q_norm.weight, module.q_norm.weight, rtol=0, atol=0)
    x = torch.randn(2, 6, 24)
    pos = torch.arange(6)[None].expand(2, -1)
    causal = torch.full((6, 6), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        want, _ = module(x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=causal)
        torch.testing.assert_close(attn(x, causal=True), want)
    back = to_hf(attn, like=module)
    assert type(back) is type(module)
    want_state, got_state = module.state_dict(), back.state_dict()
    assert list(got_state) == list(want_state) and all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    edited = copy.deepcopy(attn)
    with torch.no_grad():
        edited.k_norm.weight.mul_(2)
    torch.testing.assert_close(to_hf(edited, like=module).k_norm.weight, 2 * module.k_norm.weight)
    with pytest.raises(ValueError, match="has per-head q_norm/k_norm and the layer has none"):
        to_hf(MultiHeadAttention.from_config(attn.config), like=module)
    llama = build("llama").model.layers[0].self_attn
    with pytest.raises(ValueError, match="cannot write this"):
        to_hf(attn, like=llama)


def test_qk_norm_heads_run_alone_on_separate_key_and_value_and_sum_to_the_layer():
    torch.manual_seed(0)
    norm = [nn.LayerNorm(8, dtype=torch.float64) for _ in range(2)]
    attn = QKNormAttention(d_model=32, n_heads=4, kdim=24, vdim=20, q_norm=norm[0], k_norm=norm[1],
                           dtype=torch.float64).eval()
    x, k, v = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 7, 24, dtype=torch.float64), \
        torch.randn(2, 7, 20, dtype=torch.float64)
    with torch.no_grad():
        contexts = [attn.head(h)(x, key=k, value=v) for h in range(attn.n_heads)]  # (b, s_q, d_h) each
        for h, z in enumerate(contexts):  # each head from the formula, norms on q and k
            sl = slice(8 * h, 8 * h + 8)
            q = attn.q_norm(x @ attn.q_proj.weight[sl].T + attn.q_proj.bias[sl])
            key = attn.k_norm(k @ attn.k_proj.weight[sl].T + attn.k_proj.bias[sl])
            val = v @ attn.v_proj.weight[sl].T + attn.v_proj.bias[sl]
            torch.testing.assert_close(z, torch.softmax(q @ key.transpose(1, 2) / 8 ** 0.5, -1) @ val)
        torch.testing.assert_close(attn.out_proj(torch.cat(contexts, -1)), attn(x, key=k, value=v))


def _random_norm(width: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(width, dtype=torch.float64)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(torch.randn_like(p))
    return norm


def test_from_heads_packs_the_heads_norms_and_a_plain_layer_refuses_them():
    torch.manual_seed(0)
    attn = QKNormAttention(d_model=16, n_heads=4, n_kv_heads=2, q_norm=_random_norm(4), k_norm=_random_norm(4),
                           dtype=torch.float64).eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        want = attn(x, causal=True)
        for heads in (attn.heads(), [h.detach_copy() for h in attn.heads()]):  # views, and standalone copies
            packed = QKNormAttention.from_heads(heads, out_proj=attn.out_proj)
            assert packed.q_norm is not attn.q_norm  # copied: the new layer owns its norms
            torch.testing.assert_close(packed(x, causal=True), want)
    with pytest.raises(ValueError, match=r"head 0 normalises its queries and keys \(q_norm, k_norm\), which "
                                         r"MultiHeadAttention .*QKNormAttention\.from_heads"):
        MultiHeadAttention.from_heads(attn.heads(), out_proj=attn.out_proj)
    # identity norms (q_norm=None) compute what plain heads do: a plain layer packs them
    plain = QKNormAttention(d_model=16, n_heads=4, n_kv_heads=2, dtype=torch.float64).eval()
    with torch.no_grad():
        torch.testing.assert_close(MultiHeadAttention.from_heads(plain.heads(), out_proj=plain.out_proj)(x, causal=True),
                                   plain(x, causal=True))
    odd = [h.detach_copy() for h in attn.heads()]
    with torch.no_grad():
        odd[3].k_norm.weight.mul_(2)
    gap = (odd[3].k_norm.weight - odd[0].k_norm.weight).abs().max().item()  # the reprs alone read alike
    with pytest.raises(ValueError, match=rf"head 3 has k_norm=.* \(its weight differs by up to {gap:.3g}\) but "
                                         "head 0 has k_norm="):
        QKNormAttention.from_heads(odd, out_proj=attn.out_proj)


def test_from_heads_on_a_patched_layer_builds_a_standalone_layer_with_the_modules_norms():
    torch.manual_seed(0)
    model = build("qwen3", "eager").double()
    module = model.model.layers[0].self_attn
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    pos = torch.arange(6)[None].expand(2, -1)
    causal = torch.full((6, 6), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        want, _ = module(x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=causal)
    view = layers(patch(model))[0][1]
    out_proj = nn.Linear(view.n_heads * view.d_head, 24, bias=False, dtype=torch.float64)
    with torch.no_grad():
        out_proj.weight.copy_(module.o_proj.weight)
        packed = view.from_heads(view.heads(), out_proj=out_proj)
        assert type(packed) is QKNormAttention and packed.q_norm is not module.q_norm
        torch.testing.assert_close(packed(x, causal=True), want)
