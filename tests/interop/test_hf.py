"""headwise.interop.hf against Hugging Face transformers itself: random tiny models, float32, no download.

Every comparison is patched vs unpatched on the *same* model (or an exact eager twin for attention
weights), so the peer is transformers' own implementation.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
from headwise import MultiHeadAttention  # noqa: E402
from headwise.interop import from_hf, layers, patch, to_hf, unpatch  # noqa: E402

VOCAB = 40
IMPLS = ["eager", "sdpa"]
SIDES = ["left", "right"]

BERT = {
    "bert-20x4": dict(hidden_size=20, num_attention_heads=4),  # d_head 5
    "bert-21x3": dict(hidden_size=21, num_attention_heads=3),  # odd width, d_head 7
    "bert-12x12": dict(hidden_size=12, num_attention_heads=12),  # d_head 1
}
GPT2 = {
    "gpt2-21x3": dict(n_embd=21, n_head=3),
    "gpt2-20x5-inv-layer": dict(n_embd=20, n_head=5, scale_attn_by_inverse_layer_idx=True),
    "gpt2-16x4-unscaled": dict(n_embd=16, n_head=4, scale_attn_weights=False),
}
LLAMA = {
    "llama-mha": ("llama", dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa": ("llama", dict(hidden_size=24, num_attention_heads=6, num_key_value_heads=2)),
    "llama-mqa": ("llama", dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=1)),  # d_head 6
    "llama-head_dim-bias": ("llama", dict(hidden_size=20, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=6, attention_bias=True)),
    "llama-rope-linear": ("llama", dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=2,
                                        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})),
    "mistral-sliding": ("mistral", dict(hidden_size=24, num_attention_heads=6, num_key_value_heads=2,
                                        sliding_window=5)),
    "qwen2": ("qwen2", dict(hidden_size=24, num_attention_heads=6, num_key_value_heads=3)),
    "qwen2-mixed-sliding": ("qwen2", dict(hidden_size=24, num_attention_heads=6, num_key_value_heads=3,
                                          use_sliding_window=True, sliding_window=4, max_window_layers=1)),
}
LLAMA_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


# -- model builders -----------------------------------------------------------------------------------
def bert(name: str, impl: str, *, decoder: bool = False) -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=VOCAB, num_hidden_layers=2, intermediate_size=16,
                                  max_position_embeddings=64, is_decoder=decoder, attn_implementation=impl,
                                  pad_token_id=0, **BERT[name])
    cls = transformers.BertLMHeadModel if decoder else transformers.BertModel
    return cls(cfg).eval()


def gpt2(name: str, impl: str) -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_layer=2, n_positions=64, attn_implementation=impl,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, **GPT2[name])
    return transformers.GPT2LMHeadModel(cfg).eval()


def llama(name: str, impl: str) -> nn.Module:
    family, kw = LLAMA[name]
    cfg_cls, model_cls = (getattr(transformers, n) for n in LLAMA_CLASSES[family])
    cfg = cfg_cls(vocab_size=VOCAB, intermediate_size=32, num_hidden_layers=2, max_position_embeddings=64,
                  attn_implementation=impl, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)
    return model_cls(cfg).eval()


def batch(seed: int, side: str, b: int = 3, s: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (no special ids) and an attention mask with lengths s, s - 3, s - 1 padded on ``side``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    for row, pad in enumerate((0, 3, 1)[:b]):
        if pad and side == "left":
            mask[row, :pad] = 0
        elif pad:
            mask[row, s - pad:] = 0
    return ids, mask


def assert_hidden_states(got, want, n_layers: int) -> None:
    """Every layer's output (and the embeddings), the last one being the model's last hidden state."""
    assert len(got) == len(want) == n_layers + 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def eager_twin(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    return twin


@torch.no_grad()
def run(model: nn.Module, **kw):
    return model(**kw, output_attentions=True, output_hidden_states=True)


def assert_attentions(got, want, n_layers: int, dead: torch.Tensor | None = None) -> None:
    """Whole-tensor equality; ``dead`` (b, 1, s, 1) marks query rows that may read no key at all.

    HF's two conventions differ exactly there: eager adds finfo.min to every score of such a row and returns
    a uniform row; sdpa's bool mask gives a zero row (and zero output). The patched sdpa model returns zeros.
    """
    assert len(got) == len(want) == n_layers
    for g, w in zip(got, want):
        if dead is not None:
            assert torch.equal(g.masked_select(dead), torch.zeros_like(g.masked_select(dead)))
            g, w = g.masked_fill(dead, 0.0), w.masked_fill(dead, 0.0)
        torch.testing.assert_close(g, w)


def causal_dead_rows(mask: torch.Tensor) -> torch.Tensor:
    """Query rows of a causal model that see only padding: (b, s) mask -> (b, 1, s, 1) bool."""
    return (mask.cumsum(-1) == 0)[:, None, :, None]


# -- whole models: outputs, attentions, padding ---------------------------------------------------------
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(BERT))
def test_bert_outputs_and_attentions(name, impl, side):
    model = bert(name, impl)
    ids, mask = batch(1, side)
    want = run(eager_twin(model) if impl == "sdpa" else model, input_ids=ids, attention_mask=mask)
    ref = run(model, input_ids=ids, attention_mask=mask)
    patch(model)
    got = run(model, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state)
    torch.testing.assert_close(got.pooler_output, ref.pooler_output)
    assert_hidden_states(got.hidden_states, ref.hidden_states, 2)
    # sdpa in HF returns no weights; the patched layer computes them (eager path) when asked.
    assert_attentions(got.attentions, want.attentions, 2)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(GPT2))
def test_gpt2_outputs_attentions_and_cache(name, impl, side):
    model = gpt2(name, impl)
    ids, mask = batch(2, side)
    ref, ref_steps = run(model, input_ids=ids, attention_mask=mask), cached_logits(model, ids, mask)
    patch(model)
    got = run(model, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got.logits, ref.logits)
    assert_hidden_states(got.hidden_states, ref.hidden_states, 2)
    if impl == "eager":  # GPT2Model drops output_attentions before its layers: only eager layers return weights
        assert_attentions(got.attentions, ref.attentions, 2)
    for g, w in zip(cached_logits(model, ids, mask), ref_steps):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(LLAMA))
def test_llama_family_outputs_attentions_and_cache(name, impl, side):
    model = llama(name, impl)
    ids, mask = batch(3, side)
    want = run(eager_twin(model) if impl == "sdpa" else model, input_ids=ids, attention_mask=mask)
    ref, ref_steps = run(model, input_ids=ids, attention_mask=mask), cached_logits(model, ids, mask)
    patch(model)
    got = run(model, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got.logits, ref.logits)
    assert_hidden_states(got.hidden_states, ref.hidden_states, 2)
    assert_attentions(got.attentions, want.attentions, 2, dead=causal_dead_rows(mask) if impl == "sdpa" else None)
    for g, w in zip(cached_logits(model, ids, mask), ref_steps):
        torch.testing.assert_close(g, w)


@torch.no_grad()
def cached_logits(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, prefill: int = 4) -> list[torch.Tensor]:
    """Prefill, then one token at a time through the model's own DynamicCache."""
    out = model(input_ids=ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
    assert isinstance(out.cache, transformers.DynamicCache)
    logits, cache = [out.logits], out.cache
    for t in range(prefill, ids.shape[1]):
        out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
        logits.append(out.logits)
    assert cache.get_seq_length() == ids.shape[1]
    return logits


# -- greedy generation with the model's cache --------------------------------------------------------------
def greedy(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                          use_cache=True, pad_token_id=0)


# Every config under sdpa (HF's default), and one per family under eager.
GENERATORS = ([("gpt2", n, "sdpa") for n in GPT2] + [("llama", n, "sdpa") for n in LLAMA]
              + [("bert-decoder", "bert-21x3", impl) for impl in IMPLS]
              + [("gpt2", "gpt2-21x3", "eager"), ("llama", "llama-gqa", "eager"), ("llama", "mistral-sliding", "eager"),
                 ("llama", "qwen2", "eager")])


@pytest.mark.parametrize("kind,name,impl", GENERATORS)
def test_greedy_generate_identical(kind, name, impl):
    model = bert(name, impl, decoder=True) if kind == "bert-decoder" else globals()[kind](name, impl)
    ids, mask = batch(4, "left")
    want = greedy(model, ids, mask)
    patch(model)
    got = greedy(model, ids, mask)
    assert got.shape == (3, 7 + 20)
    assert torch.equal(got, want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("how", [dict(cache_implementation="static"), dict(num_beams=3)])
def test_static_cache_and_beam_search_identical(how, impl):
    """A StaticCache exercises HF's sdpa crop of K/V at prefill; beam search reorders the cache."""
    model = llama("mistral-sliding", impl)
    ids, mask = batch(7, "left")
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
              pad_token_id=0, **how)
    want = model.generate(**kw)
    patch(model)
    assert torch.equal(model.generate(**kw), want)


# -- structure: identity, sharing, hooks, heads ----------------------------------------------------------
def test_patch_keeps_classes_shares_weights_and_unpatch_restores_identity():
    model = llama("llama-gqa", "sdpa")
    originals = [layer.self_attn for layer in model.model.layers]
    assert patch(model) is model
    patched = model.model.layers[0].self_attn
    assert isinstance(patched, transformers.models.llama.modeling_llama.LlamaAttention)
    assert patched.attn.q_proj is originals[0].q_proj and patched.attn.out_proj is originals[0].o_proj
    assert [n for n, _ in layers(model)] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert layers(model)[1][1] is model.model.layers[1].self_attn.attn
    head = patched.attn.head(3)
    assert head.kv_index == 1 and torch.equal(head.w_q, originals[0].q_proj.weight[12:16].T)
    patch(model)  # idempotent
    assert len(layers(model)) == 2
    assert unpatch(model) is model
    assert all(layer.self_attn is o for layer, o in zip(model.model.layers, originals))
    assert layers(model) == []


def test_bert_patch_keeps_dense_where_it_is_and_the_layer_reads_it():
    model = bert("bert-20x4", "sdpa")
    block = model.encoder.layer[0].attention
    self_attn, dense = block.self, block.output.dense
    patch(model)
    assert block.self is self_attn and block.output.dense is dense  # nothing moved
    assert isinstance(block.self, transformers.models.bert.modeling_bert.BertSelfAttention)
    assert block.self.attn.out_proj is dense and block.self.attn.q_proj is self_attn.query
    unpatch(model)
    assert type(block.self) is transformers.models.bert.modeling_bert.BertSelfAttention and block.output.dense is dense


def test_gpt2_edits_through_a_head_are_edits_of_the_model():
    model = gpt2("gpt2-21x3", "eager")
    original = model.transformer.h[0].attn
    patch(model)
    attn = model.transformer.h[0].attn.attn
    new_w_q = torch.randn(21, 7)
    attn.head(1).w_q = new_w_q  # (d, d_h): x @ w_q are head 1's queries
    unpatch(model)
    assert model.transformer.h[0].attn is original
    torch.testing.assert_close(original.c_attn.weight[:, 7:14], new_w_q, rtol=0, atol=0)


def test_deepcopy_of_a_patched_model_unpatches_on_its_own():
    model = patch(gpt2("gpt2-21x3", "sdpa"))
    twin = copy.deepcopy(model)
    ids, mask = batch(8, "right")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    unpatch(twin)
    assert layers(twin) == [] and len(layers(model)) == 2
    with torch.no_grad():
        torch.testing.assert_close(twin(input_ids=ids, attention_mask=mask).logits, want)


def test_an_instance_level_forward_still_runs_and_its_heads_are_headwise():
    """accelerate-style hooks replace ``module.forward`` on the instance; patching leaves them where they are, and
    the module they wrap still hands its heads to headwise."""
    model = llama("llama-gqa", "eager")
    calls = []
    for layer in model.model.layers:
        original = layer.self_attn.forward
        layer.self_attn.forward = lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k)
    ids = batch(9, "right")[0]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        patch(model)
        with headwise.trace(model, capture=("z",)) as t:
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    assert len(calls) == 4 and t[1].z.shape == (3, 7, 6, 4)


