"""Case ``surgery``: what removing heads and regrouping K/V heads buys, measured.

* ``surgery prune``: a headwise layer at ``Sizes.forward`` (b, s, d, h) with every head, 3/4, half and 1/4 of
  them kept (:func:`headwise.surgery.prune_heads`), forward timed side by side, each note with the layer's
  parameter count; the peer is the half-pruned layer's practical limit (:class:`benchmarks.peers.PackedSDPA`:
  packed QKV GEMM, SDPA, W_O on the same weights).
* ``surgery kv``: the patched Llama-shaped decoder of ``Sizes.llama`` as the checkpoint, and copies regrouped by
  :func:`~headwise.surgery.to_mha` / :func:`~headwise.surgery.to_gqa` to h, h_kv / 2 and 1 K/V heads; a cached
  prefill at ``Sizes.prefill`` timed, each entry holding the bytes its Hugging Face cache keeps. The peers are
  the checkpoint unpatched and the 1-K/V-head model unpatched (plain transformers, each reading the same weight
  tensors as its patched model).

Entry names say which fraction is kept, not counts, so that the goals name the same entries at every size.

Shapes:
    b: batch, s: sequence, d: d_model, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import copy
import importlib.util
from functools import partial
from typing import Callable

import torch

from .cases import Sizes
from .hf import llama_model, sharing_weights
from .peers import PackedSDPA
from .timing import Entry, Group

__all__ = ["surgery_groups", "cache_bytes"]

#: (name, quarters of the heads kept), largest first: the first is the base every ratio divides by.
KEPT = (("headwise, every head", 4), ("headwise, 3/4 of the heads", 3), ("headwise, half the heads", 2),
        ("headwise, 1/4 of the heads", 1))


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer(x)


def prune_group(sz: Sizes) -> Group:
    """The layer's forward with fewer heads (the last ones removed), against the unpruned layer and the
    half-pruned layer's practical limit."""
    from headwise import MultiHeadAttention
    from headwise.surgery import prune_heads

    b, s, d, h = sz.forward
    torch.manual_seed(0)
    full = MultiHeadAttention(d_model=d, n_heads=h).eval()
    x = torch.randn(b, s, d, generator=torch.Generator().manual_seed(1))
    layers = {name: full if quarters == 4 else prune_heads(full, list(range(h * quarters // 4, h))).eval()
              for name, quarters in KEPT}
    # a pruned layer computes another function than the full one: only the limit is compared, with its own
    es = [Entry(name, partial(_forward, layer, x), compare=False,
                note=f"{layer.n_heads} of {h} heads, {_params(layer):,} parameters") for name, layer in layers.items()]
    limit = PackedSDPA(layers["headwise, half the heads"]).eval()
    es.append(Entry("packed SDPA, half the heads", partial(_forward, limit, x), ref="headwise, half the heads",
                    note=f"the practical limit; {_params(limit):,} parameters"))
    return Group("surgery prune", f"surgery prune forward b{b} s{s} d{d} h{h}", es, base=KEPT[0][0],
                 rounds=sz.rounds, block_s=sz.block_s)


def cache_bytes(cache: object) -> int:
    """Bytes of the keys and values a Hugging Face cache holds, over every layer."""
    return sum(t.numel() * t.element_size() for layer in cache.layers  # type: ignore[attr-defined]
               for t in (layer.keys, layer.values))


def _prefill(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True).logits


def _held(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int]:
    """(bytes of the cache one prefill leaves, K/V heads per layer), from an untimed prefill."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]  # the field's name before transformers 5
    return cache_bytes(cache), model.config.num_key_value_heads


def kv_group(sz: Sizes) -> Group:
    """A cached prefill of the checkpoint and of its regroupings to h, h_kv / 2 and 1 K/V heads, against the
    checkpoint and the 1-K/V-head model unpatched."""
    from headwise.interop import patch, unpatch
    from headwise.surgery import to_gqa, to_mha

    _, h, h_kv = sz.llama[:3]
    b, s = sz.prefill
    original = llama_model(*sz.llama)  # never patched: what the checkpoint must compute
    checkpoint = patch(sharing_weights(original))
    models = {"headwise, to_mha": to_mha(copy.deepcopy(checkpoint)), "headwise, checkpoint": checkpoint}
    if 1 < h_kv // 2 < h_kv:  # else the same model as one K/V head
        models["headwise, to_gqa, half the K/V heads"] = to_gqa(copy.deepcopy(checkpoint), h_kv // 2)
    models["headwise, to_gqa, 1 K/V head"] = to_gqa(copy.deepcopy(checkpoint), 1)
    plain = unpatch(sharing_weights(models["headwise, to_gqa, 1 K/V head"]))
    ids = torch.randint(3, sz.llama[-1], (b, s), generator=torch.Generator().manual_seed(2))

    def entry(name: str, model: torch.nn.Module, ref: str | None) -> Entry:
        held = _held(model, ids)
        return Entry(name, partial(_prefill, model, ids), ref=ref, compare=ref is not None, held=held,
                     note=f"{held[1]} K/V head{'s' * (held[1] != 1)}, K/V cache {held[0] / (1 << 20):.1f} MiB "
                          f"({held[0]:,} bytes)")

    # to_mha is exact, so it computes what the checkpoint does, and the checkpoint what the model it was patched
    # from does (a fault that to_mha and the patched checkpoint shared would pass the first comparison alone);
    # a mean-pooled regrouping computes another function
    refs = {"headwise, to_mha": "headwise, checkpoint", "headwise, checkpoint": "HF Llama (unpatched), checkpoint"}
    es = [entry(name, m, refs.get(name)) for name, m in models.items()]
    es.append(entry("HF Llama (unpatched), checkpoint", original, None))
    es.append(entry("HF Llama (unpatched), 1 K/V head", plain, "headwise, to_gqa, 1 K/V head"))
    return Group("surgery kv", f"surgery kv Llama prefill b{b} s{s} h{h} h_kv{h_kv}", es, base=es[-1].name,
                 rounds=sz.rounds, block_s=sz.block_s, tol=(1e-4, 1e-4))


def surgery_groups(sz: Sizes) -> dict[str, list[Callable[[], Group]]]:
    """The ``surgery`` case's factories: the pruned layer, and the regrouped decoder where transformers is
    installed."""
    groups = [partial(prune_group, sz)]
    if importlib.util.find_spec("transformers") is not None:
        groups.append(partial(kv_group, sz))
    return {"surgery": groups}
