"""A TransformerLens model holding a headwise layer's weights: the peer of the trace tests."""

from __future__ import annotations

import torch

from headwise import MultiHeadAttention


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
