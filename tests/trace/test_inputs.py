"""Model inputs as users have them: a tokenizer's BatchEncoding (and any other Mapping) gives exactly what the
plain dict gives in the four sweeps and scores on three families; a metric may take the inputs too (masked mean
pooling), checked against brute force with plain hooks on the unpatched model; bad inputs and metrics are
refused in one line before anything runs."""

from __future__ import annotations

import types

import pytest
import torch

import headwise
from headwise.patching import attribution, direct_effects, final_norm, head_effects, logit_direction
from headwise.surgery import ablation_importance, gradient_importance

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402


def pooled(out, inputs):
    """Cosine of rows 0 and 1's embeddings, mean-pooled over each row's real tokens (its attention mask)."""
    hidden = out.logits if hasattr(out, "logits") else out.last_hidden_state
    mask = inputs["attention_mask"][..., None].to(hidden.dtype)  # (b, s, 1)
    e = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.cosine_similarity(e[0], e[1], dim=0)


def loss(out):
    """A few channels of the output (a LayerNorm output's mean square alone would be ~1 whatever the heads do)."""
    hidden = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return hidden[..., :3].pow(2).sum() + hidden[..., 0].sum()


def pair(model):
    clean = ref.inputs(model, seed=1)  # row 1 right-padded
    corrupted = {**clean, "input_ids": ref.inputs(model, seed=2)["input_ids"]}
    return clean, corrupted


FUNCTIONS = {
    "head_effects": lambda m, c, x, metric: head_effects(m, c, x, metric),
    "attribution": lambda m, c, x, metric: attribution(m, c, x, metric),
    "ablation_importance": lambda m, c, x, metric: ablation_importance(m, c, metric),
    "gradient_importance": lambda m, c, x, metric: gradient_importance(m, [c, x], metric),
}


@pytest.mark.parametrize("family", list(ref.BUILDERS))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_a_batch_encoding_gives_what_its_dict_gives(family, name):
    model = patch(ref.BUILDERS[family]("sdpa"))
    clean, corrupted = pair(model)
    enc_clean, enc_corrupted = transformers.BatchEncoding(clean), transformers.BatchEncoding(corrupted)
    got = FUNCTIONS[name](model, enc_clean, enc_corrupted, loss)
    want = FUNCTIONS[name](model, dict(clean), dict(corrupted), loss)
    assert got.shape == want.shape and bool(torch.isfinite(want).all())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert want.abs().max() > 1e-6  # the heads matter: the comparison is not between zeros
    # any other Mapping (read-only, not a dict) works the same
    proxy = FUNCTIONS[name](model, types.MappingProxyType(clean), types.MappingProxyType(corrupted), loss)
    torch.testing.assert_close(proxy, want, rtol=0, atol=0)


def test_direct_effects_take_a_batch_encoding():
    model = patch(ref.BUILDERS["gpt2"]("sdpa"))
    clean, _ = pair(model)
    direction = logit_direction(model, 7, 11)
    got = direct_effects(model, transformers.BatchEncoding(clean), direction, norm=final_norm(model))
    want = direct_effects(model, clean, direction, norm=final_norm(model))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_a_metric_of_the_inputs_pools_over_real_tokens_as_brute_force_does(family):
    """metric(output, inputs) gets the inputs of the run (the corrupted batch): masked mean pooling over a padded
    row equals the loop of layers x heads forwards of the unpatched model, each patching one head with a
    plain pre-hook on W_O's input."""
    model = ref.BUILDERS[family]("sdpa")
    plain = ref.twin(model)
    patch(model)
    clean, corrupted = pair(model)
    h = model.config.num_attention_heads
    _, clean_z, _ = ref.hooked_run(plain, clean, h)
    base, _, _ = ref.hooked_run(plain, corrupted, h)
    want = torch.empty(2, h, dtype=torch.float64)
    for li in range(2):
        for i in range(h):
            src = clean_z[li][:, :, i]
            out, _, _ = ref.hooked_run(plain, corrupted, h, edit={(li, i): lambda z, src=src: src})
            want[li, i] = float(pooled(out, corrupted)) - float(pooled(base, corrupted))
    got = head_effects(model, transformers.BatchEncoding(clean), transformers.BatchEncoding(corrupted), pooled)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got.abs().max() > 1e-3
    # pooling over [PAD] too is another number: the mask reaches the metric
    unmasked = head_effects(model, clean, corrupted, lambda out: pooled(out, {"attention_mask": torch.ones(2, 6)}))
    assert (unmasked - got).abs().max() > 1e-4


