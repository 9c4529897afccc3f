"""What seeing every head costs: ``headwise.trace`` on a patched GPT-2-shaped model against a plain forward
of the unpatched model and against the peers researchers use, each capturing the same tensors.

* ``trace result``: every head's residual write ``z_h W_O^h`` (b, s, h, d) of every layer.
* ``trace pattern+z``: every head's probabilities (b, h, s, s) and context (b, s, h, d_h) of every layer.
* ``trace statistics`` (case ``stats``): every head's lse, entropy, max_weight and key_weight of every layer of a
  4-layer GPT-2-small-shaped model at b1 s8192, against a plain forward (the patterns would be 3.2 GB a layer).

Peers: plain PyTorch hooks on the unpatched model (a pre-hook on ``c_proj`` for z, then an einsum with
W_O for the result; the eager model's ``output_attentions`` for the pattern), and where installed
TransformerLens's ``HookedTransformer.run_with_cache`` with the same weights, nnsight (``NNsight.trace``)
and pyvene (``CollectIntervention``s). Every capture is checked against headwise's; each row also has the peak resident memory of one
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

__all__ = ["gpt2_models", "trace_groups", "user_lines", "statistics_group"]


def gpt2_models(d: int, h: int, layers: int, vocab: int, s: int) -> dict:
    """The models of both groups, by name: ``plain`` (unpatched ``GPT2Model``, sdpa), ``patched`` (a patched
    copy), ``eager`` (an unpatched eager copy), and where installed ``tl`` (TransformerLens's
    ``HookedTransformer`` of the same weights), ``nnsight`` and ``nnsight eager`` (copies wrapped in
    ``nnsight.NNsight``), ``pyvene`` (an ``IntervenableModel`` collecting every block's z at every one of
    ``s`` positions) and ``pyvene eager`` (z and every head's weights, on an eager copy)."""
    import transformers

    from headwise.interop import patch

    cfg = transformers.GPT2Config(n_embd=d, n_head=h, n_layer=layers, vocab_size=vocab,
                                  bos_token_id=vocab - 1, eos_token_id=vocab - 1, attn_implementation="sdpa")
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(cfg).eval()
    plain = lm.transformer
    eager = copy.deepcopy(plain)
    eager.set_attn_implementation("eager")
    models = {"plain": plain, "patched": patch(copy.deepcopy(plain)), "eager": eager}
    if _installed("transformer_lens"):
        models["tl"] = _transformer_lens(lm)
    if _installed("nnsight"):
        from nnsight import NNsight

        models["nnsight"], models["nnsight eager"] = NNsight(copy.deepcopy(plain)), NNsight(copy.deepcopy(eager))
    if _installed("pyvene"):
        import pyvene as pv

        config = pv.IntervenableConfig([{"layer": i, "component": "attention_value_output", "max_number_of_units": s,
                                         "intervention_type": pv.CollectIntervention} for i in range(layers)])
        models["pyvene"] = pv.IntervenableModel(config, model=copy.deepcopy(plain))
        # pyvene's GPT-2 attention_weight site is the input of attn.attn_dropout, which transformers' GPT-2 calls
        # only on its reordered-and-upcast eager path (the same float32 softmax here)
        upcast = copy.deepcopy(eager)
        for blk in upcast.h:
            blk.attn.reorder_and_upcast_attn = True
        sites = [{"layer": i, "component": c, "unit": u, "max_number_of_units": s,
                  "intervention_type": pv.CollectIntervention}
                 for i in range(layers) for c, u in (("attention_value_output", "pos"), ("attention_weight", "h.pos"))]
        models["pyvene eager"] = pv.IntervenableModel(pv.IntervenableConfig(sites), model=upcast)
    return models


def user_lines(fn: Callable) -> int:
    """Lines of user code in an entry's snippet: its body without the def line, docstring, comments and blanks."""
    import inspect

    body = inspect.getsource(fn).split("\n")[1:]
    doc = inspect.getdoc(fn)
    skip = len(doc.split("\n")) if doc else 0
    lines = [ln.strip() for ln in body if ln.strip() and not ln.strip().startswith("#")]
    return len(lines) - skip


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _transformer_lens(lm):  # type: ignore[no-untyped-def]
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


def _assemble(zs: list[torch.Tensor], patterns: list[torch.Tensor], w_o: list[torch.Tensor],
              capture: tuple[str, ...]) -> list[torch.Tensor]:
    """Per layer, what ``capture`` names from z (b, s, h * d_h) and the pattern: the result as z_h @ W_O^h in
    one einsum per layer, ``w_o`` the layers' W_O viewed (h, d_h, d)."""
    got = []
    for i, z in enumerate(zs):
        z = z.view(*z.shape[:2], w_o[i].shape[0], -1)  # (b, s, h, d_h)
        per = {"z": z, "pattern": patterns[i] if patterns else None}
        if "result" in capture:
            with torch.no_grad():
                per["result"] = torch.einsum("bshk,hkd->bshd", z, w_o[i])
        got += [per[c] for c in capture]
    return got


def _hooks(model, ids: torch.Tensor, capture: tuple[str, ...], w_o: list[torch.Tensor]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Plain PyTorch: z from a pre-hook on each block's ``c_proj``, the pattern from ``output_attentions``."""
    zs: list[torch.Tensor] = []
    hooks = [blk.attn.c_proj.register_forward_pre_hook(lambda m, args: zs.append(args[0])) for blk in model.h]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions="pattern" in capture)
    finally:
        for hook in hooks:
            hook.remove()
    return _assemble(zs, list(out.attentions or ()), w_o, capture)


def _nnsight(model, ids: torch.Tensor, capture: tuple[str, ...], w_o: list[torch.Tensor]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """nnsight: z saved from each block's ``c_proj`` input, the pattern from the attention's output."""
    zs: list = []
    patterns: list = []
    pattern = "pattern" in capture
    with torch.no_grad(), model.trace(input_ids=ids, output_attentions=pattern):
        for blk in model.h:  # nnsight reads values in execution order
            zs.append(blk.attn.c_proj.input.save())
            if pattern:
                patterns.append(blk.attn.output[1].save())
    return _assemble(zs, patterns, w_o, capture)


def _pyvene(model, ids: torch.Tensor, capture: tuple[str, ...], w_o: list[torch.Tensor]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """pyvene: z collected by a ``CollectIntervention`` at every position of every block's ``c_proj`` input."""
    every = [list(range(ids.shape[1]))] * ids.shape[0]
    with torch.no_grad():
        (_, zs), _ = model(base={"input_ids": ids}, unit_locations={"base": [every] * len(w_o)})
    return _assemble(zs, [], w_o, capture)


def _pyvene_pattern(model, ids: torch.Tensor, capture: tuple[str, ...], w_o: list[torch.Tensor]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """pyvene: z at every position and every head's weights (``h.pos`` units) collected per block."""
    b, s = ids.shape
    every, heads = [list(range(s))] * b, [list(range(w_o[0].shape[0]))] * b
    with torch.no_grad():
        (_, got), _ = model(base={"input_ids": ids}, unit_locations={"base": [every, [heads, every]] * len(w_o)})
    return _assemble(got[0::2], got[1::2], w_o, capture)


_TL_NAMES = {"result": "hook_result", "pattern": "hook_pattern", "z": "hook_z"}


def _tl_cache(model, ids: torch.Tensor, capture: tuple[str, ...]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    names = [f"blocks.{i}.attn.{_TL_NAMES[c]}" for i in range(model.cfg.n_layers) for c in capture]
    model.set_use_attn_result("result" in capture)  # how TransformerLens computes hook_result at all
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=names, stop_at_layer=model.cfg.n_layers)
    return [cache[n] for n in names]


def _tl_hooks(model, ids: torch.Tensor, capture: tuple[str, ...]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """TransformerLens's other kind: ``run_with_hooks`` with a forward hook saving each named activation."""
    names = [f"blocks.{i}.attn.{_TL_NAMES[c]}" for i in range(model.cfg.n_layers) for c in capture]
    model.set_use_attn_result("result" in capture)
    saved: dict = {}
    with torch.no_grad():
        model.run_with_hooks(ids, fwd_hooks=[(n, lambda x, hook: saved.__setitem__(hook.name, x)) for n in names],
                             stop_at_layer=model.cfg.n_layers)
    return [saved[n] for n in names]


def _tl_forward(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    model.set_use_attn_result(False)
    with torch.no_grad():
        return model.ln_final(model(ids, stop_at_layer=model.cfg.n_layers))  # = GPT2Model's last_hidden_state


def _group(sz: Sizes, capture: tuple[str, ...], models: dict) -> Group:
    d, h, layers, vocab, b, s = sz.trace
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))
    w_o = [blk.attn.c_proj.weight.detach().view(h, d // h, d) for blk in models["plain"].h]  # Conv1D (in, out)
    pattern = "pattern" in capture
    es = [Entry("headwise trace", partial(_headwise, models["patched"], ids, capture),
                note=f"{user_lines(_headwise)} lines"),
          Entry("hooks + einsum" if "result" in capture else "hooks",
                partial(_hooks, models["eager" if pattern else "plain"], ids, capture, w_o),
                note="plain PyTorch hooks on the unpatched model" + (" (eager)" if pattern else "")
                + f"; {user_lines(_hooks) + user_lines(_assemble)} lines")]
    if "tl" in models:
        es.append(Entry("TransformerLens run_with_cache", partial(_tl_cache, models["tl"], ids, capture),
                        note=f"HookedTransformer, the same weights; {user_lines(_tl_cache)} lines"))
        es.append(Entry("TransformerLens run_with_hooks", partial(_tl_hooks, models["tl"], ids, capture),
                        note=f"saving hooks; {user_lines(_tl_hooks)} lines"))
    if "nnsight" in models:
        es.append(Entry("nnsight", partial(_nnsight, models["nnsight eager" if pattern else "nnsight"], ids,
                                           capture, w_o), note="NNsight(model).trace" + (" (eager)" if pattern else "")
                                           + f"; {user_lines(_nnsight) + user_lines(_assemble)} lines"))
    if "pyvene" in models and not pattern:
        es.append(Entry("pyvene", partial(_pyvene, models["pyvene"], ids, capture, w_o),
                        note="IntervenableModel with a CollectIntervention per block; "
                        f"{user_lines(_pyvene) + user_lines(_assemble)} lines (+ its config in gpt2_models)"))
    notes = [f"{m} not installed: skipped" for m, key in (("TransformerLens", "tl"), ("nnsight", "nnsight"),
                                                          ("pyvene", "pyvene")) if key not in models]
    if pattern and "pyvene eager" in models:
        es.append(Entry("pyvene", partial(_pyvene_pattern, models["pyvene eager"], ids, capture, w_o),
                        note="CollectIntervention of z and h.pos weights on GPT-2's upcast eager path; "
                        f"{user_lines(_pyvene_pattern) + user_lines(_assemble)} lines (+ its config in gpt2_models)"))
    es.append(Entry("plain forward", partial(_plain, models["plain"], ids), compare=False,
                    note="unpatched, no capture"))
    es.append(Entry("headwise patched, no trace", partial(_plain, models["patched"], ids), ref="plain forward"))
    if "tl" in models and not pattern:
        es.append(Entry("TransformerLens forward", partial(_tl_forward, models["tl"], ids), ref="plain forward"))
    key = "trace " + "+".join(capture)
    return Group(key, f"{key} GPT-2-shaped d{d} h{h} {layers} layers b{b} s{s}", es, base="plain forward",
                 rounds=sz.rounds, block_s=sz.block_s, tol=(1e-4, 1e-5), memory=True, notes=notes)


def _statistics(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad(), headwise.trace(model, capture=("lse", "entropy", "max_weight", "key_weight")) as t:
        out = model(input_ids=ids).last_hidden_state
    assert t[0].key_weight.shape[-1] == ids.shape[1]  # every statistic of every layer, kept
    return out


def statistics_group(sz: Sizes) -> Group:
    """All four statistics of every head of every layer at a long length, against a plain forward of the
    unpatched model (sdpa) and of the patched one; outputs compared: the last hidden state."""
    import transformers

    from headwise.interop import patch

    d, h, layers, b, s = sz.stats
    cfg = transformers.GPT2Config(n_embd=d, n_head=h, n_layer=layers, vocab_size=50257, n_positions=s,
                                  bos_token_id=50256, eos_token_id=50256, attn_implementation="sdpa")
    torch.manual_seed(0)
    plain = transformers.GPT2Model(cfg).eval()
    patched = patch(copy.deepcopy(plain))
    ids = torch.randint(0, 50257, (b, s), generator=torch.Generator().manual_seed(1))
    es = [Entry("headwise trace, all four statistics", partial(_statistics, patched, ids),
                note="capture=('lse', 'entropy', 'max_weight', 'key_weight'), every layer"),
          Entry("plain forward", partial(_plain, plain, ids), note="unpatched, no capture"),
          Entry("headwise patched, no trace", partial(_plain, patched, ids))]
    return Group("trace statistics", f"trace statistics GPT-2-shaped d{d} h{h} {layers} layers b{b} s{s}", es,
                 base="plain forward", rounds=sz.stats_rounds, block_s=sz.block_s, tol=(1e-4, 1e-5), memory=True,
                 notes=[f"the pattern of one layer would be {b * h * s * s * 4 / 1e9:.1f} GB "
                                               "(float32)"])


def trace_groups(sz: Sizes) -> dict[str, list[Callable[[], Group]]]:
    """The trace factories (none without transformers); both groups share one set of models."""
    if not _installed("transformers"):
        return {"trace": [], "stats": []}
    shared: list[dict] = []

    def make(capture: tuple[str, ...]) -> Group:
        if not shared:
            d, h, layers, vocab, _, s = sz.trace
            shared.append(gpt2_models(d, h, layers, vocab, s))
        group = _group(sz, capture, shared[0])
        if capture == ("pattern", "z"):
            shared.clear()  # the last group: the models go with it
        return group

    return {"trace": [partial(make, ("result",)), partial(make, ("pattern", "z"))],
            "stats": [partial(statistics_group, sz)]}
