"""Surgery on Hugging Face families patched on the interface path (OPT, Phi-3's fused qkv_proj, GPT-NeoX's
head-interleaved query_key_value, Gemma 2, Mixtral, RoBERTa's W_O on the parent, BART encoder-decoder, ViT) and
Qwen2 with GQA, each a tiny random model: against plain PyTorch hooks and K/V means on the unpatched model, through
save / reload, and refusals that change nothing."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from headwise.interop import layers, patch, unpatch  # noqa: E402
from headwise.surgery import load_pretrained, prune_heads, save_pretrained, to_gqa, to_mha  # noqa: E402

D, H, KV = 16, 4, 2
D_H = D // H
COMMON = dict(vocab_size=40, num_hidden_layers=2, max_position_embeddings=64, intermediate_size=32,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
# model_type -> (model class, config kwargs, W_O of the attention module named by its layer: "" on the module, or
# a path from the module's parent). K/V heads (KV) where the family has GQA.
FAMILIES = {
    "opt": ("OPTForCausalLM", dict(hidden_size=D, num_attention_heads=H, ffn_dim=32, word_embed_proj_dim=D),
            "out_proj"),
    "phi3": ("Phi3ForCausalLM", dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=KV), "o_proj"),
    "gpt_neox": ("GPTNeoXForCausalLM", dict(hidden_size=D, num_attention_heads=H), "dense"),
    "gemma2": ("Gemma2ForCausalLM", dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=KV, head_dim=D_H,
                                         query_pre_attn_scalar=D_H), "o_proj"),
    "mixtral": ("MixtralForCausalLM", dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=KV,
                                           num_local_experts=2, num_experts_per_tok=1), "o_proj"),
    "qwen2": ("Qwen2ForCausalLM", dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=KV), "o_proj"),
    "roberta": ("RobertaModel", dict(hidden_size=D, num_attention_heads=H, pad_token_id=1), "../output.dense"),
    "bart": ("BartForConditionalGeneration", dict(d_model=D, encoder_attention_heads=H, decoder_attention_heads=H,
                                                  encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32,
                                                  decoder_ffn_dim=32, decoder_start_token_id=2), "out_proj"),
    "vit": ("ViTModel", dict(hidden_size=D, num_attention_heads=H, image_size=8, patch_size=4), "o_proj"),
}
GQA = ["phi3", "gemma2", "mixtral", "qwen2"]
# Families whose config, given 3 heads of d_h = 4, rebuilds every shape (save_pretrained's claim; the others
# derive d_h = d / h from the head count, and Gemma 2's config refuses a hidden size that h does not divide).
PLAIN = {"phi3", "mixtral", "qwen2", "vit"}


def build(model_type: str, seed: int = 0, **kw):
    """The tiny model in eval mode, its norms and biases moved off HF's init (1 and 0) so they matter."""
    cls, extra, _ = FAMILIES[model_type]
    cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **extra, **kw})
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def batch_for(model) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if model.main_input_name == "pixel_values":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}
    ids = torch.randint(3, 40, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if model.config.is_encoder_decoder:
        out["decoder_input_ids"] = ids[:, :5]
    return out


@torch.no_grad()
def output(model, batch) -> torch.Tensor:
    out = model(**batch)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def attn_names(model) -> list[str]:
    """The attention modules surgery addresses, in model order (from a patched copy: which modules they are)."""
    return [name for name, _ in layers(patch(copy.deepcopy(model)))]


def w_o(model, model_type: str, name: str) -> torch.nn.Module:
    path = FAMILIES[model_type][2]
    if path.startswith("../"):
        return model.get_submodule(f"{name.rpartition('.')[0]}.{path[3:]}")
    return model.get_submodule(f"{name}.{path}")


def zero_ablated(model, model_type: str, drop: dict[str, list[int]]):
    """A copy of the unpatched ``model`` whose W_O inputs have the dropped heads' slices zeroed (its bias stays)."""
    ref = copy.deepcopy(model)
    for name, heads in drop.items():
        def hook(module, args, heads=heads):
            z = args[0].clone()
            for i in heads:
                z[..., i * D_H:(i + 1) * D_H] = 0
            return (z,)
        w_o(ref, model_type, name).register_forward_pre_hook(hook)
    return ref


def counts(model) -> list[tuple[int, int, int]]:
    return [attn.head_params() for _, attn in layers(model)]


def uniform_drop(names: list[str]) -> dict[str, list[int]]:
    return {name: [1] if i % 2 == 0 else [2] for i, name in enumerate(names)}  # every layer keeps 3 heads


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_pruning_equals_zeroing_those_heads_before_w_o_on_the_unpatched_model(model_type):
    model = build(model_type)
    batch = batch_for(model)
    names = attn_names(model)
    drop = uniform_drop(names) if model_type == "phi3" else {names[0]: [1], names[-1]: [0, 2]}
    want = output(zero_ablated(model, model_type, drop), batch)
    assert prune_heads(patch(model), drop) is model
    assert [c[0] for c in counts(model)] == [H - len(drop.get(n, [])) for n in names]
    torch.testing.assert_close(output(model, batch), want)
    torch.testing.assert_close(output(unpatch(model), batch), want)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_uniformly_pruned_model_reloads_with_equal_outputs_and_head_counts(model_type, tmp_path):
    model = build(model_type)
    batch = batch_for(model)
    names = attn_names(model)
    drop = uniform_drop(names)
    want = output(zero_ablated(model, model_type, drop), batch)
    prune_heads(patch(model), drop)
    torch.testing.assert_close(output(model, batch), want)
    shapes = counts(model)
    plain = save_pretrained(model, tmp_path)
    assert plain is (model_type in PLAIN)
    cls = type(model)
    if plain:
        loaded = transformers.AutoModel.from_pretrained(tmp_path) if model_type in ("vit", "roberta") else \
            cls.from_pretrained(tmp_path)
    else:
        with pytest.raises((RuntimeError, ValueError)):  # the config cannot express these shapes
            cls.from_pretrained(tmp_path)
        loaded = load_pretrained(tmp_path, cls)
    assert not layers(loaded)
    torch.testing.assert_close(output(loaded.eval(), batch), want)
    assert counts(patch(loaded)) == shapes


@pytest.mark.parametrize("model_type", ["opt", "gpt_neox", "gemma2", "roberta", "bart"])
def test_per_layer_counts_reload_through_the_headwise_loader(model_type, tmp_path):
    model = build(model_type)
    batch = batch_for(model)
    names = attn_names(model)
    prune_heads(patch(model), {names[0]: [1], names[-1]: [0, 2]})
    want, shapes = output(model, batch), counts(model)
    unpatch(model)  # saved unpatched: the head counts are read through a patch that is undone
    assert save_pretrained(model, tmp_path) is False
    assert not layers(model) and model.config._attn_implementation != "headwise"
    recorded = json.loads((tmp_path / "headwise_surgery.json").read_text())["modules"]
    assert list(recorded) == names
    assert [(r["n_heads"], r["n_kv_heads"], r["d_head"]) for r in recorded.values()] == shapes
    assert {r["class"] for r in recorded.values()} <= {type(m).__name__ for m in model.modules()}
    loaded = load_pretrained(tmp_path, type(model))
    torch.testing.assert_close(output(loaded, batch), want)
    assert counts(patch(loaded)) == shapes


def kv_means(model, model_type: str):
    """A copy of the unpatched model whose K/V projections hold, for every K/V head, the mean over the K/V heads
    (one group: n_kv_heads=1, the function to_gqa(model, 1) computes)."""
    ref = copy.deepcopy(model)

    def mean(t: torch.Tensor) -> torch.Tensor:  # (h_kv * d_h[, in]) -> the same, every head the mean
        heads = t.reshape(KV, D_H, *t.shape[1:])
        return heads.mean(0, keepdim=True).expand_as(heads).reshape(t.shape)

    with torch.no_grad():
        for name in attn_names(model):
            module = ref.get_submodule(name)
            if model_type == "phi3":  # qkv_proj rows: h query heads, then h_kv key heads, then h_kv value heads
                w = module.qkv_proj.weight
                for a in (H * D_H, (H + KV) * D_H):
                    w[a:a + KV * D_H] = mean(w[a:a + KV * D_H].clone())
                continue
            for proj in (module.k_proj, module.v_proj):
                proj.weight.copy_(mean(proj.weight.clone()))
                if proj.bias is not None:
                    proj.bias.copy_(mean(proj.bias.clone()))
    return ref


@pytest.mark.parametrize("model_type", GQA)
def test_regrouping_equals_the_unpatched_model_with_mean_k_v_heads(model_type, tmp_path):
    model = build(model_type)
    batch = batch_for(model)
    want = output(kv_means(model, model_type), batch)
    to_gqa(patch(model), 1)
    assert counts(model) == [(H, 1, D_H)] * 2
    assert model.config.num_key_value_heads == 1
    torch.testing.assert_close(output(model, batch), want)
    assert save_pretrained(model, tmp_path) is True
    loaded = type(model).from_pretrained(tmp_path).eval()
    torch.testing.assert_close(output(loaded, batch), want)
    assert counts(patch(loaded)) == [(H, 1, D_H)] * 2


def snapshot(model):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = {name: (type(m), {k: v for k, v in vars(m).items() if isinstance(v, (bool, int, float, str))})
             for name, m in model.named_modules()}
    return state, model.config.to_dict(), attrs


def assert_same(before, model):
    state, config, attrs = snapshot(model)
    assert state.keys() == before[0].keys() and all(torch.equal(before[0][k], v) for k, v in state.items())
    assert config == before[1]
    assert attrs == before[2]


TINY_OTHERS = {
    "codegen": ("CodeGenForCausalLM", dict(n_embd=D, n_head=H, n_layer=2, n_positions=64, rotary_dim=2, vocab_size=40)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(COMMON, hidden_size=D, num_attention_heads=H, num_key_value_heads=H,
                                                  q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
                                                  qk_nope_head_dim=4, v_head_dim=6, first_k_dense_replace=0,
                                                  n_group=1, topk_group=1, n_routed_experts=2, num_experts_per_tok=1,
                                                  moe_intermediate_size=8, n_shared_experts=1)),
    "olmo2": ("Olmo2ForCausalLM", dict(COMMON, hidden_size=D, num_attention_heads=H, num_key_value_heads=KV)),
    "t5": ("T5Model", dict(vocab_size=40, d_model=D, num_heads=H, d_kv=D_H, d_ff=32, num_layers=2,
                           decoder_start_token_id=0)),
}


def build_other(model_type: str):
    cls, kw = TINY_OTHERS[model_type]
    torch.manual_seed(0)
    return getattr(transformers, cls)(transformers.AutoConfig.for_model(model_type, **kw)).eval()


REFUSALS = [
    ("codegen", lambda m: prune_heads(m, {0: [1]}), "interleaves its heads over 4 model-parallel shards"),
    ("deepseek_v3", lambda m: prune_heads(m, {0: [1]}), "multi-head latent attention"),
    ("t5", lambda m: prune_heads(m, {0: [1]}), "relative position bias has one column per head"),
    ("olmo2", lambda m: prune_heads(m, {0: [1]}), r"parameters over the width of all its heads \(q_norm.weight"),
    ("opt", lambda m: to_gqa(m, 2), "OPTAttention has one K/V head per query head"),
    ("gpt_neox", lambda m: to_gqa(m, 2), "GPTNeoXAttention has one K/V head per query head"),
    ("phi3", lambda m: prune_heads(m, {0: [1]}), "read their head counts from the model's shared config"),
    ("qwen2", lambda m: to_gqa(m, 3), r"n_kv_heads must divide n_heads=4; valid: \[1, 2, 4\], got 3"),
]


@pytest.mark.parametrize("model_type, call, match", REFUSALS, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSALS)])
def test_a_refused_change_raises_and_leaves_every_weight_and_attribute_as_it_was(model_type, call, match):
    model = patch(build_other(model_type) if model_type in TINY_OTHERS else build(model_type))
    before = snapshot(model)
    with pytest.raises(ValueError, match=match):
        call(model)
    assert_same(before, model)
    assert len(layers(model)) > 0


