"""Each head's direct effect: its write, read through the final norm, along a residual direction.

:func:`direct_effects` projects every head's write at one query position onto a direction (e.g. a logit
difference, :func:`logit_direction`) through the final norm, linearised: the norm's scale (LayerNorm's standard
deviation, RMSNorm's root mean square) is frozen at this run, so the norm is affine and the heads' contributions
plus those of every other residual component sum to the direction's value minus the norm's bias term. Only the
direct path is counted, never effects through later layers. :mod:`headwise.patching` re-exports these names.

Shapes:
    b: batch, s: sequence, L: traced layers, h: heads, d: model width (d_model).

Example:
    >>> import torch, headwise
    >>> torch.manual_seed(0) and None
    >>> model = torch.nn.Sequential(headwise.MultiHeadAttention(8, 2), headwise.MultiHeadAttention(8, 2)).eval()
    >>> headwise.patching.direct_effects(model, torch.randn(1, 4, 8), torch.randn(8)).shape
    torch.Size([1, 2, 2])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .tracing import trace
from .tracing.inputs import call, check_inputs, eval_mode

__all__ = ["direct_effects", "logit_direction", "final_norm"]


def final_norm(model: nn.Module) -> nn.Module:
    """The final norm of a GPT-2 (``transformer.ln_f``) or Llama-family (``model.norm``) causal LM.

    Shapes:
        the norm maps the last residual stream (b, s, d) -> (b, s, d)
    """
    for path in ("transformer.ln_f", "model.norm", "model.final_layernorm", "gpt_neox.final_layer_norm"):
        try:
            return model.get_submodule(path)
        except AttributeError:
            continue
    raise ValueError(f"no final norm found in {type(model).__name__} (looked for transformer.ln_f, model.norm, ...); "
                     "pass norm= explicitly (or norm=None for none)")


def logit_direction(model: nn.Module, good: Any, bad: Any) -> torch.Tensor:
    """``W_U[good] - W_U[bad]``: the residual direction whose value (after the final norm) is the logit
    difference between two tokens (``good``/``bad``: ints, or (b,) tensors of token ids).

    Shapes:
        W_U: (vocab, d) -> (d,) or (b, d)
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (unembedding) to take a direction from")
    w = head.weight  # (vocab, d)
    return (w[torch.as_tensor(good)] - w[torch.as_tensor(bad)]).detach()


def _norm_kind(norm: nn.Module) -> tuple[str, float, torch.Tensor | None]:
    """``(kind, eps, weight)``: ``"layer"`` and ``"rms"`` are torch's own norms; ``"rms?"`` is a class named
    *RMSNorm whose gain is not known from its type (Llama's is ``weight``, Gemma's ``1 + weight``): the run's
    own output decides (:func:`_rms_gain`)."""
    if isinstance(norm, nn.LayerNorm):
        return "layer", float(norm.eps), norm.weight
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if isinstance(norm, nn.RMSNorm):
        return "rms", float(torch.finfo(torch.float32).eps if eps is None else eps), norm.weight
    if "RMSNorm" in type(norm).__name__:
        weight = getattr(norm, "weight", None)
        return "rms?", float(1e-6 if eps is None else eps), weight if isinstance(weight, torch.Tensor) else None
    raise TypeError(f"norm must be a LayerNorm or an RMSNorm (or None), got {type(norm).__name__}")


