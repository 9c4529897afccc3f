"""AttentionConfig: resolution of defaults, validation messages, replace()."""

from __future__ import annotations

import dataclasses

import pytest

from headwise import AttentionConfig
from headwise.config import valid_head_counts


def test_seed_figures():
    cfg = AttentionConfig(d_model=4096, n_heads=32)
    assert (cfg.d_head, cfg.n_kv_heads, cfg.kind) == (128, 32, "MHA")
    assert AttentionConfig(d_model=768, n_heads=12).d_head == 64
    assert AttentionConfig(d_model=12288, n_heads=96).d_head == 128  # GPT-3 175B
    assert AttentionConfig(d_model=4096, n_heads=32, n_kv_heads=8).kind == "GQA"
    assert AttentionConfig(d_model=4096, n_heads=32, n_kv_heads=1).kind == "MQA"


def test_user_values_are_kept_and_replace_re_resolves():
    cfg = AttentionConfig(d_model=4096, n_heads=32, n_kv_heads=8)
    smaller = cfg.replace(n_heads=16)
    assert (smaller.d_head, smaller.n_kv_heads) == (256, 8)  # d_head recomputed, n_kv_heads kept
    assert AttentionConfig(d_model=512, n_heads=8).replace(n_heads=4).n_kv_heads == 4
    explicit = AttentionConfig(d_model=20, n_heads=3, d_head=8)
    assert explicit.d_head == 8 and explicit.inner_dim == 24
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_heads = 4


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(d_model=4096, n_heads=30), ValueError,
         r"n_heads=30 does not divide d_model=4096; head counts that do near 30: \[8, 16, 32, 64\]"),
        (dict(d_model=768, n_heads=12, n_kv_heads=5), ValueError,
         r"n_kv_heads=5 does not divide n_heads=12; valid n_kv_heads: \[1, 2, 3, 4, 6, 12\]"),
        (dict(d_model=0, n_heads=1), ValueError, "d_model must be a positive int, got 0"),
        (dict(d_model=8, n_heads=-2), ValueError, "n_heads must be a positive int, got -2"),
        (dict(d_model=8, n_heads=2, d_head=0), ValueError, "d_head must be a positive int, got 0"),
        (dict(d_model=8.0, n_heads=2), TypeError, r"d_model must be a positive int, got 8.0 \(float\)"),
        (dict(d_model=8, n_heads=True), TypeError, "n_heads must be a positive int, got True"),
        (dict(d_model=8, n_heads=2, dropout=1.0), ValueError, r"dropout must be in \[0, 1\), got 1.0"),
        (dict(d_model=8, n_heads=2, dropout=-0.1), ValueError, r"dropout must be in \[0, 1\), got -0.1"),
        (dict(d_model=8, n_heads=2, scale=0.0), ValueError, "scale must be a positive finite float"),
        (dict(d_model=8, n_heads=2, bias="yes"), TypeError, "bias must be a bool, got 'yes'"),
    ],
)
def test_invalid_configs_name_expected_and_received(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        AttentionConfig(**kwargs)


def test_nearest_valid_head_counts():
    assert valid_head_counts(384) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 384]
    with pytest.raises(ValueError, match=r"near 10: \[6, 8, 12, 16\]"):
        AttentionConfig(d_model=384, n_heads=10)


def test_kv_head_of_follows_h_over_group():
    cfg = AttentionConfig(d_model=64, n_heads=8, n_kv_heads=2)
    assert [cfg.kv_head_of(h) for h in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(IndexError):
        cfg.kv_head_of(8)
