"""Patching changes nothing at any position, padded rows included, in the conventions of the implementation the
model had (Gemma 2 runs eager: a query that may read nothing averages every value there, where sdpa gives zeros),
in half precision too, and for another model built on the patched model's config object; and a head_mask, which
transformers 5 ignores, is honoured (each head's probabilities and context scaled) or refused in one line before
anything runs.

Peers: the unpatched model itself, and for head_mask the unpatched model with plain forward pre-hooks scaling each
head's slice of W_O's input."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
from headwise.interop import layers, patch, unpatch  # noqa: E402

BASE = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64)
IDS = torch.randint(3, 40, (3, 7), generator=torch.Generator().manual_seed(0))
MASK = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1], [0] + [1] * 6])  # left padding: rows 1 and 2 start padded


def build(model_type: str, impl: str | None = None, **kw) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **kw})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, **({} if impl is None else
                                                                 {"attn_implementation": impl})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def loss_over_every_position(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and a loss over all positions, padded ones too (what a careless loss sees)."""
    with torch.no_grad():
        logits = model(input_ids=IDS, attention_mask=MASK).logits
    return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), IDS.flatten())


@pytest.mark.parametrize("query_pre_attn_scalar", [256, 144])
def test_patched_gemma2_equals_unpatched_at_padded_positions(query_pre_attn_scalar):
    model = build("gemma2", head_dim=8, query_pre_attn_scalar=query_pre_attn_scalar)
    assert model.config._attn_implementation == "eager"  # Gemma 2's default: eager's rules must be kept
    want, want_loss = loss_over_every_position(model)
    patch(model)
    assert [a.rule for _, a in layers(model)] == ["eager", "eager"]
    got, got_loss = loss_over_every_position(model)
    torch.testing.assert_close(got, want)  # every position, the padded ones included
    torch.testing.assert_close(got_loss, want_loss)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3"])
def test_every_position_is_unchanged_under_either_convention(model_type, impl):
    model = build(model_type, impl)
    want, _ = loss_over_every_position(model)
    patch(model)
    got, _ = loss_over_every_position(model)
    torch.testing.assert_close(got, want)
    padded = want[1, 0]  # a query that may read nothing: eager's and sdpa's answers differ there
    other = build(model_type, "sdpa" if impl == "eager" else "eager")
    assert not torch.allclose(loss_over_every_position(other)[0][1, 0], padded)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("model_type", ["qwen3", "gemma2"])
def test_an_eager_model_in_half_precision_keeps_its_uniform_padded_rows(model_type, dtype):
    # Eager adds its dtype's minimum to the scores of a row that may read nothing, which makes the row uniform;
    # headwise computes half-precision scores in float32, where float16's minimum would not swamp them.
    kw = dict(head_dim=8, query_pre_attn_scalar=64) if model_type == "gemma2" else dict(head_dim=8)
    model = build(model_type, "eager", **kw).to(dtype)
    want, _ = loss_over_every_position(model)
    patch(model)
    with headwise.trace(model, capture=("pattern",)) as t:
        got, _ = loss_over_every_position(model)
    tol = dict(atol=5e-3, rtol=5e-3) if dtype == torch.float16 else dict(atol=4e-2, rtol=4e-2)
    torch.testing.assert_close(got, want, **tol)  # every position: half-precision rounding apart
    pattern = t[0].pattern  # (b, h, s, s), the dtype the model computes in
    assert pattern.dtype == dtype
    torch.testing.assert_close(pattern[1, :, 0], torch.full_like(pattern[1, :, 0], 1 / 7))  # the padded row


def test_a_half_precision_additive_mask_keeps_an_eager_models_padded_rows_uniform():
    # A user's 4-D float16 mask in eager's convention (its dtype's minimum where a key may not be read): eager's
    # float16 scores are swamped by it, headwise's float32 ones only by float32's minimum.
    model = build("llama", "eager", head_dim=8).half()
    allowed = torch.ones(7, 7, dtype=torch.bool).tril().expand(3, 1, 7, 7).clone()  # (b, 1, s, s)
    allowed[1, :, :, :3] = False  # left padding: the first three rows of example 1 may read nothing
    mask = torch.zeros(3, 1, 7, 7, dtype=torch.float16).masked_fill(~allowed, torch.finfo(torch.float16).min)
    wide = mask.float().masked_fill(~allowed, torch.finfo(torch.float32).min)
    reference = build("llama", "eager", head_dim=8)  # the same weights in float32, its own convention
    with torch.no_grad():
        want = reference(input_ids=IDS, attention_mask=wide).logits
        patch(model)
        with headwise.trace(model, capture=("pattern",)) as t:
            got = model(input_ids=IDS, attention_mask=mask).logits
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)  # float16 rounding apart
    padded = t[0].pattern[1, :, 0]  # (h, s): a row that may read nothing
    torch.testing.assert_close(padded, torch.full_like(padded, 1 / 7))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_patching_a_model_leaves_a_model_sharing_its_config_computing_as_before(impl):
    model = build("llama", impl)
    other = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    assert other.config is model.config  # transformers shares it: patch switches both to "headwise"
    with torch.no_grad():
        other.load_state_dict(model.state_dict())
    want, _ = loss_over_every_position(other)
    patch(model)
    got, _ = loss_over_every_position(other)
    torch.testing.assert_close(got, want)  # every position, the padded ones included
    torch.testing.assert_close(loss_over_every_position(model)[0], want)
    patch(other)  # patched in turn, it keeps the conventions it computed with
    assert [a.rule for _, a in layers(other)] == [impl, impl]
    torch.testing.assert_close(loss_over_every_position(other)[0], want)
    unpatch(other)
    unpatch(model)
    assert other.config._attn_implementation == impl
    torch.testing.assert_close(loss_over_every_position(other)[0], want)