# Families with per-head Q/K norms outside the projections: StableLM's one LayerNorm(d_h) per head in a ModuleList,
# Cohere's norm weights (h, d_h) / (h_kv, d_h). Surgery carries them with their heads.
QK_HEADS = {"stablelm": ("StableLmForCausalLM", dict(qk_layernorm=True)),
            "cohere": ("CohereForCausalLM", dict(use_qk_norm=True))}


def build_qk(model_type: str, n_kv: int = KV):
    cls, kw = QK_HEADS[model_type]
    cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **kw}, hidden_size=D, num_attention_heads=H,
                                            num_key_value_heads=n_kv)
    torch.manual_seed(0)
    model = getattr(transformers, cls)._from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm.norms" in name or "q_norm" in name or "k_norm" in name:
                p.add_(torch.randn_like(p) * 0.3)  # every head's norm its own
    return model


def ablated_qk(model, drop: dict[int, list[int]]):
    ref = copy.deepcopy(model)
    for i, heads in drop.items():
        def hook(module, args, heads=heads):
            return (args[0].index_fill(-1, torch.tensor([h * D_H + r for h in heads for r in range(D_H)]), 0.0),)
        ref.model.layers[i].self_attn.o_proj.register_forward_pre_hook(hook)
    return ref


@pytest.mark.parametrize("model_type", list(QK_HEADS))
@pytest.mark.parametrize("drop", [{0: [0, 1], 1: [0, 1]}, {0: [1], 1: [2, 3]}], ids=["kv-group", "split-groups"])
def test_per_head_qk_norms_follow_their_heads_when_pruned(model_type, drop):
    model = build_qk(model_type)
    batch = batch_for(model)
    want = output(ablated_qk(model, drop), batch)
    prune_heads(patch(model), drop)
    torch.testing.assert_close(output(model, batch), want)
    torch.testing.assert_close(output(unpatch(model), batch), want)


