"""The forward's path stays short: a reader crosses few headwise functions from ``attn(x)`` to the kernel.

Counted with ``sys.setprofile``: every distinct headwise function (properties included) that a call enters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import headwise
from headwise import MultiHeadAttention

SRC = str(Path(headwise.__file__).parent)


def headwise_functions(fn) -> list[str]:
    """Distinct headwise functions entered while ``fn()`` runs, in first-call order."""
    seen: dict[object, str] = {}

    def profile(frame, event, arg):  # noqa: ARG001 - the setprofile signature
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(SRC) and code not in seen:
            seen[code] = f"{Path(code.co_filename).stem}.{code.co_qualname}"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return list(seen.values())


def test_a_default_forward_runs_at_most_ten_headwise_functions():
    attn = MultiHeadAttention(d_model=64, n_heads=8)
    x = torch.randn(2, 5, 64)
    attn(x)  # the first call may import lazily
    called = headwise_functions(lambda: attn(x))
    assert len(called) <= 10, called
    assert "functional.attend" in called and "functional.merge_heads" in called, called


def test_a_cached_one_token_call_runs_at_most_six_headwise_functions():
    attn = MultiHeadAttention(d_model=64, n_heads=8, n_kv_heads=2).eval()
    cache = attn.new_cache(batch_size=2, max_len=16)
    with torch.no_grad():
        attn(torch.randn(2, 4, 64), cache=cache)
        attn(torch.randn(2, 1, 64), cache=cache)
        called = headwise_functions(lambda: attn(torch.randn(2, 1, 64), cache=cache))
    assert len(called) <= 6, called
    assert "token_step.one_token" in called and "kv_cache.KVCache.update" in called, called
    assert "validation.check_forward" not in called, called  # the short route: no per-token planning or full checks
