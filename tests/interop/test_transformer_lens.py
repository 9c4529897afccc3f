"""headwise.trace against TransformerLens (a peer): the same weights in a one-layer attention-only
HookedTransformer, its run_with_cache hooks (q, k, v, pattern, z, result) against headwise's captures."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import MultiHeadAttention
from tests.interop.tl_twin import transformer_lens_twin

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")

tl = pytest.importorskip("transformer_lens", reason="TransformerLens (pip install transformer_lens==3.9.0)")


def hooked_twin(attn: MultiHeadAttention, causal: bool):
    """A HookedTransformer whose only block is ``attn``'s attention, weights copied head by head."""
    return transformer_lens_twin(attn, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_trace_equals_transformer_lens_run_with_cache(causal):
    torch.manual_seed(0)
    attn = MultiHeadAttention(24, 4).double()
    model = hooked_twin(attn, causal)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    resid, cache = model.run_with_cache(x, start_at_layer=0, stop_at_layer=1)
    with headwise.trace(attn, capture=("q", "k", "v", "pattern", "z", "result")) as t:
        y = attn(x, causal=causal)
    r = t[0]
    hook = "blocks.0.attn.hook_"
    torch.testing.assert_close(r.q, cache[hook + "q"].transpose(1, 2))  # TL: (b, s, h, d_h)
    torch.testing.assert_close(r.k, cache[hook + "k"].transpose(1, 2))
    torch.testing.assert_close(r.v, cache[hook + "v"].transpose(1, 2))
    torch.testing.assert_close(r.pattern, cache[hook + "pattern"])  # (b, h, s_q, s_kv)
    torch.testing.assert_close(r.z, cache[hook + "z"])  # (b, s, h, d_h)
    torch.testing.assert_close(r.result, cache[hook + "result"])  # (b, s, h, d)
    torch.testing.assert_close(y, resid - x)  # the block adds the attention output to its input


def test_zero_edit_equals_transformer_lens_hook_ablation():
    torch.manual_seed(1)
    attn = MultiHeadAttention(24, 4).double()
    model = hooked_twin(attn, causal=True)
    x = torch.randn(2, 6, 24, dtype=torch.float64)

    def zero_head_2(z, hook):
        z[:, :, 2] = 0.0
        return z

    want = model.run_with_hooks(x, start_at_layer=0, stop_at_layer=1,
                                fwd_hooks=[("blocks.0.attn.hook_z", zero_head_2)]) - x
    with headwise.trace(attn, edit={(0, 2): "zero"}):
        got = attn(x, causal=True)
    torch.testing.assert_close(got, want)
