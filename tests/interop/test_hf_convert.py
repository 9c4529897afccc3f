"""from_hf / to_hf through the registry, on every layout: weights against slices of the module's own tensors written
out here by hand, round trips exact into a differently initialised module, and, for the families the registry
calls standalone, the copy's output against the module's own (called as its model calls it) and each head alone
against the model's weights of that head (read with a plain forward hook on an eager twin)."""

from __future__ import annotations

import copy

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from headwise import MultiHeadAttention, RotaryEmbedding  # noqa: E402
from headwise.interop import from_hf, layers, patch, to_hf  # noqa: E402
from headwise.interop.hf.registry import ENTRIES, entry_for  # noqa: E402
from headwise.masks import sliding_window_mask  # noqa: E402

BASE = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64)
EXTRA = {"gpt2": dict(n_embd=16, n_head=4, n_layer=2), "opt": dict(ffn_dim=32, word_embed_proj_dim=16),
         "gemma2": dict(head_dim=4, query_pre_attn_scalar=4), "mixtral": dict(num_local_experts=2,
                                                                              num_experts_per_tok=1),
         "qwen2_moe": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                           shared_expert_intermediate_size=8),
         "qwen3_moe": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, head_dim=4),
         "qwen3": dict(head_dim=4), "gpt_neox": dict(num_key_value_heads=4)}
ENCODERS = {"bert", "roberta"}
# model_type -> the module from_hf takes (BERT-style: the block holding the self-attention and its W_O)
WHERE = {"bert": "encoder.layer.1.attention", "roberta": "encoder.layer.1.attention", "gpt2": "transformer.h.1.attn",
         "opt": "model.decoder.layers.1.self_attn", "gpt_neox": "gpt_neox.layers.1.attention"}


def build(model_type: str, seed: int = 0, impl: str = "eager", **over) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **EXTRA.get(model_type, {}), **over})
    cls = transformers.AutoModel if model_type in ENCODERS else transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    model = cls.from_config(cfg, attn_implementation=impl).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # non-trivial biases and norms
    return model


def module_of(model: torch.nn.Module, model_type: str) -> torch.nn.Module:
    return model.get_submodule(WHERE.get(model_type, "model.layers.1.self_attn"))


def by_hand(module: torch.nn.Module, model_type: str) -> dict[str, torch.Tensor]:
    """Q, K, V, O weights (out, in) of ``module``, sliced here from its own tensors, family by family."""
    if model_type in ENCODERS:
        s = module.self
        return {"q_proj": s.query.weight, "k_proj": s.key.weight, "v_proj": s.value.weight,
                "out_proj": module.output.dense.weight}
    if model_type == "gpt2":  # Conv1D: (in, out), Q | K | V columns
        w = module.c_attn.weight
        return {"q_proj": w[:, :16].T, "k_proj": w[:, 16:32].T, "v_proj": w[:, 32:].T, "out_proj": module.c_proj.weight.T}
    if model_type == "phi3":  # rows: every Q head, then every K head, then every V head
        w = module.qkv_proj.weight
        return {"q_proj": w[:16], "k_proj": w[16:24], "v_proj": w[24:], "out_proj": module.o_proj.weight}
    if model_type == "gpt_neox":  # rows head by head: [q_i, k_i, v_i]
        w = module.query_key_value.weight.view(4, 3, 4, 16)
        return {"q_proj": w[:, 0].reshape(16, 16), "k_proj": w[:, 1].reshape(16, 16), "v_proj": w[:, 2].reshape(16, 16),
                "out_proj": module.dense.weight}
    o = module.out_proj if model_type == "opt" else module.o_proj
    return {"q_proj": module.q_proj.weight, "k_proj": module.k_proj.weight, "v_proj": module.v_proj.weight,
            "out_proj": o.weight}


ROUND_TRIP = ["bert", "gpt2", "llama", "qwen3", "opt", "phi3", "gpt_neox", "gemma2", "mixtral", "roberta"]


