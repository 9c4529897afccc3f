"""One trace seam: MultiHeadAttention.attend is the step a trace sees, for a bare layer's forward and for every head
a patched Hugging Face module computes; called directly it checks its inputs. The reference is
the float64 per-head formula (tests/reference.py)."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import MultiHeadAttention

from tests.reference import reference_heads


def counting(monkeypatch) -> list:
    calls = []
    real = MultiHeadAttention.attend

    def attend(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MultiHeadAttention, "attend", attend)
    return calls


def test_a_bare_layer_and_a_patched_module_trace_through_the_same_step(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from headwise.interop import patch

    calls = counting(monkeypatch)
    attn = MultiHeadAttention(16, 4, 2).eval()
    with torch.no_grad(), headwise.trace(attn, capture=("z",)) as t:
        attn(torch.randn(2, 5, 16), causal=True)
    assert calls == ["MultiHeadAttention"] and t[0].z.shape == (2, 5, 4, 4)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = patch(transformers.LlamaForCausalLM(cfg).eval())
    calls.clear()
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:
        model(torch.tensor([[1, 5, 7, 3]]))
    assert calls == ["HFView", "HFView"] and t[1].z.shape == (1, 4, 4, 4)


def test_attend_called_directly_checks_its_inputs_and_scales_each_head():
    attn = MultiHeadAttention(16, 4, 2).eval()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4,
                                                                                                       generator=g)
    factors = torch.tensor([1.0, 0.0, 0.5, 2.0])
    with torch.no_grad():
        z, w = attn.attend(q, k, v, causal=True, return_weights=True, head_scale=factors)
    want_z, want_w = reference_heads(q, k, v, causal=True)
    torch.testing.assert_close(z, (want_z * factors.view(1, 4, 1, 1).double()).float())
    torch.testing.assert_close(w, (want_w * factors.view(1, 4, 1, 1).double()).float())
    with pytest.raises(ValueError, match=r"^q and k must share d_h; got q \(2, 4, 5, 4\), k \(2, 2, 5, 3\)"):
        attn.attend(q, k[..., :3], v)
    with pytest.raises(ValueError, match=r"head_scale must be a tensor of one factor per head, shape \(4,\)"):
        attn.attend(q, k, v, head_scale=torch.ones(3))
    with pytest.raises(TypeError, match="causal must be a bool"):
        attn.attend(q, k, v, causal="top_left")
