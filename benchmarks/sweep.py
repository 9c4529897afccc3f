"""The 144-head patching sweep: every head's context z patched from a clean run into a corrupted one, one
head at a time, the effect a logit difference at the last position (L, h), on a random GPT-2-shaped
``GPT2LMHeadModel``. Each tool in its fastest honest batched form: one forward per layer whose batch holds one
patched copy per head (headwise's ``head_effects`` additionally runs the unpatched blocks before the layer once).
Peers: plain hooks, TransformerLens ``run_with_hooks``, nnsight (a trace per layer) and pyvene (an ``h.pos``
interchange per layer fed the clean z collected once). One call takes seconds: the group times
``Sizes.sweep_rounds`` interleaved rounds and measures peak memory on the warm-up call.

A zero-ablation sweep costs the same forwards; patching is what the tools' tutorials show.

Shapes:
    ids: (b, s); effects: (L, h) float64.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Callable

import torch

from .cases import Sizes
from .timing import Entry, Group
from .trace import _installed, _transformer_lens, user_lines

__all__ = ["sweep_groups"]


def _metric(logits: torch.Tensor, b: int) -> torch.Tensor:
    """Per copy of b rows, the mean logit difference of tokens 0 and 1 at the last position: (copies,)."""
    d = logits[:, -1, 0] - logits[:, -1, 1]
    return d.view(-1, b).mean(1).double()


def _headwise(model, clean, bad) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from headwise.patching import head_effects

    with torch.no_grad():
        return head_effects(model, clean, bad, lambda out: float(_metric(out.logits, clean.shape[0])))


def _hooks(model, clean, bad) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Plain PyTorch: z from pre-hooks on every ``c_proj``, then per layer one forward of h patched copies."""
    b, (blocks, h) = clean.shape[0], (model.transformer.h, model.config.n_head)
    zs: list = []
    hooks = [blk.attn.c_proj.register_forward_pre_hook(lambda m, a: zs.append(a[0])) for blk in blocks]
    with torch.no_grad():
        model(clean)
        base = _metric(model(bad).logits, b)
    for hook in hooks:
        hook.remove()
    rows = []
    for i, blk in enumerate(blocks):
        def patch(m, a, z=zs[i]):  # copy j gets head j's slice of the clean z
            x, dh = a[0].clone(), z.shape[-1] // h
            for j in range(h):
                x[j * b:(j + 1) * b, :, j * dh:(j + 1) * dh] = z[:, :, j * dh:(j + 1) * dh]
            return (x,)
        hook = blk.attn.c_proj.register_forward_pre_hook(patch)
        with torch.no_grad():
            rows.append(_metric(model(bad.repeat(h, 1)).logits, b) - base)
        hook.remove()
    return torch.stack(rows)


def _tl(model, clean, bad) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """TransformerLens: run_with_cache for the clean z, then run_with_hooks on h batch-expanded copies."""
    b, h, n = clean.shape[0], model.cfg.n_heads, model.cfg.n_layers
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=lambda name: name.endswith("hook_z"))
        base = _metric(model(bad), b)
        rows = []
        for i in range(n):
            def patch(z, hook, clean_z=cache[f"blocks.{i}.attn.hook_z"]):  # (b * h, s, h, d_h)
                for j in range(h):
                    z[j * b:(j + 1) * b, :, j] = clean_z[:, :, j]
                return z
            logits = model.run_with_hooks(bad.repeat(h, 1), fwd_hooks=[(f"blocks.{i}.attn.hook_z", patch)])
            rows.append(_metric(logits, b) - base)
    return torch.stack(rows)


def _nnsight(model, clean, bad) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """nnsight: the clean z saved in one trace, then one trace per layer writing each copy's head slice."""
    b, h, blocks = clean.shape[0], model.config.n_head, model.transformer.h
    zs: list = []
    with torch.no_grad():
        with model.trace(clean):
            for blk in blocks:  # nnsight reads values in execution order
                zs.append(blk.attn.c_proj.input.save())
        with model.trace(bad):
            base = model.output.logits.save()
        rows = []
        for i, blk in enumerate(blocks):
            dh = zs[i].shape[-1] // h
            with model.trace(bad.repeat(h, 1)):
                for j in range(h):
                    blk.attn.c_proj.input[j * b:(j + 1) * b, :, j * dh:(j + 1) * dh] = zs[i][:, :, j * dh:(j + 1) * dh]
                logits = model.output.logits.save()
            rows.append(_metric(logits, b) - _metric(base, b))
    return torch.stack(rows)


