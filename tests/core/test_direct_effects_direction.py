"""direct_effects takes a direction of shape (d,), (1, d) or (b, d) and refuses any other batch clearly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headwise import MultiHeadAttention
from headwise.patching import direct_effects


def _model():
    torch.manual_seed(0)
    return nn.Sequential(MultiHeadAttention(16, 4), nn.LayerNorm(16)).eval()


def test_direction_per_row_equals_each_row_with_its_own_direction():
    model, x, dirs = _model(), torch.randn(2, 5, 16), torch.randn(2, 16)
    per_row = direct_effects(model, x, dirs, norm=model[1])  # (b, L, h)
    one_each = torch.stack([direct_effects(model, x, dirs[i], norm=model[1])[i] for i in range(2)])
    torch.testing.assert_close(per_row, one_each)
    torch.testing.assert_close(direct_effects(model, x, dirs[:1], norm=model[1]),
                               direct_effects(model, x, dirs[0], norm=model[1]))


def test_direction_with_another_batch_is_refused_naming_both():
    model, x = _model(), torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"b = 1 or the inputs' b=2, got \(3, 16\)"):
        direct_effects(model, x, torch.randn(3, 16), norm=model[1])
    assert not model.training  # the model's mode is as it was