def test_switching_attn_implementation_after_patching():
    """The switched model is transformers' own again: a trace refuses it in one line, and patching again takes it
    over with the new implementation's conventions (eager's uniform rows for queries that read nothing)."""
    model = llama("llama-gqa", "sdpa")
    ids, mask = batch(11, "left")
    want = run(eager_twin(model), input_ids=ids, attention_mask=mask)
    patch(model).set_attn_implementation("eager")
    with pytest.raises(ValueError, match=r"^trace: model.layers.0.self_attn computes with attn_implementation="
                                         r"'eager' since it was patched \(set_attn_implementation\); call "
                                         r"headwise.interop.patch\(model\) again$"):
        headwise.trace(model, capture=("z",))
    patch(model)
    with headwise.trace(model, capture=("z",)) as t:
        got = run(model, input_ids=ids, attention_mask=mask)
    assert t[0].z.shape == (3, 7, 6, 4)
    torch.testing.assert_close(got.logits, want.logits)
    assert_attentions(got.attentions, want.attentions, 2)  # eager masks: fully masked rows are uniform again


def test_output_attentions_hooks_installed_before_patching_still_fire():
    model = llama("llama-mqa", "eager")
    ids, mask = batch(5, "right")
    run(model, input_ids=ids, attention_mask=mask)  # installs HF's recording hooks on the original modules
    patch(model)
    assert len(run(model, input_ids=ids, attention_mask=mask).attentions) == 2


