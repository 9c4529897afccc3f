"""The layers headwise is measured against, each built with a headwise layer's weights so that every
peer computes the same function on the same inputs (the smoke test checks that they agree).

* :class:`PackedSDPA`: the practical limit, one fused QKV projection, a view/transpose, PyTorch's fused
  ``scaled_dot_product_attention``, the merge and the output projection, nothing else.
* ``nn.MultiheadAttention``: its CPU fast path (eval, no_grad, ``need_weights=False``) and its default call.
* Hugging Face ``BertSelfAttention`` (+ the output dense) and ``LlamaAttention``, "sdpa" and "eager".
* TransformerLens: a one-layer attention-only ``HookedTransformer`` (:func:`transformer_lens_twin`).
* Decoding: a ``torch.cat``-grown cache, a minimal preallocated cache (``nn.Linear``, fused QKV), the same
  loop written with ``x @ W`` weights (:class:`XWDecoder`), Hugging Face's DynamicCache and StaticCache on a
  Llama layer.

Shapes:
    b: batch, s: sequence, d: d_model, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from headwise import MultiHeadAttention

__all__ = ["PackedSDPA", "mha_peer", "bert_peer", "llama_peer", "hf_available", "CatCacheDecoder",
           "PreallocDecoder", "XWDecoder", "llama_decoder", "transformer_lens_twin"]


def hf_available() -> str | None:
    """None when transformers imports, else the reason it does not (peers are skipped with this note)."""
    try:
        import transformers  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"transformers unavailable: {exc}"
    return None


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
    if cfg.n_kv_heads != h or attn.rotary is not None or not cfg.bias:
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


def _fill(decoder, k: torch.Tensor, v: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """Prefill a plain decode loop's preallocated buffers with ``k``, ``v`` (b, h_kv, n, d_h)."""
    n = k.shape[2]
    decoder.keys[:, :, :n].copy_(k)
    decoder.values[:, :, :n].copy_(v)
    decoder.length = n


