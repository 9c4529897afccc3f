"""``head_effects(site=..., per_position=True)`` against brute force on the *unpatched* GPT-2: one forward
per (layer, head[, position]) patching the clean slice in with a plain hook."""

from __future__ import annotations

import pytest
import torch

from headwise import MultiHeadAttention
from headwise.patching import head_effects

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402
from tests.trace.per_head import per_head_reference  # noqa: E402

D, D_H, H = 24, 6, 4
COLUMNS = {"q": 0, "k": D, "v": 2 * D}  # c_attn's output: [q | k | v]


def metric(out):
    return (out.logits[:, -1, 7] - out.logits[:, -1, 11]).mean()


def c_attn_run(plain, kw, patch_at=None):
    """Run the unpatched GPT-2, recording (and optionally patching) every layer's c_attn output."""
    seen = []
    handles = []
    for li, block in enumerate(plain.transformer.h):
        def hook(m, a, out, li=li):
            seen.append(out)
            if patch_at is not None and patch_at[0] == li:
                return patch_at[1](out)
        handles.append(block.attn.c_attn.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = plain(**kw)
    finally:
        for hd in handles:
            hd.remove()
    return out, seen


def setup():
    model = ref.gpt2("sdpa")
    plain = ref.twin(model)
    patch(model)
    clean = ref.inputs(model, pad=False, seed=1)
    corrupted = {**clean, "input_ids": ref.inputs(model, pad=False, seed=2)["input_ids"]}
    return model, plain, clean, corrupted


@pytest.mark.parametrize("site", ["q", "k", "v"])
def test_q_k_v_sweeps_equal_brute_force(site):
    model, plain, clean, corrupted = setup()
    _, clean_qkv = c_attn_run(plain, clean)
    base = float(metric(c_attn_run(plain, corrupted)[0]))
    want = torch.empty(2, H, dtype=torch.float64)
    for li in range(2):
        for i in range(H):
            cols = slice(COLUMNS[site] + i * D_H, COLUMNS[site] + (i + 1) * D_H)

            def put(out, src=clean_qkv[li][..., cols], cols=cols):
                out = out.clone()
                out[..., cols] = src
                return out
            want[li, i] = float(metric(c_attn_run(plain, corrupted, (li, put))[0])) - base
    got = head_effects(model, clean, corrupted, metric, site=site)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_per_position_z_sweep_equals_brute_force():
    model, plain, clean, corrupted = setup()
    _, clean_z, _ = ref.hooked_run(plain, clean, H)
    base = float(metric(ref.hooked_run(plain, corrupted, H)[0]))
    s = clean["input_ids"].shape[1]
    want = torch.empty(2, H, s, dtype=torch.float64)
    for li in range(2):
        for i in range(H):
            for p in range(s):
                def put(z, src=clean_z[li][:, :, i], p=p):
                    z = z.clone()
                    z[:, p] = src[:, p]
                    return z
                want[li, i, p] = float(metric(ref.hooked_run(plain, corrupted, H, edit={(li, i): put})[0])) - base
    got = head_effects(model, clean, corrupted, metric, per_position=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("site", ["pattern", "k"])
def test_pattern_and_gqa_key_sweeps_of_a_bare_stack_equal_the_float64_reference(site):
    torch.manual_seed(3)
    layers = [MultiHeadAttention(16, 4, 2).double().eval() for _ in range(2)]
    model = torch.nn.Sequential(*layers)
    clean, corrupted = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 5, 16, dtype=torch.float64)
    every = torch.ones(2, 1, 5, 5, dtype=torch.bool)

    def run(x, edits=None, seen=None):  # edits: {(layer, head): fn}; seen: per layer, every head's slice
        for li, attn in enumerate(layers):
            patterns, keys = [], {}

            def record(t, i):
                keys[i] = t
                return t
            mine = {(i, site): fn for (l, i), fn in (edits or {}).items() if l == li}
            if site == "k":
                mine = {(i, "k"): mine.get((i, "k"), lambda t, i=i: record(t, i)) for i in range(4)}
            x = per_head_reference(attn, x, every, mine, patterns)
            if seen is not None:
                seen.append(patterns if site == "pattern" else [keys[i] for i in range(4)])
        return x

    def m(y):
        return y[:, -1].square().sum()
    seen = []
    with torch.no_grad():
        run(clean, seen=seen)
        base = float(m(run(corrupted)))
        want = torch.empty(2, 4, dtype=torch.float64)
        for li in range(2):
            for i in range(4):
                want[li, i] = float(m(run(corrupted, {(li, i): lambda t, src=seen[li][i]: src}))) - base
    torch.testing.assert_close(head_effects(model, clean, corrupted, m, site=site), want)


def test_bad_site_is_refused():
    model, _, clean, corrupted = setup()
    with pytest.raises(ValueError, match="site must be one of"):
        head_effects(model, clean, corrupted, metric, site="result")
