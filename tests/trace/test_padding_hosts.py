"""Where a trace reads a call's padding: a 4-D ``attention_mask`` given to the traced model is read at the call
eagerly, and in compiled code kept (a copy) and read only when a mean needs it (so a call compiled with
``fullgraph=True`` that takes none compiles); a patched layer's host
module shows the mask reaching it under its family's name (T5's ``mask``), so T5's encoder "mean" works inside
``generate``, which calls the encoder past the model's own call. References: an eager run, float64 means
over the real tokens, and plain forward hooks on the unpatched model."""

from __future__ import annotations

import copy

import pytest
import torch

import headwise

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from headwise.tracing import padding as padding_module  # noqa: E402
from tests import hf_reference as ref  # noqa: E402


def _real_mean64(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Each row's mean over its real positions, in float64. Shapes: (b, s, n), (b, s) bool -> (b, 1, n)."""
    w = real.double()[..., None]  # (b, s, 1)
    return (x.double() * w).sum(1, keepdim=True) / w.sum(1, keepdim=True)


def _causal_4d(real: torch.Tensor) -> torch.Tensor:
    """The (b, 1, s, s) bool mask transformers builds for a causal model from a (b, s) real-token mask: padded
    query rows read nothing. Shapes: (b, s) bool -> (b, 1, s, s)."""
    s = real.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return (causal & real[:, None, :] & real[:, :, None])[:, None]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_model_compiled_whole_with_fullgraph_takes_a_4d_mask_inside_a_capture_trace():
    model = ref.llama("sdpa")
    patch(model)
    ids = torch.randint(3, ref.VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    real = torch.ones(2, 6, dtype=torch.bool)
    real[1, :2] = False  # left padding
    mask = _causal_4d(real)
    runs = ref.traced_twice(model, ids, mask)
    assert runs[True][0][0].calls  # the compiled calls were traced
    for layer in range(2):
        torch.testing.assert_close(runs[True][0][layer].z, runs[False][0][layer].z)
        # the mask kept by the compiled calls is read when the record's mean asks: the float64 mean of the
        # captured z over every real token of both calls
        z = runs[True][0][layer].calls[0]["z"].double()  # (b, s, h, d_h)
        torch.testing.assert_close(runs[True][0][layer].mean("z").double(), z[real].mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs[True][1], runs[False][1])
    torch._dynamo.reset()


def test_a_mean_over_a_4d_mask_averages_over_the_real_tokens_eagerly_and_compiled():
    model = ref.llama("sdpa")
    plain = ref.twin(model)
    patch(model)
    ids = torch.randint(3, ref.VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    real = torch.ones(2, 6, dtype=torch.bool)
    real[1, :2] = False
    head, d_h = 2, 4

    def mean_over_real(module, args):  # W_O's input: head 2's slice, each row's float64 mean over its real tokens
        x = args[0].clone()
        cols = slice(head * d_h, (head + 1) * d_h)
        x[..., cols] = _real_mean64(x[..., cols], real).to(x.dtype).expand_as(x[..., cols])
        return (x,)

    handle = plain.model.layers[1].self_attn.o_proj.register_forward_pre_hook(mean_over_real)
    try:
        with torch.no_grad():
            want = plain(ids, attention_mask=real.long()).logits
    finally:
        handle.remove()
    runs = {"eager": model, "compiled": torch.compile(model, backend="eager")}  # graph breaks: the mask is data
    for name, run in runs.items():
        torch._dynamo.reset()
        with torch.no_grad(), headwise.trace(model, edit={(1, head): "mean"}):
            got = run(ids, attention_mask=_causal_4d(real)).logits
        torch.testing.assert_close(got[real], want[real], msg=name)
    torch._dynamo.reset()


def _t5():
    cfg = transformers.T5Config(vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    plain = transformers.T5ForConditionalGeneration(cfg).eval()
    return plain, patch(copy.deepcopy(plain))


T5_IDS = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(1))
T5_MASK = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])  # the encoder pads row 1
T5_GEN = dict(input_ids=T5_IDS, attention_mask=T5_MASK, max_new_tokens=4, min_new_tokens=4, do_sample=False,
              output_scores=True, return_dict_in_generate=True)


@pytest.mark.parametrize("site", ["z", "v"])
def test_t5_encoder_mean_inside_generate_averages_over_the_encoders_real_tokens(site):
    plain, model = _t5()
    layer, head, d_kv = 1, 2, 8
    cols = slice(head * d_kv, (head + 1) * d_kv)
    real = T5_MASK.bool()

    def mean_over_real(x):  # (b, s, h * d_kv): the head's slice, each row's float64 mean over its real tokens
        x = x.clone()
        x[..., cols] = _real_mean64(x[..., cols], real).to(x.dtype).expand_as(x[..., cols])
        return x

    attn = plain.encoder.block[layer].layer[0].SelfAttention
    if site == "z":  # W_O's input is the heads' contexts
        handle = attn.o.register_forward_pre_hook(lambda m, args: (mean_over_real(args[0]),))
    else:  # the values' projection gives every head's values
        handle = attn.v.register_forward_hook(lambda m, args, out: mean_over_real(out))
    try:
        with torch.no_grad():
            want = plain.generate(**T5_GEN)
    finally:
        handle.remove()
    with torch.no_grad():
        unedited = plain.generate(**T5_GEN)
    name = f"encoder.block.{layer}.layer.0.SelfAttention"
    with torch.no_grad(), headwise.trace(model, edit={(name, head, site): "mean"}, capture={name: (site,)}) as t:
        got = model.generate(**T5_GEN)
    assert torch.equal(got.sequences, want.sequences)
    for g, w, u in zip(got.scores, want.scores, unedited.scores):
        torch.testing.assert_close(g, w)
    assert not all(torch.allclose(w, u) for w, u in zip(want.scores, unedited.scores))  # the edit matters
    assert len(t[name].calls) == 1  # generate runs the encoder once


def test_a_host_showing_no_mask_refuses_mean_naming_the_masks_a_layer_is_read_from(monkeypatch):
    _, model = _t5()
    monkeypatch.setattr(padding_module, "MASK_NAMES", ("attention_mask",))  # as if T5's `mask` were unknown
    with torch.no_grad(), headwise.trace(model, edit={("encoder.block.0.layer.0.SelfAttention", 1): "mean"}):
        with pytest.raises(ValueError, match=r"T5Attention\.forward takes none of \['attention_mask'\]"):
            model.generate(**T5_GEN)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled fullgraph"])
def test_a_mean_reads_the_mask_as_it_was_at_the_call_when_the_caller_refills_it(compiled):
    # Compiled code with CUDA graphs keeps static input buffers that the caller refills before every call.
    model = ref.llama("sdpa")
    patch(model)
    ids = torch.randint(3, ref.VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    real = torch.ones(2, 6, dtype=torch.bool)
    real[1, :2] = False
    mask = _causal_4d(real)
    torch._dynamo.reset()
    run = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:
        run(ids, attention_mask=mask)
    mask.fill_(True)  # the buffer now says every position is real
    z = t[0].calls[0]["z"]  # (b, s, h, d_h)
    total = (z.double() * real.double()[..., None, None]).sum((0, 1))  # (h, d_h) over the real tokens
    want = (total / real.sum()).to(z.dtype)
    torch.testing.assert_close(t[0].mean("z"), want)


def test_a_layer_added_inside_a_trace_is_refused_before_it_runs_untraced():
    model = torch.nn.Sequential(headwise.MultiHeadAttention(8, 2))
    x = torch.randn(1, 3, 8)
    with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:
        model(x)
        model.append(headwise.MultiHeadAttention(8, 2))
        with pytest.raises(RuntimeError, match="replaced or added inside the trace"):
            model(x)
    assert len(t[0].calls) == 1


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_trace_of_one_patched_layer_means_over_the_real_tokens_that_reach_its_module(compiled):
    plain = ref.llama("sdpa")
    model = patch(ref.twin(plain))
    ids = torch.randint(3, ref.VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    real, head = mask.bool(), 1
    want, zs, _ = ref.hooked_run(plain, dict(input_ids=ids, attention_mask=mask), 6,
                                 edit={(0, head): lambda z: _real_mean64(z, real).to(z.dtype).expand_as(z)})
    view = headwise.interop.layers(model)[0][1]  # the layer alone takes no attention_mask: its module's does
    torch._dynamo.reset()
    run = torch.compile(model, backend="eager") if compiled else model
    with torch.no_grad(), headwise.trace(view, capture=("z",), edit={(0, head): "mean"}) as t:
        got = run(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want.logits)
    torch.testing.assert_close(t[0].z, zs[0])
    # the record keeps the real tokens too: its mean skips the padding
    z = t[0].z.double()
    want_mean = (z * real.double()[..., None, None]).sum((0, 1)) / real.sum()  # (h, d_h)
    torch.testing.assert_close(t[0].mean("z"), want_mean.float())
    torch._dynamo.reset()


def _decoders():
    """Per model: (unpatched, patched, inputs, the real tokens of the traced layer's queries, the layer's name,
    the unpatched W_O module of that layer, d_h), for decoders whose self-attention module says is_decoder."""
    torch.manual_seed(0)
    ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    biogpt = transformers.BioGptForCausalLM(transformers.BioGptConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=16,
        max_position_embeddings=32, pad_token_id=0)).eval()
    bert = transformers.BertLMHeadModel(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=16,
        is_decoder=True, pad_token_id=0)).eval()
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=32,
        pad_token_id=0)).eval()
    t5, _ = _t5()
    dec = dict(input_ids=T5_IDS, attention_mask=T5_MASK, decoder_input_ids=ids, decoder_attention_mask=mask)
    return {
        "biogpt": (biogpt, dict(input_ids=ids, attention_mask=mask), "biogpt.layers.0.self_attn",
                   lambda m: m.biogpt.layers[0].self_attn.out_proj, 4),
        "bert is_decoder": (bert, dict(input_ids=ids, attention_mask=mask), "bert.encoder.layer.0.attention.self",
                            lambda m: m.bert.encoder.layer[0].attention.output.dense, 4),
        "bart decoder": (bart, dec, "model.decoder.layers.0.self_attn",
                         lambda m: m.model.decoder.layers[0].self_attn.out_proj, 4),
        "t5 decoder": (t5, dec, "decoder.block.0.layer.0.SelfAttention",
                       lambda m: m.decoder.block[0].layer[0].SelfAttention.o, 8),
    }


