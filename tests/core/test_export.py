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

PLAN = MultiHeadAttention.forward.__globals__["plan_attention"].__globals__


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


def test_export_of_the_eager_path_under_autograd_reads_no_mask_data():
    # Whether a float mask has dead rows matters only for the fused path; the eager path never asks, so a
    # trainable eager layer with an additive mask exports (a data-dependent read would stop the trace).
    from torch.export import export

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, 2, backend="eager")
    mask = torch.zeros(2, 1, 5, 5)
    mask[1, :, :, 3:] = torch.finfo(torch.float32).min
    x = torch.randn(2, 5, 16)

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attn

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.attn(x, mask=mask)

    exported = export(Masked(), (x, mask), strict=False)
    torch.testing.assert_close(exported.module()(x, mask), attn(x, mask=mask))
