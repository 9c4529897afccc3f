"""On a CUDA device: a patched Hugging Face model generates the unpatched model's tokens, eagerly and compiled
with transformers' static cache under ``mode="reduce-overhead"`` (one CUDA graph for every position).

Run with ``pytest -m cuda tests`` where a GPU exists (docs/gpu.md); CI has none, so each test skips.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")]

transformers = pytest.importorskip("transformers")


def _llama(dtype: torch.dtype):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg).to("cuda", dtype).eval()
    patched = transformers.LlamaForCausalLM(cfg).to("cuda", dtype).eval()
    patched.load_state_dict(plain.state_dict())
    import headwise.interop as hwi

    hwi.patch(patched)
    return cfg, plain, patched


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_generate_gives_the_unpatched_tokens(dtype):
    cfg, plain, patched = _llama(dtype)
    ids = torch.randint(0, 128, (4, 24), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    with torch.no_grad():
        want, got = plain.generate(ids, **kw), patched.generate(ids, **kw)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # bf16: kernels round differently, so greedy choices between near-equal logits may differ; the logits
        # of one sequence (teacher-forced) must agree to bfloat16's precision
        with torch.no_grad():
            a = patched(want, attention_mask=torch.ones_like(want)).logits.float()
            b = plain(want, attention_mask=torch.ones_like(want)).logits.float()
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2 * float(b.abs().max()))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_patched_llama_compiled_with_a_static_cache_records_once_with_the_unpatched_tokens():
    from torch._dynamo.utils import counters

    cfg, plain, patched = _llama(torch.float32)
    ids = torch.randint(0, 128, (1, 12), device="cuda")

    def decode(model):
        cache = transformers.StaticCache(config=cfg, max_cache_len=64)
        step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        logits = model(ids, past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(12, device="cuda")).logits
        tokens = [logits[:, -1:].argmax(-1)]
        for i in range(40):
            pos = torch.tensor([12 + i], device="cuda")
            logits = step(tokens[-1], past_key_values=cache, use_cache=True, cache_position=pos,
                          position_ids=pos[None]).logits
            tokens.append(logits[:, -1:].argmax(-1).clone())
        return torch.cat(tokens, 1)

    with torch.no_grad():
        torch._dynamo.reset()
        want = decode(plain)
        torch._dynamo.reset()
        counters.clear()
        got = decode(patched)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for 40 positions
    assert not counters["inductor"]["cudagraph_skips"]  # ...run as a CUDA graph
    assert torch.equal(got, want)