def test_the_metric_sees_the_batch_it_scores():
    model = torch.nn.Sequential(headwise.MultiHeadAttention(8, 2)).eval()
    batches = [torch.randn(2, 3, 8), torch.randn(1, 5, 8)]
    seen = []

    def metric(out, inputs):
        seen.append(inputs)
        return out.sum()

    ablation_importance(model, batches, metric)
    assert all(any(x is b for b in batches) for x in seen) and {id(x) for x in seen} == {id(b) for b in batches}


@pytest.mark.parametrize("call, exc, match, before", [
    (lambda m, x: head_effects(m, "a text", "a text", lambda y: y.sum()), TypeError, "tokenize the text first", True),
    (lambda m, x: head_effects(m, {0: x}, {0: x}, lambda y: y.sum()), TypeError, "keyword names .str. as keys", True),
    (lambda m, x: head_effects(m, x, x, lambda y, i, j: y.sum()), TypeError, "metric.output, inputs.", True),
    (lambda m, x: head_effects(m, x, x, 3.0), TypeError, "metric must be a function", True),
    (lambda m, x: head_effects(m, x, x, lambda y: y.sum(), progress="yes"), TypeError, "progress must be None", True),
    (lambda m, x: attribution(m, x, x, lambda: 1.0), TypeError, "0 required positional", True),
    (lambda m, x: ablation_importance(m, [x, "text"], lambda y: y.sum()), TypeError, "batch 1", True),
    (lambda m, x: gradient_importance(m, x, lambda y: float(y.sum().detach())), TypeError,
     r"one-element tensor .* not .item\(\) or float\(...\)\), got float", False),
    (lambda m, x: gradient_importance(m, x, lambda y: y.sum().detach()), ValueError, "has no gradient", False),
    (lambda m, x: attribution(m, x, x, lambda y: y.sum().item()), TypeError, "got float", False),
    (lambda m, x: head_effects(m, x, x, lambda y: None), TypeError,
     "metric must return a number or a scalar tensor, got NoneType", False),
    (lambda m, x: head_effects(m, x, x, lambda y: "x"), TypeError,
     "metric must return a number or a scalar tensor, got str", False),
    (lambda m, x: attribution(m, x, x, lambda y: y.sum() * (1 + 1j)), ValueError,
     "attribution: metric must be real .*, got a torch.complex64 tensor", False),
    (lambda m, x: gradient_importance(m, x, lambda y: y.sum() * 1j), ValueError,
     "gradient_importance: metric must be real", False),
])
def test_bad_inputs_and_metrics_are_refused_in_one_line(call, exc, match, before):
    model = torch.nn.Sequential(headwise.MultiHeadAttention(8, 2)).eval()
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    with pytest.raises(exc, match=match):
        call(model, torch.randn(2, 3, 8))
    assert not calls if before else calls  # argument checks come before any forward
    assert headwise.tracing.find_layers(model)[0][1].tracer is None  # no trace left behind


def test_every_call_runs_on_its_own_copy_of_a_cache_even_one_with_gradients():
    from headwise.tracing.inputs import call

    model = ref.llama("sdpa").double()
    g = torch.Generator().manual_seed(0)
    prefix, ids = torch.randint(3, ref.VOCAB, (2, 3), generator=g), torch.randint(3, ref.VOCAB, (2, 2), generator=g)
    cache = model(input_ids=prefix, use_cache=True).cache  # with gradients on: its states are autograd's
    keys = [layer.keys.detach().clone() for layer in cache.layers]
    # the reference: the whole sequence in one forward, no cache
    want = model(input_ids=torch.cat([prefix, ids], 1)).logits[:, 3:]
    for _ in range(2):  # the second call sees the prefix alone too, not the first call's positions
        out = call(model, {"input_ids": ids, "cache": cache})
        torch.testing.assert_close(out.logits, want)
    assert cache.get_seq_length() == 3
    for layer, before in zip(cache.layers, keys):
        torch.testing.assert_close(layer.keys, before, rtol=0, atol=0)
    out.logits.sum().backward()  # the copy keeps the gradient path through the prefix's states
    only = [t for t in prefix.flatten().tolist() if t not in ids.flatten().tolist()]  # reaches out via the cache
    assert only and model.model.embed_tokens.weight.grad[only].abs().sum(1).min() > 0