def test_llama_head_alone_reproduces_its_weights():
    """attn.head(h), run on the layer's real input with the layer's own rotary, gives HF's weights of head h."""
    model = llama("llama-gqa", "eager")
    ids = batch(6, "right")[0][:1]
    inputs = {}
    patch(model)
    model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: inputs.update(x=kwargs["hidden_states"]), with_kwargs=True)
    out = run(model, input_ids=ids)
    attn = layers(model)[1][1]
    for h in range(attn.n_heads):
        _, w = attn.head(h)(inputs["x"], causal=True, return_weights=True)
        torch.testing.assert_close(w, out.attentions[1][:, h])


# -- single-module converters ------------------------------------------------------------------------------
def modules() -> dict[str, nn.Module]:
    found = {"bert": bert("bert-21x3", "eager").encoder.layer[1].attention,
             "gpt2": gpt2("gpt2-20x5-inv-layer", "eager").transformer.h[1].attn}
    for name in ("llama-head_dim-bias", "llama-mqa", "mistral-sliding", "qwen2"):
        found[name] = llama(name, "eager").model.layers[0].self_attn
    return found


def test_round_trips_are_exact():
    for name, module in modules().items():
        attn = from_hf(module)
        back = to_hf(attn, like=module)
        assert type(back) is type(module) and back is not module, name
        want, got = module.state_dict(), back.state_dict()
        assert want.keys() == got.keys(), name
        assert all(torch.equal(want[k], got[k]) for k in want), name
        again = from_hf(back).state_dict()
        assert all(torch.equal(v, again[k]) for k, v in attn.state_dict().items()), name


