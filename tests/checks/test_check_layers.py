"""headwise.check on real implementations: headwise, torch.nn.MultiheadAttention and Hugging Face
BERT / GPT-2 / Llama-family attention (random small configs, nothing downloaded) pass every applicable
property; a real mis-scaled Hugging Face layer is caught."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headwise import MultiHeadAttention, RotaryEmbedding
from headwise.checks import check

ALL = {"permutation_equivariance", "batch_independence", "causality", "padding_invariance", "softmax_sanity",
       "head_independence", "dtype_stability"}


def _ran(report) -> set[str]:
    return {r.name for r in report.results if r.verdict != "skipped"}


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("causal", [False, True])
def test_headwise_passes(n_kv_heads, causal):
    report = check(MultiHeadAttention(64, 8, n_kv_heads), causal=causal)
    assert report.ok, str(report)
    assert _ran(report) == (ALL if causal else ALL - {"causality"})
    if causal:
        assert "decode" in report["causality"].detail  # the KV-cache path was compared too


def test_headwise_with_rotary_passes_with_positions_moved_along():
    attn = MultiHeadAttention(32, 4, 2, rotary=RotaryEmbedding(8))
    report = check(attn, causal=True)
    assert report.ok and _ran(report) == ALL, str(report)
    assert "positions" in report["permutation_equivariance"].detail


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_multihead_attention_passes(batch_first, causal):
    m = nn.MultiheadAttention(32, 4, batch_first=batch_first)
    report = check(m, causal=causal)
    assert report.ok, str(report)
    assert _ran(report) == (ALL if causal else ALL - {"causality"})


# -- Hugging Face -------------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _bert(cls_name):
    from transformers import BertConfig
    from transformers.models.bert import modeling_bert

    cfg = BertConfig(hidden_size=48, num_attention_heads=4, intermediate_size=32, num_hidden_layers=1,
                     vocab_size=16, attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1)
    return getattr(modeling_bert, cls_name)(cfg)


def _gpt2(**kw):
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    cfg = GPT2Config(n_embd=48, n_head=4, n_layer=1, vocab_size=16, bos_token_id=0, eos_token_id=0, **kw)
    return GPT2Attention(cfg, layer_idx=0)


def _llama(family="llama", n_heads=4, n_kv_heads=2, **kw):
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cfg_cls = getattr(importlib.import_module(f"transformers.models.{family}.configuration_{family}"),
                      {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}[family])
    cfg = cfg_cls(hidden_size=48, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                  intermediate_size=32, num_hidden_layers=1, vocab_size=16, **kw)
    cls = {"llama": "LlamaAttention", "mistral": "MistralAttention", "qwen2": "Qwen2Attention"}[family]
    return getattr(mod, cls)(cfg, layer_idx=0)


@pytest.mark.parametrize("cls_name", ["BertAttention", "BertSelfAttention"])
def test_hf_bert_passes(cls_name):
    layer = _bert(cls_name).train()  # train mode on purpose: the check runs a copy in eval mode
    report = check(layer)
    assert report.ok and _ran(report) == ALL - {"causality"}, str(report)
    assert layer.training


def test_hf_gpt2_passes_and_decodes_with_its_cache():
    report = check(_gpt2())
    assert report.ok and _ran(report) == ALL, str(report)
    assert "decode" in report["causality"].detail


@pytest.mark.parametrize("family,n_heads,n_kv_heads", [
    ("llama", 4, 4), ("llama", 4, 2), ("llama", 4, 1), ("mistral", 6, 2), ("qwen2", 4, 2)])
def test_hf_llama_family_passes(family, n_heads, n_kv_heads):
    layer = _llama(family, n_heads, n_kv_heads)
    report = check(layer)
    assert report.ok and _ran(report) == ALL, str(report)
    assert "positions" in report["permutation_equivariance"].detail and "decode" in report["causality"].detail


def test_hf_gpt2_without_scaling_is_caught():
    report = check(_gpt2(scale_attn_weights=False))  # a real config switch: scores not scaled at all
    assert report.failed == ["softmax_sanity"]
    assert report["softmax_sanity"].counterexample["summary"].find("no scale") > 0


def test_hf_llama_with_a_broken_scale_is_caught():
    layer = _llama()
    layer.scaling = 1.0 / layer.head_dim  # the classic 1/d_head
    report = check(layer)
    assert report.failed == ["softmax_sanity"]
    assert "1/d_head" in report["softmax_sanity"].counterexample["summary"]


def test_unsupported_hf_module_is_refused():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    with pytest.raises(TypeError, match="no headwise.check adapter"):
        check(GPT2MLP(8, GPT2Config(n_embd=4, n_head=1)))


def _patched(family):
    from headwise.interop import patch
    from tests.interop.tiny_models import build

    model = patch(build(family))
    return [m for m in model.modules() if "attn" in vars(m)][0]


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "qwen3", "bert"])
def test_hf_attention_patched_by_headwise_passes(family):
    layer = _patched(family)
    report = check(layer)
    assert report.ok, str(report)
    assert _ran(report) == (ALL - {"causality"} if family == "bert" else ALL), str(report)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_hf_attention_with_heads_removed_passes(family):
    """A module resized by headwise.surgery (GPT-2's c_attn is then narrower than n_embd) is still attention."""
    from headwise.interop import layers, patch
    from headwise.surgery import prune_heads
    from tests.interop.tiny_models import build

    model = prune_heads(patch(build(family)), {0: [1]})
    name, attn = layers(model)[0]
    assert attn.n_heads == layers(patch(build(family)))[0][1].n_heads - 1
    # BERT's self-attention returns the heads' context (now narrower than d): check it with its W_O
    report = check(model.get_submodule(name.removesuffix(".self")))
    assert report.ok, str(report)
    assert _ran(report) == (ALL - {"causality"} if family == "bert" else ALL), str(report)


def test_a_patched_layer_with_a_broken_scale_is_caught():
    layer = _patched("llama")  # the check runs the patched module: the scale it hands headwise is what it sees
    layer.scaling = 1.0 / layer.attn.config.d_head
    report = check(layer)
    assert report.failed == ["softmax_sanity"] and "1/d_head" in report["softmax_sanity"].counterexample["summary"]


def test_a_non_finite_rotary_attention_scaling_is_refused():
    with pytest.raises(ValueError, match="attention_scaling must be a positive finite float, got nan"):
        RotaryEmbedding(4, attention_scaling=float("nan"))  # refused where it is made
    layer = MultiHeadAttention(16, 4, rotary=RotaryEmbedding(4))
    layer.rotary.attention_scaling = float("nan")  # set afterwards: the check refuses it
    with pytest.raises(ValueError, match="attention_scaling must be a finite number, got nan"):
        check(layer, causal=True)
    patched = _patched("llama")  # the module rotates with the model's own rotary class: the check builds one
    patched.config.rope_parameters = {**patched.config.rope_parameters, "rope_type": "yarn", "factor": float("inf")}
    with pytest.raises(ValueError, match="attention_scaling must be a finite number, got"):
        check(patched)
