"""patch on the generic path (any module on transformers' attention interface): the unpatched model is the peer
for outputs, plain tensors of the model's own weights for head views, and transformers' modules for what is
captured."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
from headwise.interop import layers, patch, unpatch  # noqa: E402
from headwise.interop.hf import registry as hf_registry  # noqa: E402

# PEFT asks transformers a deprecated question; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

BASE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
EXTRA = {"phi3": dict(num_key_value_heads=2), "gpt_neox": {},
         "mixtral": dict(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1), "opt": dict(ffn_dim=32, word_embed_proj_dim=16),
         "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                             q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6,
                             first_k_dense_replace=0, n_group=1, topk_group=1),
         "jetmoe": dict(num_key_value_heads=1, kv_channels=8, num_local_experts=2, num_experts_per_tok=2)}
IDS = torch.tensor([[1, 5, 7, 3, 9], [2, 4, 6, 8, 10]])


def tiny(model_type: str, impl: str = "sdpa") -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(model_type, **BASE, **EXTRA[model_type])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # non-trivial biases and norms
    return model


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    return model(IDS).logits


@pytest.mark.parametrize("model_type", ["phi3", "gpt_neox", "opt", "deepseek_v3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_patch_unpatch_round_trip_on_the_interface(model_type, impl):
    model = tiny(model_type, impl)
    want = logits(model)
    keys = {k: v.data_ptr() for k, v in model.state_dict().items()}
    patch(model)
    assert len(layers(model)) == 2 and all(type(a).__name__.endswith("HFView") for _, a in layers(model))
    assert model.config._attn_implementation == "headwise"
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == keys
    torch.testing.assert_close(logits(model), want)
    unpatch(model)
    assert model.config._attn_implementation == impl and layers(model) == []
    assert not any("attn" in vars(m) for m in model.modules())


def test_phi3_heads_are_live_views_of_the_fused_qkv_proj():
    model = patch(tiny("phi3"))
    attn = layers(model)[0][1]
    fused = model.model.layers[0].self_attn.qkv_proj.weight  # rows: 4 q heads, 2 k heads, 2 v heads of 4
    head = attn.head(3)
    assert head.kv_index == 1
    torch.testing.assert_close(head.w_q, fused[12:16].T, rtol=0, atol=0)
    torch.testing.assert_close(head.w_k, fused[16 + 4:16 + 8].T, rtol=0, atol=0)
    torch.testing.assert_close(head.w_v, fused[24 + 4:24 + 8].T, rtol=0, atol=0)
    assert head.w_q.data_ptr() == fused[12].data_ptr()
    torch.testing.assert_close(head.w_o, model.model.layers[0].self_attn.o_proj.weight[:, 12:16].T, rtol=0, atol=0)


def test_gpt_neox_heads_read_and_write_the_interleaved_query_key_value():
    model = patch(tiny("gpt_neox"))
    attn = layers(model)[0][1]
    qkv = model.gpt_neox.layers[0].attention.query_key_value
    per_head = qkv.weight.view(4, 3, 4, 16)  # head-major rows [q_i, k_i, v_i]
    head = attn.head(2)
    for j, w in enumerate((head.w_q, head.w_k, head.w_v)):
        torch.testing.assert_close(w, per_head[2, j].T, rtol=0, atol=0)
    torch.testing.assert_close(head.b_v, qkv.bias.view(4, 3, 4)[2, 2], rtol=0, atol=0)
    torch.testing.assert_close(attn.v_proj.weight, per_head[:, 2].reshape(16, 16), rtol=0, atol=0)
    new = torch.randn(16, 4)
    head.w_k = new
    torch.testing.assert_close(qkv.weight[2 * 12 + 4:2 * 12 + 8], new.T, rtol=0, atol=0)  # the model's weight
    before = qkv.weight.clone()
    with pytest.raises(TypeError, match="w_q must be a torch.Tensor, got list"):
        head.w_q = head.w_q.tolist()
    assert torch.equal(qkv.weight, before)


def test_captured_values_are_the_located_value_weights_applied_to_the_module_input():
    model = patch(tiny("opt"))
    seen = {}
    module = model.model.decoder.layers[0].self_attn
    handle = module.register_forward_pre_hook(lambda m, a, kw: seen.update(x=kw.get("hidden_states", a[0] if a
                                                                                     else None)), with_kwargs=True)
    with headwise.trace(model, capture=("v",)) as t, torch.no_grad():
        logits(model)
    handle.remove()
    attn = layers(model)[0][1]
    want = torch.stack([seen["x"] @ attn.head(i).w_v + attn.head(i).b_v for i in range(4)], dim=1)
    torch.testing.assert_close(t[0].v, want)


def test_latent_attention_traces_and_its_q_k_v_are_not_projections_of_x():
    model = patch(tiny("deepseek_v3"))
    attn = layers(model)[0][1]
    assert attn.located["out_proj"] == "" and "latent" in attn.located["q_proj"]
    with pytest.raises(ValueError, match="q_proj .* is unavailable: Q/K/V are not located: multi-head latent"):
        attn.q_proj  # its heads are LatentHead objects (tests/interop/test_hf_latent.py)
    with headwise.trace(model, capture=("z", "result")) as t, torch.no_grad():
        out = logits(model)
    assert t[0].z.shape == (2, 5, 4, 6)  # d_v = 6, while q/k heads are 8 wide
    o = model.model.layers[0].self_attn.o_proj
    torch.testing.assert_close(t[0].result.sum(2), o(t[0].z.reshape(2, 5, 24)))
    assert torch.isfinite(out).all()


def test_without_a_located_w_o_result_says_why_and_z_still_traces(monkeypatch):
    monkeypatch.setitem(hf_registry.ENTRIES, "opt", hf_registry.Entry(o=(), o_parent=()))
    model = patch(tiny("opt"))
    with headwise.trace(model, capture=("z", "pattern")) as t, torch.no_grad():
        logits(model)
    assert t[0].z.shape == (2, 5, 4, 4) and t[0].pattern.shape == (2, 4, 5, 5)
    with pytest.raises(ValueError, match=r"out_proj .*'result' captures.* is unavailable: W_O is not located: no "
                                         r"projection \(16, 16\) named"):
        with headwise.trace(model, capture=("result",)), torch.no_grad():
            logits(model)


def test_a_failed_switch_of_the_implementation_leaves_the_model_as_it_was(monkeypatch):
    model = tiny("phi3")
    classes = [type(m) for m in model.modules()]

    def refuse(*a, **k):
        raise ValueError("no")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    with pytest.raises(ValueError, match="no"):
        patch(model)
    assert [type(m) for m in model.modules()] == classes and layers(model) == []
    assert model.config._attn_implementation == "sdpa"


def test_patch_after_peft_takes_over_reads_the_base_weights_and_refuses_surgery():
    peft = pytest.importorskip("peft")
    from headwise.surgery import prune_heads
    from tests.interop.tiny_models import build, inputs

    model = peft.get_peft_model(build("llama"), peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=2,
                                                                init_lora_weights=False))
    batch = inputs(3)
    with torch.no_grad():
        want = model(**batch).logits
    patch(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, want)  # the LoRA modules still run: the module's forward
    name, attn = layers(model)[0]
    base = model.get_submodule(name).q_proj.base_layer.weight
    assert attn.head(1).w_q.data_ptr() == base[4:].data_ptr()  # head views read the base weight
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"q_proj of this layer is wrapped by an adapter .*merge_and_unload\(\) first"):
        prune_heads(model, {0: [1]})
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()) and len(layers(model)) == 2
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, want)  # refused with nothing changed
    assert "wrapped by an adapter (PEFT): merge_and_unload() first" in attn.edit_refusal(2, 2)


def test_the_registry_has_one_entry_per_family():
    assert hf_registry.entry_for("phi3").qkv == "qkv_proj"
    assert hf_registry.entry_for("gpt_neox").layout == "per_head"
    assert hf_registry.entry_for("opt") is hf_registry.DEFAULT and hf_registry.entry_for("llama").rotary
    big = transformers.AutoConfig.for_model("gpt_bigcode", multi_query=False)
    assert hf_registry.entry_for("gpt_bigcode", big).layout == "per_head"


@pytest.mark.parametrize("model_type", ["phi3", "gpt_neox", "opt", "deepseek_v3"])
def test_greedy_generation_with_the_models_cache_is_unchanged(model_type):
    model = tiny(model_type)
    ids = torch.tensor([[0, 5, 7, 3], [2, 4, 6, 8]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    patch(model)
    with headwise.trace(model, capture=("z",)) as t:
        got = model.generate(ids, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(t[0].calls) == 5 and t[0].z.shape[1] == 4 + 4  # prefill + one call per new token but the last


@pytest.mark.parametrize("model_type, drop", [("opt", [0]), ("gpt_neox", [2]), ("mixtral", [0, 1])])
def test_write_heads_removing_heads_equals_zeroing_them(model_type, drop):
    """The surgery seam: the host rebuilt without some heads (then patched again) computes what zeroing them
    computes (mixtral: heads 0 and 1 are K/V group 0, so the group goes too)."""
    model = patch(tiny(model_type))
    with headwise.trace(model, edit={(0, h): "zero" for h in drop}), torch.no_grad():
        want = logits(model)
    attn = layers(model)[0][1]
    h, h_kv, d_h, g = attn.n_heads, attn.n_kv_heads, attn.d_head, attn.config.group_size
    keep = [i for i in range(h) if i not in drop]
    keep_kv = sorted({i // g for i in keep})
    rows = lambda heads: torch.cat([torch.arange(i * d_h, (i + 1) * d_h) for i in heads])  # noqa: E731
    with torch.no_grad():
        new = {p: (getattr(attn, p).weight[rows(keep if p == "q_proj" else keep_kv)].clone(),
                   None if getattr(attn, p).bias is None else
                   getattr(attn, p).bias[rows(keep if p == "q_proj" else keep_kv)].clone())
               for p in ("q_proj", "k_proj", "v_proj")}
        new["out_proj"] = (attn.out_proj.weight[:, rows(keep)].clone(), attn.out_proj.bias)
        attn.write_heads(new, len(keep), len(keep_kv))
    unpatch(model)
    patch(model)
    assert (layers(model)[0][1].n_heads, layers(model)[0][1].n_kv_heads) == (len(keep), len(keep_kv))
    torch.testing.assert_close(logits(model), want)


def test_a_model_loaded_with_the_headwise_implementation_patches_and_matches_eager():
    from tests.interop.tiny_models import build, inputs, output

    eager, model = build("llama", "eager"), build("llama", "headwise")
    batch = inputs(4)
    patch(model)
    assert [a.rule for _, a in layers(model)] == ["sdpa"] * 2  # headwise's own conventions are sdpa's
    got, want = output(model, batch), output(eager, batch)
    keep = batch["attention_mask"].bool()  # padded queries read nothing: eager averages, headwise gives zeros
    torch.testing.assert_close(got[keep], want[keep])


@pytest.mark.parametrize("model_type, fused", [("phi3", "qkv_proj"), ("gpt_neox", "query_key_value")])
def test_a_deep_copy_and_a_pickle_of_a_patched_model_view_their_own_weights(model_type, fused, tmp_path):
    import copy

    model = patch(tiny(model_type))
    want = logits(model)
    torch.save(model, tmp_path / "m.pt")
    for again in (copy.deepcopy(model), torch.load(tmp_path / "m.pt", weights_only=False)):
        name, attn = layers(again)[0]
        weight = getattr(again.get_submodule(name), fused).weight
        assert attn.head(0).w_q.data_ptr() == weight.data_ptr()  # the copy's storage, not the original's
        torch.testing.assert_close(logits(again), want, rtol=0, atol=0)
        with torch.no_grad():
            weight.zero_()
        assert layers(again)[0][1].q_proj.weight.abs().sum() == 0
        torch.testing.assert_close(logits(model), want, rtol=0, atol=0)  # the original is untouched
        assert unpatch(again).config._attn_implementation == "sdpa"


@pytest.mark.parametrize("model_type", ["phi3", "opt"])
def test_output_attentions_of_a_patched_model_are_the_eager_weights(model_type):
    """An eager model keeps returning its weights; an sdpa one returns them where output_attentions reaches its
    attention function (Phi-3), and otherwise what sdpa returns: nothing (OPT's layers do not pass it down)."""
    plain = tiny(model_type, "eager")
    with torch.no_grad():
        want = plain(IDS, output_attentions=True).attentions
        for impl in ("eager", "sdpa"):
            model, unpatched = patch(tiny(model_type, impl)), tiny(model_type, impl)
            got = model(IDS, output_attentions=True).attentions
            if impl == "sdpa" and model_type == "opt":
                assert got == unpatched(IDS, output_attentions=True).attentions == ()
                continue
            assert len(got) == len(want) == 2
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)


