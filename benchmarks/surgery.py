"""Case "surgery" (issue 18): what removing heads and regrouping K/V heads buys, measured.

* ``surgery prune``: one headwise layer (d 768, h 12, BERT-base-shaped) with 12, 9, 6 and 3 of its heads kept
  by :func:`headwise.surgery.prune_heads`, forward timed side by side, each row with its parameter count;
  the peer is the practical limit of the half-pruned layer (one packed GEMM, SDPA, W_O on the same pruned
  weights). Goal: half the heads removed -> attention forward <= 0.6x the unpruned layer.
* ``surgery kv``: a patched Llama-shaped decoder (d 1024, h 16, h_kv 4, 4 layers) regrouped by
  :func:`headwise.surgery.to_gqa` / :func:`~headwise.surgery.to_mha` to 16, 4, 2 and 1 K/V heads, a cached
  prefill timed, each row with the bytes its Hugging Face cache holds afterwards; the peer is the
  same regrouped model unpatched (plain transformers, loaded through its config's ``num_key_value_heads``).

Shapes:
    b: batch, s: sequence, d: hidden size, h: query heads, h_kv: key/value heads.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.nn.functional as F

from .patched import llama_model
from .timing import Entry, Group, refresh_memory

__all__ = ["surgery_groups"]

LAYER = (768, 12)  # d, h
QUICK_LAYER = (64, 4)
KEPT = (1.0, 0.75, 0.5, 0.25)


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _forward(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return attn(x)


def _limit(w_qkv: torch.Tensor, b_qkv: torch.Tensor, w_o: torch.Tensor, b_o: torch.Tensor, h: int,
           x: torch.Tensor) -> torch.Tensor:
    """Packed QKV GEMM, SDPA, W_O: the fewest ops a layer of these weights can run."""
    with torch.no_grad():
        b, s, _ = x.shape
        qkv = F.linear(x, w_qkv, b_qkv).view(b, s, 3, h, -1).permute(2, 0, 3, 1, 4)  # (3, b, h, s, d_h)
        z = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # (b, h, s, d_h)
        return F.linear(z.transpose(1, 2).reshape(b, s, -1), w_o, b_o)


def _prune_group(d: int, h: int, b: int, s: int, rounds: int, block_s: float) -> Group:
    from headwise import MultiHeadAttention
    from headwise.surgery import prune_heads

    torch.manual_seed(0)
    full = MultiHeadAttention(d_model=d, n_heads=h).eval()
    layers = {k: prune_heads(full, list(range(h - round(k * h)))) if k < 1 else full for k in KEPT}
    x = torch.randn(b, s, d, generator=torch.Generator().manual_seed(1))
    half = layers[0.5]
    w_qkv = torch.cat([half.q_proj.weight, half.k_proj.weight, half.v_proj.weight]).detach().clone()
    b_qkv = torch.cat([half.q_proj.bias, half.k_proj.bias, half.v_proj.bias]).detach().clone()
    w_o, b_o = half.out_proj.weight.detach().clone(), half.out_proj.bias.detach().clone()
    refresh_memory(*layers.values())
    es = [Entry(f"headwise {m.n_heads} of {h} heads", partial(_forward, m, x),
                role="headwise" if k == 1.0 else "headwise-pruned", extra={"params": _params(m), "kept": k})
          for k, m in layers.items()]
    es.append(Entry(f"packed SDPA, {half.n_heads} heads (limit)", partial(_limit, w_qkv, b_qkv, w_o, b_o,
                                                                           half.n_heads, x),
                    role="limit", ref=f"headwise {half.n_heads} of {h} heads",
                    extra={"params": w_qkv.numel() + b_qkv.numel() + w_o.numel() + b_o.numel(), "kept": 0.5}))
    return Group("8 surgery", f"surgery prune forward b{b} s{s} d{d} h{h}", es, rounds=rounds, block_s=block_s,
                 tol=(1e-4, 1e-4), meta={"b": b, "s": s, "d": d, "h": h, "mode": "prune"})


def _prefill(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True).logits


def _cache_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _kv_group(spec: tuple[int, ...], b: int, s: int, rounds: int, block_s: float) -> Group:
    from headwise.interop import patch, unpatch
    from headwise.surgery import to_gqa, to_mha

    h, h_kv = spec[1], spec[2]
    base = patch(llama_model(spec))
    counts = [h, h_kv] + [k for k in (h_kv // 2, 1) if 1 <= k < h_kv]
    models = {k: (to_mha(copy.deepcopy(base)) if k == h else base if k == h_kv else to_gqa(copy.deepcopy(base), k))
              for k in dict.fromkeys(counts)}
    smallest = min(models)
    plain = unpatch(copy.deepcopy(models[smallest]))
    ids = torch.randint(1, spec[-1], (b, s), generator=torch.Generator().manual_seed(2))
    refresh_memory(*models.values(), plain)
    es = [Entry(f"headwise h_kv {k}" + (" (checkpoint)" if k == h_kv else ""), partial(_prefill, m, ids),
                role="headwise" if k == h_kv else "headwise-regrouped", compare=False,
                extra={"kv_cache_bytes": _cache_bytes(m, ids), "n_kv_heads": k}) for k, m in models.items()]
    es.append(Entry(f"HF Llama sdpa unpatched, h_kv {smallest}", partial(_prefill, plain, ids),
                    ref=f"headwise h_kv {smallest}", extra={"kv_cache_bytes": _cache_bytes(plain, ids),
                                                             "n_kv_heads": smallest}))
    return Group("8 surgery", f"surgery kv Llama prefill b{b} s{s} h{h}", es, rounds=rounds, block_s=block_s,
                 tol=(1e-4, 1e-4), meta={"b": b, "s": s, "h": h, "h_kv": h_kv, "mode": "kv"})


def surgery_groups(sz) -> list:  # type: ignore[no-untyped-def]
    """The surgery groups (the K/V group needs transformers)."""
    from .patched import LLAMA, QUICK_LLAMA
    from .peers import hf_available

    quick = sz.rounds < 5
    d, h = QUICK_LAYER if quick else LAYER
    b, s = (1, 16) if quick else (8, 512)
    groups = [partial(_prune_group, d, h, b, s, sz.rounds, sz.block_s)]
    if hf_available() is None:
        kb, ks = (1, 8) if quick else (4, 256)
        groups.append(partial(_kv_group, QUICK_LLAMA if quick else LLAMA, kb, ks, sz.rounds, sz.block_s))
    return groups
