"""What seeing every head costs: ``headwise.trace`` on a patched GPT-2-shaped model against a plain forward
of the unpatched model and against the peers researchers use, each capturing the same tensors.

* ``trace result``: every head's residual write ``z_h W_O^h`` (b, s, h, d) of every layer.
* ``trace pattern+z``: every head's probabilities (b, h, s, s) and context (b, s, h, d_h) of every layer.

Peers: plain PyTorch hooks on the unpatched model (a pre-hook on ``c_proj`` for z, then an einsum with
W_O for the result; the eager model's ``output_attentions`` for the pattern), TransformerLens's
``HookedTransformer.run_with_cache`` with the same weights, and nnsight and pyvene where they are
installed. Every capture is checked against headwise's; each row also has the peak resident memory of one
call above that of a plain forward.

Shapes:
    ids: (b, s); result: (b, s, h, d); pattern: (b, h, s, s); z: (b, s, h, d_h).
"""

from __future__ import annotations

import copy
import importlib.util
import warnings
from functools import partial
from typing import Callable

import torch

import headwise

from .cases import Sizes
from .timing import Entry, Group

__all__ = ["gpt2_models", "trace_groups"]


def gpt2_models(d: int, h: int, layers: int, vocab: int):  # type: ignore[no-untyped-def]
    """(unpatched ``GPT2Model`` (sdpa), the same model patched, the same model eager, TransformerLens's
    ``HookedTransformer`` of the same weights or None where TransformerLens is not installed)."""
    import transformers

    cfg = transformers.GPT2Config(n_embd=d, n_head=h, n_layer=layers, vocab_size=vocab,
                                  bos_token_id=vocab - 1, eos_token_id=vocab - 1, attn_implementation="sdpa")
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(cfg).eval()
    plain = lm.transformer
    from headwise.interop import patch

    patched = patch(copy.deepcopy(plain))
    eager = copy.deepcopy(plain)
    eager.set_attn_implementation("eager")
    return plain, patched, eager, _transformer_lens(lm)


def _transformer_lens(lm):  # type: ignore[no-untyped-def]
    if importlib.util.find_spec("transformer_lens") is None:
        return None
    import transformer_lens as tl
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

    c = lm.config
    cfg = tl.HookedTransformerConfig(
        n_layers=c.n_layer, d_model=c.n_embd, d_head=c.n_embd // c.n_head, n_heads=c.n_head, d_mlp=4 * c.n_embd,
        d_vocab=c.vocab_size, n_ctx=c.n_positions, act_fn="gelu_new", normalization_type="LN",
        eps=c.layer_norm_epsilon, original_architecture="GPT2LMHeadModel", default_prepend_bos=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tl.HookedTransformer(cfg)
        model.load_and_process_state_dict(convert_gpt2_weights(lm, cfg), fold_ln=False,
                                          center_writing_weights=False, center_unembed=False,
                                          fold_value_biases=False)
    return model.eval()


def _plain(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(input_ids=ids).last_hidden_state


def _headwise(model, ids: torch.Tensor, capture: tuple[str, ...]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    with torch.no_grad(), headwise.trace(model, capture=capture) as t:
        model(input_ids=ids)
    return [getattr(t[i], c) for i in range(len(t)) for c in capture]


def _hooks(model, ids: torch.Tensor, capture: tuple[str, ...]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Plain PyTorch: z from a pre-hook on each block's ``c_proj``, the pattern from ``output_attentions``
    (on the eager model), the result as z_h @ W_O^h in one einsum per layer."""
    zs: list[torch.Tensor] = []
    hooks = [blk.attn.c_proj.register_forward_pre_hook(lambda m, args: zs.append(args[0])) for blk in model.h]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions="pattern" in capture)
    finally:
        for hook in hooks:
            hook.remove()
    h = model.config.n_head
    got = []
    for i, (z, blk) in enumerate(zip(zs, model.h)):
        b, s, _ = z.shape
        z = z.view(b, s, h, -1)  # (b, s, h, d_h)
        w_o = blk.attn.c_proj.weight  # Conv1D: (h * d_h, d)
        per = {"pattern": out.attentions[i] if "pattern" in capture else None, "z": z}
        if "result" in capture:
            with torch.no_grad():
                per["result"] = torch.einsum("bshk,hkd->bshd", z, w_o.view(h, -1, w_o.shape[1]))
        got += [per[c] for c in capture]
    return got


_TL_NAMES = {"result": "hook_result", "pattern": "hook_pattern", "z": "hook_z"}


def _tl_cache(model, ids: torch.Tensor, capture: tuple[str, ...]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    names = [f"blocks.{i}.attn.{_TL_NAMES[c]}" for i in range(model.cfg.n_layers) for c in capture]
    model.set_use_attn_result("result" in capture)  # how TransformerLens computes hook_result at all
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=names, stop_at_layer=model.cfg.n_layers)
    return [cache[n] for n in names]


def _tl_forward(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    model.set_use_attn_result(False)
    with torch.no_grad():
        return model.ln_final(model(ids, stop_at_layer=model.cfg.n_layers))  # = GPT2Model's last_hidden_state


def _group(sz: Sizes, capture: tuple[str, ...], models) -> Group:  # type: ignore[no-untyped-def]
    plain, patched, eager, tl = models
    d, h, layers, vocab, b, s = sz.trace
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))
    es = [Entry("headwise trace", partial(_headwise, patched, ids, capture)),
          Entry("hooks + einsum" if "result" in capture else "hooks", partial(
              _hooks, eager if "pattern" in capture else plain, ids, capture),
              note="plain PyTorch hooks on the unpatched model" + (" (eager)" if "pattern" in capture else ""))]
    notes = []
    if tl is not None:
        es.append(Entry("TransformerLens run_with_cache", partial(_tl_cache, tl, ids, capture),
                        note="HookedTransformer, the same weights"))
    else:
        notes.append("TransformerLens not installed: skipped")
    notes += [f"{m} not installed: skipped" for m in ("nnsight", "pyvene") if importlib.util.find_spec(m) is None]
    es.append(Entry("plain forward", partial(_plain, plain, ids), compare=False, note="unpatched, no capture"))
    es.append(Entry("headwise patched, no trace", partial(_plain, patched, ids), ref="plain forward"))
    if tl is not None and "result" in capture:
        es.append(Entry("TransformerLens forward", partial(_tl_forward, tl, ids), ref="plain forward"))
    key = "trace " + "+".join(capture)
    return Group(key, f"{key} GPT-2-shaped d{d} h{h} {layers} layers b{b} s{s}", es, base="plain forward",
                 rounds=sz.rounds, block_s=sz.block_s, tol=(1e-4, 1e-5), memory=True, notes=notes)


def trace_groups(sz: Sizes) -> dict[str, list[Callable[[], Group]]]:
    """The trace factories (none without transformers); both groups share one set of models."""
    if importlib.util.find_spec("transformers") is None:
        return {"trace": []}
    shared: list = []

    def make(capture: tuple[str, ...]) -> Group:
        if not shared:
            shared.append(gpt2_models(*sz.trace[:4]))
        group = _group(sz, capture, shared[0])
        if capture == ("pattern", "z"):
            shared.clear()  # the last group: let the models go with it
        return group

    return {"trace": [partial(make, ("result",)), partial(make, ("pattern", "z"))]}