def w_o_scaled(model: torch.nn.Module, factors: torch.Tensor, d_h: int) -> list:
    """Plain forward pre-hooks on every layer's o_proj scaling head h's slice of its input by factors[layer, h]."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        def scale(m, args, row=factors[i]):  # type: ignore[no-untyped-def]
            z = args[0].unflatten(-1, (-1, d_h)) * row[:, None]  # (b, s, h, d_h)
            return (z.flatten(-2),)
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(scale))
    return handles


@pytest.mark.parametrize("shape", ["per_layer", "shared"])
def test_a_head_mask_scales_each_head_as_its_context_scaled_by_hand(shape):
    factors = torch.tensor([[1.0, 0.0, 0.5, 1.0], [0.0, 1.0, 1.0, 2.0]])
    head_mask = factors if shape == "per_layer" else factors[0]
    rows = factors if shape == "per_layer" else factors[:1].expand(2, -1)
    plain, model = build("llama", "sdpa"), patch(build("llama", "sdpa"))
    with torch.no_grad():
        ignored = plain(input_ids=IDS, attention_mask=MASK, head_mask=head_mask).logits
        assert torch.equal(ignored, plain(input_ids=IDS, attention_mask=MASK).logits)  # transformers 5 ignores it
        handles = w_o_scaled(plain, rows, d_h=4)
        want = plain(input_ids=IDS, attention_mask=MASK).logits
        for h in handles:
            h.remove()
        with headwise.trace(model, capture=("z", "pattern")) as t:
            got = model(input_ids=IDS, attention_mask=MASK, head_mask=head_mask, output_attentions=True)
    torch.testing.assert_close(got.logits, want)
    assert torch.equal(t[0].z[:, :, 1], torch.zeros_like(t[0].z[:, :, 1]))  # what W_O reads: the scaled context
    torch.testing.assert_close(got.attentions[0][:, 2].sum(-1)[0], torch.full((7,), 0.5))  # probabilities scaled


def test_a_per_layer_head_mask_with_more_rows_than_layers_is_refused_before_the_cache_changes():
    # A (L + 1, h) mask (built for a deeper model) has a row that matches no layer: refused, not half applied.
    plain, model = build("llama", "sdpa"), patch(build("llama", "sdpa"))
    with torch.no_grad():
        out = model(input_ids=IDS[:, :4], attention_mask=MASK[:, :4], use_cache=True)
    cache, length = out.cache, out.cache.get_seq_length()
    step = dict(input_ids=IDS[:, 4:5], attention_mask=MASK[:, :5], use_cache=True)
    extra = torch.ones(3, 4)
    extra[2] = 0.0
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM: head_mask has one row per layer: expected "
                                         r"\(L=2, h=4\), got \(3, 4\)$"), torch.no_grad():
        model(**step, cache=cache, head_mask=extra)
    assert [c.shape[2] for c in (layer.keys for layer in cache.layers)] == [length, length]  # untouched
    with torch.no_grad():  # the refused call changed nothing: the next step is the unpatched model's
        want = plain(input_ids=IDS[:, :5], attention_mask=MASK[:, :5]).logits[:, -1:]
        got = model(**step, cache=cache, head_mask=torch.ones(2, 4)).logits
    torch.testing.assert_close(got, want)


def test_a_per_layer_head_mask_fits_a_model_whose_last_layer_was_deleted():
    # Shortening a model by deleting layers leaves config.num_hidden_layers as it was: a mask with one row per
    # layer that remains is what the user means, and is applied as hooks scaling W_O's inputs apply it.
    factors = torch.tensor([[1.0, 0.0, 0.5, 1.0], [0.0, 1.0, 1.0, 2.0]])
    plain, model = build("llama", "sdpa", num_hidden_layers=3), patch(build("llama", "sdpa", num_hidden_layers=3))
    for m in (plain, model):
        del m.model.layers[2]
    assert model.config.num_hidden_layers == 3
    with torch.no_grad():
        handles = w_o_scaled(plain, factors, d_h=4)
        want = plain(input_ids=IDS, attention_mask=MASK).logits
        for h in handles:
            h.remove()
        got = model(input_ids=IDS, attention_mask=MASK, head_mask=factors).logits
    torch.testing.assert_close(got, want)


def test_bad_or_ambiguous_head_masks_are_refused_in_one_line_before_the_cache_changes():
    model = patch(build("llama", "sdpa"))
    with torch.no_grad():
        out = model(input_ids=IDS[:, :4], attention_mask=MASK[:, :4], use_cache=True)
    cache, length = out.cache, out.cache.get_seq_length()
    step = dict(input_ids=IDS[:, 4:5], attention_mask=MASK[:, :5], cache=cache, use_cache=True)
    for head_mask, message in ((torch.ones(3), r"head_mask must have shape \(h=4,\) or \(layers, h=4\) for "
                                               r"LlamaAttention, got \(3,\)"),
                               (torch.ones(1, 4), r"head_mask of shape \(1, 4\) has one row per layer, but "
                                                  r"LlamaAttention has layer_idx=1"),
                               ("half", "head_mask must be a tensor of per-head factors, got str")):
        with pytest.raises((ValueError, TypeError), match=message), torch.no_grad():
            model(**step, head_mask=head_mask)
        assert [c.shape[2] for c in (layer.keys for layer in cache.layers)] == [length, length]  # untouched
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)).eval()
    patch(bart)
    with pytest.raises(ValueError, match=r"^BartForConditionalGeneration: head_mask is not supported on an "
                                         r"encoder-decoder model"):
        bart(input_ids=IDS, head_mask=torch.ones(4))
    for name in ("decoder_head_mask", "cross_attn_head_mask"):
        with pytest.raises(ValueError, match=rf"^BartForConditionalGeneration: {name} is not supported on an "
                                             r"encoder-decoder model"):
            bart(input_ids=IDS, **{name: torch.ones(4)})
        # A decoder-only model has no decoder or cross-attention stack to give them to: the message says so.
        with pytest.raises(ValueError, match=rf"^LlamaForCausalLM: {name} is for an encoder-decoder model, and "
                                             r"LlamaForCausalLM is not one \(config\.is_encoder_decoder=False\); "
                                             r"pass head_mask of shape \(h,\) or \(L, h\)"), torch.no_grad():
            model(**step, **{name: torch.ones(4)})
        assert [c.shape[2] for c in (layer.keys for layer in cache.layers)] == [length, length]  # untouched
    unpatch(model)
    with torch.no_grad():  # unpatched: transformers' own behaviour (it ignores head_mask) is back
        model(input_ids=IDS, head_mask=torch.ones(3))


def cross_attention_decoder(family: str) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    """A decoder with cross-attention, and its W_O (each attention module's output projection) by module kind."""
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=32, add_cross_attention=True)).eval()
        return model, {f"{kind}{i}": getattr(block, kind).c_proj for i, block in enumerate(model.transformer.h)
                       for kind in ("attn", "crossattention")}
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
        is_decoder=True, add_cross_attention=True)).eval()
    return model, {f"{kind}{i}": getattr(layer, kind).output.dense for i, layer in enumerate(model.encoder.layer)
                   for kind in ("attention", "crossattention")}


