"""``attribution`` (attribution patching) against its definition computed independently on the *unpatched*
GPT-2 in float64: for each head, the derivative of the metric along the straight line from the corrupted to
the clean slice, by central finite differences through a plain hook."""

from __future__ import annotations

import pytest
import torch

import headwise

from headwise import MultiHeadAttention
from headwise.patching import attribution, head_effects

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402

H, D, D_H = 4, 24, 6
EPS = 1e-4


def metric(out):
    return (out.logits[:, -1, 7] - out.logits[:, -1, 11]).mean()


def setup():
    model = ref.gpt2("sdpa").double()
    plain = ref.twin(model)
    patch(model)
    clean = ref.inputs(model, pad=False, seed=1)
    corrupted = {**clean, "input_ids": ref.inputs(model, pad=False, seed=2)["input_ids"]}
    return model, plain, clean, corrupted


def test_z_attribution_equals_the_directional_derivative():
    model, plain, clean, corrupted = setup()
    _, clean_z, _ = ref.hooked_run(plain, clean, H)
    _, bad_z, _ = ref.hooked_run(plain, corrupted, H)
    want = torch.empty(2, H, dtype=torch.float64)
    for li in range(2):
        for i in range(H):
            delta = clean_z[li][:, :, i] - bad_z[li][:, :, i]
            f = [float(metric(ref.hooked_run(plain, corrupted, H, edit={(li, i): lambda z, e=e: z + e * delta})[0]))
                 for e in (EPS, -EPS)]
            want[li, i] = (f[0] - f[1]) / (2 * EPS)
    got = attribution(model, clean, corrupted, metric)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
    per_position = attribution(model, clean, corrupted, metric, per_position=True)
    torch.testing.assert_close(per_position.sum(-1), got)


def test_v_attribution_equals_the_directional_derivative():
    model, plain, clean, corrupted = setup()
    seen = {}

    def run(kw, li=None, fn=None):
        handles = []
        for l, block in enumerate(plain.transformer.h):
            def hook(m, a, out, l=l):
                seen[l] = out
                return fn(out) if l == li else None
            handles.append(block.attn.c_attn.register_forward_hook(hook))
        with torch.no_grad():
            out = plain(**kw)
        for hd in handles:
            hd.remove()
        return out

    run(clean)
    clean_qkv = dict(seen)
    run(corrupted)
    bad_qkv = dict(seen)
    want = torch.empty(2, H, dtype=torch.float64)
    for li in range(2):
        for i in range(H):
            cols = slice(2 * D + i * D_H, 2 * D + (i + 1) * D_H)
            delta = clean_qkv[li][..., cols] - bad_qkv[li][..., cols]

            def move(out, e, cols=cols, delta=delta):
                out = out.clone()
                out[..., cols] += e * delta
                return out
            f = [float(metric(run(corrupted, li, lambda out, e=e: move(out, e)))) for e in (EPS, -EPS)]
            want[li, i] = (f[0] - f[1]) / (2 * EPS)
    torch.testing.assert_close(attribution(model, clean, corrupted, metric, site="v"), want, rtol=1e-6, atol=1e-8)


def test_attribution_is_close_to_the_sweep_for_a_small_change():
    # Linear regime: a corrupted input a small step from the clean one. The estimate is first order, so the
    # two agree to O(step^2); the test would catch a sign, scale or head-order error.
    torch.manual_seed(0)
    model = torch.nn.Sequential(MultiHeadAttention(16, 4, 2), MultiHeadAttention(16, 4, 2)).double().eval()
    clean = torch.randn(2, 5, 16, dtype=torch.float64)
    corrupted = clean + 1e-4 * torch.randn(2, 5, 16, dtype=torch.float64)

    def m(y):
        return y[:, -1].square().sum()
    for site in ("z", "q", "k", "v", "pattern"):
        est = attribution(model, clean, corrupted, m, site=site)
        exact = head_effects(model, clean, corrupted, m, site=site)
        torch.testing.assert_close(est, exact, rtol=1e-3, atol=1e-9)


def test_a_metric_without_a_gradient_is_refused():
    model, _, clean, corrupted = setup()
    with pytest.raises(ValueError, match="one-element tensor"):
        attribution(model, clean, corrupted, lambda out: metric(out).detach())


def test_a_compiled_model_is_refused_saying_it_is_compiled():
    torch.manual_seed(0)
    model = torch.nn.Sequential(MultiHeadAttention(8, 2), MultiHeadAttention(8, 2)).double().eval()
    clean, corrupted = torch.randn(1, 4, 8, dtype=torch.float64), torch.randn(1, 4, 8, dtype=torch.float64)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"compiled model \(torch.compile\(model\)\).*attribution\(model, \.\.\.\)"):
        attribution(torch.compile(model, backend="aot_eager"), clean, corrupted, lambda y: y[0, -1, 0])
    torch._dynamo.reset()
    got = attribution(model, clean, corrupted, lambda y: y[0, -1, 0])  # the model itself: the gradient's sum
    eps = 1e-5  # layer 1 head 0, against a finite difference of its z along the clean - corrupted change
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as tc:
        model(clean)
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as tb:
        model(corrupted)
    delta = tc[1].z - tb[1].z

    def at(scale):
        fn = (lambda z, layer, head: z + scale * delta[:, :, 0])
        with torch.no_grad(), headwise.trace(model, edit={(1, 0): fn}):
            return model(corrupted)[0, -1, 0].double()

    torch.testing.assert_close(got[1, 0], (at(eps) - at(-eps)) / (2 * eps), rtol=1e-5, atol=1e-9)


def test_inputs_of_other_shapes_are_refused_as_the_sweep_refuses_them():
    # the gradient would broadcast a batch of 1 over 2, or one position over 6, into finite numbers
    model, _, _, corrupted = setup()
    ids = corrupted["input_ids"]  # (2, 6)
    for clean, bad, message in (
            ({"input_ids": ids[:1]}, {"input_ids": ids}, r"same batch size, got 1 and 2"),
            ({"input_ids": ids[:, :1]}, {"input_ids": ids},
             r"layer 0 \('transformer.h.0.attn'\) has z of shape \(2, 1, 4, 6\) on the clean input and "
             r"\(2, 6, 4, 6\) on the corrupted one")):
        for run in (attribution, head_effects):
            with pytest.raises(ValueError, match=message):
                run(model, clean, bad, metric)
    with pytest.raises(ValueError, match=r"has v of shape \(2, 4, 1, 6\) on the clean input"):  # each head's own
        attribution(model, {"input_ids": ids[:, :1]}, {"input_ids": ids}, metric, site="v")
    assert all(layer.tracer is None for _, layer in headwise.interop.layers(model))
