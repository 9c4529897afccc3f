"""Tracing a model that is not a transformers model never imports headwise.interop (nor transformers): that
import costs seconds, and nothing outside a transformers model can be patched."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, torch, headwise
model = torch.nn.Sequential(headwise.MultiHeadAttention(8, 2))
with headwise.trace(model, capture=("z",)) as t:
    model(torch.randn(1, 3, 8))
assert t[0].z.shape == (1, 3, 2, 4), t[0].z.shape
print("headwise.interop" in sys.modules, "transformers" in sys.modules)
"""


def test_tracing_a_plain_module_imports_neither_interop_nor_transformers():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_patched_model_inside_a_plain_module_is_still_found():
    import pytest

    transformers = pytest.importorskip("transformers")
    import torch

    import headwise
    from headwise.interop import patch

    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    wrapper = torch.nn.ModuleDict({"lm": patch(transformers.LlamaForCausalLM(cfg).eval())})
    with headwise.trace(wrapper, capture=("z",)) as t:
        wrapper["lm"](torch.tensor([[1, 2, 3]]))
    assert [r.name for r in t] == ["lm.model.layers.0.self_attn"] and t[0].z.shape == (1, 3, 2, 4)
