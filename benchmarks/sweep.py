"""The every-head sweep: each head's context ``z`` patched from a clean run into a corrupted one, one head at a
time, and the change of a logit difference read for all L x h heads (144 on GPT-2 small).

Every tool runs its fastest batched form: the h heads of one layer are h rows of one forward of the corrupted
input, row i patching head i. headwise: :func:`headwise.patching.head_effects` on the patched model (its own
batching, and the blocks before the patched layer run once). Plain hooks: a forward pre-hook on ``c_proj``
writing the clean head slices. TransformerLens: ``run_with_hooks`` on ``blocks.{l}.attn.hook_z``. nnsight: the
same write on ``c_proj``'s input inside ``NNsight.trace``. Each entry's note counts its lines of user code
(the body of the function below that a user would write).

Shapes:
    ids: (1, s); z: (rows, s, h, d_h); effects: (layers, h) float64.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
from functools import partial
from typing import Callable

import torch

from .cases import Sizes
from .timing import Entry, Group
from .trace import transformer_lens_twin

__all__ = ["sweep_groups"]

A, B = 11, 12  # the metric: logit[A] - logit[B] at the last position


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return (logits[:, -1, A] - logits[:, -1, B]).double()  # (rows,)


def _headwise(model, clean, bad) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from headwise.patching import head_effects

    with torch.no_grad():
        return head_effects(model, clean, bad, lambda out: _metric(out.logits).mean())


def _hooks(model, clean, bad) -> torch.Tensor:  # type: ignore[no-untyped-def]
    blocks, h = model.transformer.h, model.config.n_head
    zs: list[torch.Tensor] = []
    grab = [blk.attn.c_proj.register_forward_pre_hook(lambda m, a: zs.append(a[0])) for blk in blocks]
    with torch.no_grad():
        model(clean)
        base = _metric(model(bad).logits)
    for g in grab:
        g.remove()
    rows, idx, out = bad.expand(h, -1), torch.arange(h), []
    for layer, blk in enumerate(blocks):
        zc = zs[layer].view(bad.shape[1], h, -1).transpose(0, 1)  # (h, s, d_h)

        def patch(m, args, zc=zc):  # type: ignore[no-untyped-def]
            x = args[0].clone().view(h, bad.shape[1], h, -1)  # (rows, s, h, d_h)
            x[idx, :, idx] = zc
            return (x.flatten(2),)

        hook = blk.attn.c_proj.register_forward_pre_hook(patch)
        with torch.no_grad():
            out.append(_metric(model(rows).logits) - base)
        hook.remove()
    return torch.stack(out)


def _transformer_lens(model, clean, bad) -> torch.Tensor:  # type: ignore[no-untyped-def]
    h, n = model.cfg.n_heads, model.cfg.n_layers
    names = [f"blocks.{layer}.attn.hook_z" for layer in range(n)]
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=names)
        base = _metric(model(bad))
    rows, idx, out = bad.expand(h, -1), torch.arange(h), []
    for name in names:
        zc = cache[name][0].transpose(0, 1)  # (h, s, d_h)

        def patch(z, hook, zc=zc):  # type: ignore[no-untyped-def]
            z[idx, :, idx] = zc
            return z

        with torch.no_grad():
            out.append(_metric(model.run_with_hooks(rows, fwd_hooks=[(name, patch)])) - base)
    return torch.stack(out)


def _nnsight(model, clean, bad) -> torch.Tensor:  # type: ignore[no-untyped-def]
    blocks, h = model.transformer.h, model.config.n_head
    zs: list = []
    got: list = []  # nnsight runs a trace's body itself: results leave it through lists
    with torch.no_grad(), model.trace(clean):
        for blk in blocks:
            zs.append(blk.attn.c_proj.input.save())
    with torch.no_grad(), model.trace(bad):
        got.append(model.lm_head.output.save())
    base = _metric(got.pop())
    rows, idx, out = bad.expand(h, -1), torch.arange(h), []
    for layer, blk in enumerate(blocks):
        zc = zs[layer].view(bad.shape[1], h, -1).transpose(0, 1)  # (h, s, d_h)
        with torch.no_grad(), model.trace(rows):
            x = blk.attn.c_proj.input.clone().view(h, bad.shape[1], h, -1)
            x[idx, :, idx] = zc
            blk.attn.c_proj.input = x.flatten(2)
            got.append(model.lm_head.output.save())
        out.append(_metric(got.pop()) - base)
    return torch.stack(out)


def _lines(fn: Callable) -> int:
    """Lines of user code: the function's body without its signature, blank lines and comments."""
    body = inspect.getsource(fn).splitlines()[1:]
    return sum(1 for line in body if line.strip() and not line.strip().startswith("#"))


def _group(sz: Sizes) -> Group:
    import transformers

    from headwise.interop import patch

    d, h, layers, vocab, s = sz.sweep
    cfg = transformers.GPT2Config(n_embd=d, n_head=h, n_layer=layers, vocab_size=vocab, bos_token_id=vocab - 1,
                                  eos_token_id=vocab - 1, attn_implementation="sdpa")
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(2)
    clean = torch.randint(0, vocab, (1, s), generator=g)
    bad = clean.clone()
    bad[0, : s // 2] = torch.randint(0, vocab, (s // 2,), generator=g)  # the first half corrupted
    es = [Entry("headwise head_effects", partial(_headwise, patch(copy.deepcopy(lm)), clean, bad),
                note=f"{_lines(_headwise)} lines"),
          Entry("hooks, a layer's heads per forward", partial(_hooks, lm, clean, bad),
                note=f"{_lines(_hooks)} lines; pre-hooks on c_proj")]
    notes = []
    if importlib.util.find_spec("transformer_lens") is not None:
        es.append(Entry("TransformerLens run_with_hooks", partial(_transformer_lens, transformer_lens_twin(lm),
                                                                  clean, bad),
                        note=f"{_lines(_transformer_lens)} lines; hook_z"))
    else:
        notes.append("TransformerLens not installed: skipped")
    if importlib.util.find_spec("nnsight") is not None:
        from nnsight import NNsight

        es.append(Entry("nnsight", partial(_nnsight, NNsight(copy.deepcopy(lm)), clean, bad),
                        note=f"{_lines(_nnsight)} lines; c_proj input set in a trace"))
    else:
        notes.append("nnsight not installed: skipped")
    notes.append("pyvene: not in this group (an interchange per head needs one intervention config per head)")
    return Group("sweep", f"every-head sweep GPT-2-shaped d{d} h{h} {layers} layers s{s}: {layers * h} heads", es,
                 base="hooks, a layer's heads per forward", rounds=max(2, sz.rounds // 3), block_s=0.0,
                 tol=(1e-3, 1e-4), notes=notes)


def sweep_groups(sz: Sizes) -> dict[str, list[Callable[[], Group]]]:
    """The sweep factory (none without transformers)."""
    if importlib.util.find_spec("transformers") is None:
        return {"sweep": []}
    return {"sweep": [partial(_group, sz)]}
