""""mean" ablation over real tokens only (the model's attention_mask), a mean taken on other data, and
``Trace.as_dict`` against TransformerLens' own ``run_with_cache`` names, layouts and values."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import MultiHeadAttention

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402


def real_mean(z_h, real):
    """Each row's mean over its real tokens, written out row by row. Shapes: (b, s, d_h), (b, s) -> (b, s, d_h)."""
    rows = [z_h[r, real[r]].mean(0).expand(z_h.shape[1], -1) for r in range(z_h.shape[0])]
    return torch.stack(rows)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_mean_ablation_averages_over_real_tokens_only(family):
    model = ref.BUILDERS[family]("sdpa")
    plain = ref.twin(model)
    patch(model)
    kw = ref.inputs(model)  # row 1 pads its last two positions
    real = kw["attention_mask"].bool()
    h = model.config.num_attention_heads
    want, zs, _ = ref.hooked_run(plain, kw, h, edit={(1, 2): lambda z: real_mean(z, real)})
    with torch.no_grad(), headwise.trace(model, capture={1: ("z",)}, edit={(1, 2): "mean"}) as t:
        got = model(**kw)
    torch.testing.assert_close(t[1].z, zs[1])  # the edited context W_O reads
    first = "logits" if family == "gpt2" else "last_hidden_state"
    torch.testing.assert_close(getattr(got, first), getattr(want, first))
    if family == "bert":  # BertModel(input_ids, attention_mask, ...): the mask passed by position is read too
        with torch.no_grad(), headwise.trace(model, capture={1: ("z",)}, edit={(1, 2): "mean"}) as t:
            model(kw["input_ids"], kw["attention_mask"])
        torch.testing.assert_close(t[1].z, zs[1])


def test_a_mean_taken_on_other_data():
    model = ref.gpt2("sdpa")
    plain = ref.twin(model)
    patch(model)
    other, kw = ref.inputs(model, b=3, s=7, seed=5), ref.inputs(model, seed=6)
    other["attention_mask"][2, 4:] = 0
    _, zs_other, _ = ref.hooked_run(plain, other, 4)
    real = other["attention_mask"].bool()
    mean = zs_other[0][:, :, 3][real].mean(0)  # head 3 of layer 0 over every real token of the other batch
    want, _, _ = ref.hooked_run(plain, kw, 4, edit={(0, 3): lambda z: mean.expand_as(z)})
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as reference:
        model(**other)
    torch.testing.assert_close(reference[0].mean()[3], mean)
    for edit in ({(0, 3): ("mean", reference)}, {(0, 3): reference[0].mean()[3]}):
        with torch.no_grad(), headwise.trace(model, edit=edit):
            got = model(**kw)
        torch.testing.assert_close(got.logits, want.logits)


def test_mean_of_a_bare_layer_is_over_every_position():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with headwise.trace(attn, capture=("z",)) as t:
        attn(x)
    torch.testing.assert_close(t[0].mean(), t[0].z.reshape(-1, 4, 4).mean(0))


@pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
def test_as_dict_uses_transformer_lens_names_layouts_and_values():
    pytest.importorskip("transformer_lens")
    from tests.interop.tl_twin import transformer_lens_twin

    torch.manual_seed(0)
    attn = MultiHeadAttention(24, 4).double()
    model = transformer_lens_twin(attn, True)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    _, cache = model.run_with_cache(x, start_at_layer=0, stop_at_layer=1)
    with headwise.trace(attn, capture=("q", "k", "v", "pattern", "z", "result")) as t:
        attn(x, causal=True)
    names = t.as_dict()
    assert sorted(names) == sorted(f"blocks.0.attn.hook_{n}" for n in ("q", "k", "v", "pattern", "z", "result"))
    for name, tensor in names.items():
        torch.testing.assert_close(tensor, cache[name])


def _bart():
    cfg = transformers.BartConfig(vocab_size=50, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BartModel(cfg).eval()
    return model, ref.twin(model)


def _bart_inputs(s_dec, dec_mask=False):
    g = torch.Generator().manual_seed(1)
    kw = dict(input_ids=torch.randint(3, 50, (2, 6), generator=g),
              attention_mask=torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]]),  # the encoder pads row 1
              decoder_input_ids=torch.randint(3, 50, (2, s_dec), generator=g))
    if dec_mask:
        mask = torch.ones(2, s_dec, dtype=torch.long)
        mask[0, -1] = 0  # the decoder pads row 0's last token
        kw["decoder_attention_mask"] = mask
    return kw