@pytest.mark.parametrize("model_type", list(QK_HEADS))
@pytest.mark.parametrize("drop", [{0: [0, 1], 1: [0, 1]}, {0: [1], 1: [2, 3]}, {0: [0, 1, 2, 3], 1: [2]}],
                         ids=["uniform", "per-layer", "emptied-layer"])
def test_per_head_qk_norms_reload_with_their_heads(model_type, drop, tmp_path):
    """StableLM's norms are a ModuleList of one LayerNorm per head: once pruned, the config-sized model has more
    entries than were saved, which the loader must not take for missing layers."""
    model = build_qk(model_type)
    batch = batch_for(model)
    want = output(ablated_qk(model, drop), batch)
    prune_heads(patch(model), drop)
    pruned, shapes = output(model, batch), counts(model)
    torch.testing.assert_close(pruned, want)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, type(model))
    torch.testing.assert_close(output(loaded, batch), pruned)
    torch.testing.assert_close(output(loaded, batch), want)
    assert counts(patch(loaded)) == shapes


@pytest.mark.parametrize("model_type", list(QK_HEADS))
def test_to_mha_keeps_a_model_with_per_head_qk_norms_exact(model_type, tmp_path):
    model = build_qk(model_type)
    batch = batch_for(model)
    want = output(model, batch)
    to_mha(patch(model))
    assert counts(model) == [(H, H, D_H)] * 2
    torch.testing.assert_close(output(model, batch), want)
    save_pretrained(model, tmp_path)  # the config now says H K/V heads: the norms must be rebuilt to match
    torch.testing.assert_close(output(type(model).from_pretrained(tmp_path).eval(), batch), want)


