"""KV-cache and attention-memory calculators against real caches and real eager weights."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from headwise import AttentionConfig, MultiHeadAttention
from headwise.analysis import (attention_memory, dtype_itemsize, kv_cache_bytes, kv_cache_bytes_per_token,
                               parse_dtype)

CONFIGS = [dict(d_model=64, n_heads=8), dict(d_model=64, n_heads=8, n_kv_heads=2),
           dict(d_model=64, n_heads=8, n_kv_heads=1), dict(d_model=48, n_heads=4, d_head=20)]


@pytest.mark.parametrize("kw", CONFIGS, ids=["MHA", "GQA", "MQA", "d_head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,s", [(1, 1), (3, 17)])
def test_kv_cache_matches_real_cache(kw: dict, dtype: torch.dtype, b: int, s: int) -> None:
    cfg = AttentionConfig(**kw)
    attn = MultiHeadAttention.from_config(cfg, dtype=dtype)
    assert kv_cache_bytes(cfg, s, batch=b, dtype=dtype) == attn.new_cache(b, s).nbytes
    assert kv_cache_bytes_per_token(cfg, dtype=dtype) * s * b == attn.new_cache(b, s).nbytes


def test_kv_cache_scales_with_layers_and_gqa() -> None:
    mha = AttentionConfig(d_model=4096, n_heads=32)
    gqa = mha.replace(n_kv_heads=8)
    assert kv_cache_bytes(mha, 1000, n_layers=32) == 4 * kv_cache_bytes(gqa, 1000, n_layers=32)
    # Llama-2-7B-sized MHA in fp16: 2 * 32 * 128 * 2 bytes * 32 layers = 512 KiB per token.
    assert kv_cache_bytes_per_token(mha, dtype="float16", n_layers=32) == 512 * 1024


@pytest.mark.parametrize("kw", CONFIGS, ids=["MHA", "GQA", "MQA", "d_head"])
def test_materialised_matches_eager_weights(kw: dict) -> None:
    cfg = AttentionConfig(**kw)
    attn = MultiHeadAttention.from_config(cfg, backend="eager")
    _, w = attn(torch.randn(2, 7, cfg.d_model), return_weights=True)
    mem = attention_memory(cfg, 7, batch=2, dtype=torch.float32)
    assert mem.materialised == w.nbytes
    assert mem.fused == 2 * cfg.n_heads * 7 * 4  # one float32 log-sum-exp per (b, h, query): no s^2 term


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_materialised_is_what_the_eager_path_allocates(dtype: torch.dtype) -> None:
    cfg = AttentionConfig(d_model=32, n_heads=4)
    attn = MultiHeadAttention.from_config(cfg, backend="eager", dtype=dtype)
    x = torch.randn(2, 64, 32, dtype=dtype)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        attn(x)
    allocated = max(e.cpu_memory_usage for e in prof.events() if e.name == "aten::_softmax")
    mem = attention_memory(cfg, 64, batch=2, dtype=dtype)
    assert mem.materialised == allocated == attn.explain_dispatch(x).probability_bytes


def test_fused_has_no_quadratic_term() -> None:
    cfg = AttentionConfig(d_model=4096, n_heads=32)
    small, big = attention_memory(cfg, 1024), attention_memory(cfg, 4096)
    assert big.materialised == 16 * small.materialised
    assert big.fused == 4 * small.fused
    layers = attention_memory(cfg, 1024, n_layers=32)
    assert layers.materialised_all_layers == 32 * small.materialised
    assert layers.ratio == 1024  # s_kv * itemsize / 4 with float32


def test_dtype_names() -> None:
    assert parse_dtype("bf16") is torch.bfloat16
    assert dtype_itemsize("fp16") == 2 and dtype_itemsize(torch.float64) == 8
    with pytest.raises(ValueError, match="float16"):
        parse_dtype("float17")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_fused_is_the_log_sum_exp_autograd_saves(dtype: torch.dtype) -> None:
    """The fused (default) path in training keeps one statistic per (b, h, query) for the backward: float32 for
    float32 and narrower inputs, float64 for float64 ones."""
    from headwise.analysis.memory import lse_itemsize

    cfg = AttentionConfig(d_model=32, n_heads=4)
    attn = MultiHeadAttention.from_config(cfg, dtype=dtype)
    x = torch.randn(2, 16, 32, dtype=dtype, requires_grad=True)
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        attn(x, causal=True)
    (lse,) = [t for t in saved if t.shape == (2, 4, 16)]  # (b, h, s_q)
    mem = attention_memory(cfg, 16, batch=2, dtype=dtype)
    assert mem.fused == lse.nbytes == 2 * 4 * 16 * lse_itemsize(dtype)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
