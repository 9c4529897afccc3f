"""Surgery on patched Hugging Face models (tiny random BERT, GPT-2, Llama, Mistral, Qwen2, Qwen3): against
plain PyTorch hooks on the unpatched model, and through unpatch / save / load."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
from headwise.interop import layers, patch, unpatch  # noqa: E402
from headwise.surgery import load_pretrained, original_heads, prune_heads, save_pretrained, to_gqa, to_mha  # noqa: E402
from tests.interop.tiny_models import FAMILIES, build, inputs, output  # noqa: E402

W_O = {"bert": "output.dense", "gpt2": "c_proj"}  # else o_proj
ATTN = {"bert": "attention", "gpt2": "attn"}  # else self_attn
# family -> {layer: heads removed}; different counts per layer, and (GQA) groups that end up unequal
DROP = {"bert": {0: [1], 1: [0, 3]}, "gpt2": {0: [2], 1: [0, 1]}, "llama": {0: [1], 1: [0, 2, 5]},
        "mistral": {0: [0, 1, 2], 1: [4]}, "qwen2": {0: [1, 3], 1: [5]}, "qwen3": {0: [0], 1: [1, 2, 3]}}


def blocks(model):
    base = getattr(model, "transformer", None) or getattr(model, "model", None) or model
    return base.h if hasattr(base, "h") else (base.layers if hasattr(base, "layers") else base.encoder.layer)


def d_head(model, family):
    cfg = model.config
    if family == "gpt2":
        return cfg.n_embd // cfg.n_head
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def zero_ablated(model, family, drop):
    """The unpatched model with forward pre-hooks zeroing the dropped heads' slices of W_O's input."""
    ref = copy.deepcopy(model)
    d_h = d_head(model, family)
    for li, heads in drop.items():
        attn = getattr(blocks(ref)[li], ATTN.get(family, "self_attn"))
        w_o = attn.get_submodule(W_O.get(family, "o_proj"))

        def hook(mod, args, heads=heads):
            z = args[0].clone()
            for i in heads:
                z[..., i * d_h:(i + 1) * d_h] = 0
            return (z,)
        w_o.register_forward_pre_hook(hook)
    return ref


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pruned_patched_model_equals_zero_ablation_and_unpatches(family):
    model = build(family)
    batch = inputs()
    ref = zero_ablated(model, family, DROP[family])
    want = output(ref, batch)
    patch(model)
    assert prune_heads(model, DROP[family]) is model
    counts = [attn.n_heads for _, attn in layers(model)]
    full = [layer.n_heads for _, layer in layers(patch(build(family)))]
    assert counts == [h - len(DROP[family][i]) for i, h in enumerate(full)]
    torch.testing.assert_close(output(model, batch), want)
    attn = layers(model)[1][1]
    assert attn.head(0).w_q.shape == (attn.d_model, attn.d_head)
    with headwise.trace(model, capture=("z",)) as t:
        output(model, batch)
    assert [r.z.shape[2] for r in t] == counts
    unpatch(model)
    assert not layers(model)
    torch.testing.assert_close(output(model, batch), want)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pruning_every_head_of_a_layer_leaves_bias_only(family):
    model = build(family)
    batch = inputs()
    n = layers(patch(copy.deepcopy(model)))[0][1].n_heads
    want = output(zero_ablated(model, family, {0: list(range(n))}), batch)
    prune_heads(patch(model), {0: list(range(n))})
    torch.testing.assert_close(output(model, batch), want)
    torch.testing.assert_close(output(unpatch(model), batch), want)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_pruned_decoder_caches(family):
    model = prune_heads(patch(build(family)), DROP[family])
    ids = inputs()["input_ids"]
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :4], use_cache=True)
        rest = model(ids[:, 4:], cache=first.past_key_values, use_cache=True).logits
    torch.testing.assert_close(torch.cat([first.logits, rest], dim=1), full)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_to_gqa_then_to_mha_on_llama_family(family):
    model = patch(build(family))
    batch = inputs()
    ref = copy.deepcopy(unpatch(copy.deepcopy(model)))
    n = model.config.num_attention_heads
    to_gqa(model, 1)
    assert model.config.num_key_value_heads == 1 and all(a.n_kv_heads == 1 for _, a in layers(model))
    # reference: the plain HF model with each K/V projection replaced by the mean over its K/V heads
    h_kv, d_h = ref.config.num_key_value_heads, d_head(ref, family)
    for block in blocks(ref):
        for name in ("k_proj", "v_proj"):
            lin = getattr(block.self_attn, name)
            with torch.no_grad():
                mean_w = lin.weight.reshape(h_kv, d_h, -1).mean(0)
                lin.weight.copy_(mean_w.repeat(h_kv, 1))
                if lin.bias is not None:
                    lin.bias.copy_(lin.bias.reshape(h_kv, d_h).mean(0).repeat(h_kv))
    gqa_out = output(model, batch)
    torch.testing.assert_close(gqa_out, output(ref, batch))
    to_mha(model)
    assert model.config.num_key_value_heads == n
    torch.testing.assert_close(output(model, batch), gqa_out)


def test_bert_refuses_gqa_and_is_unchanged():
    model = patch(build("bert"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="BertSelfAttention has one K/V head per query head"):
        to_gqa(model, 2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and len(layers(model)) == 2


@pytest.mark.parametrize("call, exc, match", [
    (lambda m: prune_heads(m, {0: [1], 2: [0]}), ValueError, r"layer position must be in \[-2, 2\).*got 2"),
    (lambda m: prune_heads(m, {0: [6]}), ValueError, r"in \[0, 6\).*got 6"),
    (lambda m: prune_heads(m, {0: [1, 1]}), ValueError, "more than once"),
    (lambda m: prune_heads(m, {0: [0], "model.layers.0.self_attn": [1]}), ValueError, "named twice"),
    (lambda m: to_gqa(m, 4), ValueError, r"valid: \[1, 2, 3, 6\], got 4"),
    (lambda m: prune_heads(m, {0: [1]}, regroup=True), ValueError, "does not divide"),
    (lambda m: prune_heads(layers(m)[0][1], [0]), TypeError, "pass the patched model"),
    (lambda m: prune_heads(unpatch(copy.deepcopy(m)), {0: [0]}), TypeError, "patch a Hugging Face model first"),
])
def test_bad_input_on_patched_model_changes_nothing(call, exc, match):
    model = patch(build("llama"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(exc, match=match):
        call(model)
    assert [a.n_heads for _, a in layers(model)] == [6, 6] and model.config.num_key_value_heads == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("weights, biases", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("family", ["bert", "gpt2", "qwen2"])  # split Linear, fused Conv1D c_attn, GQA with biases
def test_resized_projections_keep_the_requires_grad_of_their_weight_and_bias(family, weights, biases):
    model = build(family)
    for name, p in model.named_parameters():  # (False, True) is BitFit: only the biases train
        p.requires_grad_(biases if name.endswith(".bias") else weights)
    want = {name: p.requires_grad for name, p in model.named_parameters()}
    prune_heads(patch(model), DROP[family])
    unpatch(model)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == want
    if weights or biases:  # with grad, unlike output()
        out = model(**inputs())
        (out.logits if hasattr(out, "logits") else out.last_hidden_state).sum().backward()
    attn = {n: p for n, p in model.named_parameters() if f".{ATTN.get(family, 'self_attn')}." in n}
    assert {n for n, p in attn.items() if p.grad is not None} == {n for n, p in attn.items() if want[n]}


# -- save -> load ------------------------------------------------------------------------------------------
def test_llama_uniform_regrouping_and_pruning_load_as_plain_hf(tmp_path):
    model = patch(build("llama"))
    batch = inputs()
    prune_heads(model, {0: [0, 1, 2], 1: [3, 4, 5]})  # whole groups: 3 heads, 1 K/V head in every layer
    want = output(model, batch)
    assert save_pretrained(model, tmp_path) is True
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert (plain.config.num_attention_heads, plain.config.num_key_value_heads) == (3, 1)
    torch.testing.assert_close(output(plain, batch), want)
    torch.testing.assert_close(output(load_pretrained(tmp_path, transformers.LlamaForCausalLM), batch), want)


def test_llama_pruned_uniformly_to_a_head_count_not_dividing_its_width_needs_the_headwise_loader(tmp_path):
    model = build("llama", num_key_value_heads=6)
    drop = {0: [0], 1: [3]}  # 5 heads of d_h 4 in every layer: LlamaConfig refuses hidden_size 24 with 5 heads
    want = output(zero_ablated(model, "llama", drop), inputs())
    prune_heads(patch(model), drop)
    assert save_pretrained(model, tmp_path) is False
    assert model.config.num_attention_heads == 6  # left as it was: no valid config describes the new shapes
    with pytest.raises((RuntimeError, ValueError)):
        transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(output(load_pretrained(tmp_path, transformers.LlamaForCausalLM), inputs()), want)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_per_layer_shapes_round_trip_through_the_headwise_loader(family, tmp_path):
    model = prune_heads(patch(build(family)), DROP[family])
    batch = inputs()
    want = output(model, batch)
    assert save_pretrained(model, tmp_path) is False
    cls = getattr(transformers, FAMILIES[family][1])
    with pytest.raises((RuntimeError, ValueError)):  # the config cannot express these shapes
        cls.from_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path, cls)
    assert not layers(loaded)
    torch.testing.assert_close(output(loaded, batch), want)
    torch.testing.assert_close(output(patch(loaded), batch), want)


def _sidecar(tmp_path, edit):
    path = tmp_path / "headwise_surgery.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(format=99), "format 2 .*got format 99"),
    (lambda d: d["modules"].update({"model.layers.7.self_attn": d["modules"]["model.layers.0.self_attn"]}),
     "'model.layers.7.self_attn', which LlamaForCausalLM built from this config does not have"),
    (lambda d: d["modules"]["model.layers.0.self_attn"].update(d_head=8), "d_head=4 from the config.*d_head=8"),
    (lambda d: d["modules"]["model.layers.0.self_attn"].update(n_kv_heads=4), "n_heads=5, n_kv_heads=4"),
    (lambda d: d["modules"]["model.layers.0.self_attn"].update({"class": "BertSelfAttention"}),
     "is a LlamaAttention; the sidecar recorded a BertSelfAttention"),
    (lambda d: d["modules"]["model.layers.0.self_attn"].update(n_heads=4, n_kv_heads=4, original_heads=[0, 2, 3, 4]),
     r"n_heads=4, n_kv_heads=4, d_head=4 do not fit the saved .*q_proj.weight. of shape \(20, 24\)"),
    (lambda d: d["modules"]["model.layers.0.self_attn"].update(original_heads=[0, 2, 2, 4, 5]),
     r"original_heads must list the original index of each of its 5 heads .*got \[0, 2, 2, 4, 5\]"),
    (lambda d: d["modules"]["model.layers.0.self_attn"].update(original_heads=[0, 2, 3]),
     r"original_heads must list .* 5 heads"),
    (lambda d: d["modules"]["model.layers.0.self_attn"].update(original_heads="0,2"), r"original_heads must list"),
])
def test_loader_refuses_what_it_cannot_rebuild(tmp_path, edit, match):
    save_pretrained(prune_heads(patch(build("llama")), DROP["llama"]), tmp_path)
    _sidecar(tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path, transformers.LlamaForCausalLM)


def test_loader_refuses_a_non_model_class_and_loads_plain_folders(tmp_path):
    model = build("bert")
    with pytest.raises(TypeError, match=r"model_class must be a transformers model class \(e.g. BertModel\) or an "
                                        r"AutoModel\* class, got .BertModel."):
        load_pretrained(tmp_path, "BertModel")
    model.save_pretrained(tmp_path)  # no sidecar: plain from_pretrained
    batch = inputs()
    torch.testing.assert_close(output(load_pretrained(tmp_path, transformers.BertModel), batch), output(model, batch))


def test_loader_sets_the_attention_implementation(tmp_path):
    model = prune_heads(patch(build("qwen2")), DROP["qwen2"])
    batch = inputs()
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, transformers.Qwen2ForCausalLM, attn_implementation="eager")
    assert loaded.config._attn_implementation == "eager"
    torch.testing.assert_close(output(loaded, batch), output(model, batch))


# -- the model as users hold it: inside a wrapper, under PEFT; views fetched before; an emptied layer ------------
class Wrapper(torch.nn.Module):
    """A training module holding the patched model (as a LightningModule does)."""

    def __init__(self, *models):
        super().__init__()
        self.models = torch.nn.ModuleList(models)

    def forward(self, **kw):
        return self.models[0](**kw)


def test_surgery_through_a_plain_wrapper_changes_the_transformers_model_inside():
    model = build("llama")
    batch = inputs()
    drop = {0: [0, 1, 2], 1: [3, 4, 5]}  # whole groups: 3 heads, 1 K/V head in every layer
    want = output(zero_ablated(model, "llama", drop), batch)
    wrapper = Wrapper(patch(model))
    assert prune_heads(wrapper, drop) is wrapper
    assert [(a.n_heads, a.n_kv_heads) for _, a in layers(model)] == [(3, 1), (3, 1)]  # patched again
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (3, 1)
    assert original_heads(model) == [(3, 4, 5), (0, 1, 2)]
    torch.testing.assert_close(output(model, batch), want)
    assert to_mha(wrapper) is wrapper and model.config.num_key_value_heads == 3
    torch.testing.assert_close(output(model, batch), want)  # to_mha is exact


def test_a_wrapper_of_two_patched_models_is_refused_before_anything_changes():
    one, two = patch(build("llama")), patch(build("llama", seed=1))
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in (one, two)]
    with pytest.raises(TypeError, match=r"expected a patched transformers model, or a module holding exactly "
                                        r"one.*got Wrapper.*\['LlamaForCausalLM', 'LlamaForCausalLM'\]"):
        prune_heads(Wrapper(one, two), {0: [1]})
    for m, state in zip((one, two), before):
        assert [a.n_heads for _, a in layers(m)] == [6, 6]  # still patched, nothing resized
        assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())


def test_uniform_pruning_under_peft_keeps_the_config_in_step_with_the_weights(tmp_path):
    peft = pytest.importorskip("peft")
    drop = {0: [0, 1, 2], 1: [3, 4, 5]}
    wrapped = peft.get_peft_model(build("llama"), peft.LoraConfig(target_modules=["gate_proj"], r=2,
                                                                  init_lora_weights=False))
    batch = inputs()
    want = output(zero_ablated(copy.deepcopy(wrapped).merge_and_unload(), "llama", drop), batch)
    prune_heads(patch(wrapped), drop)
    cfg = wrapped.get_base_model().config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (3, 1)
    merged = unpatch(wrapped.merge_and_unload())
    torch.testing.assert_close(output(merged, batch), want)
    assert save_pretrained(merged, tmp_path) is True
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert (plain.config.num_attention_heads, plain.config.num_key_value_heads) == (3, 1)
    torch.testing.assert_close(output(plain, batch), want)


def test_a_view_fetched_before_surgery_refuses_every_use():
    model = patch(build("llama"))
    q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()  # (6 * 4, 24): head i is rows 4i..4i+4
    old, kept = layers(model)[0][1], layers(model)[1][1]
    head = old.head(2)
    prune_heads(model, {0: [0]})
    x = torch.randn(1, 3, 24)
    for use in (lambda: old.n_heads, lambda: old.head(2), lambda: old(x), lambda: head.w_q, lambda: head(x)):
        with pytest.raises(TypeError, match="stale view of model.layers.0.self_attn: prune_heads resized its module"):
            use()
    assert "stale view of model.layers.0.self_attn" in repr(old)
    fresh = layers(model)[0][1]
    torch.testing.assert_close(fresh.head(1).w_q, q[8:12].T)  # now head 1 is the original head 2
    assert kept.head(2).w_q.data_ptr() == layers(model)[1][1].head(2).w_q.data_ptr()  # unchanged layer: still good


@pytest.mark.parametrize("inner", [False, True], ids=["patched-model", "its-base-model"])
def test_a_view_of_a_layer_surgery_left_alone_still_traces_and_edits_the_model(inner):
    model = build("llama")
    batch = inputs()
    want = output(zero_ablated(model, "llama", {0: [1], 1: [0]}), batch)  # the pruned head, and the edited one
    patch(model)
    kept = layers(model)[1][1]
    prune_heads(model.model if inner else model, {0: [1]})  # surgery on another root than the patched one
    assert layers(model)[1][1] is kept  # still the view the module's forward calls
    with torch.no_grad(), headwise.trace(kept, capture=("z",), edit={(0, 0): "zero"}) as t:
        got = output(model, batch)
    torch.testing.assert_close(got, want)
    assert len(t[0].calls) == 1 and t[0].calls[0]["z"][:, :, 0].abs().max() == 0  # z: (b, s, h, d_h)


def test_to_gqa_on_a_patched_model_with_an_emptied_layer():
    model = build("llama")
    with torch.no_grad():  # layer 1: both K/V heads alike, so pooling them into one is exact
        for name in ("k_proj", "v_proj"):
            w = getattr(model.model.layers[1].self_attn, name).weight
            w[4:] = w[:4]
    batch = inputs()
    want = output(zero_ablated(model, "llama", {0: list(range(6))}), batch)
    prune_heads(patch(model), {0: list(range(6))})
    to_gqa(model, 1)
    assert [(a.n_heads, a.n_kv_heads) for _, a in layers(model)] == [(1, 1), (6, 1)]
    assert original_heads(model) == [(), (0, 1, 2, 3, 4, 5)]
    torch.testing.assert_close(output(model, batch), want)