def test_qwen2_bias_layout_and_explicit_head_dim():
    qwen = from_hf(llama("qwen2", "eager").model.layers[0].self_attn)
    assert (qwen.config.bias, qwen.config.out_bias, qwen.config.kind) == (True, False, "GQA")
    odd = from_hf(llama("llama-head_dim-bias", "eager").model.layers[0].self_attn)
    assert (odd.d_model, odd.d_head, odd.n_kv_heads, odd.config.inner_dim) == (20, 6, 2, 24)


@pytest.mark.parametrize("name", ["llama-gqa", "llama-rope-linear", "qwen2"])
def test_rotary_matches_the_models(name):
    model = llama(name, "eager")
    pos = torch.arange(9)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, 9, 1), pos)
    for attn in (from_hf(model.model.layers[0].self_attn), layers(patch(model))[0][1]):
        hw_cos, hw_sin = attn.rotary(pos)
        torch.testing.assert_close(hw_cos[:, 0], cos, rtol=0, atol=0)
        torch.testing.assert_close(hw_sin[:, 0], sin, rtol=0, atol=0)


def test_gpt2_conv1d_orientation_by_hand():
    """Conv1D computes x @ W + b with W stored (in, out): check q/k/v/out against that formula in float64."""
    module = gpt2("gpt2-21x3", "eager").transformer.h[0].attn
    d, d_h = 21, 7
    with torch.no_grad():  # a non-symmetric, recognisable W: transposing it would give different numbers
        module.c_attn.weight.copy_(torch.arange(d * 3 * d, dtype=torch.float32).reshape(d, 3 * d) / 1000 - 0.5)
        module.c_attn.bias.copy_(torch.linspace(-1, 1, 3 * d))
    attn = from_hf(module)
    x = torch.randn(2, 5, d, dtype=torch.float64)
    w, b = module.c_attn.weight.double(), module.c_attn.bias.double()
    expected = torch.einsum("bsi,io->bso", x, w) + b  # (b, s, 3d): HF's c_attn output, by hand
    got = torch.cat([attn.q_proj.double()(x), attn.k_proj.double()(x), attn.v_proj.double()(x)], dim=-1)
    torch.testing.assert_close(got, expected)
    z = torch.randn(2, 5, d, dtype=torch.float64)
    expected_out = torch.einsum("bsi,io->bso", z, module.c_proj.weight.double()) + module.c_proj.bias.double()
    torch.testing.assert_close(attn.out_proj.double()(z), expected_out)
    assert torch.equal(attn.double().head(2).w_v, w[:, 2 * d + 2 * d_h:2 * d + 3 * d_h])