@pytest.mark.filterwarnings("ignore:from_hf:UserWarning")
@pytest.mark.parametrize("model_type", ROUND_TRIP)
def test_weights_are_the_modules_slices_and_round_trip_exactly(model_type):
    module = module_of(build(model_type), model_type)
    attn = from_hf(module)
    for name, want in by_hand(module, model_type).items():
        assert torch.equal(getattr(attn, name).weight, want), name
    assert getattr(attn, "q_norm", None) is None or torch.equal(attn.q_norm.weight, module.q_norm.weight)
    other = module_of(build(model_type, seed=1), model_type)  # same shapes, other values everywhere
    back = to_hf(attn, like=other)
    assert type(back) is type(module) and back is not other
    for name, want in by_hand(module, model_type).items():
        assert torch.equal(by_hand(back, model_type)[name], want), name
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in other.state_dict().items())  # like is untouched
    same = to_hf(attn, like=module)  # written over its own source: every tensor bit for bit
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in same.state_dict().items())
    again = from_hf(same).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in attn.state_dict().items())


def test_to_hf_refuses_another_layer_naming_what_differs():
    like = module_of(build("phi3"), "phi3")
    with pytest.raises(ValueError, match=r"cannot write this MultiHeadAttention into Phi3Attention: n_kv_heads: "
                                         r"module 2 vs attn 4"):
        to_hf(MultiHeadAttention(16, 4, bias=False), like=like)
    qwen3 = module_of(build("qwen3"), "qwen3")
    with pytest.raises(ValueError, match="has per-head q_norm/k_norm and the layer has none"):
        to_hf(MultiHeadAttention.from_config(from_hf(qwen3).config), like=qwen3)


def test_a_family_the_registry_does_not_call_standalone_warns_that_the_copy_holds_its_weights():
    module = module_of(build("gemma2"), "gemma2")
    with pytest.warns(UserWarning, match=r"from_hf: Gemma2Attention's attention is more than the copy holds"):
        from_hf(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_hf(module_of(build("llama"), "llama"))  # standalone: no warning


def _window_warning(module: torch.nn.Module) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        from_hf(module)
    return [str(w.message) for w in seen if "sliding window" in str(w.message)]


def test_a_sliding_window_shorter_than_the_models_positions_warns_naming_it_and_its_mask():
    model = build("mistral", sliding_window=3)
    module, x, want, _ = _model_inputs(model, "mistral")  # 6 positions: past the window
    with pytest.warns(UserWarning, match=r"from_hf: MistralAttention attends within a sliding window of 3 positions "
                                         r".*mask=headwise.masks.sliding_window_mask\(s_q, s_kv, window=3\)"):
        attn = from_hf(module)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, mask=sliding_window_mask(6, window=3)), want)
        assert not torch.allclose(attn(x, causal=True), want, atol=1e-3)  # what the warning is about
    # the window where the layer has one: Qwen2's use_sliding_window layers, Gemma 2's local ones
    qwen2 = build("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert _window_warning(qwen2.model.layers[0].self_attn) == []
    assert "sliding window of 4 positions" in _window_warning(qwen2.model.layers[1].self_attn)[0]
    gemma2 = build("gemma2", sliding_window=4)
    assert "sliding window of 4 positions" in _window_warning(gemma2.model.layers[0].self_attn)[0]
    assert _window_warning(gemma2.model.layers[1].self_attn) == []
    # a window no shorter than max_position_embeddings (64) never cuts anything
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_hf(module_of(build("mistral", sliding_window=64), "mistral"))


STANDALONE = sorted(t for t, e in ENTRIES.items() if not callable(e) and e.standalone)


def test_the_standalone_families_are_the_ones_tested_here():
    assert STANDALONE == ["bert", "gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                          "roberta"]


def _model_inputs(model: torch.nn.Module, model_type: str):
    """The module's input and output inside its model, the positions and whether it is causal (plain hooks)."""
    module = module_of(model, model_type)
    seen = {}
    pre = module.register_forward_pre_hook(lambda m, a, kw: seen.update(x=kw.get("hidden_states", a[0] if a else None)),
                                           with_kwargs=True)
    post = module.register_forward_hook(lambda m, a, out: seen.update(y=out[0] if isinstance(out, tuple) else out,
                                                                      w=out[1] if isinstance(out, tuple) else None))
    ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad():
            model(input_ids=ids, output_attentions=True)
    finally:
        pre.remove()
        post.remove()
    return module, seen["x"], seen["y"], seen["w"]


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _unchanged(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = module.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], v) for k, v in before.items())