@pytest.mark.parametrize("model_type", ["phi3", "gpt_neox", "deepseek_v3"])
def test_training_gradients_through_the_interface_equal_the_unpatched_models(model_type):
    plain, model = tiny(model_type), patch(tiny(model_type))
    for m in (plain, model):
        m.train()
        m(IDS, labels=IDS).loss.backward()
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


def test_latent_attention_ignores_the_configs_key_value_head_count():
    # DeepSeek's config carries num_key_value_heads (128 by default) that its latent attention never reads:
    # every query head gets its own K/V from kv_b_proj, so patch must count K/V heads as query heads.
    kw = {k: v for k, v in EXTRA["deepseek_v3"].items() if k != "num_key_value_heads"}
    cfg = transformers.AutoConfig.for_model("deepseek_v3", **BASE, **kw)
    assert cfg.num_key_value_heads != cfg.num_attention_heads
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    want = logits(model)
    patch(model)
    assert [v.n_kv_heads for _, v in layers(model)] == [cfg.num_attention_heads] * cfg.num_hidden_layers
    torch.testing.assert_close(logits(model), want)


def test_heads_computed_other_than_configured_are_taken_as_transformers_hands_them_over():
    # JetMoE's attention experts: each of the top-k experts computes its own query heads over shared K/V, so
    # transformers hands over top_k * num_key_value_heads heads, not num_attention_heads. With no projection
    # located to fix the counts, the layer takes them; tracing names heads as they are computed.
    plain, model = tiny("jetmoe", "eager"), patch(tiny("jetmoe"))
    want = plain(IDS, output_attentions=True)
    with headwise.trace(model, capture=("pattern", "z")) as t:
        got = model(IDS)
    torch.testing.assert_close(got.logits, want.logits)
    cfg = plain.config
    assert [v.n_heads for _, v in layers(model)] == [cfg.num_experts_per_tok * cfg.num_key_value_heads] * 2
    for i, w in enumerate(want.attentions):
        torch.testing.assert_close(t[i].pattern, w)


