"""torch.export of the layer with dynamic batch and sequence lengths."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from headwise import AttentionConfig, AttentionHead, KVCache, MaterializationWarning, MultiHeadAttention
from headwise import RotaryEmbedding
from headwise import functional as hwf
from headwise import masks as hwm

_PLAN_FORWARD = MultiHeadAttention.forward.__globals__["plan_forward"]
PLAN = _PLAN_FORWARD.__globals__["plan_attention"].__globals__


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("n_kv_heads", [8, 2, 1])
def test_export_with_dynamic_batch_and_sequence(n_kv_heads, backend):
    from torch.export import Dim, export

    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 8, n_kv_heads, rotary=RotaryEmbedding(4), backend=backend).eval()

    class Causal(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, causal=True)

    program = export(Causal(), (torch.randn(2, 5, 32),), dynamic_shapes=({0: Dim("b"), 1: Dim("s")},))
    for shape in ((3, 9, 32), (1, 2, 32)):
        x = torch.randn(shape)
        torch.testing.assert_close(program.module()(x), attn(x, causal=True))


class _Masked(torch.nn.Module):
    """``attn(x, mask=mask)`` with the mask an input of the exported program."""

    def __init__(self, attn: MultiHeadAttention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.attn(x, mask=mask)


def test_export_of_the_eager_path_under_autograd_reads_no_mask_data():
    # Whether a float mask has dead rows matters only for the fused path; the eager path never asks, so a
    # trainable eager layer with an additive mask exports (a data-dependent read would stop the trace).
    from torch.export import export

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2, backend="eager")
    mask = torch.zeros(2, 1, 5, 5)
    mask[1, :, :, 3:] = torch.finfo(torch.float32).min
    x = torch.randn(2, 5, 16)

    exported = export(_Masked(attn), (x, mask), strict=False)
    torch.testing.assert_close(exported.module()(x, mask), attn(x, mask=mask))


@pytest.mark.parametrize("strict", [False, True])
def test_export_of_a_trainable_fused_layer_with_a_floating_mask_runs_the_formula(strict):
    # The fused path's check for rows at the minimum reads the mask; exported code cannot, so a call recorded by
    # autograd with a floating mask takes the eager path there, right on every row.
    from torch.export import export

    from tests.reference import reference_mha

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2)
    mask = torch.zeros(2, 1, 5, 5)
    mask[1, :, :, 3:] = torch.finfo(torch.float32).min
    mask[1, :, 4] = torch.finfo(torch.float32).min  # a padded query reads nothing
    x = torch.randn(2, 5, 16)

    exported = export(_Masked(attn), (x, mask), strict=strict).module()
    for m in (mask, torch.randn(2, 1, 5, 5)):
        torch.testing.assert_close(exported(x, m).double(), reference_mha(attn, x, mask=m)[0])


def _exported_step(attn, cache, x):
    from torch.export import export

    from headwise import DecodeStep

    class Step(torch.nn.Module):
        def __init__(self, step) -> None:
            super().__init__()
            self.step = step

        def forward(self, x):
            return self.step(x)

    return export(Step(DecodeStep(attn, cache)), (x,)).module()


def _prefilled_export(max_len: int):
    """A GQA layer, its inputs, a cache holding their first 4 positions, and a decode step exported on it."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, 2).eval()
    x = torch.randn(1, 10, 32)
    cache = attn.new_cache(1, max_len)
    with torch.no_grad():
        attn(x[:, :4], cache=cache)
        prog = _exported_step(attn, cache, x[:, 4:5])
    return attn, x, cache, prog


def test_an_exported_step_keeps_the_host_length_true_for_the_next_eager_step():
    attn, x, cache, prog = _prefilled_export(16)
    with torch.no_grad():
        assert cache.length == 4  # a host read between export and the exported steps
        ys = [prog(x[:, t:t + 1]) for t in range(4, 8)]
        assert cache.length == 8
        ys.append(attn(x[:, 8:9], cache=cache))  # eager, after exported steps
        cache.reset()
        attn(x[:, :2], cache=cache)
        again = prog(x[:, 2:3])  # exported, after a reset
        assert cache.length == 3
    want = torch.cat([torch.cat(ys, 1), again], 1)
    ref = attn(x[:, :9], causal=True).detach()
    torch.testing.assert_close(want, torch.cat([ref[:, 4:9], attn(x[:, :3], causal=True).detach()[:, 2:3]], 1),
                               atol=1e-5, rtol=1e-5)


def test_an_exported_step_past_max_len_is_reported_at_the_next_host_use():
    attn, x, cache, prog = _prefilled_export(6)
    with torch.no_grad():
        assert cache.length == 4
        for t in range(4, 7):  # two fit, the third is refused
            prog(x[:, t:t + 1])
        with pytest.raises(ValueError, match="cache overflow: 1 compiled step"):
            cache.length
        assert cache.length == 6
