"""A head run alone takes the layer's inputs and refusals (context, key/value, positions), W_O is assignable like
W_Q/W_K/W_V, and from_heads packs only heads that one rotary embedding can rotate."""

from __future__ import annotations

import re

import pytest
import torch

from headwise import AttentionHead, MultiHeadAttention, RotaryEmbedding
from tests.reference import reference_heads, rope64


def _head_formula(head: AttentionHead, x, key=None, value=None, positions=None):
    """float64 context of one head from its weights: rotate, softmax(q k^T * scale), times v."""
    x = x.double()
    key, value = (x if key is None else key.double()), (x if value is None else value.double())
    q, k, v = x @ head.w_q.double(), key @ head.w_k.double(), value @ head.w_v.double()
    if head.b_q is not None:
        q, k, v = q + head.b_q.double(), k + head.b_k.double(), v + head.b_v.double()
    if head.rotary is not None:
        pos = torch.arange(x.shape[1]) if positions is None else positions
        q, k = rope64(q, pos, head.rotary.inv_freq), rope64(k, pos, head.rotary.inv_freq)
    return reference_heads(q[:, None], k[:, None], v[:, None], scale=head.scale)[0][:, 0]  # (b, s_q, d_h)


def test_from_heads_refuses_heads_whose_rotary_embeddings_differ():
    torch.manual_seed(0)
    plain = MultiHeadAttention(16, 2)
    rope = MultiHeadAttention(16, 2, rotary=RotaryEmbedding(8))
    other_base = MultiHeadAttention(16, 2, rotary=RotaryEmbedding(8, base=500000.0))
    partial = MultiHeadAttention(16, 2, rotary=RotaryEmbedding(8, rotary_dim=4))
    scaled = MultiHeadAttention(16, 2, rotary=RotaryEmbedding(8, attention_scaling=2.0))
    rounded = MultiHeadAttention(16, 2, rotary=RotaryEmbedding(8), dtype=torch.bfloat16)
    rounded.rotary.inv_freq = rounded.rotary.inv_freq.to(torch.bfloat16)  # a dtype cast keeps it float32: by hand
    kept = MultiHeadAttention(16, 2, rotary=RotaryEmbedding(8), dtype=torch.bfloat16)  # inv_freq in float32
    for heads, why in (([plain.head(0), rope.head(1)], "RotaryEmbedding vs no rotary"),
                       ([rope.head(0), plain.head(1)], "no rotary vs RotaryEmbedding"),
                       ([rope.head(0), other_base.head(1)], "inv_freq (another base"),
                       ([rope.head(0), partial.head(1)], "rotary_dim 4 vs 8"),
                       ([rope.head(0), scaled.head(1)], "attention_scaling 2.0 vs 1.0"),
                       ([kept.head(0), rounded.head(1)], "inv_freq in torch.bfloat16 vs torch.float32")):
        with pytest.raises(ValueError, match=r"head 1 rotates differently from head 0 \(" + re.escape(why)):
            MultiHeadAttention.from_heads(heads, out_proj=heads[0]._parent.out_proj)


def test_from_heads_packs_heads_of_equal_rotary_embeddings():
    torch.manual_seed(1)
    a = MultiHeadAttention(16, 2, rotary=RotaryEmbedding(8))
    b = MultiHeadAttention(16, 2, rotary=RotaryEmbedding(8))  # another module, the same numbers
    x = torch.randn(2, 5, 16)
    heads = [a.head(0), b.head(1)]
    layer = MultiHeadAttention.from_heads(heads, out_proj=a.out_proj)
    # The packed layer's output is the sum of its heads' own contexts through W_O, each from the formula.
    w_o = a.out_proj.weight.double().T
    expected = sum(_head_formula(h, x) @ w_o[i * 8:(i + 1) * 8] for i, h in enumerate(heads)) + a.out_proj.bias.double()
    torch.testing.assert_close(layer(x), expected.float(), rtol=1e-5, atol=1e-5)