@pytest.mark.parametrize("family, scaled", [("gpt2", ("attn",)), ("bert", ("attention", "crossattention"))])
def test_a_head_mask_scales_the_modules_the_model_hands_it_and_leaves_the_others_as_unpatched(family, scaled):
    # GPT2Block calls its cross-attention without its keyword arguments, so head_mask never reaches it: those heads
    # stay as the unpatched model computes them; BERT's layer hands the mask to both.
    ids = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    enc = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    factors = torch.tensor([1.0, 0.0, 0.5, 1.0])
    model, w_o = cross_attention_decoder(family)

    def scale(m, args):  # type: ignore[no-untyped-def]
        return (args[0].unflatten(-1, (4, 4)).mul(factors[:, None]).flatten(-2),) + args[1:]

    handles = [w.register_forward_pre_hook(scale) for name, w in w_o.items() if name.rstrip("01") in scaled]
    with torch.no_grad():
        want = model(ids, encoder_hidden_states=enc)[0]
        for h in handles:
            h.remove()
        patch(model)
        got = model(ids, encoder_hidden_states=enc, head_mask=factors)[0]
    torch.testing.assert_close(got, want)


def test_a_per_layer_head_mask_on_a_decoder_with_cross_attention_is_refused_naming_two_modules_of_a_layer():
    model = patch(cross_attention_decoder("gpt2")[0])
    with pytest.raises(ValueError, match=r"^GPT2LMHeadModel: head_mask has one row per layer, but its attention "
                                         r"modules share layer numbers \('transformer\.h\.0\.attn' and "
                                         r"'transformer\.h\.0\.crossattention' both have layer_idx=0\)"):
        model(torch.tensor([[3, 4]]), encoder_hidden_states=torch.randn(1, 5, 16), head_mask=torch.ones(2, 4))
