"""Patching changes the attention computation and nothing else: names, shapes, storage, checkpoints, weight
init, meta-device construction and tensor-parallel plans of every family are those of the unpatched model.

Peers: the same model unpatched (or an unpatched twin built the same way), and transformers itself
(save_pretrained / from_pretrained, init_weights, its tp_plan matching rule).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from headwise import MultiHeadAttention  # noqa: E402
from headwise.interop import layers, patch, unpatch  # noqa: E402

from tests.interop.tiny_models import FAMILIES, attention_modules, build, config, inputs, output  # noqa: E402

ALL = list(FAMILIES)


def snapshot(model: nn.Module) -> dict[str, tuple[tuple[int, ...], int, torch.Tensor]]:
    return {k: (tuple(v.shape), v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", ALL)
def test_state_dict_names_shapes_storage_and_values_unchanged(family):
    model = build(family)
    before = snapshot(model)
    names = ([n for n, _ in model.named_parameters()], [n for n, _ in model.named_buffers()],
             [n for n, _ in model.named_modules()])
    patch(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, (shape, ptr, value) in before.items():
        assert (tuple(after[key].shape), after[key].data_ptr()) == (shape, ptr), key  # same tensor, not a copy
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
    assert ([n for n, _ in model.named_parameters()], [n for n, _ in model.named_buffers()],
            [n for n, _ in model.named_modules()]) == names  # no `.attn` anywhere in the tree
    assert len(layers(model)) == 2
    unpatch(model)
    assert list(model.state_dict()) == list(before)


@pytest.mark.parametrize("family", ALL)
def test_save_pretrained_while_patched_then_plain_from_pretrained(family, tmp_path):
    model = build(family)
    batch = inputs(1)
    want = output(model, batch)
    patch(model).save_pretrained(tmp_path)
    torch.testing.assert_close(output(model, batch), want)
    again, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not any(isinstance(m, MultiHeadAttention) for m in again.modules()) and layers(again) == []
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(output(again.eval(), batch), want, rtol=0, atol=0)


@pytest.mark.parametrize("family", ALL)
def test_weight_init_after_patch_equals_unpatched(family):
    """HF's per-module ``_init_weights`` (which reads e.g. GPT-2's ``module.c_proj``) and ``post_init``."""
    model = build(family)
    twin = copy.deepcopy(model)
    patch(model)
    for m in (model, twin):
        torch.manual_seed(5)
        for module in m.modules():
            m._init_weights(module)
        m.post_init()
    want = twin.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(v, build(family).state_dict()[k]) for k, v in want.items())  # init did something


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_a_patched_model_pickles_and_unpatches_after_loading(family, tmp_path):
    model = patch(build(family))
    batch = inputs(6)
    want = output(model, batch)
    torch.save(model, tmp_path / "m.pt")
    again = torch.load(tmp_path / "m.pt", weights_only=False)
    assert len(layers(again)) == 2 and layers(again)[0][1].host is again.get_submodule(layers(again)[0][0])
    torch.testing.assert_close(output(again, batch), want, rtol=0, atol=0)
    torch.testing.assert_close(output(unpatch(again), batch), want)  # HF's own kernel: float32 rounding


def on_meta(family: str, patched: bool) -> nn.Module:
    """Build under the meta device (as from_pretrained and FSDP do), optionally patch there, then materialise
    and run HF's init_weights (which also fills the rotary buffers)."""
    cfg = config(family)
    with torch.device("meta"):
        model = getattr(transformers, FAMILIES[family][1])(cfg)
        if patched:
            patch(model)
            attn = layers(model)[0][1]
            assert attn.q_proj.weight.is_meta and attn.head(1).w_q.is_meta  # a view of not-yet-real weights
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("family", ALL)
def test_patch_on_the_meta_device_then_real_weights(family):
    patched, plain = on_meta(family, True), on_meta(family, False)
    assert len(layers(patched)) == 2
    want = plain.state_dict()
    for key, value in patched.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)  # init_weights ran the same way
    batch = inputs(2)
    torch.testing.assert_close(output(patched, batch), output(plain, batch))
    real = build(family)
    patched.load_state_dict(real.state_dict())
    torch.testing.assert_close(output(patched, batch), output(real, batch))


def tp_rule(key: str, plan: dict[str, str]) -> str | None:
    """transformers' matching rule (distributed.tensor_parallel.verify_tp_plan): a parameter's generic module
    name (layer numbers -> ``*``), or its parent's, must be a key of the plan."""
    name = re.sub(r"\d+", "*", key.rsplit(".", 1)[0])
    if name in plan:
        return name
    parent = name.rsplit(".", 1)[0] if "." in name else None
    return parent if parent in plan else None


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_tensor_parallel_plans_still_name_the_parameters(family):
    model = build(family)
    plans = {"model._tp_plan": (model._tp_plan, model), "config.base_model_tp_plan":
             (model.config.base_model_tp_plan, model.base_model)}
    before = {label: {k: tp_rule(k, plan) for k, _ in owner.named_parameters()}
              for label, (plan, owner) in plans.items()}
    patch(model)
    for label, (plan, owner) in plans.items():
        after = {k: tp_rule(k, plan) for k, _ in owner.named_parameters()}
        assert after == before[label], label
        used = set(after.values())
        attention_rules = {r for r in plan if ".self_attn." in r}
        assert attention_rules and attention_rules <= used, (label, attention_rules - used)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ALL)
