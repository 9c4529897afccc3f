"""direct_effects on models whose attention output is normalised before the residual add (Gemma2, Gemma3, OLMo2),
on layers of different head counts (pruned) and on a layer run several times per forward: against float64
formulas from plain hooks on the *unpatched* model."""

from __future__ import annotations

import copy

import pytest
import torch

import headwise
from headwise import MultiHeadAttention
from headwise.patching import attribution, direct_effects, final_norm, head_effects, logit_direction

transformers = pytest.importorskip("transformers")

from headwise.interop import patch, unpatch  # noqa: E402
from tests import hf_reference as ref  # noqa: E402

V = 40


def _gemma2():
    cfg = transformers.Gemma2Config(vocab_size=V, hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                                    max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                    attn_implementation="eager")
    return transformers.Gemma2ForCausalLM(cfg), lambda w: 1 + w  # GemmaRMSNorm: x / rms(x) * (1 + weight)


def _gemma3():
    cfg = transformers.Gemma3TextConfig(vocab_size=V, hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                                        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Gemma3ForCausalLM(cfg), lambda w: 1 + w


def _olmo2():
    cfg = transformers.Olmo2Config(vocab_size=V, hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Olmo2ForCausalLM(cfg), lambda w: w  # Olmo2RMSNorm: weight * x / rms(x)


def _over_rms(x, norm):
    """1 / rms of each row of x (b, d) as ``norm`` computes it (its eps), in float64: (b, 1)."""
    eps = norm.eps if hasattr(norm, "eps") else norm.variance_epsilon
    return (x.pow(2).mean(-1) + eps).rsqrt()[:, None]


@pytest.mark.parametrize("build", [_gemma2, _gemma3, _olmo2], ids=["gemma2", "gemma3", "olmo2"])
def test_heads_pass_through_the_post_attention_norm_and_add_up_to_what_the_layer_adds(build):
    torch.manual_seed(0)
    model, gain = build()
    model = model.double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # trained gains, far from the init's 1: gain(weight) ~ N(1, 0.5^2)
                p.copy_(0.5 * torch.randn_like(p) + 1 - gain(torch.zeros_like(p)))
    plain = ref.twin(model)
    patch(model)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0  # right padding: each row is read at its last real token
    kw = {"input_ids": torch.randint(3, V, (2, 6), generator=g), "attention_mask": mask}
    direction = logit_direction(model, 7, 11)
    pos, rows = torch.tensor([5, 3]), torch.arange(2)
    got = direct_effects(model, kw, direction, norm=final_norm(model), position=pos)
    # the reference: hooks on the unpatched model's W_O input, post-attention norm and final norm; float64 formulas
    zs, post, final_in = {}, {}, []

    def keep(li):
        def hook(module, args, out):
            post[li] = args[0], out  # the norm's input (W_O's output) and what the layer adds to the stream
        return hook

    hooks = []
    for li, layer in enumerate(plain.model.layers):
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, li=li: zs.__setitem__(li, a[0])))
        hooks.append(layer.post_attention_layernorm.register_forward_hook(keep(li)))
    hooks.append(plain.model.norm.register_forward_pre_hook(lambda m, a: final_in.append(a[0])))
    with torch.no_grad():
        plain(**kw)
    for hook in hooks:
        hook.remove()
    x = final_in[-1][rows, pos].double()

    def final(r):  # the final norm, its scale frozen at x
        return r * _over_rms(x, plain.model.norm) * gain(plain.model.norm.weight.double())

    want = torch.empty(2, 2, 4, dtype=torch.float64)
    for li, layer in enumerate(plain.model.layers):
        norm = layer.post_attention_layernorm
        a, added = (t[rows, pos].double() for t in post[li])
        w = layer.self_attn.o_proj.weight.double()
        for i in range(4):
            r = zs[li][rows, pos, i * 6:(i + 1) * 6].double() @ w[:, i * 6:(i + 1) * 6].T  # (b, d): z_h W_O^h
            want[:, li, i] = final(r * _over_rms(a, norm) * gain(norm.weight.double())) @ direction.double()
        # o_proj has no bias here: the heads' parts add up to the norm's output, what the layer adds to the stream
        torch.testing.assert_close(got[:, li].sum(-1), final(added) @ direction.double(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got, want)
    assert want.abs().max() > 1e-3


def _gpt2_3():
    cfg = transformers.GPT2Config(vocab_size=V, n_layer=3, n_positions=64, n_embd=24, n_head=4, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def test_layers_of_fewer_heads_are_padded_with_nan():
    from headwise.surgery import prune_heads

    model = patch(_gpt2_3())
    model = prune_heads(model, {0: [1], 1: [0, 3]}) or model
    heads = [layer.n_heads for _, layer in headwise.interop.layers(model)]
    assert heads == [3, 2, 4]
    plain = unpatch(copy.deepcopy(model))
    kw = ref.inputs(model, pad=False)
    direction = logit_direction(model, 7, 11)
    got = direct_effects(model, kw, direction, norm=final_norm(model))
    # the reference: each pruned layer's W_O input from hooks on the unpatched copy, through ln_f frozen, float64
    zs, final_in, hooks = {}, [], []
    for li, block in enumerate(plain.transformer.h):
        hooks.append(block.attn.c_proj.register_forward_pre_hook(lambda m, a, li=li: zs.__setitem__(li, a[0])))
    hooks.append(plain.transformer.ln_f.register_forward_pre_hook(lambda m, a: final_in.append(a[0])))
    with torch.no_grad():
        plain(**kw)
    for hook in hooks:
        hook.remove()
    x = final_in[-1][:, -1]
    ln = plain.transformer.ln_f
    want = torch.full((2, 3, 4), float("nan"), dtype=torch.float64)
    for li, block in enumerate(plain.transformer.h):
        w = block.attn.c_proj.weight.T  # Conv1D stores (in, out)
        for i in range(heads[li]):
            r = zs[li][:, -1, i * 6:(i + 1) * 6] @ w[:, i * 6:(i + 1) * 6].T  # (b, d)
            r = (r - r.mean(-1, keepdim=True)) / (x.var(-1, unbiased=False) + ln.eps).sqrt()[:, None]
            want[:, li, i] = (r * ln.weight) @ direction
    torch.testing.assert_close(got, want, equal_nan=True)


def test_a_layer_run_several_times_per_forward_is_refused():
    torch.manual_seed(0)
    attn = MultiHeadAttention(8, 2).eval()
    stack = torch.nn.Sequential(attn, attn, attn).eval()  # one layer, three calls per forward
    x1, x2 = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    for run in (lambda: direct_effects(stack, x2, torch.eye(8)[0]),
                lambda: direct_effects(stack, x2, torch.eye(8)[0], position=9),
                lambda: head_effects(stack, x1, x2, lambda y: y[0, -1, 0]),
                lambda: attribution(stack, x1, x2, lambda y: y[0, -1, 0])):
        with pytest.raises(ValueError, match=r"layer 0 \('0'\) ran 3 times in one forward"):
            run()
    assert attn.tracer is None


def test_albert_s_shared_layer_is_refused_by_name():
    cfg = transformers.AlbertConfig(vocab_size=V, embedding_size=16, hidden_size=24, num_attention_heads=4,
                                    num_hidden_layers=3, intermediate_size=32, max_position_embeddings=64,
                                    pad_token_id=0)
    torch.manual_seed(0)
    model = patch(transformers.AlbertModel(cfg).eval())
    g = torch.Generator().manual_seed(0)
    clean, corrupted = ({"input_ids": torch.randint(3, V, (2, 5), generator=g)} for _ in range(2))
    metric = lambda out: out.last_hidden_state[:, 0, :3].sum()  # noqa: E731
    name = r"'encoder\.albert_layer_groups\.0\.albert_layers\.0\.attention'\) ran 3 times"
    with pytest.raises(ValueError, match=name):
        head_effects(model, clean, corrupted, metric)
    with pytest.raises(ValueError, match=name):
        attribution(model, clean, corrupted, metric)
    with pytest.raises(ValueError, match=name):
        direct_effects(model, corrupted, torch.randn(24))
