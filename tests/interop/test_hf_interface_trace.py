"""trace on families patched through the attention interface, against plain PyTorch hooks on the unpatched model:
z is the input of the module's output projection, pattern is transformers' own eager attention weights, and a
zero edit of a head equals zeroing that head's slice of the output projection's input.

Families: Gemma 2 (logit softcapping, sliding window), Phi-3 (fused qkv_proj), GPT-NeoX (head-interleaved
query_key_value, partial rotary), OPT (learned positions, biases), Mixtral (GQA, experts), DeepSeek-V3 (latent
attention, d_qk 8 and d_v 6).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
from headwise.interop import layers, patch  # noqa: E402

from tests.interop.hf_sweep import OVERRIDES, SMALL  # noqa: E402

# family -> (path of the decoder layers, attention attribute, W_O attribute)
FAMILIES = {
    "gemma2": ("model.layers", "self_attn", "o_proj"),
    "phi3": ("model.layers", "self_attn", "o_proj"),
    "gpt_neox": ("gpt_neox.layers", "attention", "dense"),
    "opt": ("model.decoder.layers", "self_attn", "out_proj"),
    "mixtral": ("model.layers", "self_attn", "o_proj"),
    "deepseek_v3": ("model.layers", "self_attn", "o_proj"),
}
KV = {"gpt_neox": 4, "opt": 4, "deepseek_v3": 4}  # families without grouped K/V
IDS = torch.tensor([[1, 5, 7, 3, 9, 11], [2, 4, 6, 8, 10, 12]])


def build(family: str, impl: str) -> torch.nn.Module:
    kw = {**SMALL, **OVERRIDES.get(family, {}), "num_key_value_heads": KV.get(family, 2)}
    if family == "gemma2":
        kw.update(sliding_window=3, attn_logit_softcapping=2.0)  # small enough that both change the output
    cfg = transformers.AutoConfig.for_model(family, **kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def w_o_modules(model: torch.nn.Module, family: str) -> list[torch.nn.Module]:
    path, attn, o = FAMILIES[family]
    return [getattr(getattr(layer, attn), o) for layer in model.get_submodule(path)]


@torch.no_grad()
def hooked(model: torch.nn.Module, family: str, zero: tuple[int, int, int] | None = None, weights: bool = False):
    """(logits, z per layer (b, s, h, d_v), eager weights per layer) of the unpatched model; ``zero`` =
    (layer, head, d_v) zeroes that head's slice of W_O's input."""
    zs, handles = [], []
    for li, o in enumerate(w_o_modules(model, family)):
        def pre(m, args, li=li):  # type: ignore[no-untyped-def]
            x = args[0]
            if zero is not None and zero[0] == li:
                x = x.clone()
                x[..., zero[1] * zero[2]:(zero[1] + 1) * zero[2]] = 0
            zs.append(x)
            return (x,)
        handles.append(o.register_forward_pre_hook(pre))
    try:
        out = model(IDS, output_attentions=weights)
    finally:
        for h in handles:
            h.remove()
    return out.logits, zs, out.attentions


@pytest.mark.parametrize("family", list(FAMILIES))
def test_z_and_pattern_equal_hooks_and_eager_weights_of_the_unpatched_model(family):
    plain = build(family, "eager")
    want, zs, weights = hooked(plain, family, weights=True)
    model = patch(build(family, "eager"))
    with headwise.trace(model, capture=("z", "pattern")) as t, torch.no_grad():
        got = model(IDS).logits
    torch.testing.assert_close(got, want)
    assert len(t) == len(zs) == 2
    for li in range(2):
        b, s, _ = zs[li].shape
        h, d_v = layers(model)[li][1].n_heads, layers(model)[li][1].d_head
        torch.testing.assert_close(t[li].z, zs[li].view(b, s, h, d_v))
        torch.testing.assert_close(t[li].pattern, weights[li])


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layer, head", [(0, 1), (1, 3)])
def test_a_zero_edit_equals_zeroing_the_heads_slice_of_the_output_projection_input(family, layer, head):
    impl = "eager" if family == "gemma2" else "sdpa"  # transformers has no sdpa path for Gemma 2's softcap
    plain = build(family, impl)
    model = patch(build(family, impl))
    d_v = layers(model)[layer][1].d_head
    want, _, _ = hooked(plain, family, zero=(layer, head, d_v))
    with headwise.trace(model, edit={(layer, head): "zero"}), torch.no_grad():
        got = model(IDS).logits
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        assert not torch.allclose(model(IDS).logits, want)  # the edit ended with the block, and it mattered
