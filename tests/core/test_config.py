"""AttentionConfig: resolution of defaults, validation messages, replace()."""

from __future__ import annotations

import dataclasses
import math

import pytest
import numpy as np
import torch

from headwise import AttentionConfig
from headwise.config import MAX_SUGGESTED_HEADS, valid_head_counts
from headwise import AttentionConfig, KVCache, MultiHeadAttention
from headwise import masks as hwm


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


def brute_divisors(n: int, limit: int | None = None) -> list[int]:
    top = n if limit is None else min(n, limit)
    return [d for d in range(1, top + 1) if n % d == 0]




def brute_divisors(n: int, limit: int | None = None) -> list[int]:
    top = n if limit is None else min(n, limit)
    return [d for d in range(1, top + 1) if n % d == 0]




@pytest.mark.timeout(10)
@pytest.mark.parametrize("d_model", [10**12 + 1, 10**18 + 9, 2**61 - 1, (2**31 - 1) * (2**31 + 11)])
def test_huge_d_model_errors_at_once_listing_small_divisors(d_model):
    # The suggestion loops over head counts up to MAX_SUGGESTED_HEADS, never over d_model.
    with pytest.raises(ValueError, match=rf"n_heads=7 does not divide d_model={d_model}; head counts that do near 7"):
        AttentionConfig(d_model=d_model, n_heads=7)
    assert valid_head_counts(d_model) == brute_divisors(d_model, MAX_SUGGESTED_HEADS)


@pytest.mark.timeout(10)
def test_huge_n_heads_kv_message_is_fast():
    n_heads = 10**12 + 1  # = 73 * 137 * 99990001
    with pytest.raises(ValueError, match=r"valid n_kv_heads: \[1, 73, 137\]"):
        AttentionConfig(d_model=n_heads, n_heads=n_heads, n_kv_heads=2)


@pytest.mark.parametrize("n", [1, 2, 12, 36, 97, 360, 720, 1001, 4096, 5040, 65537, 99991 * 3])
def test_valid_head_counts_are_the_divisors_up_to_the_limit(n):
    assert valid_head_counts(n) == brute_divisors(n, MAX_SUGGESTED_HEADS)
    assert valid_head_counts(n, limit=n) == brute_divisors(n, n)


def test_nearest_message_matches_brute_force_ratio_rule():
    for d_model, n_heads in [(4096, 30), (384, 10), (5040, 11), (1000, 3), (97, 5)]:
        divs = brute_divisors(d_model)
        near = sorted(sorted(divs, key=lambda v: (abs(math.log(v / n_heads)), v))[:4])
        with pytest.raises(ValueError, match=rf"near {n_heads}: \[{', '.join(map(str, near))}\]"):
            AttentionConfig(d_model=d_model, n_heads=n_heads)


def test_sizes_beyond_torch_sizes_are_refused():
    with pytest.raises(ValueError, match=r"d_model must be at most 2\*\*63 - 1"):
        AttentionConfig(d_model=2**63, n_heads=1)
    with pytest.raises(ValueError, match=r"valid_head_counts needs a positive int at most 2\*\*63 - 1, got 0"):
        valid_head_counts(0)
    with pytest.raises(TypeError, match=r"valid_head_counts needs a positive int at most 2\*\*63 - 1, got 12.0"):
        valid_head_counts(12.0)




@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(scale=True), TypeError, r"scale must be a float or None, got True \(bool\)"),
        (dict(scale="0.5"), TypeError, r"scale must be a float or None, got '0.5' \(str\)"),
        (dict(scale=np.float32(0.5)), TypeError, r"scale must be a float or None, got .*\(numpy.float32\)"),
        (dict(scale=math.nan), ValueError, "scale must be a positive finite float or None, got nan"),
        (dict(scale=-0.5), ValueError, "scale must be a positive finite float or None, got -0.5"),
        (dict(scale=math.inf), ValueError, "scale must be a positive finite float or None, got inf"),
        (dict(scale=0), ValueError, "scale must be a positive finite float or None, got 0"),
        (dict(bias=None), TypeError, r"bias must be a bool, got None"),
        (dict(bias=1), TypeError, r"bias must be a bool, got 1 \(int\)"),
        (dict(out_bias=0), TypeError, r"out_bias must be a bool or None, got 0 \(int\)"),
        (dict(dropout=True), TypeError, r"dropout must be a float in \[0, 1\), got True \(bool\)"),
        (dict(dropout=np.float32(0.1)), TypeError, r"dropout must be a float in \[0, 1\), got .*\(numpy.float32\)"),
        (dict(dropout=math.nan), ValueError, r"dropout must be in \[0, 1\), got nan"),
        (dict(dropout=10**400), ValueError, r"dropout must be in \[0, 1\), got 10{400}$"),  # beyond any float
        (dict(dropout=-10**400), ValueError, r"dropout must be in \[0, 1\), got -10{400}$"),
    ],
)
def test_scale_bias_dropout_types(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        AttentionConfig(d_model=8, n_heads=2, **kwargs)


def test_out_bias_none_still_means_same_as_bias_and_numpy_float64_is_a_float():
    assert AttentionConfig(d_model=8, n_heads=2, bias=False, out_bias=None).out_bias is False
    assert AttentionConfig(d_model=8, n_heads=2, bias=True).out_bias is True
    assert AttentionConfig(d_model=8, n_heads=2, scale=np.float64(0.25)).scale == 0.25  # a float subclass
    assert AttentionConfig(d_model=8, n_heads=2, scale=2).scale == 2


@pytest.mark.parametrize("field", ["d_model", "n_heads", "n_kv_heads", "d_head", "kdim", "vdim"])
@pytest.mark.parametrize("np_int", [np.int64, np.int32])
def test_numpy_ints_are_a_type_error_naming_the_type(field, np_int):
    kwargs = dict(d_model=8, n_heads=2)
    kwargs[field] = np_int(2)
    with pytest.raises(TypeError, match=rf"{field} must be a positive int, got .*\(numpy.{np_int.__name__}\)"):
        AttentionConfig(**kwargs)
