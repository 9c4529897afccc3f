"""Input validation shared by the public entry points: every message names expected and received.

Checks read metadata only (shapes, dtypes, devices, types), never tensor data, so they cost a few Python
comparisons per call.

Shapes:
    b: batch, s_q: query length, s_kv: key/value length, h: query heads, h_kv: key/value heads,
    d: model width (d_model), d_h: head width (d_head).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from .kv_cache import KVCache
# The cache's device and autocast rules are the layer's too: one rule, so both refuse with the same words.
from .kv_support import autocast_dtype, check_device  # noqa: F401 (check_device: the layer's, from here)
from .masks import causal_mask, validate_mask


def check_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_input(name: str, x: object, width: int, width_name: str, dtype: torch.dtype,
                device: torch.device, *, batched: bool | None = None) -> torch.Tensor:
    """``x`` must be ``(b, s, width)`` (or ``(s, width)``) of the weights' dtype and device."""
    x = check_tensor(name, x)
    if x.dim() not in (2, 3) or x.shape[-1] != width:
        raise ValueError(
            f"{name} must have shape (b, s, {width_name}={width}) or (s, {width_name}={width}), "
            f"got {tuple(x.shape)}"
        )
    if batched is not None and (x.dim() == 3) != batched:
        want = "batched (b, s, width)" if batched else "unbatched (s, width)"
        raise ValueError(f"{name} must be {want} like the query input, got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but the weights are {dtype}; convert one of them "
                        f"(e.g. x.to({dtype}) or module.to({x.dtype}))")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the weights are on {device}")
    return x


def check_causal(causal: object) -> None:
    # A string such as "top_left" is truthy and would silently mean bottom-right.
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool (True = bottom-right aligned), got {causal!r}; for top-left "
                        f"alignment pass mask=headwise.masks.causal_mask(s_q, s_kv, align='top_left')")


def check_positions(positions: object, b: int, s: int, device: torch.device | None = None) -> torch.Tensor:
    """Rotary positions: an integer tensor ``(s,)``, ``(1, s)`` or ``(b, s)``, on ``device`` when one is given.

    Args:
        positions: what the caller passed as ``positions=``.
        b: the batch size of the call.
        s: its query length s_q.
        device: the inputs' device, or None to leave the device unchecked.
    """
    positions = check_tensor("positions", positions)
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    shape = positions.shape
    # Explicit ==, not tuple membership: dynamo folds `in` to False when s or b is a symbolic size
    if not (len(shape) == 1 and shape[0] == s
            or len(shape) == 2 and shape[1] == s and (shape[0] == 1 or shape[0] == b)):
        raise ValueError(f"positions must have shape (s_q={s},) or (b={b}, s_q={s}), got {tuple(positions.shape)}")
    if device is not None and positions.device != device:
        raise ValueError(f"positions are on {positions.device}, but the inputs are on {device}")
    return positions


def check_bool(name: str, value: object) -> None:
    # A string such as "no" is truthy: flags must be real bools.
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


def check_qkv(q: object, k: object, v: object) -> None:
    """Split heads that agree: q (b, h, s_q, d_h), k and v (b, h_kv, s_kv, d_h), h a multiple of h_kv,
    one dtype (floating) and one device. Metadata only: nothing reads tensor data."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 4:
            want = "(b, h, s_q, d_h)" if name == "q" else "(b, h_kv, s_kv, d_h)"
            raise ValueError(f"{name} must be a 4-D tensor {want}, got {tuple(t.shape)}")
    qs, ks, vs = q.shape, k.shape, v.shape
    if qs[0] == ks[0] and ks[:3] == vs[:3] and qs[3] == ks[3] and ks[1] and not qs[1] % ks[1]:
        if q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point and q.device == k.device == v.device:
            return  # the common case: no message is built
    got = f"q {tuple(qs)}, k {tuple(ks)}, v {tuple(vs)}"
    if not qs[0] == ks[0] == vs[0]:
        raise ValueError(f"q, k, v must share the batch size b; got {got}")
    if ks[:3] != vs[:3]:
        raise ValueError(f"k and v must share (b, h_kv, s_kv); got {got}")
    if qs[3] != ks[3]:
        raise ValueError(f"q and k must share d_h; got {got}")
    if ks[1] == 0 or qs[1] % ks[1]:
        raise ValueError(f"query heads h={qs[1]} must be a multiple of K/V heads h_kv={ks[1]}; got {got}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q, k, v must be floating point, got {q.dtype}")
    raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def check_sinks(sinks: object, b: int, h: int, s_q: int, device: torch.device) -> None:
    """Attention sinks: None, or floating logits on the queries' device, one per query head ``(h,)`` or one per
    query row ``(b or 1, h, s_q or 1, 1)`` (never broadcast over heads: each head has its own)."""
    if sinks is None:
        return
    check_tensor("sinks", sinks)
    shape = tuple(sinks.shape)
    per_row = (len(shape) == 4 and (shape[0] == 1 or shape[0] == b) and shape[1] == h  # ==, not `in`: see validate_mask
               and (shape[2] == 1 or shape[2] == s_q) and shape[3] == 1)
    if not (shape == (h,) or per_row) or not sinks.dtype.is_floating_point:
        raise ValueError(f"sinks must be a floating tensor of shape (h={h},) or (b or 1, h={h}, s_q or 1, 1) with "
                         f"b={b}, s_q={s_q}, got {shape} {sinks.dtype}")
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device} but the queries are on {device}")


def has_dead_rows(mask: torch.Tensor | None, causal: tuple[int, int] | None = None) -> bool:
    """Whether a floating mask has a query row entirely at (or below half of) its dtype's minimum: Hugging
    Face's padding rows. Reads the mask: called only while autograd records (see plan rule 2).

    ``causal``: ``(s_q, s_kv)`` of a causal call; a row's keys past its position (bottom-right) are blocked
    anyway, so the row counts as dead when every key it may read is at the minimum (left padding under a
    causal call), and a row that may read no key at all is left to the zeroing of rows that read nothing."""
    if mask is None or mask.dtype == torch.bool or mask.numel() == 0:
        return False
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(mask):
        return True  # compile, export and torch.func cannot branch on data: the formula is right on every row
    low = mask <= torch.finfo(mask.dtype).min / 2  # broadcastable to (b, h, s_q, s_kv)
    if causal is None:
        return bool(low.all(-1).any())
    readable = causal_mask(*causal, device=mask.device)  # (s_q, s_kv), bottom-right
    return bool(((low | ~readable).all(-1) & readable.any(-1)).any())


def check_dtype(name: str, dtype: object) -> None:
    """``dtype`` is None or a floating torch.dtype (attention weights and activations are floats)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{name} must be a floating torch.dtype (e.g. torch.float32) or None, got {dtype!r}")


