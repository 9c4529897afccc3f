"""A patched model lives exactly as long as the unpatched one: ``del model`` frees its weights by reference counting
(GPU memory back at once, with no wait for Python's cyclic collector), while deep copies and pickles of it are
whole patched models that view their own weights, and a view used after its model was freed says so."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from headwise.interop import from_torch, layers, patch  # noqa: E402
from headwise.surgery import prune_heads, to_gqa  # noqa: E402

from tests.interop.tiny_models import build, inputs, output  # noqa: E402

# where each family keeps a weight of its first attention module
FIRST = {"llama": "model.layers.0.self_attn.q_proj.weight", "gpt2": "transformer.h.0.attn.c_attn.weight",
         "bert": "encoder.layer.0.attention.output.dense.weight"}


def freed_by_refcount(make) -> bool:
    """Whether the model ``make()`` returns frees its first attention module's weight at ``del``, with the cyclic
    collector off (what a user's ``del model; torch.cuda.empty_cache()`` relies on)."""
    gc.collect()
    gc.disable()
    try:
        model, name = make()
        weight = weakref.ref(model.get_parameter(name))
        del model
        return weight() is None
    finally:
        gc.enable()


def run(model: nn.Module) -> nn.Module:
    output(model, inputs())  # a forward: whatever the call leaves behind must not hold the model either
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_a_patched_model_is_freed_at_del_as_the_unpatched_one(family):
    assert freed_by_refcount(lambda: (run(build(family)), FIRST[family]))  # the reference behaviour
    assert freed_by_refcount(lambda: (run(patch(build(family))), FIRST[family]))


def test_a_model_loaded_with_the_headwise_implementation_and_patched_is_freed_at_del():
    assert freed_by_refcount(lambda: (run(patch(build("llama", "headwise"))), FIRST["llama"]))


@pytest.mark.parametrize("surgery", ["prune_heads", "to_gqa"])
def test_a_model_after_head_surgery_is_freed_at_del(surgery):
    def make():
        model = patch(build("llama"))
        held = layers(model)[1][1]  # a view kept across surgery: given back to its module where that is unchanged
        if surgery == "prune_heads":
            prune_heads(model, {0: [1, 4]})
            assert layers(model)[1][1] is held
        else:
            to_gqa(model, 1)
        return run(model), FIRST["llama"]

    assert freed_by_refcount(make)


def test_a_module_holding_an_nn_multihead_attention_and_its_shared_view_is_freed_at_del():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 4, batch_first=True)
            self.attn = from_torch(self.mha, share=True)

    def make():
        holder = Holder()
        holder.attn(torch.randn(2, 3, 16))
        return holder, "mha.in_proj_weight"

    assert freed_by_refcount(make)


def test_a_shared_view_of_an_nn_multihead_attention_keeps_it_alive():
    """from_torch's view is what its caller holds, so it holds the module (nothing holds the view back)."""
    m = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 3, 16)
    want = m(x, x, x, need_weights=False)[0]
    view = from_torch(m, share=True)
    del m
    gc.collect()
    torch.testing.assert_close(view(x), want)
    twin = copy.deepcopy(view)
    with torch.no_grad():
        twin.host.out_proj.weight.zero_()
    torch.testing.assert_close(view(x), want)  # the copy has its own module
    torch.testing.assert_close(twin(x), twin.host.out_proj.bias.expand_as(want))


def torch_round_trip(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_patched_model_is_a_patched_model_of_its_own_weights(family, how):
    batch = inputs()
    want = output(build(family), batch)
    model = patch(build(family))
    twin = copy.deepcopy(model) if how == "deepcopy" else torch_round_trip(model)
    torch.testing.assert_close(output(twin, batch), want)
    name, attn = layers(twin)[0]
    assert attn.host is twin.get_submodule(name)
    assert attn.sources() and all(any(m is s for s in twin.modules()) for _, m in attn.sources())
    # W_O (BERT's lives on the attention module's parent) and Q/K/V: each read from the copy's own modules
    for proj in ("q_proj", "out_proj"):
        assert attn.resolve(proj).weight.data_ptr() in {p.data_ptr() for p in twin.parameters()}
    with torch.no_grad():
        twin.get_parameter(FIRST[family]).zero_()
    torch.testing.assert_close(output(model, batch), want)  # the original is untouched
    edited = build(family)
    with torch.no_grad():
        edited.get_parameter(FIRST[family]).zero_()
    torch.testing.assert_close(output(twin, batch), output(edited, batch))  # the copy computes with its change
    reference = layers(patch(edited))[0][1]
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        torch.testing.assert_close(attn.resolve(proj).weight, reference.resolve(proj).weight, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_a_view_kept_after_its_model_was_freed_refuses_to_compute(family):
    model = patch(build(family))
    name, attn = layers(model)[0]
    q, kv = torch.randn(1, attn.n_heads, 3, attn.d_head), torch.randn(1, attn.n_kv_heads, 3, attn.d_head)
    del model
    gc.collect()
    with pytest.raises(ReferenceError, match=rf"the module \w+ at '{name}' no longer exists"):
        attn.host
    with pytest.raises(ReferenceError, match="no longer exists"):
        attn.head(0).w_q
    with pytest.raises(ReferenceError, match="no longer exists"):
        attn.q_proj
    with pytest.raises(ReferenceError, match="no longer exists"):
        attn.attend(q, kv, kv)
    assert "freed" in repr(attn)  # a repr still names what it was a view of


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_a_view_pickled_alone_loads_with_the_modules_it_reads(family):
    # BERT's W_O lives on the attention module's parent: the pickle brings that along too, and keeps it
    model = patch(build(family))
    name, attn = layers(model)[0]
    x = torch.randn(2, 4, attn.d_model)
    with torch.no_grad():
        want = attn(x)
    twin = torch_round_trip(attn)
    del model, attn
    gc.collect()
    with torch.no_grad():
        torch.testing.assert_close(twin(x), want)
    assert type(twin.host).__name__ and twin.host_name == name
