""""mean" edits when the model is given a 4-D attention mask (``generate`` with a static cache passes
(b, 1, s_q, s_kv) masks) or a static cache with a 2-D one: the mean is over the real tokens as with a 2-D mask
and a dynamic cache, never over padding or a static cache's empty slots; a 4-D mask that does not show which
tokens are real is refused."""

from __future__ import annotations

import copy

import pytest
import torch

import headwise

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402

IDS = torch.tensor([[0, 0, 0, 5, 7, 3, 9, 11], [5, 7, 3, 9, 11, 12, 8, 4]])  # row 0 left-padded
MASK = (IDS != 0).long()
NEW = 4
GEN = dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
           pad_token_id=0, output_scores=True, return_dict_in_generate=True)


def models():
    plain = ref.llama("sdpa")  # 6 query heads on 2 key/value heads, d_h = 4
    return plain, patch(copy.deepcopy(plain))


def masked_mean64(x, real):
    """Each row's mean over its real positions in float64. Shapes: (b, s, n), (b, s) bool -> (b, 1, n)."""
    w = real.double().unsqueeze(-1)
    return (x.double() * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)


def assert_same_generation(got, want):
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.scores, want.scores):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_z_mean_in_generate_averages_each_call_over_its_real_query_tokens(cache):
    plain, model = models()
    head, d_h = 2, 4
    seen = {}

    def track(module, args, kwargs):  # generate's 2-D mask of each call (a dynamic cache: always 2-D)
        seen["mask"] = kwargs["attention_mask"].bool()

    def mean_over_real(module, args):  # W_O's input: head 2's slice, each row's mean over its real queries
        x = args[0].clone()
        cols = slice(head * d_h, (head + 1) * d_h)
        real = seen["mask"][:, -x.shape[1]:]
        x[..., cols] = masked_mean64(x[..., cols], real).to(x.dtype).expand_as(x[..., cols])
        return (x,)

    handles = [plain.register_forward_pre_hook(track, with_kwargs=True),
               plain.model.layers[1].self_attn.o_proj.register_forward_pre_hook(mean_over_real)]
    try:
        with torch.no_grad():
            want = plain.generate(**GEN)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad(), headwise.trace(model, edit={(1, head): "mean"}):
        got = model.generate(**GEN, cache_implementation=cache)
    assert_same_generation(got, want)


@pytest.mark.parametrize("site", ["k", "v"])
def test_k_and_v_mean_in_generate_with_a_static_cache_average_over_the_real_keys(site):
    _, model = models()
    with torch.no_grad(), headwise.trace(model, edit={(1, 1, site): "mean"}):
        want = model.generate(**GEN)  # a dynamic cache: 2-D masks, every key slot a token
    with torch.no_grad(), headwise.trace(model, edit={(1, 1, site): "mean"}, capture={1: (site,)}) as t:
        got = model.generate(**GEN, cache_implementation="static")
    assert_same_generation(got, want)
    for step, call in enumerate(t[1].calls):
        x = call[site]  # (b, 6, slots, d_h): each query head's copy; heads 0-2 share key/value head 0
        length = IDS.shape[1] + step  # the tokens written so far; the static cache's later slots are empty
        assert x.shape[2] > length or step == NEW - 1
        real = torch.nn.functional.pad(torch.cat([MASK, torch.ones(2, step, dtype=torch.long)], 1).bool(),
                                       (0, x.shape[2] - length), value=False)
        mean = masked_mean64(x[:, 0], real).float()  # head 0 is unedited: the values head 1 averaged
        torch.testing.assert_close(x[:, 1], mean.expand_as(x[:, 1]))


def test_k_mean_over_keys_past_a_2d_mask_is_refused():
    """Keys past a 2-D mask may be a static cache's empty slots or cross-attention keys from another sequence:
    a 2-D mask does not tell them apart, so k "mean" refuses them (a 4-D mask is read exactly, above)."""
    _, model = models()
    ids, nxt = IDS[1:, :6], IDS[1:, 6:7]
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True)
        with headwise.trace(model, edit={(1, 4, "k"): "mean"}):
            with pytest.raises(ValueError, match="keys beyond the mask"):
                model(input_ids=nxt, attention_mask=torch.ones(1, 7, dtype=torch.long), cache=cache,
                      use_cache=True, position_ids=torch.tensor([[6]]))
    with torch.no_grad(), headwise.trace(model, capture={1: ("k",)}) as t:  # capturing alone needs no real keys
        model(input_ids=IDS, attention_mask=MASK, cache=transformers.StaticCache(config=model.config,
                                                                                max_cache_len=16), use_cache=True)
    assert t[1].k.shape[2] == 16
    with pytest.raises(ValueError, match="keys beyond the mask"):
        t[1].mean("k")


