"""forward_flops against PyTorch's FlopCounterMode on a real eager forward (an independent count)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from headwise import AttentionConfig, MultiHeadAttention
from headwise.analysis import forward_flops
from headwise.analysis.flops import causal_pairs


def _counted(cfg: AttentionConfig, b: int, s_q: int, s_kv: int | None = None) -> int:
    # eager: on CPU, FlopCounterMode has no formula for the fused SDPA kernel and would count 0 for it
    attn = MultiHeadAttention.from_config(cfg, backend="eager")
    x = torch.randn(b, s_q, cfg.d_model)
    kw = {}
    if s_kv is not None:
        kw = dict(key=torch.randn(b, s_kv, cfg.kdim), value=torch.randn(b, s_kv, cfg.vdim))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        attn(x, **kw)
    return counter.get_total_flops()


@pytest.mark.parametrize("kw", [
    dict(d_model=64, n_heads=8),
    dict(d_model=64, n_heads=8, n_kv_heads=2),
    dict(d_model=64, n_heads=8, n_kv_heads=1, bias=False),
    dict(d_model=48, n_heads=4, d_head=20),
], ids=["MHA", "GQA", "MQA", "d_head"])
@pytest.mark.parametrize("b,s", [(1, 7), (3, 16)])
def test_self_attention_matches_flop_counter(kw: dict, b: int, s: int) -> None:
    cfg = AttentionConfig(**kw)
    assert forward_flops(cfg, s, batch=b).total == _counted(cfg, b, s)


def test_cross_attention_matches_flop_counter() -> None:
    cfg = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, kdim=16, vdim=24)
    assert forward_flops(cfg, 5, batch=2, kv_len=11).total == _counted(cfg, 2, 5, 11)


def test_causal_is_counted_in_full_unless_skipped() -> None:
    cfg = AttentionConfig(d_model=64, n_heads=8)
    attn = MultiHeadAttention.from_config(cfg, backend="eager")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        attn(torch.randn(1, 10, 64), causal=True)
    full, skip = forward_flops(cfg, 10), forward_flops(cfg, 10, causal_skip=True)
    assert full.total == counter.get_total_flops()
    assert skip.projections == full.projections
    assert skip.attention == full.attention * 55 // 100  # 10 * 11 / 2 of 100 pairs


def test_causal_pairs_against_the_mask() -> None:
    from headwise.masks import causal_mask

    for s_q in range(1, 13):
        for s_kv in range(1, 13):
            assert causal_pairs(s_q, s_kv) == int(causal_mask(s_q, s_kv).sum()), (s_q, s_kv)


def test_causal_pairs_at_huge_sizes_is_exact() -> None:
    n = 10 ** 20
    assert causal_pairs(3, n) == (n - 2) + (n - 1) + n  # three decode-like queries at the end of n keys
    assert causal_pairs(n, 3) == 1 + 2 + 3  # only the last three queries see any key
    assert causal_pairs(n, n) * 2 == n * (n + 1)  # the full lower triangle


def test_calculators_need_no_torch_and_no_time_at_huge_sizes() -> None:
    import subprocess
    import sys

    code = ("import sys\n"
            "from headwise.analysis import summarize\n"
            "from headwise.presets import get_preset\n"
            "s = summarize(get_preset('llama-2-7b').config, 10 ** 30, dtype='bf16', n_layers=32)\n"
            # bf16 probabilities take float32's 4 bytes on the eager path
            "assert s['probabilities']['materialised'] == 32 * 10 ** 60 * 4, s['probabilities']\n"
            "assert s['flops']['layer_attention_causal_skip'] == 4 * 32 * 128 * (10 ** 30 * (10 ** 30 + 1) // 2)\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_seed_attention_grows_with_s_squared() -> None:
    # d_model 4096, 32 heads, 4096 tokens: projections 8 s d^2, attention 4 s^2 d (FLOPs = 2 x MACs).
    f = forward_flops(AttentionConfig(d_model=4096, n_heads=32), 4096)
    assert f.projections == 8 * 4096 * 4096 ** 2
    assert f.attention == 4 * 4096 ** 2 * 4096
    assert f.scores == f.context


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_rejects_bad_sizes(bad: object) -> None:
    cfg = AttentionConfig(d_model=8, n_heads=2)
    with pytest.raises(ValueError, match="seq_len"):
        forward_flops(cfg, bad)
    with pytest.raises(ValueError, match="batch"):
        forward_flops(cfg, 4, batch=bad)
