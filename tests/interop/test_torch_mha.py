"""headwise <-> torch.nn.MultiheadAttention: same outputs, same weights, explicit mask conversions.

The peer is PyTorch's own nn.MultiheadAttention; every comparison is on whole tensors.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from headwise import AttentionConfig, MultiHeadAttention, RotaryEmbedding
from headwise.interop import from_torch, to_torch
from headwise.interop.torch_mha import torch_masks_to_headwise

DTYPES = [torch.float32, torch.float64]


def _randomize(m: nn.Module) -> nn.Module:
    # torch initialises in_proj_bias and out_proj.bias to zero; random biases make the bias mapping testable.
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m


def _mha(d=16, h=4, *, dtype=torch.float32, batch_first=True, bias=True, kdim=None, vdim=None, dropout=0.0):
    m = nn.MultiheadAttention(d, h, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first, dropout=dropout,
                              dtype=dtype)
    return _randomize(m).eval()


def _weights(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in m.state_dict().items()}


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == wb[k].dtype, k
        assert torch.equal(wa[k], wb[k]), k


# -- outputs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_self_attention_with_padding_equals_torch(dtype, batch_first, bias):
    m = _mha(dtype=dtype, batch_first=batch_first, bias=bias)
    attn = from_torch(m)
    assert attn.config.bias is bias and attn.q_proj.weight.dtype == dtype
    x = torch.randn(3, 6, 16, dtype=dtype)  # (b, s, d)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    kpm[2, :2] = True  # left padding
    xt = x if batch_first else x.transpose(0, 1)
    ref, _ = m(xt, xt, xt, key_padding_mask=kpm, need_weights=False)
    ref = ref if batch_first else ref.transpose(0, 1)
    out = attn(x, mask=torch_masks_to_headwise(key_padding_mask=kpm))
    torch.testing.assert_close(out, ref)
    # the same through the core helper the docs name
    from headwise.masks import padding_mask

    torch.testing.assert_close(attn(x, mask=padding_mask(keep=~kpm)), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bool_attn_mask_polarity_is_converted(dtype):
    m = _mha(dtype=dtype)
    attn = from_torch(m)
    x = torch.randn(2, 5, 16, dtype=dtype)
    blocked = torch.rand(5, 5) < 0.4  # torch: True = NOT allowed
    blocked.fill_diagonal_(False)  # every row keeps one key (torch gives NaN for empty rows)
    ref, _ = m(x, x, x, attn_mask=blocked, need_weights=False)
    converted = torch_masks_to_headwise(blocked)
    assert converted.dtype == torch.bool
    assert torch.equal(converted, ~blocked)  # headwise: True = may attend
    torch.testing.assert_close(attn(x, mask=converted), ref)
    # passing torch's mask unconverted is a different (wrong) layer: the conversion matters
    assert not torch.allclose(attn(x, mask=blocked | torch.eye(5, dtype=torch.bool)), ref)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("dtype", DTYPES)
def test_float_attn_mask_and_3d_per_head_mask(dtype):
    m = _mha(dtype=dtype)
    attn = from_torch(m)
    x = torch.randn(2, 5, 16, dtype=dtype)
    add = torch.randn(5, 5, dtype=dtype)
    add[0, 3] = float("-inf")
    ref, _ = m(x, x, x, attn_mask=add, need_weights=False)
    torch.testing.assert_close(attn(x, mask=torch_masks_to_headwise(add)), ref)
    per_head = torch.randn(2 * 4, 5, 5, dtype=dtype)  # (b * h, s_q, s_kv), torch's batch-major order
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    ref3, _ = m(x, x, x, attn_mask=per_head, key_padding_mask=kpm, need_weights=False)
    mask = torch_masks_to_headwise(per_head, kpm, n_heads=4)
    assert mask.shape == (2, 4, 5, 5) and mask.dtype == dtype
    torch.testing.assert_close(attn(x, mask=mask), ref3)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_padding", [False, True])
def test_is_causal_equals_headwise_causal(dtype, with_padding):
    m = _mha(dtype=dtype)
    attn = from_torch(m)
    x = torch.randn(2, 6, 16, dtype=dtype)
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=dtype)
    kpm = torch.tensor([[False] * 6, [False] * 4 + [True] * 2]) if with_padding else None
    ref, _ = m(x, x, x, attn_mask=causal, is_causal=True, key_padding_mask=kpm, need_weights=False)
    mask = torch_masks_to_headwise(key_padding_mask=kpm)
    torch.testing.assert_close(attn(x, mask=mask, causal=True), ref)
    torch.testing.assert_close(attn(x, mask=torch_masks_to_headwise(causal, kpm)), ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kdim,vdim", [(16, 16), (10, 10), (10, 7)])
def test_cross_attention_with_kdim_vdim(dtype, kdim, vdim):
    m = _mha(dtype=dtype, kdim=kdim, vdim=vdim)
    assert m._qkv_same_embed_dim == (kdim == vdim == 16)
    attn = from_torch(m)
    assert (attn.config.kdim, attn.config.vdim) == (kdim, vdim)
    q = torch.randn(2, 4, 16, dtype=dtype)
    k, v = torch.randn(2, 7, kdim, dtype=dtype), torch.randn(2, 7, vdim, dtype=dtype)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0, 5:] = True
    ref, ref_w = m(q, k, v, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    out, w = attn(q, key=k, value=v, mask=torch_masks_to_headwise(key_padding_mask=kpm), return_weights=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w, ref_w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("average", [True, False])
def test_need_weights_average_and_per_head(dtype, average):
    m = _mha(dtype=dtype)
    attn = from_torch(m)
    x = torch.randn(2, 5, 16, dtype=dtype)
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    ref, ref_w = m(x, x, x, key_padding_mask=kpm, need_weights=True, average_attn_weights=average)
    out, w = attn(x, mask=torch_masks_to_headwise(key_padding_mask=kpm), return_weights=True)
    assert w.shape == (2, 4, 5, 5)  # headwise: per head, never averaged
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w.mean(1) if average else w, ref_w)


def test_inference_fast_path_equals_headwise():
    # eval + no_grad + batch-first self-attention takes torch's fused native path, a different kernel
    m = _mha(dtype=torch.float32)
    attn = from_torch(m)
    x = torch.randn(2, 6, 16)
    kpm = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    with torch.no_grad():
        ref, _ = m(x, x, x, key_padding_mask=kpm, need_weights=False)
        out = attn(x, mask=torch_masks_to_headwise(key_padding_mask=kpm))
    torch.testing.assert_close(out, ref)


def test_train_mode_with_zero_dropout_and_gradients_match():
    m = _mha(dtype=torch.float64).train()
    attn = from_torch(m)
    assert attn.training
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    ref, _ = m(x, x, x, need_weights=False)
    out = attn(x)
    torch.testing.assert_close(out, ref)
    ref.square().sum().backward()
    out.square().sum().backward()
    torch.testing.assert_close(attn.q_proj.weight.grad, m.in_proj_weight.grad[:16])
    torch.testing.assert_close(attn.v_proj.weight.grad, m.in_proj_weight.grad[32:])
    torch.testing.assert_close(attn.out_proj.weight.grad, m.out_proj.weight.grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_first", [True, False])
def test_unbatched_input(dtype, batch_first):
    m = _mha(dtype=dtype, batch_first=batch_first)
    attn = from_torch(m)
    x = torch.randn(5, 16, dtype=dtype)  # (s, d): batch_first does not apply
    kpm = torch.tensor([False, False, False, True, False])
    ref, ref_w = m(x, x, x, key_padding_mask=kpm, average_attn_weights=False)
    out, w = attn(x, mask=torch_masks_to_headwise(key_padding_mask=kpm), return_weights=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w, ref_w)


# -- what cannot be converted ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,named", [({"add_bias_kv": True}, "add_bias_kv"),
                                          ({"add_zero_attn": True}, "add_zero_attn")])
def test_unmodelled_features_raise_naming_them(kwargs, named):
    m = nn.MultiheadAttention(16, 4, **kwargs)
    with pytest.raises(ValueError, match=named):
        from_torch(m)


@pytest.mark.parametrize("make,named", [
    (lambda: MultiHeadAttention(16, 4, n_kv_heads=2), "GQA"),
    (lambda: MultiHeadAttention(16, 4, n_kv_heads=1), "MQA"),
    (lambda: MultiHeadAttention(16, 4, d_head=8), "d_head"),
    (lambda: MultiHeadAttention.from_config(AttentionConfig(16, 4, out_bias=False)), "out_bias"),
    (lambda: MultiHeadAttention.from_config(AttentionConfig(16, 4, scale=0.1)), "scale"),
    (lambda: MultiHeadAttention(16, 4, rotary=RotaryEmbedding(4)), "rotary"),
])
def test_to_torch_refuses_what_torch_cannot_express(make, named):
    with pytest.raises(ValueError, match=named):
        to_torch(make())


def test_to_torch_refuses_per_head_qk_norms_and_overridden_forward_steps():
    # A QK-norm layer (what from_hf builds for Qwen3) computes another function than nn.MultiheadAttention would
    # with its weights: converting it must refuse, not drop the norms.
    from headwise.interop.hf.qk_norm import QKNormAttention

    qk = QKNormAttention(d_model=16, n_heads=4, q_norm=nn.RMSNorm(4), k_norm=nn.RMSNorm(4))
    with pytest.raises(ValueError, match=r"per-head Q/K norms \(q_norm=RMSNorm, k_norm=RMSNorm\)"):
        to_torch(qk)

    class Sharpened(MultiHeadAttention):  # any other override of a forward step is named
        def project_q(self, x):
            return 2 * super().project_q(x)

    with pytest.raises(ValueError, match=r"Sharpened\.project_q"):
        to_torch(Sharpened(16, 4))
    patched = MultiHeadAttention(16, 4)  # a step assigned on the instance shadows the class's, as an override does
    plain = MultiHeadAttention.project_out
    patched.project_out = types.MethodType(lambda self, z, results=None: 2 * plain(self, z, results), patched)
    with pytest.raises(ValueError, match=r"MultiHeadAttention overrides the forward steps project_out \(set on the "
                                         r"instance\)"):
        to_torch(patched)
    tripled = MultiHeadAttention(16, 4)  # a projection whose forward is assigned computes more than F.linear
    lin = tripled.q_proj
    lin.forward = lambda inp: 3 * nn.functional.linear(inp, lin.weight, lin.bias)
    with pytest.raises(ValueError, match=r"q_proj=torch\.nn\.modules\.linear\.Linear with a forward set on the "
                                         r"instance"):
        to_torch(tripled)


@pytest.mark.parametrize("bias,name,named", [(False, "q_proj", "q_proj has a bias but bias=False"),
                                              (True, "k_proj", "k_proj has no bias but bias=True"),
                                              (True, "out_proj", "out_proj has no bias but out_bias=True")])
def test_to_torch_refuses_projection_biases_that_disagree_with_the_config(bias, name, named):
    # nn.MultiheadAttention takes its biases from one flag: a swapped-in bias would be dropped, a missing one absent.
    attn = MultiHeadAttention(16, 4, bias=bias)
    setattr(attn, name, nn.Linear(16, 16, bias=not bias))
    with pytest.raises(ValueError, match=f"projection biases that disagree with the config \\({named}\\)"):
        to_torch(attn)
    torch.manual_seed(0)
    agreeing = MultiHeadAttention(16, 4, bias=bias).eval()
    agreeing.v_proj = nn.Linear(16, 16, bias=bias)  # a swapped-in projection that agrees converts, output unchanged
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(to_torch(agreeing).eval()(x, x, x, need_weights=False)[0], agreeing(x))


# PEFT asks transformers a deprecated question; not ours to fix.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_to_torch_refuses_projections_that_are_not_a_linear_and_copies_no_hooks():
    # to_torch copies weights and biases only: a LoRA delta or another module would be silently dropped.
    peft = pytest.importorskip("peft")

    class Host(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = MultiHeadAttention(16, 4)

    host = Host()
    peft.get_peft_model(host, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    with pytest.raises(ValueError, match=r"not an nn.Linear.s F.linear \(q_proj=peft\.[\w.]+\.Linear \(an adapter, "
                                         r"whose delta is not in the weight to_torch copies\)\).*merge_and_unload"):
        to_torch(host.attn)
    seq = MultiHeadAttention(16, 4)
    seq.k_proj = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match=r"\(k_proj=torch\.nn\.modules\.container\.Sequential\)"):
        to_torch(seq)
    torch.manual_seed(0)
    hooked = MultiHeadAttention(16, 4).eval()
    handle = hooked.v_proj.register_forward_hook(lambda m, args, out: 2 * out)
    x = torch.randn(2, 5, 16)
    # a hook is not the module's weights: the copy computes the bare layer, as a copy of its state_dict would
    converted = to_torch(hooked).eval()
    handle.remove()
    torch.testing.assert_close(converted(x, x, x, need_weights=False)[0], hooked(x))


def test_to_torch_of_a_shared_view_equals_the_viewed_module():
    # The view's fused QKV override computes the plain function: it still converts, to the same outputs.
    m = _mha()
    back = to_torch(from_torch(m, share=True)).eval()
    x = torch.randn(2, 5, 16)
    _assert_same_weights(m, back)
    torch.testing.assert_close(back(x, x, x, need_weights=False)[0], m(x, x, x, need_weights=False)[0])


def test_wrong_types_raise():
    with pytest.raises(TypeError, match="MultiheadAttention"):
        from_torch(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        to_torch(nn.MultiheadAttention(8, 2))
    with pytest.raises(ValueError, match="n_heads"):
        torch_masks_to_headwise(torch.zeros(8, 3, 3, dtype=torch.bool))
    # A truthy str would silently pick batch-first (to_torch) or a shared view (from_torch).
    with pytest.raises(TypeError, match=r"batch_first must be a bool, got 'False' \(str\)"):
        to_torch(MultiHeadAttention(16, 4), batch_first="False")
    with pytest.raises(TypeError, match=r"share must be a bool, got 'False' \(str\)"):
        from_torch(nn.MultiheadAttention(16, 4), share="False")


@pytest.mark.parametrize("n_heads,error,got", [(0, ValueError, "0"), (-4, ValueError, "-4"),
                                              (2.0, TypeError, r"2\.0 \(float\)"), (True, TypeError, r"True \(bool\)"),
                                              ("4", TypeError, r"'4' \(str\)")])
def test_n_heads_of_a_3d_attn_mask_must_be_a_positive_int(n_heads, error, got):
    per_head = torch.randn(8, 5, 5)  # (b * h, s_q, s_kv), b = 2, h = 4
    with pytest.raises(error, match=f"n_heads must be a positive int.*, got {got}"):
        torch_masks_to_headwise(per_head, n_heads=n_heads, query=torch.randn(2, 5, 16))
    torch.testing.assert_close(torch_masks_to_headwise(per_head, n_heads=4), per_head.view(2, 4, 5, 5))


# -- round trips ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"kdim": 10, "vdim": 7}, {"kdim": 5, "vdim": 5, "bias": False},
                                {"batch_first": False, "dropout": 0.1}])
def test_torch_round_trip_is_exact(dtype, kw):
    m = _mha(dtype=dtype, **kw)
    back = to_torch(from_torch(m), batch_first=m.batch_first)
    assert back._qkv_same_embed_dim == m._qkv_same_embed_dim
    assert (back.kdim, back.vdim, back.dropout, back.batch_first) == (m.kdim, m.vdim, m.dropout, m.batch_first)
    _assert_same_weights(m, back)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", [AttentionConfig(16, 4), AttentionConfig(16, 2, bias=False),
                                 AttentionConfig(16, 4, kdim=6, vdim=9), AttentionConfig(12, 3, dropout=0.2)])
def test_headwise_round_trip_is_exact(dtype, cfg):
    attn = MultiHeadAttention.from_config(cfg, dtype=dtype)
    _randomize(attn)
    back = from_torch(to_torch(attn))
    assert back.config == attn.config
    _assert_same_weights(attn, back)
    x = torch.randn(2, 3, cfg.d_model, dtype=dtype)
    attn.eval(), back.eval()
    k, v = torch.randn(2, 4, cfg.kdim, dtype=dtype), torch.randn(2, 4, cfg.vdim, dtype=dtype)
    assert torch.equal(attn(x, key=k, value=v), back(x, key=k, value=v))


# -- share=True: a view of the module's own parameters -------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"kdim": 10, "vdim": 7}])
def test_shared_layer_is_a_view_gradients_and_steps_reach_both(kw):
    m = _mha(**kw)
    view = from_torch(m, share=True)
    copied = from_torch(m)  # the default stays a copy
    assert {id(p) for p in view.parameters()} == {id(p) for p in m.parameters()}
    assert not {id(p) for p in copied.parameters()} & {id(p) for p in m.parameters()}
    x = torch.randn(3, 5, 16)
    k, v = torch.randn(3, 4, m.kdim), torch.randn(3, 4, m.vdim)
    kpm = torch.zeros(3, 4, dtype=torch.bool)
    kpm[1, 3:] = True
    mask = torch_masks_to_headwise(key_padding_mask=kpm, query=x, key=k)

    def ours() -> torch.Tensor:
        return view(x, key=k, value=v, mask=mask)

    def torch_own() -> torch.Tensor:
        return m(x, k, v, key_padding_mask=kpm, need_weights=False)[0]

    torch.testing.assert_close(ours(), torch_own())
    ours().square().sum().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    torch_own().square().sum().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=n)  # gradients through the view land on m's parameters
    opt = torch.optim.SGD(view.parameters(), lr=0.1)
    opt.step()  # a step through the view is a step of m
    torch.testing.assert_close(ours(), torch_own())
    with torch.no_grad():
        m.out_proj.weight.mul_(0.5)  # and an edit of m is seen by the view
    torch.testing.assert_close(ours(), torch_own())
    assert not torch.allclose(copied(x, key=k, value=v, mask=mask), torch_own())  # the copy went stale


def test_from_heads_on_a_shared_layer_packs_a_standalone_layer():
    m = _mha(dtype=torch.float64)
    view = from_torch(m, share=True)
    out_proj = nn.Linear(16, 16, dtype=torch.float64)
    out_proj.load_state_dict(m.out_proj.state_dict())
    packed = view.from_heads(view.heads(), out_proj=out_proj)
    assert type(packed) is MultiHeadAttention
    assert not {id(p) for p in packed.parameters()} & {id(p) for p in m.parameters()}  # copies, not views
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), m(x, x, x, need_weights=False)[0])


def test_shared_layer_heads_write_through_and_follow_train_mode():
    m = _mha(dropout=0.5)
    view = from_torch(m, share=True)
    assert view.head(2).w_q.data_ptr() == m.in_proj_weight[8:12].data_ptr()
    new = torch.randn(16, 4)
    view.head(2).w_k = new  # (d, d_h): x @ w_k are head 2's keys
    torch.testing.assert_close(m.in_proj_weight[16 + 8:16 + 12], new.T, rtol=0, atol=0)
    assert not view.training and not m.training
    m.train()
    assert view.training
    view.eval()
    assert not m.training
    assert "view of MultiheadAttention (MultiheadAttention: q_proj=in_proj_weight[0:16]" in repr(view)
    with pytest.raises(TypeError, match="is a view"):
        view.q_proj = nn.Linear(16, 16)


def test_key_padding_mask_is_checked_against_the_query():
    kpm = torch.tensor([False, True, False])
    batched, single = torch.randn(2, 4, 16), torch.randn(4, 16)
    m = nn.MultiheadAttention(16, 4, batch_first=True)
    with pytest.raises(AssertionError, match="expected `key_padding_mask` to be `None` or 2-D"):  # torch refuses too
        m(batched, batched[:, :3], batched[:, :3], key_padding_mask=kpm)
    with pytest.raises(ValueError, match=r"key_padding_mask \(3,\) is 1-D .* the query \(2, 4, 16\) is batched"):
        torch_masks_to_headwise(key_padding_mask=kpm, query=batched)
    with pytest.raises(ValueError, match=r"key_padding_mask \(2, 3\) must be 1-D \(s_kv,\) for an unbatched "
                                         r"query, got the query \(4, 16\)"):
        torch_masks_to_headwise(key_padding_mask=kpm.expand(2, 3), query=single)
    with pytest.raises(ValueError, match=r"key_padding_mask \(3, 3\) has b=3 but the query \(2, 4, 16\) has b=2"):
        torch_masks_to_headwise(key_padding_mask=kpm.expand(3, 3), query=batched)
    ok = torch_masks_to_headwise(key_padding_mask=kpm, query=single, key=single[:3])  # 3 keys: cross-attention
    assert ok.shape == (1, 1, 1, 3) and ok[0, 0, 0].tolist() == [True, False, True]


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_masks_are_checked_against_the_query_and_key_lengths_as_torch_checks_them(batched):
    m = nn.MultiheadAttention(16, 4, kdim=10, vdim=10, batch_first=True, dtype=torch.float64).eval()
    attn = from_torch(m)
    q, k = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 7, 10, dtype=torch.float64)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    blocked = torch.zeros(5, 7, dtype=torch.bool)
    blocked[0, 3] = True
    per_head = torch.randn(8, 5, 7, dtype=torch.float64)  # (b * h, s_q, s_kv)
    if not batched:
        q, k, kpm, per_head = q[1], k[1], kpm[1], per_head[:4]
    # Masks of the right shapes convert to what torch computes with them.
    for attn_mask, key_padding_mask in ((blocked, kpm), (per_head, None), (None, kpm)):
        want, _ = m(q, k, k, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False)
        mask = torch_masks_to_headwise(attn_mask, key_padding_mask, n_heads=4, query=q, key=k)
        torch.testing.assert_close(attn(q, key=k, value=k, mask=mask), want)
    # A size-1 axis where torch expects s_q, s_kv or b * h: torch refuses it, and so does the conversion,
    # instead of broadcasting it over every query, key or head.
    refused = [dict(key_padding_mask=kpm[..., :1]), dict(attn_mask=blocked[:1]), dict(attn_mask=blocked[:, :1]),
               dict(attn_mask=per_head[:1], n_heads=4)]
    for bad in refused:
        with pytest.raises((RuntimeError, AssertionError)):
            m(q, k, k, attn_mask=bad.get("attn_mask"), key_padding_mask=bad.get("key_padding_mask"))
        with pytest.raises(ValueError, match=r"must be \(.*\) = \(.*\) for the key .* got \("):
            torch_masks_to_headwise(**bad, query=q, key=k)
    # Without key= the masks give the key length (cross-attention keys may differ from the queries), except a
    # size-1 key axis under several queries: torch would refuse the broadcast, so it is refused, naming key=.
    for attn_mask, key_padding_mask in ((blocked, kpm), (None, kpm)):
        want, _ = m(q, k, k, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False)
        mask = torch_masks_to_headwise(attn_mask, key_padding_mask, query=q)
        torch.testing.assert_close(attn(q, key=k, value=k, mask=mask), want)
    with pytest.raises(ValueError, match="key axis 1 .* pass key="):
        torch_masks_to_headwise(key_padding_mask=kpm[..., :1], query=q)
    with pytest.raises(ValueError, match="same key axis"):
        torch_masks_to_headwise(blocked, kpm[..., :6])



def test_a_shared_views_forward_reads_its_module_without_a_python_lookup():
    from tests.core.test_call_path import headwise_functions

    for kdim in (None, 24):  # packed in_proj_weight (one GEMM) and separate q/k/v weights (resolved per call)
        m = nn.MultiheadAttention(32, 4, kdim=kdim, vdim=kdim, batch_first=True).eval()
        attn = from_torch(m, share=True)
        x = torch.randn(2, 5, 32)
        context = None if kdim is None else torch.randn(2, 5, kdim)  # keys and values from another sequence
        with torch.no_grad():
            attn(x, context)
            called = headwise_functions(lambda: attn(x, context))
        assert "views.LayerView.host" not in called and "views.HostRef.get" not in called, called
