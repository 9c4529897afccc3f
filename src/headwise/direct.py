"""Each head's direct effect: its write, read through the final norm, along a residual direction.

:func:`direct_effects` projects every head's write at one query position onto a direction (e.g. a logit
difference, :func:`logit_direction`) through the final norm, linearised: the norm's scale (LayerNorm's standard
deviation, RMSNorm's root mean square) is frozen at this run, so the norm is affine and the heads' contributions
plus those of every other residual component sum to the direction's value minus the norm's bias term. A norm
that a model applies to the attention output before the residual add (Gemma2, Gemma3, OLMo2) is frozen the same
way, each head's write passed through it. Only the direct path is counted, never effects through later layers.
:mod:`headwise.patching` re-exports these names.

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

from .module_calls import adapter_base
from .tracing import find_layers, head_results, trace
from .tracing.inputs import call, check_inputs, eval_mode
from .tracing.layers import encoder_modules
from .viz.projection import applied_weight, output_weight

__all__ = ["direct_effects", "logit_direction", "final_norm"]


def final_norm(model: nn.Module) -> nn.Module:
    """The final norm of a GPT-2 (``transformer.ln_f``) or Llama-family (``model.norm``) causal LM, or of the one
    a wrapper such as PEFT's ``PeftModel`` holds.

    Shapes:
        the norm maps the last residual stream (b, s, d) -> (b, s, d)
    """
    paths = ("transformer.ln_f", "model.norm", "model.final_layernorm", "gpt_neox.final_layer_norm")
    found = _submodule(model, paths)
    if found is None:
        from .surgery.hosts import transformers_model  # only for a wrapped model: surgery is not needed otherwise

        inner = transformers_model(model)
        found = None if inner is None or inner is model else _submodule(inner, paths)
    if found is None:
        raise ValueError(f"no final norm found in {type(model).__name__} (looked for transformer.ln_f, model.norm, "
                         "..., also in the transformers model a wrapper holds); pass norm= explicitly (or norm=None "
                         "for none)")
    return found


def _submodule(model: nn.Module, paths: tuple[str, ...]) -> nn.Module | None:
    """The first of ``paths`` that names a submodule of ``model``, or None."""
    for path in paths:
        try:
            return model.get_submodule(path)
        except AttributeError:
            continue
    return None


def logit_direction(model: nn.Module, good: Any, bad: Any) -> torch.Tensor:
    """``W_U[good] - W_U[bad]``: the residual direction whose value (after the final norm) is the logit
    difference between two tokens (``good``/``bad``: ints, or (b,) tensors of token ids). ``W_U`` is the
    unembedding as the model's forward applies it: under an adapter (PEFT's LoRA on ``lm_head``) the rows with
    the adapter's update merged, read from the forward in eval mode (no adapter dropout), as
    :func:`direct_effects` runs the model; an adapter whose output is not linear in its input has no such rows
    and is refused (ValueError, naming it).

    Shapes:
        W_U: (vocab, d) -> (d,) or (b, d)
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (unembedding) to take a direction from")
    good, bad = torch.as_tensor(good), torch.as_tensor(bad)
    base = adapter_base(head)
    if base is None:
        w = head.weight  # (vocab, d)
        return (w[good] - w[bad]).detach()
    ids, where = torch.unique(torch.cat([good.reshape(-1), bad.reshape(-1)]), return_inverse=True)
    w = applied_weight(head, base.weight, head, rows=ids)  # (k, d): the merged rows of the tokens asked for
    _check_linear(head, w, ids)
    return w[where[:good.numel()]].view(*good.shape, -1) - w[where[good.numel():]].view(*bad.shape, -1)


