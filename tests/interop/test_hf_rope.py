"""The model's rotary as headwise's (``from_hf``'s copy, a patched layer alone) against the unpatched module handed
transformers' own rotary ``(cos, sin)``: dynamic-NTK and longrope hold their initial frequencies, exact up to the
position where transformers switches them and refused from there; a ``rotary_emb`` of another width is refused."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from headwise import DecodeStep  # noqa: E402
from headwise.interop import from_hf, layers, patch  # noqa: E402

# rope_type -> (rope_parameters, the first position transformers computes with other frequencies)
ROPES = {
    "dynamic": ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}, 16),  # max_position_embeddings
    "longrope": ({"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 3.0],
                  "long_factor": [2.0, 4.0, 8.0, 16.0], "original_max_position_embeddings": 4, "factor": 4.0}, 4),
}


def llama(rope: dict, head_dim: int = 8) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                   max_position_embeddings=16, rope_parameters=copy.deepcopy(rope),
                                   attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper patterns, as trained weights have: a wrong rotation shows
        for p in (model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj):
            p.weight.mul_(20)
    return model


def unpatched(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module as its model calls it, on transformers' own (cos, sin) at positions 0 .. s - 1."""
    positions = torch.arange(x.shape[1])[None]
    rope = copy.deepcopy(model.model.rotary_emb)  # a fresh one: dynamic NTK keeps state between calls
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return model.model.layers[0].self_attn(x, position_embeddings=rope(x, positions), attention_mask=mask)[0]


@pytest.mark.parametrize("rope_type", sorted(ROPES))
def test_switching_frequencies_are_exact_below_the_switch_and_refused_from_it(rope_type):
    params, limit = ROPES[rope_type]
    model = llama(params)
    module = model.model.layers[0].self_attn
    copies = {"from_hf(rotary_emb=)": from_hf(module, rotary_emb=model.model.rotary_emb), "from_hf()": from_hf(module)}
    torch.manual_seed(1)
    short, long = torch.randn(1, limit, 32), torch.randn(1, limit + 3, 32)
    want = unpatched(model, short)
    assert (unpatched(model, long)[:, :limit] - unpatched(model, long[:, :limit])).abs().max() > 1e-3  # it switches
    patched = patch(copy.deepcopy(model))  # kept: a view does not keep its model alive
    copies["patched attn"] = layers(patched)[0][1]
    for name, attn in copies.items():
        assert (attn.rotary.rope_type, attn.rotary.max_positions) == (rope_type, limit), name
        with torch.no_grad():
            torch.testing.assert_close(attn(short, causal=True), want, msg=name)
            for call in (lambda: attn(long, causal=True), lambda: attn.head(0)(long, causal=True),
                         lambda: attn(short, causal=True, positions=torch.arange(1, limit + 1))):
                with pytest.raises(ValueError, match=rf"positions reach \d+, but this {rope_type} rotary's "
                                                     rf"frequencies hold only for positions < {limit}"):
                    call()


def test_decoding_into_the_switch_is_refused_and_leaves_the_cache_as_it_was():
    params, limit = ROPES["longrope"]
    model = llama(params)
    attn = from_hf(model.model.layers[0].self_attn, rotary_emb=model.model.rotary_emb)
    x = torch.randn(1, limit + 1, 32)
    cache = attn.new_cache(batch_size=1, max_len=limit + 1)
    with torch.no_grad():
        torch.testing.assert_close(attn(x[:, :limit], cache=cache), unpatched(model, x[:, :limit]))
        with pytest.raises(ValueError, match=f"longrope rotary's frequencies hold only for positions < {limit}"):
            DecodeStep(attn, cache)(x[:, limit:])
    assert cache.length == limit


@pytest.mark.parametrize("rope_type", sorted(ROPES))
def test_the_patched_models_own_forward_switches_as_transformers_does(rope_type):
    params, limit = ROPES[rope_type]
    model = llama(params)
    ids = torch.randint(0, 32, (1, limit + 5))
    with torch.no_grad():
        want = copy.deepcopy(model)(ids).logits
        torch.testing.assert_close(patch(model)(ids).logits, want)


def test_a_rotary_emb_of_another_width_is_refused_naming_both():
    model, narrow = llama(ROPES["dynamic"][0]), llama(ROPES["dynamic"][0], head_dim=4)
    with pytest.raises(ValueError, match=r"rotary_emb rotates 4 features per head \(2 \* inv_freq.numel\(\)\), the "
                                         r"config gives a rotary width of 8 \(head width 8\)"):
        from_hf(model.model.layers[0].self_attn, rotary_emb=narrow.model.rotary_emb)
    attn = from_hf(model.model.layers[0].self_attn, rotary_emb=model.model.rotary_emb)  # its own: accepted
    assert attn.rotary.rotary_dim == 8


def _pre_rotation_queries(family: str):
    """A tiny model, and a hook on its unpatched twin's query projection giving the queries before any rotation
    (b, h, s, d_h): OLMo (no registry entry), Phi-3 (a fused qkv_proj; an entry without rotary), GPT-2 (none)."""
    torch.manual_seed(0)
    if family == "olmo":
        cfg = transformers.OlmoConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, max_position_embeddings=16)
        model = transformers.OlmoForCausalLM(cfg)
        proj, width = lambda m: m.model.layers[0].self_attn.q_proj, 16
    elif family == "phi3":
        cfg = transformers.Phi3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                                      pad_token_id=0)
        model = transformers.Phi3ForCausalLM(cfg)
        proj, width = lambda m: m.model.layers[0].self_attn.qkv_proj, 16
    else:
        cfg = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=4, n_positions=16)
        model = transformers.GPT2LMHeadModel(cfg)
        proj, width = lambda m: m.transformer.h[0].attn.c_attn, 16
    return model.eval(), proj, width


@pytest.mark.parametrize("family,rotates", [("olmo", True), ("phi3", True), ("gpt2", False)])
def test_a_layer_says_whether_the_q_and_k_its_module_hands_over_are_rotated(family, rotates):
    import headwise

    model, proj, width = _pre_rotation_queries(family)
    plain = copy.deepcopy(model)
    seen = []
    proj(plain).register_forward_hook(lambda m, a, out: seen.append(out[..., :width]))
    ids = torch.tensor([[3, 7, 1, 9, 4, 2]])
    with torch.no_grad():
        plain(ids)
        patch(model)
        with headwise.trace(model, capture=("q",)) as t:
            model(ids)
    before = seen[0].view(1, 6, 4, 4).transpose(1, 2)  # (b, h, s, d_h): the projection's queries, unrotated
    assert layers(model)[0][1].rotated is rotates
    if rotates:  # position 0 is rotated by angle 0; every later one is not what the projection gave
        torch.testing.assert_close(t[0].q[:, :, :1], before[:, :, :1])
        assert not torch.allclose(t[0].q[:, :, 1:], before[:, :, 1:])
    else:
        torch.testing.assert_close(t[0].q, before)
    assert set(t.as_dict()) == {"blocks.0.attn.hook_rot_q" if rotates else "blocks.0.attn.hook_q"}