def test_w_o_is_assignable_and_changes_the_layer():
    torch.manual_seed(2)
    attn = MultiHeadAttention(16, 4, bias=True)
    x = torch.randn(2, 5, 16)
    new = torch.randn(4, 16)
    attn.head(1).w_o = new
    torch.testing.assert_close(attn.out_proj.weight[:, 4:8], new.T, rtol=0, atol=0)
    contexts = [_head_formula(h, x) for h in attn.heads()]
    w_o = attn.out_proj.weight.double().T
    expected = sum(z @ w_o[i * 4:(i + 1) * 4] for i, z in enumerate(contexts)) + attn.out_proj.bias.double()
    torch.testing.assert_close(attn(x), expected.float(), rtol=1e-5, atol=1e-5)
    before = attn.out_proj.weight.detach().clone()
    with pytest.raises(ValueError, match=r"w_o must have shape \(4, 16\), got \(16, 4\)"):
        attn.head(1).w_o = new.T
    with pytest.raises(TypeError, match="w_o must be a torch.Tensor, got list"):
        attn.head(1).w_o = [[0.0]]
    torch.testing.assert_close(attn.out_proj.weight, before, rtol=0, atol=0)  # refused: nothing written
    standalone = AttentionHead(torch.randn(16, 4), torch.randn(16, 4), torch.randn(16, 4))
    with pytest.raises(ValueError, match="standalone head has no W_O"):
        standalone.w_o = new


def test_a_rotary_head_refuses_context_and_a_plain_head_refuses_positions_as_their_layers_do():
    torch.manual_seed(3)
    rope = MultiHeadAttention(16, 4, rotary=RotaryEmbedding(4))
    plain = MultiHeadAttention(16, 4)
    x, c, p = torch.randn(1, 3, 16), torch.randn(1, 5, 16), torch.tensor([7, 8, 9])
    for layer_call, head_call in ((lambda: rope(x, c), lambda: rope.head(0)(x, c)),
                                  (lambda: plain(x, positions=p), lambda: plain.head(0)(x, positions=p))):
        with pytest.raises(ValueError) as layer_error:
            layer_call()
        with pytest.raises(ValueError) as head_error:
            head_call()
        assert str(head_error.value).split(";")[0] == str(layer_error.value).split(";")[0]
    # Positions on a rotary head rotate as the formula does.
    torch.testing.assert_close(rope.head(2)(x, positions=p), _head_formula(rope.head(2), x, positions=p).float(),
                               rtol=1e-5, atol=1e-5)


def test_a_head_of_a_layer_with_kdim_not_vdim_runs_alone_on_key_and_value():
    torch.manual_seed(4)
    attn = MultiHeadAttention(16, 4, kdim=8, vdim=12, bias=True)
    q, k, v = torch.randn(2, 3, 16), torch.randn(2, 5, 8), torch.randn(2, 5, 12)
    contexts = [h(q, key=k, value=v) for h in attn.heads()]
    for h, z in zip(attn.heads(), contexts):
        torch.testing.assert_close(z, _head_formula(h, q, k, v).float(), rtol=1e-5, atol=1e-5)
    # The layer's output is its heads' contexts through W_O.
    y = sum(z @ h.w_o for h, z in zip(attn.heads(), contexts)) + attn.out_proj.bias
    torch.testing.assert_close(attn(q, key=k, value=v), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn.head(1)(q[0], key=k[0], value=v[0]), contexts[1][0])  # unbatched
    head = attn.head(0)
    with pytest.raises(ValueError, match="kdim=8 != vdim=12: pass key= and value= separately"):
        head(q, k)
    with pytest.raises(ValueError, match="pass both key= and value="):
        head(q, key=k)
    with pytest.raises(ValueError, match="value must have shape"):
        head(q, key=k, value=k)
    with pytest.raises(ValueError, match="batch mismatch"):
        head(q, key=k[:1], value=v[:1])
    with pytest.raises(ValueError, match="self-attention"):
        head(q)