def _check_linear(head: nn.Module, w: torch.Tensor, ids: torch.Tensor) -> None:
    """ValueError unless ``head``'s forward (eval mode) gives ``x @ w.T`` plus its bias on rows ``ids`` for a
    random ``x``: an adapter that is not linear in its input has no merged rows, and a direction read off its
    unit vectors would not be what the model applies to the residual stream."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, w.shape[1], generator=g).to(dtype=w.dtype, device=w.device)  # (1, d)
    with torch.no_grad(), eval_mode(head):
        got = (head(x) - head(torch.zeros_like(x)))[:, ids].double()  # (1, k)
    want = x.double() @ w.double().T  # (1, k)
    err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
    # rounding of the forward's dtype (its two paths, base and adapter, each rounded), never a nonlinearity
    if not err <= max(1e-4, 16 * torch.finfo(w.dtype).eps):
        raise ValueError(f"logit_direction: the output embeddings are wrapped by "
                         f"{type(head).__module__}.{type(head).__qualname__}, whose output is not linear in its "
                         f"input (relative error {err:.2e} against the rows read from its unit vectors), so the "
                         "unembedding rows it applies are unknown; merge the adapter (merge_and_unload()) or "
                         "pass a direction of your own to direct_effects")


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


def _norm_like(module: nn.Module) -> bool:
    """Whether ``module`` may be a norm (torch's, or a class named *Norm*): what a post-attention norm is."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "Norm" in type(module).__name__


def _watch(model: nn.Module, names: list[str], norm: nn.Module | None, seen: list,
           posts: dict[int, list]) -> list[Any]:
    """Hooks for one forward: ``seen`` gets the final norm's (input, output) per call; ``posts[li]`` gets
    (norm, input, output) for a norm whose input is traced layer ``li``'s output itself, the tensor the module
    returned (Gemma2's, Gemma3's and OLMo2's ``post_attention_layernorm``, applied before the residual add)."""
    outs: dict[int, torch.Tensor] = {}  # layer index -> its module's output in this forward

    def layer_hook(li: int) -> Any:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            outs[li] = out[0] if isinstance(out, (tuple, list)) and out else out
        return hook

    def norm_hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        x = args[0] if args else next(iter(kwargs.values()), None)
        for li, o in outs.items():
            if x is o:  # identity, not equality: this norm reads the layer's output before anything is added
                posts.setdefault(li, []).append((module, x, out))

    handles = [model.get_submodule(name).register_forward_hook(layer_hook(li)) for li, name in enumerate(names)]
    handles += [m.register_forward_hook(norm_hook, with_kwargs=True) for m in model.modules()
                if m is not norm and _norm_like(m)]
    if norm is not None:
        handles.append(norm.register_forward_hook(lambda m, args, out: seen.append((args[0], out))))
    return handles


def _frozen(writes: torch.Tensor, norm: nn.Module, kind: tuple, x: torch.Tensor, y: Any, rows: torch.Tensor,
            pos: torch.Tensor) -> torch.Tensor:
    """What each write adds to ``norm``'s output, less its bias, with the norm's scale frozen at its input ``x``
    in this run (per row, at ``pos``): the norm is then linear in its input, so the writes' parts add up.

    Shapes:
        writes (b, ..., d); x, y (b, s, d) -> (b, ..., d)
    """
    name, eps, gamma = kind
    if name == "rms?":
        gamma = _rms_gain(norm, eps, gamma, x, y)
    x = x[rows, pos].to(writes.dtype)  # (b, d): the input the norm normalised
    if name == "layer":
        scale = (x.var(-1, unbiased=False) + eps).rsqrt()  # (b,): frozen 1 / sigma
        writes = writes - writes.mean(-1, keepdim=True)
    else:
        scale = (x.pow(2).mean(-1) + eps).rsqrt()  # (b,): frozen 1 / rms
    writes = writes * scale.view(-1, *([1] * (writes.dim() - 1)))
    return writes if gamma is None else writes * gamma.to(writes.dtype)


def _post_norm(posts: list, record: Any) -> tuple[nn.Module, tuple, torch.Tensor, Any]:
    """(norm, kind, input, output) of the one norm a layer's output passed through, else a ValueError."""
    if len(posts) > 1:
        raise ValueError(f"direct_effects: layer {record.index} ({record.name!r})'s output is the input of "
                         f"{len(posts)} norms ({', '.join(type(m).__name__ for m, _, _ in posts)}), so which one "
                         "carries its heads' writes to the residual stream is unknown")
    module, x, y = posts[0]
    try:
        kind = _norm_kind(module)
    except TypeError:
        raise ValueError(f"direct_effects: layer {record.index} ({record.name!r})'s output passes through "
                         f"{type(module).__name__} before it reaches the residual stream, a norm of unknown formula "
                         "(not a LayerNorm or an RMSNorm), so its heads' writes cannot be carried through it") from None
    return module, kind, x, y


@torch.no_grad()
def direct_effects(model: nn.Module, inputs: Any, direction: torch.Tensor, *, norm: nn.Module | None = None,
                   position: int | torch.Tensor = -1) -> torch.Tensor:
    """Each head's direct write along ``direction`` at ``position``, through ``norm`` with its scale frozen.

    For LayerNorm, head write ``r`` contributes ``gamma * (r - mean(r)) / sigma . direction``; for RMSNorm
    ``gamma * r / rms . direction``, with ``sigma`` / ``rms`` those of the norm's actual input in this run
    (the standard linearisation: exact for the run's own residual stream, as the scale is a constant of it).
    An RMSNorm's ``gamma`` is its ``weight`` or, as in Gemma, ``1 + weight``: whichever reproduces the norm's
    output in this run; a norm of neither form is refused (ValueError). ``norm=None`` projects the raw writes.
    Where a model normalises the attention output before adding it to the residual stream (Gemma2's, Gemma3's
    and OLMo2's ``post_attention_layernorm``: a norm whose input is the attention module's output itself), a
    head's write ``z_h @ W_O^h`` first passes through that norm, its scale frozen the same way at its own input
    (per row): the heads' parts plus W_O's bias then add up exactly to what the layer adds to the residual
    stream, less that norm's bias. The model runs in eval mode for the duration (dropout off). On an
    encoder-decoder model (``config.is_encoder_decoder``) ``position`` is a decoder position, and the encoder's
    heads get exactly 0: they write into the encoder's residual stream, which the decoder reads only through
    cross-attention. A layer run more than once in the forward (ALBERT's shared layer) is refused (ValueError).
    A W_O that an adapter wraps (PEFT's LoRA on ``o_proj``) is read as the forward applies it, the adapter's
    update merged (:func:`headwise.viz.projection.output_weight`).

    Args:
        model: a patched Hugging Face model (or any module with headwise layers), or a wrapper of one such as
            PEFT's ``PeftModel``.
        inputs: the model's inputs (a tensor, a tuple, or a mapping such as a tokenizer's encoding).
        direction: (d,) or (b, d), e.g. :func:`logit_direction`.
        norm: the final norm (e.g. :func:`final_norm`), or None.
        position: the query position read (int, or (b,) positions such as each row's last real token), in
            [-s, s) (else IndexError).

    Shapes:
        each layer's result (b, s, h, d) -> (b, L, h) float32/64 as the model (NaN where a layer has fewer
        heads than the widest, e.g. after pruning)
    """
    kind = None if norm is None else _norm_kind(norm)
    check_inputs(inputs, "direct_effects")
    encoder = encoder_modules(model)
    if encoder is None:
        raise ValueError(f"direct_effects: {type(model).__name__} is an encoder-decoder model "
                         "(config.is_encoder_decoder) without a get_encoder() module, so its encoder's heads, which "
                         "write into the encoder's residual stream and not the decoder's, cannot be told apart")
    seen: list[tuple[torch.Tensor, Any]] = []  # the final norm's (input, output) per call
    posts: dict[int, list] = {}  # per layer index: the norm its output passed through, (norm, input, output)
    handles = _watch(model, [name for name, _ in find_layers(model)], norm, seen, posts)
    try:
        with eval_mode(model), trace(model, capture=("z",)) as t:
            call(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    for r in t:
        r.require_one_call("direct_effects")
    on_decoder = [r for r in t if r.name not in encoder]
    if not on_decoder:
        raise ValueError("direct_effects: every traced layer is in the encoder of this encoder-decoder model; none "
                         "writes into the decoder's residual stream that the output reads")
    b, s = on_decoder[0].z.shape[:2]
    rows = torch.arange(b)
    pos = _positions(position, b, s)
    parts: dict[int, torch.Tensor] = {}  # decoder layer index -> its heads' writes at pos, (b, h_l, d)
    for li, r in enumerate(t):
        if r.name in encoder:
            continue
        # W_O as the forward applies it (an adapter's update merged), so the writes add up to the layer's output
        w = head_results(r.z[rows, pos][:, :, None], output_weight(r.layer))[:, 0]  # (b, h_l, 1, d_h) -> (b, h_l, d)
        parts[li] = _frozen(w, *_post_norm(posts[li], r), rows, pos) if li in posts else w
    d = next(iter(parts.values())).shape[-1]
    width = max(r.layer.n_heads for r in t)
    writes = on_decoder[0].z.new_full((b, len(t), width, d), float("nan"))  # (b, L, h, d): NaN where no head
    for li, r in enumerate(t):
        # an encoder head writes into the encoder's stream, which the decoder reads only through cross-attention:
        # its direct effect on the decoder's stream is exactly zero (its row is kept so that L indexes the layers)
        writes[:, li, :r.layer.n_heads] = parts[li] if li in parts else 0
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
        writes = _frozen(writes, norm, kind, *seen[-1], rows, pos)
    return (writes * direction).sum(-1)  # (b, L, h)