def test_cross_attention_k_mean_past_the_mask_is_refused():
    class Decoder(torch.nn.Module):  # self-attention masks its tokens; cross-attention reads a longer memory
        def __init__(self):
            super().__init__()
            self.cross = headwise.MultiHeadAttention(8, 2)

        def forward(self, x, memory, attention_mask=None):
            return self.cross(x, memory)

    model, x, memory = Decoder(), torch.randn(2, 4, 8), torch.randn(2, 9, 8)
    with headwise.trace(model, edit={(0, 0, "k"): "mean"}):
        with pytest.raises(ValueError, match="keys beyond the mask"):
            model(x, memory, attention_mask=torch.ones(2, 4))
    with headwise.trace(model, capture=("v",)) as t:
        model(x, memory, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="keys beyond the mask"):
        t[0].mean("v")


def _cross_decoder(family):
    """A decoder with cross-attention that is no encoder-decoder model (add_cross_attention), its unpatched twin,
    its inputs (the decoder's rows padded; encoder row 0 has 3 real tokens of 5) and its cross layer's name."""
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=4, n_positions=32,
                                      add_cross_attention=True, attn_implementation="sdpa")
        torch.manual_seed(0)
        model, cross, w_o = transformers.GPT2Model(cfg).eval(), "h.0.crossattention", "h.0.crossattention.c_proj"
    else:
        cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=32, is_decoder=True, add_cross_attention=True,
                                      attn_implementation="sdpa")
        torch.manual_seed(0)
        model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
        cross, w_o = "encoder.layer.0.crossattention.self", "encoder.layer.0.crossattention.output.dense"
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    enc_mask = torch.ones(2, 5, dtype=torch.long)
    enc_mask[0, 3:] = 0
    kw = dict(input_ids=torch.randint(3, 40, (2, 7), generator=g), attention_mask=mask,
              encoder_hidden_states=torch.randn(2, 5, 16, generator=g), encoder_attention_mask=enc_mask)
    plain = copy.deepcopy(model)
    return patch(model), plain, kw, cross, w_o


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_k_or_v_mean_of_cross_attention_in_a_decoder_is_refused_and_its_queries_mean_is_over_its_tokens(family):
    # not an encoder-decoder (config.is_encoder_decoder is False): the cross layer's keys are the encoder's
    # tokens, which the decoder's attention_mask does not describe, so a mean over them is refused ...
    model, plain, kw, cross, w_o = _cross_decoder(family)
    for site in ("k", "v"):
        with torch.no_grad(), headwise.trace(model, edit={(cross, 1, site): "mean"}):
            with pytest.raises(ValueError, match="called as cross-attention, whose keys are another sequence"):
                model(**kw)
    with torch.no_grad(), headwise.trace(model, capture=("k", "v", "z")) as t:
        model(**kw)
    for site in ("k", "v"):
        with pytest.raises(ValueError, match=rf"called as cross-attention, whose {site} positions are another"):
            t[cross].mean(site)
    # ... while its queries are the decoder's tokens: a z mean is over the decoder's real ones, as plain hooks on
    # W_O's input of the unpatched model compute it
    real = kw["attention_mask"].bool()

    def mean_head_1(m, args):
        x = args[0].clone()  # (b, s, h * d_h)
        x[..., 4:8] = masked_mean64(x[..., 4:8], real).to(x.dtype).expand_as(x[..., 4:8])
        return (x,)

    handle = plain.get_submodule(w_o).register_forward_pre_hook(mean_head_1)
    try:
        with torch.no_grad():
            want = plain(**kw).last_hidden_state
    finally:
        handle.remove()
    with torch.no_grad(), headwise.trace(model, edit={(cross, 1): "mean"}):
        got = model(**kw).last_hidden_state
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(t[cross].mean("z").double(), t[cross].z.double()[real].mean(0))
    # the decoder's self-attention keys are its own tokens: their mean is over its real ones
    own = t[0].k.transpose(1, 2).double()  # (b, s, h_kv, d_h)
    torch.testing.assert_close(t[0].mean("k").double(), own[real].mean(0))


