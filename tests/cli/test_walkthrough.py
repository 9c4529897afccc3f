"""The shape walk behind `headwise tour` / `explain` (headwise.walkthrough.walk): its steps against a plain
PyTorch forward of the same layer, and bad sizes refused with an error naming expected and received."""

from __future__ import annotations

import pytest

from headwise import AttentionConfig, MultiHeadAttention
from headwise.walkthrough import walk


def test_the_walk_computes_the_layers_own_output_shapes():
    cfg = AttentionConfig(d_model=16, n_heads=4, n_kv_heads=2)
    steps = walk(cfg, seq_len=5, batch=2)
    shapes = {s.name: s.shape for s in steps}
    assert shapes["input x"] == (2, 5, 16) and shapes["y = concat W_O"] == (2, 5, 16)
    assert shapes["split K"] == (2, 2, 5, 4) and shapes["scores = Q K^T * scale"] == (2, 4, 5, 5)


@pytest.mark.parametrize("n_kv_heads, note", [(1, "1 K/V head"), (2, "2 K/V heads")])
def test_the_walk_counts_the_kv_heads_it_projects(n_kv_heads, note):
    steps = {s.name: s for s in walk(AttentionConfig(d_model=16, n_heads=4, n_kv_heads=n_kv_heads), seq_len=3)}
    assert steps["K = x W_K"].note == note and steps["K = x W_K"].shape[-1] == 4 * n_kv_heads


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(seq_len=-1), ValueError, "walk: seq_len must be a positive int, got -1"),
    (dict(seq_len=0), ValueError, "seq_len must be a positive int, got 0"),
    (dict(batch=-3), ValueError, "batch must be a positive int, got -3"),
    (dict(seq_len=2.5), TypeError, r"seq_len must be an int, got float \(2.5\)"),
    (dict(batch=True), TypeError, r"batch must be an int, got bool"),
    (dict(attn=MultiHeadAttention(16, 2)), ValueError, "attn must be a MultiHeadAttention of this config"),
])
def test_bad_sizes_are_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        walk(AttentionConfig(d_model=16, n_heads=4), **kwargs)


def test_a_config_that_is_not_a_config_is_refused():
    with pytest.raises(TypeError, match="config must be an AttentionConfig, got dict"):
        walk({"d_model": 16, "n_heads": 4})
