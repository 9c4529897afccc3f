"""``headwise.check`` on a layer whose causal mask is a sliding window (Mistral): a query reads nothing
after itself and nothing more than window - 1 back; the check builds the window the model builds, sizes
decoding masks to the model's sliding cache, and catches a layer that reads past its window."""

from __future__ import annotations

import pytest
import torch

from headwise.checks import check
from headwise.checks.hf_adapter import HFAdapter

transformers = pytest.importorskip("transformers")

from transformers import MistralConfig, MistralForCausalLM  # noqa: E402

WINDOW, SEQ = 3, 8


def tiny_mistral(window=WINDOW, impl="eager"):
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                        max_position_embeddings=64)
    cfg._attn_implementation = impl
    return MistralForCausalLM(cfg).eval()


@pytest.mark.parametrize("impl, patched", [("eager", False), ("sdpa", False), ("sdpa", True)])
def test_a_sliding_window_layer_passes_with_the_window_checked(impl, patched):
    from headwise.interop import patch

    model = tiny_mistral(impl=impl)
    attn = (patch(model) if patched else model).model.layers[0].self_attn
    report = check(attn, seq_len=SEQ)
    assert report.ok, str(report)
    assert f"sliding window {WINDOW}" in report["causality"].detail
    assert "decode" in report["causality"].detail


def test_the_checked_window_is_the_one_the_unpatched_model_applies():
    model = tiny_mistral()
    attn = model.model.layers[0].self_attn
    seen = {}

    def hook(module, args, kwargs, out):  # plain PyTorch hook: what the model itself fed and got
        seen["x"], seen["y"] = kwargs["hidden_states"], out[0]
    handle = attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, 32, (2, SEQ), generator=torch.Generator().manual_seed(1)))
    handle.remove()
    adapter = HFAdapter(attn)
    assert adapter.window == WINDOW
    with torch.no_grad():
        torch.testing.assert_close(adapter.run(seen["x"]), seen["y"])
        full = tiny_mistral(window=None).model.layers[0].self_attn  # same weights, no window
        full.load_state_dict(attn.state_dict())
        assert not torch.allclose(HFAdapter(full).run(seen["x"]), seen["y"])  # the window matters here


def _plain_causal(attention_mask: torch.Tensor) -> torch.Tensor:
    """A bottom-right causal additive mask of ``attention_mask``'s shape and dtype: what a layer that ignores
    its window or chunks would read."""
    s_q, s_kv = attention_mask.shape[-2:]
    blocked = ~torch.ones(s_q, s_kv, dtype=torch.bool).tril(s_kv - s_q)
    return torch.zeros_like(attention_mask).masked_fill(blocked, torch.finfo(attention_mask.dtype).min)


def test_a_layer_that_reads_past_its_window_fails_causality():
    attn = tiny_mistral().model.layers[0].self_attn
    forward = attn.forward

    def wide(hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kw):
        # ignore the window: plain bottom-right causal
        return forward(hidden_states, position_embeddings, _plain_causal(attention_mask), past_key_values, **kw)
    attn.forward = wide
    report = check(attn, seq_len=SEQ, properties=["causality"])
    result = report["causality"]
    assert result.failed and "past its sliding window of 3" in result.detail, str(report)
    assert result.counterexample["output_token"] - result.counterexample["changed_token"] >= WINDOW


CHUNK = 3


def tiny_llama4(impl="eager"):
    cfg = transformers.AutoConfig.for_model(
        "llama4_text", vocab_size=32, hidden_size=16, intermediate_size=32, intermediate_size_mlp=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_local_experts=2,
        num_experts_per_tok=1, attention_chunk_size=CHUNK, no_rope_layers=[1, 0], pad_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_chunked_attention_layer_is_masked_and_decoded_as_its_model_does(impl):
    model = tiny_llama4(impl)
    assert model.config.layer_types[0] == "chunked_attention"
    attn = model.model.layers[0].self_attn
    keep = torch.ones(2, SEQ, dtype=torch.bool)
    keep[1, :2] = False  # left padding: the model counts chunks from the first real token
    seen = {}

    def hook(module, args, kwargs, out):  # plain PyTorch hook: what the model itself fed and got
        seen["x"], seen["y"] = kwargs["hidden_states"], out[0]
    handle = attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(3, 32, (2, SEQ), generator=torch.Generator().manual_seed(1)), attention_mask=keep.long())
    handle.remove()
    adapter = HFAdapter(attn)
    assert adapter.chunk == CHUNK
    with torch.no_grad():
        torch.testing.assert_close(adapter.run(seen["x"], keep=keep)[keep], seen["y"][keep])
        # the model's DynamicCache keeps only the current chunk: prefill then decode gives the full pass
        torch.testing.assert_close(adapter.decode(seen["x"][:1], 4), adapter.run(seen["x"][:1]))
    report = check(attn, seq_len=SEQ)
    assert report.ok, str(report)
    assert "decode" in report["causality"].detail


def test_a_chunked_layer_that_reads_past_its_chunk_fails_causality():
    attn = tiny_llama4().model.layers[0].self_attn
    forward = attn.forward

    def whole(hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kw):
        # ignore the chunks: plain bottom-right causal
        return forward(hidden_states, position_embeddings, _plain_causal(attention_mask), cache, **kw)
    attn.forward = whole
    report = check(attn, seq_len=SEQ, properties=["causality"])
    assert report.failed == ["causality"], str(report)
