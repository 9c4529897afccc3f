"""Forward hooks on the projections run on every path of a layer: the one-token decode route and the
chunked long forward call the hooked module exactly as the general one-pass forward does."""

from __future__ import annotations

import pytest
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

import headwise.attention as attention_module
from headwise import DecodeStep, MultiHeadAttention
from tests.reference import reference_mha


def _layer(seed: int = 0) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(32, 4, 2, bias=True).eval()


@pytest.mark.parametrize("stepper", ["forward", "DecodeStep"])
def test_global_forward_hook_on_out_proj_changes_decode_steps_as_the_formula_says(stepper):
    attn = _layer()
    x = torch.randn(2, 7, 32)
    # Steering on W_O's output: the reference applies the same map to the float64 formula's output.
    handle = register_module_forward_hook(lambda m, args, out: out * 2.0 + 1.0 if m is attn.out_proj else None)
    try:
        cache = attn.new_cache(2, 8)
        step = DecodeStep(attn, cache) if stepper == "DecodeStep" else (lambda t: attn(t, cache=cache))
        with torch.no_grad():
            ys = [attn(x[:, :4], cache=cache)] + [step(x[:, t:t + 1]) for t in range(4, 7)]
            general = attn(x, causal=True)  # seven tokens: the general forward, which runs the module calls
    finally:
        handle.remove()
    expected = reference_mha(attn, x, causal=True)[0] * 2.0 + 1.0
    torch.testing.assert_close(torch.cat(ys, 1), expected.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(ys, 1), general)


def test_global_forward_pre_hook_on_q_proj_reaches_decode_steps():
    attn = _layer(1)
    x = torch.randn(2, 6, 32)
    handle = register_module_forward_pre_hook(lambda m, args: (args[0] * 0.0,) if m is attn.q_proj else None)
    try:
        cache = attn.new_cache(2, 6)
        with torch.no_grad():
            steps = torch.cat([attn(x[:, :3], cache=cache)] + [attn(x[:, t:t + 1], cache=cache) for t in (3, 4, 5)], 1)
    finally:
        handle.remove()
    # Zero query inputs leave only q_proj's bias as every query: the formula with those queries.
    plain = _layer(1)
    with torch.no_grad():
        plain.q_proj.weight.zero_()
    torch.testing.assert_close(steps, reference_mha(plain, x, causal=True)[0].float(), rtol=1e-5, atol=1e-5)


def _record(attn: MultiHeadAttention, names=("q_proj", "k_proj", "v_proj", "out_proj")):
    seen: dict[str, list] = {n: [] for n in names}
    handles = [getattr(attn, n).register_forward_hook(lambda m, a, o, n=n: seen[n].append(o.clone()))
               for n in names]
    return seen, handles


def test_hooks_on_a_chunked_forward_see_every_row_once_as_on_one_pass(monkeypatch):
    attn = _layer(2)
    x = torch.randn(2, 9, 32)
    calls = []
    real = attention_module.forward_in_chunks
    monkeypatch.setattr(attention_module, "forward_in_chunks", lambda *a: calls.append(1) or real(*a))
    outputs, captured = {}, {}
    for setting in (False, 2):  # one pass, then chunks of two positions forced
        attn.chunk_queries = setting
        seen, handles = _record(attn)
        steer = attn.q_proj.register_forward_hook(lambda m, a, o: o + 0.5)  # edits what the hooks after it see
        with torch.no_grad():
            info = attn.explain_dispatch(x, causal=True)  # explained as it runs, with the reason
            assert info.query_chunk is None
            # The reason is given where chunks would otherwise run (forced here), not on a plain one pass.
            assert any("forward hooks" in r for r in info.reasons) is bool(setting), info.reasons
            assert any("kernel's own is_causal" in r for r in info.reasons), info.reasons  # and how it is causal
            outputs[setting] = attn(x, causal=True)
        for h in handles + [steer]:
            h.remove()
        captured[setting] = seen
    assert not calls  # a hooked layer takes the one-pass forward even where chunks are forced
    for name in captured[False]:
        assert len(captured[2][name]) == len(captured[False][name]) == 1
        torch.testing.assert_close(captured[2][name][0], captured[False][name][0])
    torch.testing.assert_close(outputs[2], outputs[False])
    # The same layer without hooks still chunks.
    with torch.no_grad():
        assert attn.explain_dispatch(x, causal=True).query_chunk == 2
        unhooked = attn(x, causal=True)
    assert calls
    torch.testing.assert_close(unhooked, reference_mha(attn, x, causal=True)[0].float(), rtol=1e-5, atol=1e-5)


def test_a_global_hook_on_out_proj_sees_the_whole_output_of_a_chunked_forward():
    attn = _layer(3)
    attn.chunk_queries = 3
    x = torch.randn(1, 8, 32)
    shapes = []
    handle = register_module_forward_hook(
        lambda m, a, o: shapes.append(tuple(o.shape)) or o - 2.0 if m is attn.out_proj else None)
    try:
        with torch.no_grad():
            y = attn(x, causal=True)
    finally:
        handle.remove()
    assert shapes == [(1, 8, 32)]
    torch.testing.assert_close(y, reference_mha(attn, x, causal=True)[0].float() - 2.0, rtol=1e-5, atol=1e-5)