# -- errors ------------------------------------------------------------------------------------------------
def test_unsupported_modules_raise_clear_errors():
    with pytest.raises(TypeError, match=r"^from_hf: Linear is not a supported attention module: headwise converts "
                                        r"modules that call transformers' attention interface"):
        from_hf(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"W_O is not located: .*; pass the module that holds W_O \(its parent, "
                                         r"e.g. BertAttention for BertSelfAttention\)$"):
        from_hf(bert("bert-20x4", "eager").encoder.layer[0].attention.self)
    cross = transformers.GPT2Model(transformers.GPT2Config(n_embd=12, n_head=3, n_layer=1, add_cross_attention=True))
    with pytest.raises(ValueError, match=r"GPT2Attention cannot be converted: it is cross-attention: its keys and "
                                         r"values read the encoder's hidden states, not its input"):
        from_hf(cross.h[0].crossattention)  # Q in q_attn, K | V in c_attn: a copy would attend over its own input
    with pytest.raises(TypeError, match="Sequential contains no attention module"):
        patch(nn.Sequential(nn.Linear(4, 4)))
    for fn in (patch, unpatch, layers):  # not a module at all: named, not an AttributeError from inside
        with pytest.raises(TypeError, match=rf"^{fn.__name__}: model must be a torch.nn.Module, got NoneType$"):
            fn(None)
    model = llama("llama-gqa", "eager")  # a patched module converts as it is: patching changed nothing of it
    assert torch.equal(from_hf(patch(model).model.layers[0].self_attn).q_proj.weight,
                       model.model.layers[0].self_attn.q_proj.weight)
    with pytest.raises(TypeError, match="is itself an attention module"):
        patch(llama("llama-gqa", "eager").model.layers[0].self_attn)
    with pytest.raises(TypeError, match="must be a MultiHeadAttention"):
        to_hf(nn.Linear(4, 4), like=llama("llama-gqa", "eager").model.layers[0].self_attn)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_cross_attention_layers_are_patched_and_the_decoder_still_matches(family, impl):
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=12, n_head=3, n_layer=2, add_cross_attention=True,
                                      attn_implementation=impl)
        model = transformers.GPT2LMHeadModel(cfg).eval()
        names = [f"transformer.h.{i}.{part}" for i in range(2) for part in ("attn", "crossattention")]
        cross = lambda: model.transformer.h[0].crossattention  # noqa: E731
    else:
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=12, num_attention_heads=3, num_hidden_layers=2,
                                      intermediate_size=16, is_decoder=True, add_cross_attention=True,
                                      attn_implementation=impl)
        model = transformers.BertLMHeadModel(cfg).eval()
        names = [f"bert.encoder.layer.{i}.{part}.self" for i in range(2) for part in ("attention", "crossattention")]
        cross = lambda: model.bert.encoder.layer[0].crossattention.self  # noqa: E731
    ids, mask = batch(10, "right")
    enc = torch.randn(3, 5, 12)

    @torch.no_grad()
    def two_steps():  # prefill + one cached step (an EncoderDecoderCache: self-attention part is ours)
        out = model(input_ids=ids[:, :6], attention_mask=mask[:, :6], encoder_hidden_states=enc, use_cache=True)
        nxt = model(input_ids=ids[:, 6:], attention_mask=mask, encoder_hidden_states=enc, cache=out.cache,
                    use_cache=True)
        return out.logits, nxt.logits

    want = two_steps()
    patch(model)
    assert [n for n, _ in layers(model)] == names
    assert cross().attn.host is cross() and type(cross()).__name__ in ("GPT2Attention", "BertCrossAttention")
    assert model.config._attn_implementation == "headwise"
    for g, w in zip(two_steps(), want):
        torch.testing.assert_close(g, w)
    unpatch(model)
    assert model.config._attn_implementation == impl and layers(model) == []