def test_to_hf_refuses_a_rotary_other_than_the_modules_and_writes_the_modules_own():
    bert = module_of(build("bert"), "bert")
    before = _state(bert)
    with pytest.raises(ValueError, match=r"into BertSelfAttention: the module has no rotary the layer can hold, the "
                                         r"layer has a RotaryEmbedding"):
        to_hf(MultiHeadAttention(16, 4, rotary=RotaryEmbedding(4)), like=bert)
    assert _unchanged(bert, before)
    model = build("llama")
    llama = module_of(model, "llama")
    before = _state(llama)
    with pytest.raises(ValueError, match=r"into LlamaAttention: the module rotates Q and K with the model's rotary, "
                                         r"the layer has none"):
        to_hf(MultiHeadAttention(16, 4, n_kv_heads=2, bias=False), like=llama)
    with pytest.raises(ValueError, match=r"into LlamaAttention: its rotary differs from the one the model's config "
                                         r"gives \(rotary_dim 4, attention_scaling 1.0, inv_freq \[1.0, 0.0099"):
        to_hf(MultiHeadAttention(16, 4, n_kv_heads=2, bias=False, rotary=RotaryEmbedding(4, base=500000.0)), like=llama)
    assert _unchanged(llama, before)
    # Llama's own rope (theta 10000, every feature) is accepted: the written module, in its model, computes the layer.
    torch.manual_seed(5)
    attn = MultiHeadAttention(16, 4, n_kv_heads=2, bias=False, rotary=RotaryEmbedding(4, base=10000.0)).eval()
    model.model.layers[1].self_attn = to_hf(attn, like=llama)
    _, x, want, _ = _model_inputs(model, "llama")
    with torch.no_grad():
        torch.testing.assert_close(attn(x, causal=True), want)
    # A layer cast to half precision, its rotary with it, is still the module's rotary.
    to_hf(copy.deepcopy(attn).to(torch.bfloat16), like=llama)
    to_hf(from_hf(llama, rotary_emb=copy.deepcopy(model.model.rotary_emb).to(torch.bfloat16)), like=llama)


# PEFT asks transformers a deprecated question; not ours to fix.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_peft_wrapped_module_is_refused_both_ways_and_converts_once_merged():
    peft = pytest.importorskip("peft")
    model = build("llama")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))
    module, x, want, _ = _model_inputs(model, "llama")  # what the module computes with the adapter's delta
    before = _state(module)
    with pytest.raises(ValueError, match=r"from_hf: LlamaAttention cannot be converted: q_proj \(peft\.[\w.]+\.Linear\), "
                                         r"v_proj \(peft\.[\w.]+\.Linear\) wrapped by an adapter \(PEFT\).*"
                                         r"merge_and_unload\(\) first"):
        from_hf(module)
    with pytest.raises(ValueError, match=r"to_hf: LlamaAttention cannot be converted: q_proj .*merge_and_unload"):
        to_hf(MultiHeadAttention(16, 4, n_kv_heads=2, bias=False, rotary=RotaryEmbedding(4)), like=module)
    assert _unchanged(module, before)
    merged = module_of(wrapped.merge_and_unload(), "llama")
    with torch.no_grad():
        torch.testing.assert_close(from_hf(merged)(x, causal=True), want)


@pytest.mark.parametrize("model_type", STANDALONE)
def test_a_standalone_familys_copy_and_heads_compute_what_the_module_computes(model_type):
    model = build(model_type)
    module, x, want, weights = _model_inputs(model, model_type)
    causal = model_type not in ENCODERS
    attn = from_hf(module)
    assert (attn.rotary is not None) == entry_for(model_type).rotary
    with torch.no_grad():
        got = attn(x, causal=causal)
        if model_type in ENCODERS:  # BertAttention: W_O, dropout, then LayerNorm(x + residual)
            got = module.output.LayerNorm(got + x)
        torch.testing.assert_close(got, want)
        view = layers(patch(model))[1][1]  # the patched layer's heads: the same rotary and norms
        for h in range(view.n_heads):
            _, w = view.head(h)(x, causal=causal, return_weights=True)
            torch.testing.assert_close(w, weights[:, h])
        if model_type not in ENCODERS:
            torch.testing.assert_close(view(x, causal=True), want)  # the layer alone, on the module's weights