@pytest.mark.parametrize("s_dec,dec_mask", [(4, False), (4, True), (8, False)])
def test_mean_in_an_encoder_decoders_decoder_is_over_the_decoders_real_tokens(s_dec, dec_mask):
    model, plain = _bart()
    patch(model)
    kw = _bart_inputs(s_dec, dec_mask)
    real = kw["decoder_attention_mask"].bool() if dec_mask else torch.ones(2, s_dec, dtype=torch.bool)
    head, d_h = 1, 8
    cols = slice(head * d_h, (head + 1) * d_h)

    def mean_over_real(m, args):  # the reference: W_O's input, head 1's slice averaged over the decoder's tokens
        x = args[0].clone()
        x[..., cols] = real_mean(x[..., cols], real)
        return (x,)

    decoder = plain.decoder.layers[0]
    handles = [decoder.self_attn.out_proj.register_forward_pre_hook(mean_over_real),
               decoder.encoder_attn.out_proj.register_forward_pre_hook(mean_over_real)]
    try:
        with torch.no_grad():
            want = plain(**kw).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    edit = {("decoder.layers.0.self_attn", head): "mean", ("decoder.layers.0.encoder_attn", head): "mean"}
    with torch.no_grad(), headwise.trace(model, edit=edit, capture=("z",)) as t:
        got = model(**kw).last_hidden_state
    torch.testing.assert_close(got, want)
    # the record's mean is over the same tokens: the float64 mean of the captured z over the real positions
    z = t["decoder.layers.0.self_attn"].z.double()  # (b, s, h, d_h)
    expected = z[real].mean(0)  # (h, d_h)
    torch.testing.assert_close(t["decoder.layers.0.self_attn"].mean("z").double(), expected)


def test_mean_of_k_or_v_in_an_encoder_decoders_decoder_is_refused():
    model, _ = _bart()
    patch(model)
    with pytest.raises(ValueError, match="'mean' of k or v in a decoder layer of an encoder-decoder model"):
        headwise.trace(model, edit={("decoder.layers.0.encoder_attn", 1, "k"): "mean"})
    with torch.no_grad(), headwise.trace(model, capture=("k", "v")) as t:
        model(**_bart_inputs(4))
    with pytest.raises(ValueError, match="whose padding to average over is unknown"):
        t["decoder.layers.0.self_attn"].mean("v")
    # the encoder's layer keeps its own padding: the float64 mean of its keys over the encoder's real tokens
    k = t["encoder.layers.0.self_attn"].k.transpose(1, 2).double()  # (b, s, h_kv, d_h)
    real = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]]).bool()
    torch.testing.assert_close(t["encoder.layers.0.self_attn"].mean("k").double(), k[real].mean(0))


def _llama_and_lens(tl):
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights

    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, intermediate_size=64, max_position_embeddings=32,
                                   rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    tcfg = tl.HookedTransformerConfig(
        n_layers=2, d_model=32, n_ctx=32, d_head=8, n_heads=4, n_key_value_heads=2, d_mlp=64, d_vocab=50,
        act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8,
        rotary_adjacent_pairs=False, gated_mlp=True, final_rms=True, eps=1e-6, rotary_base=10000,
        use_attn_result=True, dtype=torch.float64, default_prepend_bos=False)
    return model, tcfg, convert_llama_weights


def test_as_dict_names_q_and_k_of_a_layer_without_rotary_as_transformer_lens_plain_hooks():
    gpt2 = patch(ref.gpt2("sdpa"))  # no rotary: TransformerLens' plain names
    with torch.no_grad(), headwise.trace(gpt2, capture=("q", "k")) as t:
        gpt2(**ref.inputs(gpt2))
    assert sorted(t.as_dict()) == sorted(f"blocks.{layer}.attn.hook_{n}" for layer in range(2) for n in "qk")


def _neox_and_lens(tl):
    from transformer_lens.pretrained.weight_conversions.neox import convert_neox_weights

    cfg = transformers.GPTNeoXConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=32, rotary_pct=0.5,
                                     hidden_act="gelu")
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(cfg).double().eval()
    tcfg = tl.HookedTransformerConfig(
        n_layers=2, d_model=32, n_ctx=32, d_head=8, n_heads=4, d_mlp=64, d_vocab=50, act_fn="gelu",
        normalization_type="LN", eps=cfg.layer_norm_eps, parallel_attn_mlp=True, positional_embedding_type="rotary",
        rotary_dim=4, rotary_adjacent_pairs=False, rotary_base=cfg.rope_parameters["rope_theta"],
        use_attn_result=True, dtype=torch.float64, default_prepend_bos=False)
    return model, tcfg, convert_neox_weights