def test_mean_refuses_a_4d_mask_that_does_not_show_the_real_tokens():
    _, model = models()
    s = IDS.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mask = (causal & MASK.bool()[:, None, :])[:, None]  # (b, 1, s, s): left padding, padded rows read nothing
    mask[0, 0, :3] = True  # ... except row 0's padded queries, which may read every key: not a padding mask
    with torch.no_grad(), headwise.trace(model, capture={1: ("z",)}) as t:
        want = model(input_ids=IDS, attention_mask=mask).logits  # capturing alone needs no real tokens
    for site in ("z", "k"):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad(), headwise.trace(model, edit={(1, 2, site): "mean"}):
            with pytest.raises(ValueError, match=r"\('mean', reference\)"):
                model(input_ids=IDS, attention_mask=mask, cache=cache, use_cache=True)
        # transformers writes its own cache before the attention function runs, as under a raising hook
        assert cache.get_seq_length() == s
    with pytest.raises(ValueError, match="real"):
        t[1].mean("z")
    with torch.no_grad(), headwise.trace(model, capture={1: ("z",)}) as t2:  # a 4-D padding mask is read exactly
        model(input_ids=IDS, attention_mask=(causal & MASK.bool()[:, None, :])[:, None])
    with torch.no_grad(), headwise.trace(model, capture={1: ("z",)}) as t3:
        model(input_ids=IDS, attention_mask=MASK)
    torch.testing.assert_close(t2[1].mean("z"), t3[1].mean("z"))
    assert want.shape == (2, s, model.config.vocab_size)


def _left_padded(model, seed=0):
    kw = ref.inputs(model, seed=seed)
    kw["attention_mask"] = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])  # row 1 left-padded
    return kw


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_mean_through_model_forward_reads_the_mask_reaching_the_layers(impl):
    model = ref.gpt2(impl)
    plain = ref.twin(model)
    patch(model)
    kw = _left_padded(model)
    real = kw["attention_mask"].bool()

    def real_mean(z_h):  # (b, s, d_h): each row's mean over its real tokens, row by row
        return torch.stack([z_h[r, real[r]].mean(0).expand_as(z_h[r]) for r in range(z_h.shape[0])])

    want, zs, _ = ref.hooked_run(plain, kw, 4, edit={(0, 1): real_mean})
    other = dict(kw, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]))
    runs = {"forward": model.forward, "compiled forward": torch.compile(model.forward, backend="eager"),
            "submodule": lambda **k: model.lm_head(model.transformer(**k)[0])}
    for name, run in runs.items():
        torch._dynamo.reset()
        with torch.no_grad(), headwise.trace(model, capture={0: ("z",)}, edit={(0, 1): "mean"}) as t:
            model(**other)  # an earlier call with another padding: never this call's
            got = run(**kw)
        logits = got if name == "submodule" else got.logits
        torch.testing.assert_close(logits[real], want.logits[real], msg=name)
        torch.testing.assert_close(t[0].calls[1]["z"], zs[0], msg=name)
    _, zs_plain, _ = ref.hooked_run(plain, kw, 4)
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:
        model.forward(**kw)
    z = zs_plain[1].double()  # (b, s, h, d_h): over every real token of every row
    torch.testing.assert_close(t[1].mean(), z[real].mean(0).to(z.dtype).float())
    torch._dynamo.reset()


class _Wrapper(torch.nn.Module):
    """A model taking an attention_mask whose layers are bare headwise layers (no host module shows the mask)."""

    def __init__(self):
        super().__init__()
        self.attn = headwise.MultiHeadAttention(8, 2).eval()

    def forward(self, x, attention_mask=None):
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        return self.attn(x, mask=mask)


def test_mean_of_a_module_run_past_its_own_call_is_refused_never_a_stale_mask():
    torch.manual_seed(0)
    model, x = _Wrapper(), torch.randn(2, 4, 8)
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    with torch.no_grad(), headwise.trace(model, capture=("z",), edit={(0, 1): "mean"}) as t:
        model(x, attention_mask=mask)  # through its call: the mask is read
        with pytest.raises(ValueError, match=r"model\(ids, attention_mask=mask\)"):
            model.forward(x, attention_mask=mask)  # the earlier call's mask is not reused
    z = t[0].calls[0]["z"][:, :, 1].double()
    real = mask.bool()
    want = torch.stack([z[r, real[r]].mean(0) for r in range(2)])[:, None].expand_as(z)
    torch.testing.assert_close(z, want)
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:
        model.forward(x, attention_mask=mask)
    with pytest.raises(ValueError, match="never saw its attention_mask"):
        t[0].mean()
    assert len(t[0].calls) == 1
