"""A Hugging Face projection whose weight is recomputed on use (torch.nn.utils.parametrize's weight_norm, the older
weight_norm hook), patched before or after: the model computes as the unpatched one, heads and from_hf read the
weight it computes with (against weight_norm's formula on the tensors it keeps), and a write through a head or
to_hf, which would land in a temporary, is refused naming it with nothing changed."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from headwise.interop import from_hf, layers, patch, to_hf  # noqa: E402

from tests.interop.tiny_models import build, inputs, output  # noqa: E402

# family -> (the module to_hf / from_hf take, its fused or whole Q projection, head 1's W_Q^T in its stored weight,
# how the refusals name where Q lives)
WHERE = {"llama": ("model.layers.0.self_attn", "q_proj", lambda w: w[4:8], "q_proj"),  # d_h 4, weight (out, in)
         "gpt2": ("transformer.h.0.attn", "c_attn", lambda w: w[:, 7:14].T,  # d_h 7, Conv1D weight (in, out)
                  r"c_attn\[0:21\]")}
HOW = {  # put on a projection; weight_norm's g and v as it keeps them; the refusal
    "parametrizations.weight_norm": (
        torch.nn.utils.parametrizations.weight_norm,
        lambda m: (m.parametrizations.weight.original0, m.parametrizations.weight.original1),
        r"weight is parametrized by _WeightNorm \(remove it with torch\.nn\.utils\.parametrize\.remove_parametrizations"),
    "weight_norm hook": (
        torch.nn.utils.weight_norm, lambda m: (m.weight_g, m.weight_v),
        r"weight is recomputed by a WeightNorm hook \(remove it with torch\.nn\.utils\.remove_weight_norm"),
}


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("family, how, first", [("llama", "parametrizations.weight_norm", "patch"),
                                                ("llama", "weight_norm hook", "parametrize"),
                                                ("gpt2", "parametrizations.weight_norm", "parametrize")])
def test_a_recomputed_projection_is_read_as_computed_and_refuses_writes_changing_nothing(family, how, first):
    put, kept, refusal = HOW[how]
    where, name, rows, named = WHERE[family]
    ref = build(family, impl="eager")
    model = copy.deepcopy(ref)
    if first == "patch":
        patch(model)
    for m in (ref, model):
        put(m.get_submodule(where).get_submodule(name))
    if first == "parametrize":
        patch(model)
    batch = inputs()
    torch.testing.assert_close(output(model, batch), output(ref, batch))  # (the hook computes its weight here)
    module = model.get_submodule(where)
    g, v = (t.detach() for t in kept(module.get_submodule(name)))
    effective = g * v / v.norm(dim=1, keepdim=True)  # weight_norm (dim=0) by its formula
    attn = layers(model)[0][1]
    torch.testing.assert_close(attn.head(1).w_q, rows(effective).T)
    torch.testing.assert_close(from_hf(module).head(1).w_q, rows(effective).T)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    said = rf"holds a weight recomputed from other tensors on every use: {refusal}.*a write into it would be lost"
    q = "q_proj" if family == "llama" else rf"q_proj \({named}\)"
    with pytest.raises(TypeError, match=rf"cannot write w_q of head 1: {q} {said}"):
        attn.head(1).w_q = torch.zeros_like(attn.head(1).w_q)
    other = from_hf(build(family, seed=1).get_submodule(where))
    with pytest.raises(TypeError, match=rf"to_hf: cannot write into {type(module).__name__}'s {named}: \w+ {said}"):
        to_hf(other, like=module)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
    torch.testing.assert_close(output(model, batch), output(ref, batch))


@pytest.mark.parametrize("family, part", [("gpt_neox", "w_q"), ("deepseek_v3", "w_o"), ("deepseek_v3", "w_q_nope")])
def test_heads_of_fused_and_latent_projections_refuse_writes_a_parametrization_would_lose(family, part):
    # GPT-NeoX's head-interleaved query_key_value and DeepSeek's latent heads write through their own views
    if family == "gpt_neox":
        torch.manual_seed(0)
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            vocab_size=64, hidden_size=16, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32,
            max_position_embeddings=64)).eval()
        where, names = "gpt_neox.layers.0.attention", ("query_key_value", "w_q", "query_key_value")
    else:
        model = build(family)
        where = "model.layers.0.self_attn"
        names = ("o_proj", "w_o", "out_proj") if part == "w_o" else ("q_b_proj", part, "q_b_proj")
    patch(model)
    module, name, said = names
    torch.nn.utils.parametrizations.weight_norm(model.get_submodule(where).get_submodule(module))
    head = layers(model)[0][1].head(1)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    with pytest.raises(TypeError, match=rf"cannot write {name} of head 1: {said} holds a weight recomputed .*"
                                        r"parametrized by _WeightNorm"):
        setattr(head, name, torch.zeros_like(getattr(head, name)))
    after = model.state_dict()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