@pytest.mark.parametrize("model_type", list(QK_HEADS))
def test_to_gqa_pools_per_head_k_norms_with_their_k_v_heads(model_type):
    model = build_qk(model_type, n_kv=H)
    batch = batch_for(model)
    ref = build_qk(model_type, n_kv=KV)  # the unpatched GQA model holding the means of consecutive pairs
    state = model.state_dict()

    def pooled(key: str) -> torch.Tensor:
        if ".k_layernorm.norms." in key:
            j = int(key.split(".norms.")[1].split(".")[0])
            return (state[key.replace(f".norms.{j}.", f".norms.{2 * j}.")]
                    + state[key.replace(f".norms.{j}.", f".norms.{2 * j + 1}.")]) / 2
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            return state[key].reshape(KV, 2, D_H, D).mean(1).reshape(KV * D_H, D)
        if key.endswith("k_norm.weight"):
            return state[key].reshape(KV, 2, D_H).mean(1)
        return state[key]

    ref.load_state_dict({k: pooled(k) for k in ref.state_dict()})
    to_gqa(patch(model), KV)
    assert counts(model) == [(H, KV, D_H)] * 2
    torch.testing.assert_close(output(model, batch), output(ref, batch))


def test_per_head_state_of_an_unknown_side_is_refused_when_the_counts_would_differ():
    model = patch(build_qk("cohere", n_kv=H))  # h == h_kv: only a name can say which heads it follows
    for layer in model.model.layers:
        layer.self_attn.head_gain = torch.nn.Parameter(torch.ones(H, D_H))
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"per-head state outside its projections \(head_gain"):
        to_gqa(model, KV)
    assert_same(before, model)
    prune_heads(model, {0: [1]})  # counts stay equal: query and K/V heads are the same heads
    assert tuple(model.model.layers[0].self_attn.head_gain.shape) == (H - 1, D_H)