def _gemma_and_lens(tl):
    from transformer_lens.pretrained.weight_conversions.gemma import convert_gemma_weights

    cfg = transformers.GemmaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=32, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(cfg).double().eval()
    tcfg = tl.HookedTransformerConfig(
        n_layers=2, d_model=32, n_ctx=32, d_head=8, n_heads=4, n_key_value_heads=2, d_mlp=64, d_vocab=50,
        act_fn="gelu_pytorch_tanh", normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8,
        rotary_adjacent_pairs=False, gated_mlp=True, final_rms=True, eps=1e-6, rotary_base=10000,
        use_attn_result=True, dtype=torch.float64, default_prepend_bos=False)
    return model, tcfg, convert_gemma_weights


@pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gemma"])
def test_as_dict_names_rotary_q_and_k_as_transformer_lens_rotated_hooks(family):
    # Llama's layer has a rotary; GPT-NeoX (partial rotary) and Gemma (no registry entry) have none, yet the module
    # rotates q and k before handing them over: all three are TransformerLens' hook_rot_q / hook_rot_k
    tl = pytest.importorskip("transformer_lens")
    build = {"llama": _llama_and_lens, "gpt_neox": _neox_and_lens, "gemma": _gemma_and_lens}[family]
    model, tcfg, convert = build(tl)
    lens = tl.HookedTransformer(tcfg)
    lens.load_state_dict(convert(model, tcfg), strict=False)
    patch(model)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, cache = lens.eval().run_with_cache(ids)
        with headwise.trace(model, capture=("q", "k", "v", "z")) as t:
            got = model(ids).logits
    torch.testing.assert_close(got, logits)  # the lens is the same model
    names = t.as_dict()
    assert sorted(names) == sorted(f"blocks.{layer}.attn.hook_{n}" for layer in range(2)
                                   for n in ("rot_q", "rot_k", "v", "z"))
    for name, tensor in names.items():
        torch.testing.assert_close(tensor, cache[name])
    for n in "qk":  # rotated
        assert not torch.allclose(names[f"blocks.1.attn.hook_rot_{n}"], cache[f"blocks.1.attn.hook_{n}"])


def test_as_dict_of_a_decode_gives_each_calls_tensors_or_a_clear_refusal():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 4, 16)
    cache = attn.new_cache(1, 8)
    with torch.no_grad(), headwise.trace(attn, capture=("q", "k", "v", "pattern", "z")) as t:
        attn(x[:, :3], cache=cache)
        attn(x[:, 3:], cache=cache)
    with pytest.raises(ValueError, match=r"ran 2 times.*as_dict\(call=i\)"):
        t.as_dict()
    for i, call in enumerate(t[0].calls):
        names = t.as_dict(call=i)
        torch.testing.assert_close(names["blocks.0.attn.hook_k"], call["k"].transpose(1, 2))
        torch.testing.assert_close(names["blocks.0.attn.hook_pattern"], call["pattern"])
    with torch.no_grad(), headwise.trace(attn, capture=("pattern",)) as whole:
        attn(x, causal=True)
    torch.testing.assert_close(t.as_dict(call=1)["blocks.0.attn.hook_pattern"], whole[0].pattern[:, :, 3:])
    with torch.no_grad(), headwise.trace(attn, capture=("z",)) as t:
        attn(torch.randn(1, 3, 16))
        attn(torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match=r"call 0 is \(1, 3, 4, 4\) and call 1 is \(2, 3, 4, 4\)"):
        t.as_dict()


def test_as_dict_refuses_a_call_that_is_not_an_int_before_reading_anything():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).eval()
    x1, x2 = torch.randn(1, 3, 16), torch.randn(1, 1, 16)
    with torch.no_grad(), headwise.trace(attn, capture=("z",)) as t:
        attn(x1)
        attn(x2)
    for call, name in (("0", "str"), (1.0, "float"), (True, "bool")):  # True would read call 1
        with pytest.raises(TypeError, match=rf"call must be an int .* got {name}"):
            t.as_dict(call=call)
    with torch.no_grad(), headwise.trace(attn, capture=("z",)) as alone:
        attn(x2)
    torch.testing.assert_close(t.as_dict(call=1)["blocks.0.attn.hook_z"], alone[0].z)
