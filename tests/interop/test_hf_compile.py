"""A patched Hugging Face model under ``torch.compile`` with transformers' static cache: one graph for every
decode position, the same tokens as the unpatched compiled model.

transformers' ``StaticCache`` keeps the position on the device (``cache_position``) and hands attention the whole
``max_cache_len`` buffer with a mask, so a step's shapes never change; headwise must add no per-position Python
value (a guard that changes would recompile, and re-record a CUDA graph under ``mode="reduce-overhead"``).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from torch._dynamo.testing import CompileCounter  # noqa: E402

import headwise.interop as hwi  # noqa: E402


def _decode(model, step, ids: torch.Tensor, n: int, max_len: int) -> torch.Tensor:
    """Greedy tokens: an eager prefill into a StaticCache, then ``n`` steps through ``step``."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)
    s = ids.shape[1]
    logits = model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(s)).logits
    tokens = [logits[:, -1:].argmax(-1)]
    for i in range(n):
        pos = torch.tensor([s + i])
        logits = step(tokens[-1], past_key_values=cache, use_cache=True, cache_position=pos,
                      position_ids=pos[None]).logits
        tokens.append(logits[:, -1:].argmax(-1))
    return torch.cat(tokens, 1)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_patched_llama_with_a_static_cache_compiles_once_for_every_position():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    plain = transformers.LlamaForCausalLM(cfg).eval()
    patched = transformers.LlamaForCausalLM(cfg).eval()
    patched.load_state_dict(plain.state_dict())
    hwi.patch(patched)
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        torch._dynamo.reset()
        want = _decode(plain, torch.compile(plain.forward, backend=CompileCounter(), fullgraph=True), ids, 20, 32)
        torch._dynamo.reset()
        counter = CompileCounter()
        got = _decode(patched, torch.compile(patched.forward, backend=counter, fullgraph=True), ids, 20, 32)
        eager = _decode(patched, patched.forward, ids, 20, 32)
    assert counter.frame_count == 1
    assert torch.equal(got, want) and torch.equal(eager, want)
