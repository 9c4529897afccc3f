"""Pruned models remember who survived: ``original_heads`` after one and two rounds of surgery, checked by what
the heads compute (head i of the changed layer computes what head ``original_heads[i]`` computed before, against
the unchanged model: plain hooks on the unpatched Hugging Face model, a float64 trace of a bare layer), through
unpatch / patch, save / load (AutoModel* classes included) and to_gqa's reordering."""

from __future__ import annotations

import json

import pytest
import torch

import headwise
from headwise.surgery import load_pretrained, original_heads, prune_heads, save_pretrained, to_gqa, to_mha

transformers = pytest.importorskip("transformers")

from headwise.interop import patch, unpatch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402
from tests.interop.tiny_models import build, inputs, output  # noqa: E402


def z_of(model, kw):
    """Every layer's context (b, s, h, d_h) in the model's own forward (a trace capture)."""
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:
        model(**kw) if isinstance(kw, dict) else model(kw)
    return [r.z for r in t]


def test_two_rounds_on_a_bare_stack_and_every_kind_of_surgery():
    torch.manual_seed(0)
    model = torch.nn.Sequential(headwise.MultiHeadAttention(24, 6), headwise.MultiHeadAttention(24, 6, 3)).double()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    before = z_of(model, x)
    prune_heads(model, {0: [1, 3]})
    prune_heads(model, {0: [0]})  # the new head 0 is the original head 0
    assert original_heads(model) == [(2, 4, 5), tuple(range(6))]
    after = z_of(model, x)
    torch.testing.assert_close(after[0], before[0][:, :, [2, 4, 5]])  # layer 0's input is unchanged
    to_gqa(model, 1, groups="similarity", layers=[1])  # one group of all six: their order is kept
    assert original_heads(model) == [(2, 4, 5), tuple(range(6))]
    prune_heads(model, {1: [0, 1, 2, 3, 4, 5]})  # every head: one zero placeholder, no original head
    assert original_heads(model) == [(2, 4, 5), ()]
    layer = headwise.MultiHeadAttention(16, 4)
    small = prune_heads(prune_heads(layer, [3]), [0])
    assert original_heads(small) == [(1, 2)] and original_heads(layer) == [(0, 1, 2, 3)]  # the copy's record only
    assert "original heads [1, 2]" in repr(small) and "original heads" not in repr(layer)
    assert original_heads(to_mha(small)) == [(1, 2)]


def test_similarity_regrouping_reorders_the_record_with_the_heads():
    torch.manual_seed(1)
    attn = headwise.MultiHeadAttention(16, 4).double()
    x = torch.randn(1, 3, 16, dtype=torch.float64)
    with torch.no_grad():  # heads 0 and 3 share K/V weights, so similarity pairs them (and reorders the heads)
        attn.k_proj.weight[12:] = attn.k_proj.weight[:4]
        attn.v_proj.weight[12:] = attn.v_proj.weight[:4]
        attn.k_proj.bias[12:] = attn.k_proj.bias[:4]
        attn.v_proj.bias[12:] = attn.v_proj.bias[:4]
    before = z_of(attn, x)[0]
    gqa = to_gqa(attn, 2, groups="similarity")
    order = original_heads(gqa)[0]
    assert order[:2] == (0, 3) and sorted(order) == [0, 1, 2, 3]
    mha = to_mha(gqa)  # exact: each head's own K/V again, so the z of the group-pooled K/V ...
    after = z_of(mha, x)[0]
    # ... of heads 0 and 3 (identical K/V, so the pooled K/V is theirs) equal the original heads' z
    torch.testing.assert_close(after[:, :, :2], before[:, :, [0, 3]])


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_two_rounds_on_a_patched_model_survive_unpatch_save_and_load(family, tmp_path):
    model = ref.BUILDERS[family]("sdpa")  # 4, 4 and 6 heads (Llama: 2 K/V heads)
    plain = ref.twin(model)
    kw = ref.inputs(model)
    h = model.config.num_attention_heads
    _, before, _ = ref.hooked_run(plain, kw, h)  # z per layer of the unpatched, unchanged model
    patch(model)
    prune_heads(model, {1: [1, 3]})
    prune_heads(model, {1: [0]})
    want = (tuple(range(h)), tuple(i for i in range(h) if i not in (0, 1, 3)))
    assert tuple(original_heads(model)) == want
    found = headwise.interop.layers(model)  # each layer's repr names its original heads after surgery
    assert "original heads" not in repr(found[0][1]) and f"original heads {list(want[1])}" in repr(found[1][1])
    after = z_of(model, kw)
    torch.testing.assert_close(after[1], before[1][:, :, list(want[1])])  # layer 0 is unchanged: same input
    unpatch(model)
    assert tuple(original_heads(patch(model))) == want
    assert save_pretrained(model, tmp_path) is False
    side = json.loads((tmp_path / "headwise_surgery.json").read_text())
    assert [m["original_heads"] for m in side["modules"].values()] == [list(w) for w in want]
    loaded = load_pretrained(tmp_path, type(model))
    assert tuple(original_heads(patch(loaded))) == want
    torch.testing.assert_close(output(loaded, kw), output(model, kw))
    auto = load_pretrained(tmp_path, transformers.AutoModel)  # the base model class config.json builds
    assert type(auto) is transformers.MODEL_MAPPING[type(model.config)]
    assert tuple(original_heads(patch(auto))) == want
    base = model.base_model if family != "bert" else model
    with torch.no_grad():
        torch.testing.assert_close(auto(**kw).last_hidden_state, base(**kw).last_hidden_state)