def _built(model_type: str, **sizes) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **sizes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # the learned sink and residual queries start at zero
    return model


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_attention_over_residual_blocks_is_no_layer_and_per_row_sinks_count(model_type):
    # Inkling 2's block attention residuals call the interface with positions as "heads": patch gives them no
    # layer; its self-attention hands over one sink logit per query row, which must take part in the softmax.
    plain = _built(model_type, head_dim=4)
    model = patch(_built(model_type, head_dim=4))
    residuals = [m for m in model.modules() if "AttentionResidual" in type(m).__name__]
    assert residuals and not any(type(m).__name__.startswith("Headwise") for m in residuals)  # not patched
    assert layers(model) and all(name.endswith("self_attn") for name, _ in layers(model))
    torch.testing.assert_close(logits(model), logits(plain))
    with headwise.trace(model, capture=("pattern",)) as t:
        logits(model)
    sums = torch.stack([t[i].pattern.sum(-1) for i in range(len(layers(model)))])
    assert (sums < 1 - 1e-4).any() and (sums <= 1 + 1e-5).all()  # the sinks took part of some rows


def test_a_sparse_selection_made_for_eager_and_sdpa_only_is_refused_never_ignored():
    # DeepSeek-V3.2 folds its indexer's top-k keys into the mask under 'eager' and 'sdpa' only, and hands them to
    # any other implementation as indices=: headwise cannot apply them, so the patched model refuses to run.
    model = patch(_built("deepseek_v32", num_key_value_heads=4, n_routed_experts=2, num_experts_per_tok=1,
                         moe_intermediate_size=8,
                         q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                         index_n_heads=2, index_head_dim=8, index_topk=3, first_k_dense_replace=0, n_group=1,
                         topk_group=1))
    with pytest.raises(ValueError, match=r"DeepseekV32Attention handed headwise a sparse attention selection "
                                         r"\(indices=\.\.\.\), which transformers folds into the mask only under"):
        logits(model)
    unpatch(model)  # under sdpa the selection is in the mask again
    assert torch.isfinite(logits(model)).all()


def test_a_prefill_whose_queries_the_model_slices_after_masking_keeps_its_mask():
    # Gemma 4's KV-shared layers keep only the last logits_to_keep queries of a prefill; transformers allows that
    # under sdpa only with a mask, by the implementation's name, so headwise materialises the causal mask there.
    from headwise.interop.hf.attention_function import mask

    plain = _built("gemma4_unified_text", num_hidden_layers=4, num_kv_shared_layers=2, head_dim=4,
                   layer_types=["sliding_attention", "full_attention"] * 2)
    model = patch(_built("gemma4_unified_text", num_hidden_layers=4, num_kv_shared_layers=2, head_dim=4,
                         layer_types=["sliding_attention", "full_attention"] * 2))
    with torch.no_grad():
        torch.testing.assert_close(model(IDS, logits_to_keep=3).logits, plain(IDS, logits_to_keep=3).logits)
    assert mask(batch_size=1, q_length=4, kv_length=4, config=model.config) is not None
