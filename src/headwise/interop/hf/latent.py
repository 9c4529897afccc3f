"""Heads of multi-head latent attention (MLA: DeepSeek-V2/V3) as objects: :class:`LatentHead`.

In MLA no head has a projection of the module input ``x`` of its own. Every head reads latents shared by all
heads, through rows of two up-projections, and shares one rope key (names as in transformers' modules, registry
entry :class:`~headwise.interop.hf.registry.Latent`)::

    q_lat        = q_a_layernorm(q_a_proj(x))                 (x itself where the module has q_proj instead)
    q_h          = q_lat @ [w_q_nope | w_q_rope]              rows of q_b_proj (or q_proj); rotary on the rope part;
                                                              Mistral 4 then scales it by position (below)
    c_kv, k_in   = split(kv_a_proj_with_mqa(x), [r_kv, d_rope])
    kv_lat       = kv_a_layernorm(c_kv)
    k_h          = [kv_lat @ w_k_nope | rotary(k_in)]         rows of kv_b_proj; k_in = x @ w_k_rope + b_k_rope is
                                                              ONE key head, the same for every head
    v_h          = kv_lat @ w_v                               rows of kv_b_proj
    out          = sum_h z_h @ w_o + o_proj.bias              columns of o_proj

So a head's W_Q / W_K / W_V are not ``(d_model, d_head)`` maps of x (the contract of
:class:`~headwise.AttentionHead`): :class:`LatentHead` names each slice and the space it reads (``inputs``).
Rotary differs by family (V2 rotates interleaved pairs as complex numbers; V3 ``rope_interleave`` or rotate-half)
and runs in the module's forward only, so every rope slice here is *before* rotary. Mistral 4 (its config's
``rope_parameters`` hold ``llama_4_scaling_beta``) also multiplies every query, both parts, by the position's
llama-4 scale ``1 + beta * log(1 + floor(position / original_max_position_embeddings))`` (1 before that many
tokens; a number per position, so it commutes with rotary): :meth:`LatentHead.project` applies it.

Shapes:
    b: batch, s: sequence, h: heads, d: model width, r_q: query latent width (d where q_proj reads x),
    r_kv: kv latent width, d_nope / d_rope: the query/key parts without / with rotary, d_v: value width.

Example:
    >>> import torch, transformers
    >>> from headwise.interop import layers, patch
    >>> cfg = transformers.AutoConfig.for_model("deepseek_v3", vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=8, kv_lora_rank=6,
    ...     qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=5, n_routed_experts=2, num_experts_per_tok=1,
    ...     moe_intermediate_size=8, first_k_dense_replace=1, n_group=1, topk_group=1)
    >>> model = patch(transformers.AutoModelForCausalLM.from_config(cfg).eval())
    >>> head = layers(model)[0][1].head(2)
    >>> tuple(head.w_v.shape), head.inputs["w_v"]
    ((6, 5), 'kv_a_layernorm(kv_a_proj_with_mqa(x)[..., :r_kv])')
    >>> kv_b = model.model.layers[0].self_attn.kv_b_proj.weight     # rows head by head, each [k nope | v]
    >>> head.w_v.data_ptr() == kv_b[2 * 9 + 4].data_ptr()          # a view, no copy
    True
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from ...stored_weights import recomputed_weight
from ...validation import check_input, check_positions, check_tensor
from .registry import Latent

__all__ = ["LatentHead"]

_PARTS = ("q_nope", "q_rope", "k_nope", "v", "k_rope")


def _width(host: nn.Module, name: str) -> int:
    value = getattr(host, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{type(host).__name__}: multi-head latent attention needs a positive int {name}, got "
                         f"{value!r}")
    return value


def _linear(host: nn.Module, name: str, shape: tuple[int, int]) -> nn.Linear:
    found = getattr(host, name, None)
    if not isinstance(found, nn.Linear) or tuple(found.weight.shape) != shape:
        got = tuple(found.weight.shape) if isinstance(found, nn.Linear) else type(found).__name__
        raise ValueError(f"{type(host).__name__}.{name}: expected an nn.Linear with weight {shape} (out, in) for "
                         f"multi-head latent attention, got {got}")
    return found


def _slice_property(part: str, bias: bool, doc: str) -> property:
    def get(self: "LatentHead") -> torch.Tensor | None:
        return self._get(part, bias)

    def set_(self: "LatentHead", value: torch.Tensor) -> None:
        target = self._get(part, bias)
        if target is None:
            raise ValueError(f"b_{part}: this head has no such bias (its projection has none)")
        name = f"{'b_' if bias else 'w_'}{part}"
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {tuple(target.shape)}, got {type(value).__name__}")
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{name} must be a tensor of shape {tuple(target.shape)}, got {tuple(value.shape)}")
        module = self.rows[part][0]
        _check_stored(f"{name} of head {self.index}", getattr(self.host, module), module, target)
        with torch.no_grad():
            target.copy_(value)

    return property(get, set_, doc=doc)


def _check_stored(what: str, module: nn.Module, name: str, target: torch.Tensor) -> None:
    """``TypeError`` where a write into ``target`` would not reach ``module`` (a parametrized weight)."""
    why = recomputed_weight(module, target)
    if why:
        raise TypeError(f"cannot write {what}: {name} {why}")


class LatentHead:
    """One head of a patched multi-head latent attention module (``attn.head(i)``): live views of its slices.

    Every ``w_*`` is a transposed row slice (``(in, out)``, so a head computes ``input @ w``) and every ``w_o`` a
    column slice of the module's own weight: no copy, read on every access (a replaced module is followed), and
    assignment writes into the model. ``inputs`` names the space each slice reads: the per-head Q/K/V slices read
    the *latents*, not x. ``shared`` names the modules every head goes through (one set per layer); ``w_k_rope``
    and ``b_k_rope`` are the single rope key head that every head shares (changing it changes every head).

    The head runs nothing on its own: rotary, the mask and the softmax live in the module's forward; trace the
    model for each head's q, k, v (after rotary), pattern, z and result.

    Shapes:
        w_q_nope (r_q, d_nope), w_q_rope (r_q, d_rope), w_k_nope (r_kv, d_nope), w_v (r_kv, d_v),
        w_k_rope (d, d_rope) shared, w_o (d_v, d); b_*: (width,) or None;
        project: x (b, s, d), positions (s,) or (b, s) -> q (b, s, d_nope + d_rope), k (b, s, d_nope + d_rope),
        v (b, s, d_v), before rotary
    """

    def __init__(self, layer: nn.Module, index: int, latent: Latent) -> None:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"head index must be an int, got {type(index).__name__}")
        host, h, d = layer.host, layer.n_heads, layer.d_model
        if not -h <= index < h:
            raise IndexError(f"head index must be in [0, {h}), got {index}")
        nope, rope = _width(host, latent.nope), _width(host, latent.rope)
        d_v, r_kv = _width(host, latent.d_v), _width(host, latent.kv_rank)
        q_name = next((n for n in latent.q_up if isinstance(getattr(host, n, None), nn.Linear)), latent.q_up[0])
        q_down = getattr(host, latent.q_down, None)
        reads_x = q_down is None  # q_proj reads x: the config's q_lora_rank is None
        r_q = d if reads_x else _linear(host, latent.q_down, (getattr(q_down, "out_features", -1), d)).out_features
        _linear(host, q_name, (h * (nope + rope), r_q))
        _linear(host, latent.kv_down, (r_kv + rope, d))
        _linear(host, latent.kv_up, (h * (nope + d_v), r_kv))
        self.layer, self.index, self.kv_index = layer, index % h, index % h
        self._latent, self._q_name = latent, q_name
        self.d_model, self.d_nope, self.d_rope, self.d_v, self.r_q, self.r_kv = d, nope, rope, d_v, r_q, r_kv
        self.scale = layer.config.scale
        q_in = "x" if reads_x else f"{latent.q_norm}({latent.q_down}(x))"
        kv_in = f"{latent.kv_norm}({latent.kv_down}(x)[..., :r_kv])"
        #: The space each slice reads (``w_*`` and its ``b_*``): the per-head Q/K/V slices read latents, not x.
        self.inputs = {"w_q_nope": q_in, "w_q_rope": q_in, "w_k_nope": kv_in, "w_v": kv_in, "w_k_rope": "x",
                       "w_o": "z_h (this head's context)"}
        #: What every head of the layer goes through alike (names on the module).
        self.shared = ((() if reads_x else (latent.q_down, latent.q_norm))
                       + (latent.kv_down, latent.kv_norm, f"{latent.kv_down} rows [r_kv:] (the rope key)"))
        #: Where each slice lives: ``{part: (module name, first row, end row)}``.
        self.rows = {
            "q_nope": (q_name, self.index * (nope + rope), self.index * (nope + rope) + nope),
            "q_rope": (q_name, self.index * (nope + rope) + nope, (self.index + 1) * (nope + rope)),
            "k_nope": (latent.kv_up, self.index * (nope + d_v), self.index * (nope + d_v) + nope),
            "v": (latent.kv_up, self.index * (nope + d_v) + nope, (self.index + 1) * (nope + d_v)),
            "k_rope": (latent.kv_down, r_kv, r_kv + rope),
        }

    @property
    def host(self) -> nn.Module:
        """The patched attention module whose weights this head views."""
        return self.layer.host

    def _get(self, part: str, bias: bool) -> torch.Tensor | None:
        name, a, b = self.rows[part]
        proj = getattr(self.host, name)
        if bias:
            return None if proj.bias is None else proj.bias[a:b]
        return proj.weight[a:b].T  # (in, width): a view of the module's weight

    w_q_nope = _slice_property("q_nope", False, "Query rows without rotary, (r_q, d_nope); reads the query latent.")
    w_q_rope = _slice_property("q_rope", False, "Query rows that rotary turns, (r_q, d_rope), before rotary.")
    w_k_nope = _slice_property("k_nope", False, "Key rows without rotary, (r_kv, d_nope); reads the kv latent.")
    w_v = _slice_property("v", False, "Value rows, (r_kv, d_v); reads the kv latent.")
    w_k_rope = _slice_property("k_rope", False, "The rope key, (d, d_rope), before rotary: ONE key head that every "
                               "head shares; reads x.")
    b_q_nope = _slice_property("q_nope", True, "Bias of w_q_nope, (d_nope,) or None.")
    b_q_rope = _slice_property("q_rope", True, "Bias of w_q_rope, (d_rope,) or None.")
    b_k_nope = _slice_property("k_nope", True, "Bias of w_k_nope, (d_nope,) or None.")
    b_v = _slice_property("v", True, "Bias of w_v, (d_v,) or None.")
    b_k_rope = _slice_property("k_rope", True, "Bias of the shared rope key, (d_rope,) or None.")

    @property
    def w_o(self) -> torch.Tensor:
        """This head's columns of W_O (``o_proj``), (d_v, d): the head adds ``z_h @ w_o`` to the module's output."""
        d_v = self.d_v
        return self.layer.out_proj.weight[:, self.index * d_v:(self.index + 1) * d_v].T

    @w_o.setter
    def w_o(self, value: torch.Tensor) -> None:
        target = self.w_o
        check_tensor("w_o", value)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"w_o must have shape {tuple(target.shape)}, got {tuple(value.shape)}")
        _check_stored(f"w_o of head {self.index}", self.layer.out_proj, "out_proj", target)
        with torch.no_grad():
            target.copy_(value)

    # -- the shared latents, through the module's own shared modules -------------------------------------
    def q_latent(self, x: torch.Tensor) -> torch.Tensor:
        """What the query slices read. Shapes: x (b, s, d) -> (b, s, r_q)."""
        if self.inputs["w_q_nope"] == "x":
            return x
        return getattr(self.host, self._latent.q_norm)(getattr(self.host, self._latent.q_down)(x))

    def kv_latent(self, x: torch.Tensor) -> torch.Tensor:
        """What the key (nope) and value slices read. Shapes: x (b, s, d) -> (b, s, r_kv)."""
        c_kv = getattr(self.host, self._latent.kv_down)(x)[..., :self.r_kv]
        return getattr(self.host, self._latent.kv_norm)(c_kv)

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This head's Q, K, V from the module input, before rotary, laid out as the module lays them out
        (``[nope | rope]``); q times the module's per-position query scale where it has one (Mistral 4's
        llama-4 scale, see the module docstring), at ``positions`` (default ``0 .. s - 1``, a call without a cache).

        Shapes: x (b, s, d) or (s, d); positions (s,), (1, s) or (b, s) -> (b, s, d_nope + d_rope) x2, (b, s, d_v)
        """
        w = getattr(self.host, self._latent.kv_down).weight  # every slice reads x through modules of its dtype
        check_input("x", x, self.d_model, "d_model", w.dtype, w.device)
        s = x.shape[-2]
        if positions is not None:
            check_positions(positions, x.shape[0] if x.dim() == 3 else 1, s, x.device)
        q_lat, kv_lat = self.q_latent(x), self.kv_latent(x)
        q = torch.cat([F.linear(q_lat, self.w_q_nope.T, self.b_q_nope), F.linear(q_lat, self.w_q_rope.T,
                                                                                  self.b_q_rope)], -1)
        rope = getattr(getattr(self.host, "config", None), "rope_parameters", None)
        beta = rope.get("llama_4_scaling_beta") if isinstance(rope, Mapping) else None
        if beta is not None:
            pos = torch.arange(s, device=x.device) if positions is None else positions
            # As transformers computes it: float32, then the queries' dtype.
            scale = 1 + beta * torch.log(1 + torch.floor(pos / rope["original_max_position_embeddings"]))
            q = q * scale.to(q.dtype).reshape(*(pos.shape if x.dim() == 3 else (s,)), 1)  # (b | 1, s, 1) or (s, 1)
        k = torch.cat([F.linear(kv_lat, self.w_k_nope.T, self.b_k_nope), F.linear(x, self.w_k_rope.T,
                                                                                   self.b_k_rope)], -1)
        return q, k, F.linear(kv_lat, self.w_v.T, self.b_v)

    @property
    def is_view(self) -> bool:
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a LatentHead does not run alone: rotary, the mask and the softmax live in the module's "
                        "forward; trace the model for this head's pattern and output, or call head.project(x) for "
                        "its Q, K, V before rotary")

    def __repr__(self) -> str:
        return (f"LatentHead(head {self.index} of {self.layer._hw_name or type(self.host).__name__}: "
                f"q {self._q_name} rows from {self.inputs['w_q_nope']}, k/v {self._latent.kv_up} rows from the kv "
                f"latent (r_kv={self.r_kv}), shared rope key (d_rope={self.d_rope}), d_v={self.d_v})")

    def __getattr__(self, name: str) -> Any:
        if name in ("w_q", "w_k", "b_q", "b_k"):
            raise AttributeError(f"LatentHead has no {name}: in multi-head latent attention a head's Q and K are "
                                 f"[nope | rope] parts reading different spaces; use {name}_nope / "
                                 f"{'w' if name[0] == 'w' else 'b'}_{name[-1]}_rope (see .inputs)")
        raise AttributeError(f"'LatentHead' object has no attribute {name!r}")
