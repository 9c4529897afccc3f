"""param_count against the parameters of real MultiHeadAttention modules."""

from __future__ import annotations

import pytest
import torch

from headwise import AttentionConfig, MultiHeadAttention
from headwise.analysis import param_count

CONFIGS = [
    dict(d_model=64, n_heads=8),                                # MHA
    dict(d_model=64, n_heads=8, n_kv_heads=2),                  # GQA
    dict(d_model=64, n_heads=8, n_kv_heads=1),                  # MQA
    dict(d_model=48, n_heads=4, d_head=20),                     # explicit d_head, h * d_h != d
    dict(d_model=32, n_heads=4, kdim=16, vdim=24),              # cross-attention widths
    dict(d_model=32, n_heads=4, n_kv_heads=2, kdim=16, vdim=24, d_head=6),
    dict(d_model=32, n_heads=4, out_bias=False),                # bias on Q/K/V only
]


def _real(cfg: AttentionConfig) -> dict[str, int]:
    attn = MultiHeadAttention.from_config(cfg, device="meta")
    per = {name: sum(p.numel() for p in getattr(attn, f"{name}_proj").parameters()) for name in ("q", "k", "v")}
    per["out"] = sum(p.numel() for p in attn.out_proj.parameters())
    per["total"] = sum(p.numel() for p in attn.parameters())
    return per


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("bias", [True, False])
def test_matches_real_module(kw: dict, bias: bool) -> None:
    cfg = AttentionConfig(**kw).replace(bias=bias)
    assert param_count(cfg).to_dict() == _real(cfg)


@pytest.mark.parametrize("kw", CONFIGS[:3], ids=["MHA", "GQA", "MQA"])
def test_forced_bias_off_matches_bias_free_module(kw: dict) -> None:
    cfg = AttentionConfig(**kw)  # bias=True
    assert param_count(cfg, bias=False).total == _real(cfg.replace(bias=False, out_bias=False))["total"]


def test_gqa_shrinks_k_and_v_only() -> None:
    mha, gqa = AttentionConfig(d_model=64, n_heads=8), AttentionConfig(d_model=64, n_heads=8, n_kv_heads=2)
    pm, pg = param_count(mha), param_count(gqa)
    assert (pg.q, pg.out) == (pm.q, pm.out)
    assert pg.k * 4 == pm.k  # weights and biases both shrink by h / h_kv = 4
    assert pg.v == pg.k


def test_rejects_non_config() -> None:
    with pytest.raises(TypeError, match="AttentionConfig"):
        param_count({"d_model": 8, "n_heads": 2})
    with pytest.raises(TypeError, match="bias"):
        param_count(AttentionConfig(d_model=8, n_heads=2), bias="no")


def test_seed_four_d_model_squared() -> None:
    # Seed: d_model 4096, 32 heads, no bias -> 4 * 4096^2 = 67,108,864 parameters.
    cfg = AttentionConfig(d_model=4096, n_heads=32, bias=False)
    assert param_count(cfg).total == 67_108_864 == 4 * 4096 ** 2
    assert _real(cfg)["total"] == 67_108_864


def test_seed_d_head() -> None:
    # Seed: d_model 768 with 12 heads gives d_head 64.
    assert AttentionConfig(d_model=768, n_heads=12).d_head == 64
    assert MultiHeadAttention(768, 12, device="meta").head(0).w_q.shape == torch.Size([768, 64])