class PackedSDPA(nn.Module):
    """Minimal packed attention: the fastest a fused-SDPA layer can be written in PyTorch.

    ``repeat_kv=True`` expands K/V to every query head before SDPA (the classic GQA implementation).

    Shapes:
        x: (b, s, d) -> (b, s, d)
    """

    def __init__(self, attn: MultiHeadAttention, *, repeat_kv: bool = False) -> None:
        super().__init__()
        cfg = attn.config
        self.h, self.h_kv, self.d_h = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.repeat_kv = repeat_kv
        bias = cfg.bias
        self.qkv = nn.Linear(cfg.d_model, cfg.inner_dim + 2 * cfg.kv_dim, bias=bias)
        self.out = nn.Linear(cfg.inner_dim, cfg.d_model, bias=cfg.out_bias)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
            if bias:
                self.qkv.bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
            self.out.weight.copy_(attn.out_proj.weight)
            if cfg.out_bias:
                self.out.bias.copy_(attn.out_proj.bias)

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d_h, self.h_kv * self.d_h, self.h_kv * self.d_h], dim=-1)
        q = q.view(b, s, self.h, self.d_h).transpose(1, 2)  # (b, h, s, d_h)
        k = k.view(b, s, self.h_kv, self.d_h).transpose(1, 2)  # (b, h_kv, s, d_h)
        v = v.view(b, s, self.h_kv, self.d_h).transpose(1, 2)  # (b, h_kv, s, d_h)
        gqa = self.h != self.h_kv
        if gqa and self.repeat_kv:
            k = k.repeat_interleave(self.h // self.h_kv, dim=1)  # (b, h, s, d_h)
            v = v.repeat_interleave(self.h // self.h_kv, dim=1)  # (b, h, s, d_h)
            gqa = False
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return self.out(o.transpose(1, 2).reshape(b, s, self.h * self.d_h))  # (b, s, d)


def mha_peer(attn: MultiHeadAttention) -> nn.MultiheadAttention:
    """``nn.MultiheadAttention`` (batch_first) holding ``attn``'s weights (MHA with biases only)."""
    cfg = attn.config
    m = nn.MultiheadAttention(cfg.d_model, cfg.n_heads, bias=cfg.bias, batch_first=True)
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        m.out_proj.weight.copy_(attn.out_proj.weight)
        if cfg.bias:
            m.in_proj_bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
            m.out_proj.bias.copy_(attn.out_proj.bias)
    return m


def bert_peer(attn: MultiHeadAttention, impl: str) -> Callable[..., torch.Tensor]:
    """Hugging Face ``BertSelfAttention`` + the output dense (no dropout/LayerNorm), ``impl`` "sdpa"/"eager".

    Returns ``f(x, causal=False) -> (b, s, d)``; eager gets the additive causal mask HF would build.
    """
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    cfg = attn.config
    config = BertConfig(hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads, intermediate_size=4,
                        num_hidden_layers=1, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    config._attn_implementation = impl
    layer = BertSelfAttention(config)
    dense = nn.Linear(cfg.inner_dim, cfg.d_model)
    with torch.no_grad():
        for mine, theirs in ((attn.q_proj, layer.query), (attn.k_proj, layer.key), (attn.v_proj, layer.value),
                             (attn.out_proj, dense)):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)
    masks: dict[int, torch.Tensor] = {}

    def f(x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        mask = None
        if causal and impl == "eager":
            mask = masks.get(x.shape[1])
            if mask is None:
                mask = masks[x.shape[1]] = _additive_causal(x.shape[1], x.dtype)
        out = layer(x, attention_mask=mask, is_causal=causal)[0]
        return dense(out)

    f.modules = (layer, dense)  # type: ignore[attr-defined]
    return f


def _additive_causal(s: int, dtype: torch.dtype) -> torch.Tensor:
    keep = torch.ones(s, s, dtype=torch.bool).tril()
    return torch.zeros(s, s, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)[None, None]  # (1,1,s,s)


def _llama_config(attn: MultiHeadAttention, impl: str):
    from transformers import LlamaConfig

    cfg = attn.config
    config = LlamaConfig(hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.d_head, intermediate_size=4,
                         num_hidden_layers=1, attention_bias=cfg.bias, max_position_embeddings=1 << 16,
                         rope_theta=attn.rotary.base if attn.rotary is not None else 10000.0)
    config._attn_implementation = impl
    return config


def _llama_layer(attn: MultiHeadAttention, impl: str):
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = _llama_config(attn, impl)
    layer = LlamaAttention(config, layer_idx=0)
    rope = LlamaRotaryEmbedding(config)
    with torch.no_grad():
        for mine, theirs in ((attn.q_proj, layer.q_proj), (attn.k_proj, layer.k_proj),
                             (attn.v_proj, layer.v_proj), (attn.out_proj, layer.o_proj)):
            theirs.weight.copy_(mine.weight)
            if mine.bias is not None:
                theirs.bias.copy_(mine.bias)
    return config, layer, rope


def llama_peer(attn: MultiHeadAttention, impl: str) -> Callable[..., torch.Tensor]:
    """Hugging Face ``LlamaAttention`` (with its rotary embedding computed per call) holding ``attn``'s
    weights; ``attn`` should carry a :class:`~headwise.RotaryEmbedding` so both compute the same thing.

    Returns ``f(x, causal=False) -> (b, s, d)``.
    """
    _, layer, rope = _llama_layer(attn, impl)
    masks: dict[int, torch.Tensor] = {}

    def f(x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        s = x.shape[1]
        pos = torch.arange(s).unsqueeze(0)
        cos_sin = rope(x, pos)
        mask = None
        if causal and impl == "eager":
            mask = masks.get(s)
            if mask is None:
                mask = masks[s] = _additive_causal(s, x.dtype)
        return layer(x, position_embeddings=cos_sin, attention_mask=mask, is_causal=causal)[0]

    f.modules = (layer,)  # type: ignore[attr-defined]
    return f


# -- decoding ------------------------------------------------------------------------------------------
class CatCacheDecoder(nn.Module):
    """Decoding with a cache that grows by ``torch.cat`` (a copy of everything cached, every token).

    Shapes:
        x: (b, 1, d) -> (b, 1, d); the cache: (b, h_kv, length, d_h)
    """

    def __init__(self, attn: MultiHeadAttention) -> None:
        super().__init__()
        self.packed = PackedSDPA(attn)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def fill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k.clone(), v.clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        b, s, _ = x.shape
        q, k, v = p.qkv(x).split([p.h * p.d_h, p.h_kv * p.d_h, p.h_kv * p.d_h], dim=-1)
        q = q.view(b, s, p.h, p.d_h).transpose(1, 2)  # (b, h, 1, d_h)
        k = k.view(b, s, p.h_kv, p.d_h).transpose(1, 2)  # (b, h_kv, 1, d_h)
        v = v.view(b, s, p.h_kv, p.d_h).transpose(1, 2)  # (b, h_kv, 1, d_h)
        self.k = torch.cat([self.k, k], dim=2)  # (b, h_kv, length + 1, d_h)
        self.v = torch.cat([self.v, v], dim=2)  # (b, h_kv, length + 1, d_h)
        o = F.scaled_dot_product_attention(q, self.k, self.v, enable_gqa=p.h != p.h_kv)
        return p.out(o.transpose(1, 2).reshape(b, s, p.h * p.d_h))  # (b, 1, d)


class PreallocDecoder(nn.Module):
    """The minimal preallocated cache: one fused QKV projection, write into a fixed buffer, attend over
    the filled prefix (a view). The decode limit headwise is held to.

    Shapes:
        x: (b, 1, d) -> (b, 1, d); buffers: (b, h_kv, max_len, d_h)
    """

    def __init__(self, attn: MultiHeadAttention, batch_size: int, max_len: int) -> None:
        super().__init__()
        self.packed = PackedSDPA(attn)
        p = self.packed
        self.register_buffer("keys", torch.zeros(batch_size, p.h_kv, max_len, p.d_h), persistent=False)
        self.register_buffer("values", torch.zeros(batch_size, p.h_kv, max_len, p.d_h), persistent=False)
        self.length = 0

    def fill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        _fill(self, k, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        b, s, _ = x.shape
        q, k, v = p.qkv(x).split([p.h * p.d_h, p.h_kv * p.d_h, p.h_kv * p.d_h], dim=-1)
        q = q.view(b, s, p.h, p.d_h).transpose(1, 2)  # (b, h, 1, d_h)
        end = self.length + s
        self.keys[:, :, self.length:end].copy_(k.view(b, s, p.h_kv, p.d_h).transpose(1, 2))
        self.values[:, :, self.length:end].copy_(v.view(b, s, p.h_kv, p.d_h).transpose(1, 2))
        self.length = end
        o = F.scaled_dot_product_attention(q, self.keys[:, :, :end], self.values[:, :, :end],
                                           enable_gqa=p.h != p.h_kv)
        return p.out(o.transpose(1, 2).reshape(b, s, p.h * p.d_h))  # (b, 1, d)


class XWDecoder:
    """The minimal preallocated-cache decode loop written with ``x @ W`` weights, as a plain object (no
    ``nn.Module`` call machinery): W_Q, W_K, W_V and W_O stored (d_in, d_out), contiguous, with their biases
    as separate vectors; per token ``x @ W + b`` as one ``addmm`` each, the new key and value written in
    place into a preallocated buffer, ``F.scaled_dot_product_attention`` over the filled prefix, the merge
    (a view: one token) and ``@ W_O``. Nothing else, so it is the fastest honest plain loop.

    ``attn``'s weights are copied (``.t().clone(memory_format=torch.contiguous_format)``), never shared; it must have no rotary embedding.
    One token per call.

    Shapes:
        x: (b, 1, d) -> (b, 1, d); w_q: (d, h * d_h); w_k, w_v: (d, h_kv * d_h); w_o: (h * d_h, d);
        buffers: (b, h_kv, max_len, d_h)
    """

    def __init__(self, attn: MultiHeadAttention, batch_size: int, max_len: int) -> None:
        if attn.rotary is not None:
            raise ValueError("XWDecoder computes no rotary embedding; expected a layer with rotary=None, "
                             f"got {type(attn.rotary).__name__}")
        cfg = attn.config
        self.h, self.h_kv, self.d_h, self.scale = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.scale
        self.gqa = self.h != self.h_kv
        with torch.no_grad():
            self.w_q, self.w_k, self.w_v, self.w_o = (
                m.weight.detach().t().clone(memory_format=torch.contiguous_format) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj))
            self.b_q, self.b_k, self.b_v, self.b_o = (
                None if m.bias is None else m.bias.detach().clone()
                for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj))
        w = self.w_q
        self.keys = torch.zeros(batch_size, self.h_kv, max_len, self.d_h, dtype=w.dtype, device=w.device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def fill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        _fill(self, k, v)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        x2 = x.view(b, d)  # one token: (b, d)
        bq, bk, bv, bo = self.b_q, self.b_k, self.b_v, self.b_o
        q = x2 @ self.w_q if bq is None else torch.addmm(bq, x2, self.w_q)  # (b, h * d_h)
        k = x2 @ self.w_k if bk is None else torch.addmm(bk, x2, self.w_k)  # (b, h_kv * d_h)
        v = x2 @ self.w_v if bv is None else torch.addmm(bv, x2, self.w_v)  # (b, h_kv * d_h)
        n = self.length
        self.keys[:, :, n].copy_(k.view(b, self.h_kv, self.d_h))  # slot n of (b, h_kv, max_len, d_h)
        self.values[:, :, n].copy_(v.view(b, self.h_kv, self.d_h))
        self.length = n + 1
        o = F.scaled_dot_product_attention(q.view(b, self.h, 1, self.d_h), self.keys[:, :, :n + 1],
                                           self.values[:, :, :n + 1], scale=self.scale,
                                           enable_gqa=self.gqa)  # (b, h, 1, d_h)
        o2 = o.reshape(b, self.h * self.d_h)  # merge: (b, h * d_h), a view for one token
        out = o2 @ self.w_o if bo is None else torch.addmm(bo, o2, self.w_o)  # (b, d)
        return out.view(b, 1, d)


def llama_decoder(attn: MultiHeadAttention, kind: str, batch_size: int, max_len: int, built=None):
    """A Hugging Face Llama layer decoding with ``kind`` "dynamic" (DynamicCache) or "static" (StaticCache,
    attended through a padding mask over the whole buffer, as HF's generate does).

    Returns ``(fill(k, v), step(x) -> (b, 1, d))``; ``attn`` should carry a rotary embedding. ``built``:
    the ``(config, layer, rope)`` of an earlier call, to share one layer's weights between decoders.
    """
    from transformers import DynamicCache, StaticCache

    config, layer, rope = built if built is not None else _llama_layer(attn, "sdpa")
    state: dict = {}

    def fill(k: torch.Tensor, v: torch.Tensor) -> None:
        if kind == "dynamic":
            cache = DynamicCache(config=config)
        else:
            cache = StaticCache(config=config, max_cache_len=max_len)
        cache.update(k.clone(), v.clone(), 0)
        state["cache"], state["length"] = cache, k.shape[2]
        if kind == "static":
            state["slots"] = torch.arange(max_len)

    def step(x: torch.Tensor) -> torch.Tensor:
        n = state["length"]
        pos = torch.full((x.shape[0], 1), n, dtype=torch.long)
        cos_sin = rope(x, pos)
        mask = None
        if kind == "static":
            mask = (state["slots"] <= n)[None, None, None, :]  # (1, 1, 1, max_len): filled slots only
        out = layer(x, position_embeddings=cos_sin, attention_mask=mask, cache=state["cache"])[0]
        state["length"] = n + 1
        return out

    step.modules = (layer,)  # type: ignore[attr-defined]
    step.built = (config, layer, rope)  # type: ignore[attr-defined]
    return fill, step