def _pyvene_models(model, s: int):  # type: ignore[no-untyped-def]
    """pyvene's setup: one model collecting every block's z at s positions, one patching each layer's heads."""
    import pyvene as pv

    n = model.config.n_layer
    collect = pv.IntervenableModel(pv.IntervenableConfig([{"layer": i, "component": "attention_value_output",
                                   "max_number_of_units": s, "intervention_type": pv.CollectIntervention}
                                   for i in range(n)]), model=model)
    patchers = [pv.IntervenableModel(pv.IntervenableConfig([{"layer": i, "component": "head_attention_value_output",
                "unit": "h.pos", "intervention_type": pv.VanillaIntervention}]), model=model) for i in range(n)]
    return collect, patchers


def _pyvene(collect, patchers, clean, bad) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """pyvene: the clean z collected once, then per layer one batch of h copies, copy j's rows given head j's
    clean z at every position (``h.pos`` units, ``source_representations``)."""
    (b, s), h = clean.shape, collect.model.config.n_head
    every = [list(range(s))] * b
    with torch.no_grad():
        (_, zs), _ = collect(base={"input_ids": clean}, unit_locations={"base": [every] * len(patchers)})
        base = _metric(collect.model(bad).logits, b)
        where = {"base": [[[[r // b] for r in range(h * b)], [list(range(s))] * (h * b)]]}
        rows = []
        for z, model in zip(zs, patchers):
            source = z.view(b, s, h, -1).permute(2, 0, 1, 3).reshape(h * b, 1, s, -1)  # (copies x b, 1 head, s, d_h)
            _, out = model(base={"input_ids": bad.repeat(h, 1)}, unit_locations=where, source_representations=[source])
            rows.append(_metric(out.logits, b) - base)
    return torch.stack(rows)


def _plain(model, ids) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(ids).logits


def _group(sz: Sizes) -> Group:
    import transformers

    from headwise.interop import patch

    d, h, layers, vocab, b, s = sz.sweep
    cfg = transformers.GPT2Config(n_embd=d, n_head=h, n_layer=layers, vocab_size=vocab, bos_token_id=vocab - 1,
                                  eos_token_id=vocab - 1, attn_implementation="sdpa")
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(cfg).eval()
    gen = torch.Generator().manual_seed(2)
    clean, bad = (torch.randint(0, vocab, (b, s), generator=gen) for _ in range(2))
    es = [Entry("headwise head_effects", partial(_headwise, patch(copy.deepcopy(lm)), clean, bad),
                note=f"{user_lines(_headwise)} lines of user code"),
          Entry("hooks, a batch per layer", partial(_hooks, lm, clean, bad),
                note=f"plain PyTorch hooks; {user_lines(_hooks)} lines")]
    notes = []
    if _installed("transformer_lens"):
        es.append(Entry("TransformerLens run_with_hooks", partial(_tl, _transformer_lens(lm), clean, bad),
                        note=f"batch-expanded hooks on hook_z; {user_lines(_tl)} lines"))
    if _installed("nnsight"):
        from nnsight import NNsight

        es.append(Entry("nnsight", partial(_nnsight, NNsight(copy.deepcopy(lm)), clean, bad),
                        note=f"one batched trace per layer; {user_lines(_nnsight)} lines"))
    if _installed("pyvene"):
        es.append(Entry("pyvene", partial(_pyvene, *_pyvene_models(copy.deepcopy(lm), s), clean, bad),
                        note=f"h.pos interchange per layer batch; {user_lines(_pyvene) + user_lines(_pyvene_models)} "
                        "lines"))
    notes += [f"{m} not installed: skipped" for m in ("transformer_lens", "nnsight", "pyvene") if not _installed(m)]
    es.append(Entry("plain forward", partial(_plain, lm, bad), compare=False, note="one forward, no patching"))
    return Group("sweep", f"sweep {layers * h} heads GPT-2-shaped d{d} h{h} {layers} layers b{b} s{s}", es,
                 base="plain forward", rounds=sz.sweep_rounds, block_s=sz.block_s, tol=(1e-4, 1e-5), memory=True,
                 memory_on_warmup=True, notes=notes)


def sweep_groups(sz: Sizes) -> dict[str, list[Callable[[], Group]]]:
    return {"sweep": [partial(_group, sz)] if _installed("transformers") else []}