class ForwardInputs(NamedTuple):
    """A forward's inputs after :func:`check_forward`: batched, ``key``/``value`` None for self-attention,
    the mask a validated 4-D view, rotary positions resolved."""

    x: torch.Tensor
    key: torch.Tensor | None
    value: torch.Tensor | None
    mask: torch.Tensor | None
    positions: torch.Tensor | None
    batched: bool


def check_forward(config: Any, dtype: torch.dtype, device: torch.device, rotary: bool,
                  x: object, context: object, key: object, value: object, mask: object, causal: object,
                  cache: object, positions: object, return_weights: object) -> ForwardInputs:
    """Every check of a layer's forward, once, before any work or state change. ``config`` is the layer's
    :class:`~headwise.AttentionConfig` (not imported here: the config is built on these checks). Rotary
    positions left as None are the layer's to fill (the cache's next positions, or ``0 .. s_q - 1``).

    Shapes:
        x: (b, s_q, d) or (s_q, d); context: (b, s_kv, kdim); key: (b, s_kv, kdim); value: (b, s_kv, vdim)
        mask: broadcastable to (b, h, s_q, s_kv) with s_kv = cache.length + s_q under a cache
        positions: (s_q,), (1, s_q) or (b, s_q)
    """
    if causal is not True and causal is not False:
        check_causal(causal)
    if return_weights is not True and return_weights is not False:
        check_bool("return_weights", return_weights)
    if not (type(x) is torch.Tensor and x.dim() in (2, 3) and x.shape[-1] == config.d_model and x.dtype == dtype
            and x.device == device):  # the common case builds no message
        x = check_input("x", x, config.d_model, "d_model", dtype, device)
    batched = x.dim() == 3
    if (key is None) != (value is None):
        raise ValueError("pass both key= and value= (or neither)")
    if key is not None and context is not None:
        raise ValueError("pass either context= or key=/value=, not both")
    if key is not None:
        key = check_input("key", key, config.kdim, "kdim", dtype, device, batched=batched)
        value = check_input("value", value, config.vdim, "vdim", dtype, device, batched=batched)
    elif context is not None:
        if config.kdim != config.vdim:
            raise ValueError(f"kdim={config.kdim} != vdim={config.vdim}: pass key= and value= separately")
        key = value = check_input("context", context, config.kdim, "kdim", dtype, device, batched=batched)
    if not batched:
        x = x.unsqueeze(0)
        key = None if key is None else key.unsqueeze(0)
        value = None if value is None else value.unsqueeze(0)
    b, s_q = x.shape[0], x.shape[1]
    if key is not None:
        if key.shape[0] != b or value.shape[0] != b:
            raise ValueError(f"batch mismatch: x has b={b}, key/context has b={key.shape[0]}, "
                             f"value has b={value.shape[0]}")
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"key has s_kv={key.shape[1]} but value has s_kv={value.shape[1]}")
        if cache is not None:
            raise ValueError("cache= is for self-attention decoding; cross-attention keys need no cache")
        if rotary:
            raise ValueError("rotary embeddings apply to self-attention only; got context/key inputs")
    elif config.kdim != config.d_model or config.vdim != config.d_model:
        raise ValueError(f"this layer projects keys from kdim={config.kdim} and values from vdim={config.vdim} "
                         f"features, but self-attention (no context=, key= or value=) gives it x of "
                         f"d_model={config.d_model}: pass context= (or key= and value=)")
    if cache is not None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache (see new_cache), got {type(cache).__name__}")
        held = (cache.batch_size, cache.n_kv_heads, cache.d_head)
        if held != (b, config.n_kv_heads, config.d_head):
            raise ValueError(f"the cache does not fit this call: it holds (b, h_kv, d_h) = {held}, this layer "
                             f"writes {(b, config.n_kv_heads, config.d_head)}; make one with "
                             f"layer.new_cache(batch_size={b}, max_len=...)")
        if cache.keys.dtype != dtype and cache.keys.dtype != autocast_dtype(dtype, device):
            raise TypeError(cache_dtype_message(cache.keys.dtype, dtype, device))
        if cache.keys.device != device:
            raise ValueError(f"the cache is on {cache.keys.device}, this call runs on {device}")
    if mask is not None:
        # The cache's length is read only here: a compiled decode step without a mask never reads it (the
        # position it writes at is a tensor: see KVCache.write_static).
        s_kv = (cache.length + s_q) if cache is not None else (s_q if key is None else key.shape[1])
        mask = validate_mask(mask, (b, config.n_heads, s_q, s_kv), dtype, device)
    if not rotary:
        if positions is not None:
            raise ValueError("positions= is for rotary layers; this layer has no rotary embedding")
    elif positions is not None:
        positions = check_positions(positions, b, s_q, device)
    return ForwardInputs(x, key, value, mask, positions, batched)