def test_auto_classes_load_task_models_and_refuse_what_they_cannot(tmp_path):
    model = patch(build("llama"))
    prune_heads(model, {0: [5]})
    save_pretrained(model, tmp_path)
    kw = inputs()
    lm = load_pretrained(tmp_path, transformers.AutoModelForCausalLM)
    assert type(lm) is transformers.LlamaForCausalLM
    torch.testing.assert_close(output(lm, kw), output(model, kw))
    with pytest.raises(ValueError, match="AutoModelForImageClassification builds no model from"):
        load_pretrained(tmp_path, transformers.AutoModelForImageClassification)
    with pytest.raises(TypeError, match="a transformers model class .* or an AutoModel\\* class, got 3"):
        load_pretrained(tmp_path, 3)


def test_a_uniformly_pruned_model_keeps_its_numbers_through_the_headwise_loader(tmp_path):
    model = patch(build("llama"))
    prune_heads(model, {0: [0, 1, 2], 1: [3, 4, 5]})  # whole K/V groups: the config describes it
    assert save_pretrained(model, tmp_path) is True
    assert original_heads(patch(load_pretrained(tmp_path, type(model)))) == [(3, 4, 5), (0, 1, 2)]
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)  # loads, but knows nothing of the numbers
    assert original_heads(patch(plain)) == [(0, 1, 2), (0, 1, 2)]


def test_weights_of_another_shape_than_config_json_are_explained(tmp_path):
    model = patch(build("bert"))
    prune_heads(model, {0: [1]})
    unpatch(model).save_pretrained(tmp_path)  # transformers' own save: no sidecar
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # what plain from_pretrained says
        transformers.BertModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"changed by head surgery \(heads removed or regrouped\) and saved without "
                                         r"the headwise_surgery.json .* load it with headwise.surgery.load_pretrained; "
                                         r"'encoder.layer.0.attention.self.query.weight' has shape \(15, 20\) where "
                                         r"config.json gives BertModel \(20, 20\)$"):
        load_pretrained(tmp_path, transformers.BertModel)
    (tmp_path / "config.json").write_text((tmp_path / "config.json").read_text().replace('"vocab_size": 40',
                                                                                         '"vocab_size": 41'))
    with pytest.raises(ValueError, match=r"config.json in .* does not describe these weights: "
                                         r"'embeddings.word_embeddings.weight' has shape \(40, 20\) where"):
        load_pretrained(tmp_path, transformers.BertModel)


def test_saving_and_loading_show_no_bar_and_change_no_setting(tmp_path, capfd):
    from transformers.utils import logging

    model = patch(build("bert"))
    prune_heads(model, {0: [1]})
    logging.enable_progress_bar()
    logging.set_verbosity_info()
    try:
        capfd.readouterr()
        save_pretrained(model, tmp_path)
        load_pretrained(tmp_path, transformers.BertModel)
        err = capfd.readouterr().err
        assert "Writing model shards" not in err and "Loading weights" not in err and "it/s" not in err, err
        assert logging.is_progress_bar_enabled() and logging.get_verbosity() == logging.INFO
    finally:
        logging.set_verbosity_warning()
