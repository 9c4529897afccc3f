"""A patched Hugging Face module's path stays short: from its forward (transformers' own) to the kernel a reader
crosses few headwise functions: the attention function, the layer's one trace seam, its checks and plan.

Counted with ``sys.setprofile`` (tests/core/test_call_path.py's counter): every distinct headwise function
(properties included) the call enters.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
from headwise.interop import patch  # noqa: E402

from tests.core.test_call_path import headwise_functions  # noqa: E402


def llama_attention(impl: str):
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl)
    model = patch(transformers.LlamaForCausalLM(cfg).eval())
    x = torch.randn(2, 5, 16)
    position_embeddings = model.model.rotary_emb(x, torch.arange(5)[None])
    return model, model.model.layers[0].self_attn, x, position_embeddings


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_patched_llama_module_runs_at_most_eleven_headwise_functions(impl):
    model, module, x, pe = llama_attention(impl)
    # the mask the model hands its layers: headwise's mask function, materialised for a prefill (bool)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    with torch.no_grad():
        module(x, position_embeddings=pe, attention_mask=mask)  # the first call may import lazily
        called = headwise_functions(lambda: module(x, position_embeddings=pe, attention_mask=mask))
    # the seam, attend, its checks (q/k/v, the call's other arguments, the mask), the plan, the kernel call
    assert len(called) <= 11, called
    assert called[0] == "attention_function.attention_forward", called
    assert "attention.MultiHeadAttention.attend" in called and "functional.attend" in called, called


def test_the_whole_patched_model_enters_the_seam_once_per_layer_call():
    model, module, x, pe = llama_attention("sdpa")
    seams = []
    layer = module.attn
    real = type(layer).attend

    def counted(self, *args, **kwargs):
        seams.append(self)
        return real(self, *args, **kwargs)

    type(layer).attend = counted  # headwise's own class: the count, not a change of transformers
    try:
        with torch.no_grad(), headwise.trace(model, capture=("z",)) as t:
            model(torch.tensor([[1, 5, 7, 3]]))
    finally:
        del type(layer).attend
    assert seams == [layer] and t[0].z.shape == (1, 4, 4, 4)


def test_a_decoding_loop_plans_a_patched_module_once():
    """One query at every token over a growing cache: checked at every call, planned at the first."""
    model, module, x, _ = llama_attention("sdpa")
    past = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 7, 3]])
        out = model(ids, cache=past, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        model(token, cache=past, use_cache=True)  # the first one-query call plans
        token = torch.tensor([[4]])
        called = headwise_functions(lambda: model(token, cache=past, use_cache=True))
    assert "validation.check_qkv" in called and "plan.plan_attention" not in called, called


def test_a_patched_layers_attend_plans_one_query_calls_with_its_hosts_mode():
    """Called directly (dropout None), a view's one-query plan reads the host's train/eval mode and config."""
    model, module, _, _ = llama_attention("sdpa")
    layer = module.attn
    q, k, v = torch.randn(2, 4, 1, 4), torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    with torch.no_grad():
        z, _ = layer.attend(q, k, v)
        want = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.5, -1) @ v.repeat_interleave(2, 1)
        torch.testing.assert_close(z, want)
        module.train()  # attention_dropout 0.0: training changes nothing here
        torch.testing.assert_close(layer.attend(q, k, v)[0], z, rtol=0, atol=0)
