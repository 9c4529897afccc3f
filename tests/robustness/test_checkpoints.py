"""Checkpoints: state_dict round-trips, refuses another head layout by name, survives weights_only loading."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from headwise import AttentionConfig, MultiHeadAttention

LAYOUTS = {
    "MHA": dict(d_model=16, n_heads=4),
    "GQA": dict(d_model=16, n_heads=4, n_kv_heads=2),
    "MQA": dict(d_model=16, n_heads=4, n_kv_heads=1),
    "no bias": dict(d_model=16, n_heads=4, bias=False),
    "d_head": dict(d_model=16, n_heads=4, d_head=6),
}


def build(**kw) -> MultiHeadAttention:
    return MultiHeadAttention(**kw).eval()


def saved(sd) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_state_dict_round_trips_through_torch_save_weights_only(layout):
    torch.manual_seed(0)
    src = build(**LAYOUTS[layout])
    torch.manual_seed(1)
    dst = build(**LAYOUTS[layout])
    x = torch.randn(2, 5, 16)
    assert not torch.equal(src(x), dst(x))
    sd = saved(src.state_dict())
    assert sd._metadata[""]["headwise_config"] == src.config.to_dict()
    dst.load_state_dict(sd)
    assert torch.equal(dst(x), src(x))
    assert all(isinstance(v, torch.Tensor) for v in src.state_dict().values())  # keys: the projections only


def test_kdim_vdim_layer_round_trips():
    cfg = AttentionConfig(d_model=16, n_heads=4, kdim=8, vdim=12, out_bias=False)
    src, dst = MultiHeadAttention.from_config(cfg), MultiHeadAttention.from_config(cfg)
    dst.load_state_dict(saved(src.state_dict()))
    q, k, v = torch.randn(2, 3, 16), torch.randn(2, 4, 8), torch.randn(2, 4, 12)
    assert torch.equal(dst(q, key=k, value=v), src(q, key=k, value=v))


MISMATCHES = {
    # same weight shapes as the (16, 4) MHA layer: only the recorded config can tell
    "n_heads": (dict(d_model=16, n_heads=4), dict(d_model=16, n_heads=2), "n_heads 4 vs 2"),
    "d_head": (dict(d_model=16, n_heads=4, d_head=4), dict(d_model=16, n_heads=2, d_head=8), "d_head 4 vs 8"),
    "n_kv_heads": (dict(d_model=16, n_heads=4, n_kv_heads=2), dict(d_model=16, n_heads=2, n_kv_heads=1, d_head=8),
                   "n_kv_heads 2 vs 1"),
    "bias": (dict(d_model=16, n_heads=4), dict(d_model=16, n_heads=4, bias=False), "bias True vs False"),
    "n_kv_heads shape": (dict(d_model=16, n_heads=4, n_kv_heads=1), dict(d_model=16, n_heads=4, n_kv_heads=2),
                         "n_kv_heads 1 vs 2"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_another_layout_is_refused_naming_both_configs_and_nothing_is_copied(case):
    a_kw, b_kw, diff = MISMATCHES[case]
    src, dst = build(**a_kw), build(**b_kw)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ValueError) as info:
        dst.load_state_dict(saved(src.state_dict()))
    msg = str(info.value)
    assert f"saved from AttentionConfig(d_model=16, n_heads={src.n_heads}, n_kv_heads={src.n_kv_heads}, " \
           f"d_head={src.d_head}" in msg
    assert f"this layer is AttentionConfig(d_model=16, n_heads={dst.n_heads}, n_kv_heads={dst.n_kv_heads}, " \
           f"d_head={dst.d_head}" in msg
    assert diff in msg
    assert all(torch.equal(v, before[k]) for k, v in dst.state_dict().items())


def test_custom_scale_is_part_of_the_layout():
    src = MultiHeadAttention.from_config(AttentionConfig(d_model=16, n_heads=4, scale=1.0))
    with pytest.raises(ValueError, match="scale 1.0 vs 0.5"):
        build(d_model=16, n_heads=4).load_state_dict(src.state_dict())


def test_dropout_is_not_part_of_the_layout():
    src = build(d_model=16, n_heads=4, dropout=0.1)
    dst = build(d_model=16, n_heads=4)
    dst.load_state_dict(src.state_dict())
    x = torch.randn(1, 3, 16)
    assert torch.equal(dst(x), src(x))


def test_plain_state_dicts_of_the_four_projections_still_load():
    torch.manual_seed(0)
    src = build(d_model=16, n_heads=4)
    plain = {k: v.clone() for k, v in src.state_dict().items()}  # a plain dict: no metadata
    dst = build(d_model=16, n_heads=4)
    dst.load_state_dict(plain, strict=True)
    x = torch.randn(2, 3, 16)
    assert torch.equal(dst(x), src(x))
    # without the recorded config only PyTorch's shape checks remain
    with pytest.raises(RuntimeError, match="size mismatch for k_proj.weight"):
        build(d_model=16, n_heads=4, n_kv_heads=1).load_state_dict(plain)


def test_nested_layer_is_checked_and_named_by_its_prefix():
    class Block(nn.Module):
        def __init__(self, n_heads):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.attn = MultiHeadAttention(16, n_heads)

    src = Block(4)
    Block(4).load_state_dict(saved(src.state_dict()))
    with pytest.raises(ValueError, match=r"state dict at 'attn' was saved from AttentionConfig\(d_model=16, n_heads=4"):
        Block(2).load_state_dict(saved(src.state_dict()))


def test_whole_module_save_and_weights_only_state_dict():
    src = build(d_model=16, n_heads=4, n_kv_heads=2)
    buf = io.BytesIO()
    torch.save({"model": src.state_dict(), "step": 3}, buf)
    buf.seek(0)
    blob = torch.load(buf, weights_only=True)
    dst = build(d_model=16, n_heads=4, n_kv_heads=2)
    dst.load_state_dict(blob["model"])
    x = torch.randn(1, 4, 16)
    assert torch.equal(dst(x), src(x))
