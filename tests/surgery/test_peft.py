"""Surgery on patched Hugging Face models under PEFT adapters that keep state outside the attention weights: a
prefix (keys and values per K/V head), input-embedding prompts, ``modules_to_save`` copies. Against plain
PyTorch hooks / hand-pooled weights on the unpatched model, and the model bitwise unchanged after a refusal."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from headwise.interop import layers, patch  # noqa: E402
from headwise.surgery import prune_heads, to_gqa, to_mha  # noqa: E402
from tests.interop.tiny_models import build, inputs, output  # noqa: E402
from tests.surgery.test_hf import blocks, d_head, zero_ablated  # noqa: E402


def snapshot(model):
    """Everything a refused surgery must leave as it was: weights (cloned), configs, module classes, views."""
    base = model.get_base_model()
    return ({k: v.detach().clone() for k, v in model.state_dict().items()}, base.config.to_dict(),
            {n: c.to_dict() for n, c in model.peft_config.items()}, [(n, type(m)) for n, m in model.named_modules()],
            [(n, a.n_heads, a.n_kv_heads, a.d_head) for n, a in layers(model)])


def assert_unchanged(model, before):
    state, cfg, peft_cfg, modules, views = before
    now = model.state_dict()
    assert now.keys() == state.keys() and all(torch.equal(now[k], v) for k, v in state.items())
    assert model.get_base_model().config.to_dict() == cfg
    assert {n: c.to_dict() for n, c in model.peft_config.items()} == peft_cfg
    assert [(n, type(m)) for n, m in model.named_modules()] == modules
    assert [(n, a.n_heads, a.n_kv_heads, a.d_head) for n, a in layers(model)] == views


def prefixed(family):
    torch.manual_seed(3)
    return peft.get_peft_model(build(family), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))


class Holder(torch.nn.Module):
    """A training module holding the PEFT model."""

    def __init__(self, model):
        super().__init__()
        self.net = model


# -- a prefix: keys and values for every layer's K/V heads --------------------------------------------------------
CHANGES = {  # (family, surgery): each changes some layer's K/V heads
    "whole-groups": ("llama", lambda m: prune_heads(m, {0: [0, 1, 2], 1: [0, 1, 2]})),  # (6, 2) -> (3, 1)
    "sub-groups": ("llama", lambda m: prune_heads(m, {0: [1]})),  # -> (5, 5): K/V heads copied per query head
    "regroup-same-count": ("llama", lambda m: prune_heads(m, {0: [3, 5]}, regroup=True)),  # 2 K/V heads, one pooled
    "to_gqa": ("llama", lambda m: to_gqa(m, 1)),
    "to_mha": ("llama", lambda m: to_mha(m)),
    "mha-one-head": ("gpt2", lambda m: prune_heads(m, {1: [0]})),  # fused c_attn, one K/V head per query head
}


@pytest.mark.parametrize("held", [False, True], ids=["peft-model", "in-a-holder"])
@pytest.mark.parametrize("case", list(CHANGES))
def test_a_prefix_refuses_a_change_to_any_layers_kv_heads_and_leaves_the_model_as_it_was(case, held):
    family, surgery = CHANGES[case]
    model = patch(prefixed(family))
    batch = inputs()
    want = output(model, batch)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"holds a PREFIX_TUNING adapter \('default'\) whose prompt encoder gives "
                                         r"every layer keys and values for its K/V heads.*Expected a change that "
                                         r"keeps every layer's K/V heads.*drop the PREFIX_TUNING adapter first"):
        surgery(Holder(model) if held else model)
    assert_unchanged(model, before)
    torch.testing.assert_close(output(model, batch), want, rtol=0, atol=0)  # still runs, and computes the same


def test_a_prefix_lets_query_heads_go_where_every_kv_head_stays():
    model = prefixed("llama")
    batch = inputs()
    drop = {0: [0, 3], 1: [1, 4]}  # one query head of each K/V group: (6, 2) -> (4, 2)
    want = output(zero_ablated(model, "llama", drop), batch)  # the prefix included
    prune_heads(patch(model), drop)
    assert [(a.n_heads, a.n_kv_heads) for _, a in layers(model)] == [(4, 2), (4, 2)]
    torch.testing.assert_close(output(model, batch), want)


# -- prompts that only prepend input embeddings: no state per head ------------------------------------------------
PROMPTS = {"prompt-tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
           "p-tuning": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3,
                                                        encoder_hidden_size=8)}


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_embedding_prompts_leave_pruning_and_regrouping_free(kind):
    torch.manual_seed(3)
    model = peft.get_peft_model(build("llama"), PROMPTS[kind]())
    batch = inputs()
    drop = {0: [1], 1: [0, 2, 5]}  # unequal groups: K/V heads copied per sub-group
    pruned = copy.deepcopy(model)
    want = output(zero_ablated(pruned, "llama", drop), batch)  # the virtual tokens included
    prune_heads(patch(pruned), drop)
    torch.testing.assert_close(output(pruned, batch), want)
    # to_gqa: the reference is the plain model with each K/V projection replaced by the mean of its K/V heads
    ref = copy.deepcopy(model)
    h_kv, d_h = ref.get_base_model().config.num_key_value_heads, d_head(ref.get_base_model(), "llama")
    with torch.no_grad():
        for block in blocks(ref.get_base_model()):
            for name in ("k_proj", "v_proj"):
                w = getattr(block.self_attn, name).weight
                w.copy_(w.reshape(h_kv, d_h, -1).mean(0).repeat(h_kv, 1))
    to_gqa(patch(model), 1)
    assert [a.n_kv_heads for _, a in layers(model)] == [1, 1]
    torch.testing.assert_close(output(model, batch), output(ref, batch))


# -- modules_to_save: a trained copy per adapter beside the module ------------------------------------------------
@pytest.mark.parametrize("how", ["modules_to_save", "lora"])
def test_a_wrapped_w_o_is_refused_naming_it_and_merging_as_advised_then_prunes(how):
    kw = dict(target_modules=["gate_proj"], modules_to_save=["o_proj"]) if how == "modules_to_save" else \
        dict(target_modules=["o_proj"], init_lora_weights=False)
    torch.manual_seed(3)
    model = peft.get_peft_model(patch(build("llama")), peft.LoraConfig(r=2, **kw))  # wrapped after patching
    if how == "modules_to_save":  # a trained copy that differs from the original
        with torch.no_grad():
            model.base_model.model.model.layers[1].self_attn.o_proj.modules_to_save["default"].weight.mul_(1.5)
    batch = inputs()
    want = output(model, batch)
    before = snapshot(model)
    wrapper = {"modules_to_save": r"ModulesToSaveWrapper around Linear, PEFT modules_to_save[^)]*",
               "lora": r"Linear around Linear, PEFT"}[how]
    for surgery in (lambda: prune_heads(model, {1: [0]}), lambda: to_gqa(model, 1, layers=1)):
        with pytest.raises(ValueError, match=rf"out_proj of this layer is wrapped by an adapter \({wrapper}\) at "
                                             r"'base_model\.model\.model\.layers\.1\.self_attn\.o_proj': "
                                             r"merge_and_unload\(\) first"):
            surgery()
        assert_unchanged(model, before)
    torch.testing.assert_close(output(model, batch), want, rtol=0, atol=0)
    attn = layers(model)[1][1]
    assert "out_proj (peft." in attn.edit_refusal(5, 5) and "wrapped by an adapter (PEFT)" in attn.edit_refusal(5, 5)
    merged = model.merge_and_unload()  # what the message says: then the surgery runs, on what the model computed
    want = output(zero_ablated(merged, "llama", {1: [0]}), batch)
    prune_heads(merged, {1: [0]})
    torch.testing.assert_close(output(merged, batch), want)