def test_hf_attention_module_scan_and_switching_implementation(family, impl):
    """transformers' test suite reads ``.config._attn_implementation`` on every module whose class name ends in
    "Attention": after patching every such module is still HF's (the headwise layer is not in the tree) and says
    "headwise". Switched to another implementation, the model is that implementation's; patched again, it keeps
    that implementation's conventions."""
    model = build(family, impl)
    batch = inputs(3)
    patch(model)
    scanned = [m for m in attention_modules(model) if hasattr(m, "config")]
    assert scanned and all(m.config._attn_implementation == "headwise" for m in scanned)
    assert not any(isinstance(m, MultiHeadAttention) for m in model.modules())
    other = "sdpa" if impl == "eager" else "eager"
    twin = build(family, other)
    model.set_attn_implementation(other)
    assert all(m.config._attn_implementation == other for m in scanned)
    torch.testing.assert_close(output(model, batch), output(twin, batch))
    patch(model)
    assert [a.rule for _, a in layers(model)] == [other, other]
    torch.testing.assert_close(output(model, batch), output(twin, batch))
    unmasked = {"input_ids": batch["input_ids"]}  # no mask: causality is the rule's (sdpa may skip the mask)
    torch.testing.assert_close(output(model, unmasked), output(twin, unmasked))
    assert unpatch(model).config._attn_implementation == impl  # what the first patch found


WHAT = {"bert": ("BertSelfAttention", "encoder.layer.0.attention.self"),
        "gpt2": ("GPT2Attention", "transformer.h.0.attn"),
        "llama": ("LlamaAttention", "model.layers.0.self_attn"),
        "mistral": ("MistralAttention", "model.layers.0.self_attn"),
        "qwen2": ("Qwen2Attention", "model.layers.0.self_attn"),
        "qwen3": ("Qwen3Attention", "model.layers.0.self_attn")}


@pytest.mark.parametrize("family", ALL)
def test_a_patched_model_says_what_it_is(family):
    plain = build(family)
    model = patch(build(family))
    cls, first = WHAT[family]
    names = [name for name, _ in layers(model)]
    assert names == [first, first.replace(".0.", ".1.")]
    module = model.get_submodule(first)
    assert type(module).__name__ == cls and repr(module) == repr(plain.get_submodule(first))  # nothing re-classed
    attn = layers(model)[0][1]
    assert module.attn is attn and attn.host is module
    assert repr(attn).startswith(f"{type(attn).__name__}(view of {first} ({cls}: ")
    assert f"n_heads={attn.n_heads}" in repr(attn)
    with pytest.raises(TypeError, match="is a view of .*save the host model's state_dict"):
        attn.state_dict()


def fingerprint(model: nn.Module) -> tuple:
    return ([type(m) for m in model.modules()], {k: v.clone() for k, v in model.state_dict().items()})


def assert_unchanged(model: nn.Module, before: tuple) -> None:
    classes, state = fingerprint(model)
    assert classes == before[0] and layers(model) == []
    assert state.keys() == before[1].keys() and all(torch.equal(state[k], before[1][k]) for k in state)


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention", "sdpa_paged"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "qwen3"])
def test_unsupported_attention_implementations_are_refused_before_anything_changes(family, impl):
    model = build(family)
    before = fingerprint(model)
    model.config._attn_implementation_internal = impl
    refused = rf"attn_implementation='{impl}' is not supported.*supported: \('eager', 'sdpa', 'headwise'\)"
    with pytest.raises(ValueError, match=refused):
        patch(model)
    assert_unchanged(model, before)


def test_a_family_outside_the_attention_interface_is_refused_naming_its_classes():
    cfg = transformers.FalconConfig(vocab_size=40, hidden_size=12, num_attention_heads=3, num_hidden_layers=1)
    model = transformers.FalconModel(cfg).eval()
    before = fingerprint(model)
    with pytest.raises(TypeError, match=r"^patch: FalconModel contains no attention module headwise can patch \(it "
                                        r"patches every module that calls transformers' attention interface, "
                                        r"ALL_ATTENTION_FUNCTIONS\); it has \['FalconAttention'\], none of them calling"):
        patch(model)
    assert_unchanged(model, before)


def test_a_layer_whose_projections_do_not_fit_is_traced_and_says_why_its_heads_are_not_located():
    from headwise.interop import from_hf

    model = build("llama")
    model.model.layers[1].self_attn.k_proj = nn.Linear(24, 12, bias=False)  # 3 K/V heads of 4 beside 2 for V
    patch(model)
    attn = layers(model)[1][1]
    assert "the projections have {'q_proj': 24, 'k_proj': 12, 'v_proj': 8} outputs" in attn.located["k_proj"]
    with pytest.raises(ValueError, match=r"head weight views, surgery, from_hf\) is unavailable: Q/K/V are not located"):
        attn.head(0)
    with pytest.raises(ValueError, match="cannot be converted: Q/K/V are not located"):
        from_hf(model.model.layers[1].self_attn)
