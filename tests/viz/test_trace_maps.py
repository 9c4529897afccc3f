"""The drawn maps are the model's own attention: on a patched GPT-2 they equal Hugging Face's
output_attentions of the unpatched model (causal: no weight on a future token), padding included."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from headwise.viz.maps import model_head_maps  # noqa: E402
from tests import hf_reference as ref  # noqa: E402


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_maps_equal_the_models_own_output_attentions(family):
    model = ref.BUILDERS[family]("sdpa")
    plain = ref.twin(model)
    plain.set_attn_implementation("eager")  # HF returns its weights on the eager path
    kw = ref.inputs(model)  # row 1 is padded on the right
    with torch.no_grad():
        want = plain(**kw, output_attentions=True).attentions
    for layer in range(2):
        for row in range(2):
            maps = model_head_maps(model, kw, layer=layer, row=row)
            torch.testing.assert_close(maps.weights, want[layer][row])
            if family != "bert":
                assert bool((maps.weights.triu(1) == 0).all())  # nothing on future tokens
            if row == 1 and family == "gpt2":  # padded keys get no weight from real queries
                assert bool((maps.weights[:, :4, 4:] == 0).all())


def test_value_norms_follow_w_o_per_head_under_gqa():
    model = ref.BUILDERS["llama"]("sdpa")
    plain = ref.twin(model)
    kw = ref.inputs(model, pad=False)
    maps = model_head_maps(model, kw, layer=1, row=0)
    # the reference: the unpatched model's values (a hook on v_proj) through each head's W_O slice
    seen = []
    attn = plain.model.layers[1].self_attn
    handle = attn.v_proj.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        plain(**kw)
    handle.remove()
    v = seen[0][0].reshape(6, 2, 4).double()  # (s, h_kv, d_h)
    w_o = attn.o_proj.weight.double()  # (d, h * d_h)
    want = torch.stack([(v[:, i // 3] @ w_o[:, 4 * i:4 * i + 4].T).norm(dim=-1) for i in range(6)])
    torch.testing.assert_close(maps.value_norms.double(), want, rtol=1e-5, atol=1e-6)


def test_bad_layer_is_refused():
    model = ref.BUILDERS["gpt2"]("sdpa")
    with pytest.raises(ValueError, match=r"layer must be an int in \[-2, 2\)"):
        model_head_maps(model, ref.inputs(model), layer=2)
