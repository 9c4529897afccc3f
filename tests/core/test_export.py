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


@pytest.mark.parametrize("n_kv_heads", [8, 2, 1])
def test_export_with_dynamic_batch_and_sequence(n_kv_heads):
    from torch.export import Dim, export

    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 8, n_kv_heads, rotary=RotaryEmbedding(4)).eval()

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