def check_first_write(cache: KVCache, s: int, dtype: torch.dtype, device: torch.device) -> None:
    """What a cache's first write by a layer (with parameters of ``dtype`` on ``device``) would refuse, checked
    before the layer claims the cache, so that a refused call binds nothing: the dtype the projections write
    (the autocast dtype under ``torch.autocast``) and room for ``s`` new positions. A layer's later calls
    need not ask: the write itself refuses them, and the cache is theirs already."""
    writes = autocast_dtype(dtype, device) or dtype
    if cache.keys.dtype != writes:
        raise TypeError(cache_dtype_message(cache.keys.dtype, dtype, device))
    if not torch.compiler.is_compiling():  # compiled, an overflow raises when the graph runs (KVCache.write_static)
        cache.check_room(s)


def check_step_cache(cache: KVCache, dtype: torch.dtype, device: torch.device) -> None:
    """A cache that a decoding loop over a layer with parameters of ``dtype`` on ``device`` can write: on that
    device, and of that dtype, of the autocast dtype now active, or half precision (for decoding under an
    autocast entered later; float64 layers are never autocast)."""
    if cache.keys.device != device:
        raise ValueError(f"the cache is on {cache.keys.device}, this layer's parameters on {device}")
    held = cache.keys.dtype
    half = held in (torch.float16, torch.bfloat16) and dtype != torch.float64
    if held != dtype and held != autocast_dtype(dtype, device) and not half:
        raise TypeError(cache_dtype_message(held, dtype, device))


def cache_dtype_message(held: torch.dtype, dtype: torch.dtype, device: torch.device) -> str:
    """Why a cache of dtype ``held`` does not fit a layer with parameters of ``dtype`` on ``device``."""
    writes = autocast_dtype(dtype, device)
    if writes is None:
        return f"the cache holds {held}, this layer writes {dtype} keys"
    return (f"the cache holds {held}, this layer writes {writes} keys under torch.autocast({device.type!r}, "
            f"dtype={writes}); make the cache with layer.new_cache(..., dtype={writes})")


def _device_bytes(device: torch.device) -> int | None:
    """The memory of ``device`` (physical RAM for the CPU), or None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def check_layer_size(config: Any, dtype: torch.dtype | None, device: object) -> None:
    """The four projections of ``config`` fit a tensor (2**63 - 1 bytes) and the device's memory; refused
    before anything is allocated."""
    itemsize = (dtype or torch.get_default_dtype()).itemsize
    shapes = {"q_proj": (config.inner_dim, config.d_model), "k_proj": (config.kv_dim, config.kdim),
              "v_proj": (config.kv_dim, config.vdim), "out_proj": (config.d_model, config.inner_dim)}
    total = 0
    for proj, (rows, cols) in shapes.items():
        nbytes = rows * cols * itemsize
        if nbytes > 2**63 - 1:
            raise ValueError(f"{proj}.weight of shape ({rows}, {cols}) would take {nbytes:.3e} bytes, more than "
                             f"a torch tensor can address (2**63 - 1); choose smaller sizes")
        total += nbytes
    dev = torch.get_default_device() if device is None else torch.device(device)
    limit = _device_bytes(dev)
    if limit is not None and total > limit:
        raise ValueError(f"the layer's projections would take {total:.3e} bytes, more than the {limit:.3e} "
                         f"bytes of memory {dev} has; choose smaller sizes")