@pytest.mark.parametrize("case", ["biogpt", "bert is_decoder", "bart decoder", "t5 decoder"])
def test_a_trace_of_one_decoder_self_attention_means_over_its_own_real_tokens(case):
    plain, kw, name, w_o, d_h = _decoders()[case]
    model = patch(copy.deepcopy(plain))
    real = kw.get("decoder_attention_mask", kw["attention_mask"]).bool()  # the queries' sequence
    head = 1
    cols = slice(head * d_h, (head + 1) * d_h)

    def mean_over_real(module, args):  # W_O's input: the head's slice, each row's float64 mean over real tokens
        x = args[0].clone()
        x[..., cols] = _real_mean64(x[..., cols], real).to(x.dtype).expand_as(x[..., cols])
        return (x,)

    handle = w_o(plain).register_forward_pre_hook(mean_over_real)
    try:
        with torch.no_grad():
            want = plain(**kw).logits
    finally:
        handle.remove()
    with torch.no_grad():
        unedited = plain(**kw).logits
    view = dict(headwise.interop.layers(model))[name]  # the layer alone takes no attention_mask
    with torch.no_grad(), headwise.trace(view, edit={(0, head): "mean"}):
        got = model(**kw).logits
    torch.testing.assert_close(got, want)
    assert not torch.allclose(want, unedited)  # the edit matters


@pytest.mark.parametrize("case,name", [("bart decoder", "model.decoder.layers.0.encoder_attn"),
                                       ("t5 decoder", "decoder.block.0.layer.1.EncDecAttention")])
def test_a_trace_of_one_cross_attention_layer_refuses_mean_as_its_mask_is_the_encoders(case, name):
    plain, kw, *_ = _decoders()[case]
    model = patch(plain)
    view = dict(headwise.interop.layers(model))[name]
    with torch.no_grad(), headwise.trace(view, capture=("z",), edit={(0, 1): "mean"}) as t:
        with pytest.raises(ValueError, match=r"takes no attention_mask, and layer 0's module \w+ was called as "
                                             r"cross-attention, whose mask is the other sequence's"):
            model(**kw)
    assert not t[0].calls  # the refused call left nothing behind