def _rms_gain(norm: nn.Module, eps: float, weight: torch.Tensor | None, x: torch.Tensor, y: Any) -> torch.Tensor | None:
    """The gain of an RMSNorm the type does not name, read off its own call ``y = norm(x)``: ``weight``
    (Llama, Mistral, Qwen2, ...) or ``1 + weight`` (Gemma, Gemma2, Gemma3, ...), whichever reproduces ``y``.
    A norm that is neither is refused: a guessed gain would scale every effect silently."""
    candidates = [("weight", weight)] if weight is None else [("weight", weight), ("1 + weight", 1 + weight)]
    if isinstance(y, torch.Tensor) and y.shape == x.shape and y.is_floating_point():
        xd = x.detach().double()
        normed = xd * (xd.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        # rounding of y's dtype (two roundings in Llama's bf16 path), never the 1/|weight| gap between gains
        tol = max(1e-4, 4 * torch.finfo(y.dtype).eps)
        errors = []
        for name, gain in candidates:
            want = normed if gain is None else normed * gain.detach().double()
            err = float((y.detach().double() - want).abs().max() / want.abs().max().clamp(min=1e-30))
            errors.append((err, name, gain))
        err, _, gain = min(errors, key=lambda e: e[0])
        if err <= tol:
            return gain
    forms = " or ".join(f"{name} * x / rms(x)" for name, _ in candidates)
    raise ValueError(f"direct_effects: the norm {type(norm).__name__}'s output in this run is not {forms} "
                     f"(eps={eps}); its formula is unknown, so its frozen-scale linearisation is too: pass a "
                     "LayerNorm, an RMSNorm of one of those forms, or norm=None")


def _encoder_modules(model: nn.Module) -> set[str]:
    """The names of the modules inside an encoder-decoder model's encoder (``config.is_encoder_decoder``), empty
    for any other model."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return set()
    encoder = model.get_encoder() if callable(getattr(model, "get_encoder", None)) else None
    if not isinstance(encoder, nn.Module):
        raise ValueError(f"direct_effects: {type(model).__name__} is an encoder-decoder model "
                         "(config.is_encoder_decoder) without a get_encoder() module, so its encoder's heads, which "
                         "write into the encoder's residual stream and not the decoder's, cannot be told apart")
    inside = {id(m) for m in encoder.modules()}
    return {name for name, m in model.named_modules() if id(m) in inside}


def _positions(position: Any, b: int, s: int) -> torch.Tensor:
    """``position`` (an int, or (b,) ints) as (b,) indices in [0, s): a position outside [-s, s) is refused,
    never wrapped onto another token."""
    if isinstance(position, bool) or not isinstance(position, (int, torch.Tensor)):
        raise TypeError(f"direct_effects: position must be an int or a (b,) tensor of ints, got "
                        f"{type(position).__name__}")
    pos = torch.as_tensor(position)
    if pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool or pos.dim() > 1 \
            or (pos.dim() == 1 and pos.shape[0] != b):
        raise TypeError(f"direct_effects: position must be an int or a ({b},) tensor of ints, got a "
                        f"{pos.dtype} tensor of shape {tuple(pos.shape)}")
    outside = (pos < -s) | (pos >= s)
    if outside.any():
        raise IndexError(f"direct_effects: position must lie in [-{s}, {s}) for this sequence of {s} tokens, got "
                         f"{pos.tolist()}")
    return pos.expand(b) % s


@torch.no_grad()
def direct_effects(model: nn.Module, inputs: Any, direction: torch.Tensor, *, norm: nn.Module | None = None,
                   position: int | torch.Tensor = -1) -> torch.Tensor:
    """Each head's direct write along ``direction`` at ``position``, through ``norm`` with its scale frozen.

    For LayerNorm, head write ``r`` contributes ``gamma * (r - mean(r)) / sigma . direction``; for RMSNorm
    ``gamma * r / rms . direction``, with ``sigma`` / ``rms`` those of the norm's actual input in this run
    (the standard linearisation: exact for the run's own residual stream, as the scale is a constant of it).
    An RMSNorm's ``gamma`` is its ``weight`` or, as in Gemma, ``1 + weight``: whichever reproduces the norm's
    output in this run; a norm of neither form is refused (ValueError). ``norm=None`` projects the raw writes.
    The model runs in eval mode for the duration (dropout off). On an encoder-decoder model
    (``config.is_encoder_decoder``) ``position`` is a decoder position, and the encoder's heads get exactly 0:
    they write into the encoder's residual stream, which the decoder reads only through cross-attention.

    Args:
        model: a patched Hugging Face model (or any module with headwise layers).
        inputs: the model's inputs (a tensor, a tuple, or a mapping such as a tokenizer's encoding).
        direction: (d,) or (b, d), e.g. :func:`logit_direction`.
        norm: the final norm (e.g. :func:`final_norm`), or None.
        position: the query position read (int, or (b,) positions such as each row's last real token), in
            [-s, s) (else IndexError).

    Shapes:
        each layer's result (b, s, h, d) -> (b, L, h) float32/64 as the model
    """
    kind = None if norm is None else _norm_kind(norm)
    check_inputs(inputs, "direct_effects")
    encoder = _encoder_modules(model)
    seen: list[tuple[torch.Tensor, Any]] = []  # the norm's (input, output) per call
    handle = None if norm is None else norm.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    try:
        with eval_mode(model), trace(model, capture=("result",)) as t:
            call(model, inputs)
    finally:
        if handle is not None:
            handle.remove()
    on_decoder = [r.result for r in t if r.name not in encoder]  # each (b, s, h, d)
    if not on_decoder:
        raise ValueError("direct_effects: every traced layer is in the encoder of this encoder-decoder model; none "
                         "writes into the decoder's residual stream that the output reads")
    b, s, _, d = on_decoder[0].shape
    rows = torch.arange(b)
    pos = _positions(position, b, s)
    # an encoder head writes into the encoder's stream, which the decoder reads only through cross-attention:
    # its direct effect on the decoder's stream is exactly zero (its row is kept so L indexes the traced layers)
    writes = torch.stack([on_decoder[0].new_zeros(b, r.layer.n_heads, d) if r.name in encoder
                          else r.result[rows, pos] for r in t], dim=1)  # (b, L, h, d)
    direction = torch.as_tensor(direction).to(writes.dtype)
    if direction.shape[-1] != writes.shape[-1] or direction.dim() not in (1, 2):
        raise ValueError(f"direction must be (d={writes.shape[-1]},) or (b, d), got {tuple(direction.shape)}")
    if direction.dim() == 2 and direction.shape[0] not in (1, b):
        raise ValueError(f"direction must be (d={writes.shape[-1]},) or (b, d) with b = 1 or the inputs' b={b}, "
                         f"got {tuple(direction.shape)}")
    direction = direction.expand(b, -1)[:, None, None, :]  # (b, 1, 1, d)
    if kind is not None:
        if not seen:
            raise ValueError("the norm was not called during the forward; pass the model's final norm")
        name, eps, gamma = kind
        if name == "rms?":
            gamma = _rms_gain(norm, eps, gamma, *seen[-1])
        x = seen[-1][0][rows, pos].to(writes.dtype)  # (b, d): the residual stream the norm normalised
        if name == "layer":
            scale = (x.var(-1, unbiased=False) + eps).rsqrt()  # (b,): frozen 1 / sigma
            writes = writes - writes.mean(-1, keepdim=True)
        else:
            scale = (x.pow(2).mean(-1) + eps).rsqrt()  # (b,): frozen 1 / rms
        writes = writes * scale[:, None, None, None]
        if gamma is not None:
            writes = writes * gamma.to(writes.dtype)
    return (writes * direction).sum(-1)  # (b, L, h)