def test_unsupported_layouts_raise_clear_errors():
    module = llama("llama-gqa", "eager").model.layers[0].self_attn
    module.k_proj = nn.Linear(24, 8, bias=True)  # bias on K only
    with pytest.raises(ValueError, match="some of q_proj, k_proj, v_proj have a bias and some do not"):
        from_hf(module)
    module.k_proj = nn.Linear(24, 12, bias=False)  # wrong width for num_key_value_heads=2, head_dim=4
    with pytest.raises(ValueError, match=r"the projections have \{'q_proj': 24, 'k_proj': 12, 'v_proj': 8\} outputs"):
        from_hf(module)
    g = gpt2("gpt2-21x3", "eager").transformer.h[0].attn
    g.c_attn.weight = nn.Parameter(g.c_attn.weight.T.contiguous())  # nn.Linear order: the classic mistake
    with pytest.raises(ValueError, match=r"c_attn is not a projection with \(h \+ 2 h_kv\) d_h = 63 outputs \(got 21\)"):
        from_hf(g)
    like = llama("llama-gqa", "eager").model.layers[0].self_attn
    with pytest.raises(ValueError, match="n_kv_heads: module 2 vs attn 6"):
        to_hf(MultiHeadAttention(24, 6, bias=False), like=like)


def test_unsupported_attention_implementation_raises():
    model = llama("llama-gqa", "eager")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='flex_attention' is not supported"):
        patch(model)


def test_a_rotary_emb_whose_inv_freq_is_not_a_tensor_is_refused_naming_it():
    import types

    import numpy as np

    model = llama("llama-gqa", "sdpa")
    rot = types.SimpleNamespace(inv_freq=np.ones(2), attention_scaling=1.0)
    with pytest.raises(TypeError, match=r"^rotary_emb must be the model's rotary module, whose inv_freq is a "
                                        r"torch.Tensor; got SimpleNamespace with inv_freq numpy.ndarray$"):
        from_hf(model.model.layers[0].self_attn, rotary_emb=rot)


@pytest.mark.parametrize("impl", IMPLS)
def test_gpt2_cross_attention_heads_take_q_from_q_attn_and_k_v_from_c_attn(impl):
    # 4 heads of 8: c_attn's K | V (64 columns) would also read as Q | K | V with 2 K/V heads of 8.
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=2, add_cross_attention=True,
                                  attn_implementation=impl)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    plain = copy.deepcopy(model)
    ids, enc = torch.randint(3, VOCAB, (2, 5)), torch.randn(2, 4, 32)
    with torch.no_grad():
        want = plain(input_ids=ids, encoder_hidden_states=enc).logits
    patch(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, encoder_hidden_states=enc).logits, want)
    cross = model.transformer.h[0].crossattention
    attn = cross.attn
    assert (attn.n_heads, attn.config.n_kv_heads, attn.d_head) == (4, 4, 8)
    for i in range(4):
        head, cols = attn.head(i), slice(8 * i, 8 * i + 8)
        torch.testing.assert_close(head.w_q, cross.q_attn.weight[:, cols])  # Conv1D: (in, out)
        torch.testing.assert_close(head.w_k, cross.c_attn.weight[:, cols])
        torch.testing.assert_close(head.w_v, cross.c_attn.weight[:, 32:][:, cols])
        torch.testing.assert_close(head.b_q, cross.q_attn.bias[cols])
    with pytest.raises(ValueError, match="cross-attention: its keys and values read the encoder's hidden states"):
        from_hf(cross)

    # Removing head 1 equals zeroing its context before c_proj in the unpatched model (a plain PyTorch hook).
    def zero_head_1(module, args):
        x = args[0].clone()
        x[..., 8:16] = 0
        return (x,)

    plain.transformer.h[0].crossattention.c_proj.register_forward_pre_hook(zero_head_1)
    headwise.surgery.prune_heads(model, {"transformer.h.0.crossattention": [1]})
    assert model.transformer.h[0].crossattention.attn.n_heads == 3
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, encoder_hidden_states=enc).logits,
                                   plain(input_ids=ids, encoder_hidden_states=enc).logits)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_attentions_in_training_with_dropout_are_eagers_weights_after_dropout(family):
    """transformers' eager attention returns the weights after dropout, the ones its context is made of; under
    the same seed the patched model draws the same dropout and returns the same weights."""
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.3)
        build = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_head=4, n_layer=1, attn_pdrop=0.3,
                                      resid_pdrop=0.0, embd_pdrop=0.0)
        build = transformers.GPT2LMHeadModel
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    plain = build(cfg).train()
    model = patch(copy.deepcopy(plain))
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    want = plain(input_ids=ids, output_attentions=True)
    torch.manual_seed(5)
    got = model(input_ids=ids, output_attentions=True)
    torch.testing.assert_close(got.logits, want.logits)
    assert (want.attentions[0] == 0).any()  # dropout ran: some weights were dropped
    torch.testing.assert_close(got.attentions[0], want.attentions[0])
