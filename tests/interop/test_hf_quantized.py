"""A Hugging Face model quantized with torch.ao.quantization.quantize_dynamic, patched before or after: it computes
as the unpatched quantized model and its traced z is what its W_O takes (a plain forward pre-hook on that model);
what needs float weights (heads, 'result' captures, from_hf) is refused naming the quantized module, before a trace
starts, and the refusal never says the projection is missing."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
from headwise.interop import from_hf, layers, patch  # noqa: E402

from tests.interop.tiny_models import build, inputs, output  # noqa: E402

PACKED = r"torch\.ao\.nn\.quantized\.dynamic\.[\w.]*Linear, whose weight is packed \(quantized\), not a float tensor: " \
         r"headwise reads float weights, so take heads, capture 'result' and edit weights before quantizing"
# family -> (its first attention module, the module whose input is z, where W_Q lives)
WHERE = {"llama": ("model.layers.0.self_attn", "o_proj", "q_proj"),
         "bert": ("encoder.layer.0.attention", "output.dense", "self.query")}


def quantized(model: torch.nn.Module) -> torch.nn.Module:
    quantization = pytest.importorskip("torch.ao.quantization")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization and qint8 tensors announce their move to torchao
        return quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


@pytest.mark.parametrize("family", list(WHERE))
@pytest.mark.parametrize("first", ["patch", "quantize"])
def test_a_quantized_model_computes_as_unpatched_and_refuses_what_needs_float_weights(family, first):
    where, w_o, w_q = WHERE[family]
    ref = quantized(build(family, impl="eager"))
    model = quantized(patch(build(family, impl="eager"))) if first == "patch" else patch(quantized(build(family,
                                                                                                         impl="eager")))
    batch = inputs()
    torch.testing.assert_close(output(model, batch), output(ref, batch))
    seen = []
    hook = ref.get_submodule(where).get_submodule(w_o).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    output(ref, batch)
    hook.remove()
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:
        model(**batch)
    torch.testing.assert_close(t[0].z.flatten(-2), seen[0])
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    attn = layers(model)[0][1]
    if first == "patch":  # located before quantizing: a float weight is asked of a quantized module
        with pytest.raises(TypeError, match=r"each head's write through W_O is read off its float weight, but "
                                            rf"out_proj is a {PACKED}"):
            with headwise.trace(model, capture=("result",)):
                model(**batch)
        for name, proj in (("w_q", "q_proj"), ("w_o", "out_proj")):
            with pytest.raises(TypeError, match=rf"{proj} is a {PACKED}"):
                getattr(attn.head(0), name)
    else:  # quantized before patching: not located, saying why
        with pytest.raises(ValueError, match=rf"out_proj .*is unavailable: W_O is not located: \w+\.{w_o} is a {PACKED}"):
            with headwise.trace(model, capture=("result",)):
                model(**batch)
        with pytest.raises(ValueError, match=rf"q_proj .*is unavailable: Q/K/V are not located: \w+\.{w_q.split('.')[-1]} "
                                             rf"is a {PACKED}"):
            attn.head(0)
    assert calls == [] and [layer.tracer for _, layer in layers(model)] == [None] * len(layers(model))
    with pytest.raises(ValueError, match=rf"from_hf: \w+ cannot be converted: .* is a {PACKED}") as refused:
        from_hf(model.get_submodule(where))
    assert "no projection" not in str(refused.value)
