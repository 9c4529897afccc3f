"""headwise.trace against TransformerLens (a peer): the same weights in a one-layer attention-only
HookedTransformer, its run_with_cache hooks (q, k, v, pattern, z, result) against headwise's captures."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import MultiHeadAttention

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")

tl = pytest.importorskip("transformer_lens", reason="TransformerLens (pip install transformer_lens==3.9.0)")


def transformer_lens_twin(attn: MultiHeadAttention, causal: bool = False, n_ctx: int = 64):  # type: ignore[no-untyped-def]
    """A TransformerLens ``HookedTransformer`` whose only block is ``attn``'s attention (attention-only, no
    norm, ``use_attn_result=True``), W_Q, W_K, W_V, W_O and biases copied head by head; ``attn``'s dtype.
    Run it on a residual stream with ``start_at_layer=0, stop_at_layer=1``: it returns input + attention.

    Shapes:
        TL weights: W_Q, W_K, W_V (h, d, d_h); W_O (h, d_h, d); b_Q, b_K, b_V (h, d_h); b_O (d,)
    """
    import transformer_lens as tl

    cfg = attn.config
    h, d, d_h = cfg.n_heads, cfg.d_model, cfg.d_head
    if cfg.n_kv_heads != h or getattr(attn, "rotary", None) is not None or attn.q_proj.bias is None:
        raise ValueError(f"transformer_lens_twin copies an MHA layer with biases and no rotary, got {cfg}")
    w = attn.q_proj.weight
    model = tl.HookedTransformer(tl.HookedTransformerConfig(
        n_layers=1, d_model=d, n_ctx=n_ctx, d_head=d_h, n_heads=h, d_vocab=8, attn_only=True, act_fn=None,
        normalization_type=None, attention_dir="causal" if causal else "bidirectional", use_attn_result=True,
        dtype=w.dtype, device=str(w.device)))
    block = model.blocks[0].attn
    with torch.no_grad():
        for name, proj in (("Q", attn.q_proj), ("K", attn.k_proj), ("V", attn.v_proj)):
            getattr(block, f"W_{name}").copy_(proj.weight.view(h, d_h, d).transpose(1, 2))  # (h, d, d_h)
            getattr(block, f"b_{name}").copy_(proj.bias.view(h, d_h))
        block.W_O.copy_(attn.out_proj.weight.view(d, h, d_h).permute(1, 2, 0))  # (h, d_h, d)
        block.b_O.copy_(attn.out_proj.bias)
    return model.eval()


def hooked_twin(attn: MultiHeadAttention, causal: bool):
    """A HookedTransformer whose only block is ``attn``'s attention, weights copied head by head."""
    return transformer_lens_twin(attn, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_trace_equals_transformer_lens_run_with_cache(causal):
    torch.manual_seed(0)
    attn = MultiHeadAttention(24, 4).double()
    model = hooked_twin(attn, causal)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    resid, cache = model.run_with_cache(x, start_at_layer=0, stop_at_layer=1)
    with headwise.trace(attn, capture=("q", "k", "v", "pattern", "z", "result")) as t:
        y = attn(x, causal=causal)
    r = t[0]
    hook = "blocks.0.attn.hook_"
    torch.testing.assert_close(r.q, cache[hook + "q"].transpose(1, 2))  # TL: (b, s, h, d_h)
    torch.testing.assert_close(r.k, cache[hook + "k"].transpose(1, 2))
    torch.testing.assert_close(r.v, cache[hook + "v"].transpose(1, 2))
    torch.testing.assert_close(r.pattern, cache[hook + "pattern"])  # (b, h, s_q, s_kv)
    torch.testing.assert_close(r.z, cache[hook + "z"])  # (b, s, h, d_h)
    torch.testing.assert_close(r.result, cache[hook + "result"])  # (b, s, h, d)
    torch.testing.assert_close(y, resid - x)  # the block adds the attention output to its input


def test_zero_edit_equals_transformer_lens_hook_ablation():
    torch.manual_seed(1)
    attn = MultiHeadAttention(24, 4).double()
    model = hooked_twin(attn, causal=True)
    x = torch.randn(2, 6, 24, dtype=torch.float64)

    def zero_head_2(z, hook):
        z[:, :, 2] = 0.0
        return z

    want = model.run_with_hooks(x, start_at_layer=0, stop_at_layer=1,
                                fwd_hooks=[("blocks.0.attn.hook_z", zero_head_2)]) - x
    with headwise.trace(attn, edit={(0, 2): "zero"}):
        got = attn(x, causal=True)
    torch.testing.assert_close(got, want)
