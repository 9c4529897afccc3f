"""headwise.check on real implementations: headwise, torch.nn.MultiheadAttention and Hugging Face
BERT / GPT-2 / Llama-family attention (random small configs, nothing downloaded) pass every applicable
property; a real mis-scaled Hugging Face layer is caught."""

from __future__ import annotations

import math

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


@pytest.mark.parametrize("kwargs,named", [({"add_bias_kv": True}, "add_bias_kv=True"),
                                          ({"add_zero_attn": True}, "add_zero_attn=True"),
                                          ({"kdim": 16, "vdim": 16}, "kdim=16, vdim=16")])
def test_torch_multihead_attention_with_keys_beyond_the_tokens_is_refused_naming_the_value(kwargs, named):
    with pytest.raises(ValueError, match=rf"add_bias_kv=False, add_zero_attn=False, kdim = vdim = embed_dim \(32\), "
                                         rf"got {named}$"):
        check(nn.MultiheadAttention(32, 4, **kwargs))


def _torch_contexts(m: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    """Each head's softmax(q k^T / sqrt(d_h)) v from the module's in_proj, in plain PyTorch: (b, h, s, d_h)."""
    b, s, d = x.shape
    q, k, v = (x @ w.T + bias for w, bias in zip(m.in_proj_weight.chunk(3), m.in_proj_bias.chunk(3)))
    q, k, v = (t.view(b, s, m.num_heads, m.head_dim).transpose(1, 2) for t in (q, k, v))
    return (q @ k.transpose(-2, -1) / math.sqrt(m.head_dim)).softmax(-1) @ v


@pytest.mark.parametrize("factor", [0.0, 1e-7])
def test_torch_multihead_attention_with_a_zeroed_or_tiny_head_in_w_o_passes(factor):
    from headwise.checks import adapt

    torch.manual_seed(0)
    m = nn.MultiheadAttention(32, 4, batch_first=True)
    with torch.no_grad():
        m.out_proj.weight[:, :8] *= factor  # head 0's columns of W_O
    report = check(m)
    assert report.ok, str(report)
    m64 = m.double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    w_o = m64.out_proj.weight.clone()
    with torch.no_grad():
        torch.testing.assert_close(adapt(m64).contexts(x), _torch_contexts(m64, x))
    assert torch.equal(m64.out_proj.weight, w_o)  # W_O is put back


def test_headwise_layer_is_held_to_its_declared_scale():
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, scale=0.1).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    q, k = (t.view(2, 5, 4, 8).transpose(1, 2) for t in (layer.q_proj(x), layer.k_proj(x)))
    with torch.no_grad():  # the layer computes what it declares: softmax(0.1 q . k)
        torch.testing.assert_close(layer(x, return_weights=True)[1], (0.1 * q @ k.transpose(-2, -1)).softmax(-1))
    for causal in (False, True):
        report = check(MultiHeadAttention(32, 4, scale=0.1), causal=causal)
        assert report.ok, str(report)
        assert "config.scale = 0.1 (the layer's)" in report["softmax_sanity"].detail


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


# -- the shortest sequence, W_O that cannot be inverted, heads pruned, a declared scale ---------------------
def test_causal_layers_pass_at_the_shortest_sequence_and_a_wrong_scale_still_fails():
    torch.manual_seed(0)
    for layer, causal in [(MultiHeadAttention(32, 4), True), (MultiHeadAttention(32, 4, 2), True),
                          (nn.MultiheadAttention(32, 4, batch_first=True), True), (_llama(), None)]:
        report = check(layer, causal=causal, seq_len=2)
        assert report.ok, str(report)
        assert "fitted on every head" in report["softmax_sanity"].detail
    layer = _llama()
    layer.scaling = 1.0 / layer.head_dim  # one row of two keys cannot tell scales apart: more inputs are drawn
    report = check(layer, seq_len=2)
    assert report.failed == ["softmax_sanity"]
    cex = report["softmax_sanity"].counterexample
    assert "1/d_head" in cex["summary"] and math.isclose(cex["fitted_scale"], 1 / layer.head_dim, rel_tol=1e-3)


def test_head_pruned_bert_self_attention_is_checked():
    from transformers import BertConfig, BertModel

    from headwise.interop import layers, patch
    from headwise.surgery import prune_heads

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=128,
                     vocab_size=100)
    model = prune_heads(patch(BertModel(cfg).eval()), {0: [1, 2]})
    attn = model.encoder.layer[0].attention
    x = torch.randn(2, 5, 64)
    with torch.no_grad():  # without its W_O the module returns the 2 heads left: 32 wide, not d_model
        assert attn.self(x)[0].shape == (2, 5, 32)
    for layer in (attn.self, layers(model)[0][1], attn):
        report = check(layer)
        assert report.ok and _ran(report) == ALL - {"causality"}, str(report)


@pytest.mark.parametrize("where,wrap", [
    ("out_proj", "weight_norm"), ("out_proj", "spectral_norm"), ("out_proj", "orthogonal"),
    ("in_proj_weight", "weight_norm")])
def test_torch_multihead_attention_with_parametrized_projections_passes(where, wrap):
    from torch.nn.utils import parametrizations

    from headwise.checks import adapt

    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 4, batch_first=True)
    if where == "out_proj":
        getattr(parametrizations, wrap)(m.out_proj)
    else:
        getattr(parametrizations, wrap)(m, "in_proj_weight")
    m.eval()
    report = check(m)
    assert report.ok, str(report)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():  # the contexts are W_O's input, also for a parametrized (recomputed) W_O
        torch.testing.assert_close(adapt(m).contexts(x), _torch_contexts(m, x), rtol=1e-5, atol=1e-6)


class _HalfPrecisionOnly(nn.MultiheadAttention):
    """A correct layer that refuses anything but bfloat16 / float16 input (e.g. a half-precision kernel)."""

    def forward(self, q, k, v, **kw):
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError("half precision only")
        return super().forward(q, k, v, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_only_layer_passes_on_a_copy_in_eval_mode(dtype):
    torch.manual_seed(0)
    m = _HalfPrecisionOnly(16, 4, dropout=0.5, batch_first=True, dtype=dtype).train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(2, 3, 16, dtype=dtype, requires_grad=True)
    loss = m(x, x, x)[0].float().square().sum()  # a graph built before the check
    report = check(m)
    assert report.ok, str(report)
    assert report.dtype == str(dtype).replace("torch.", "")
    assert m.training  # the caller's module stays in train mode; the check ran an eval copy
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    loss.backward()  # the caller's tensors were never written to
    assert x.grad is not None


def test_a_head_with_zeroed_queries_passes_with_its_scale_not_determined():
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, n_kv_heads=2)
    with torch.no_grad():
        m.q_proj.weight[:4].zero_()
        m.q_proj.bias[:4].zero_()
        x = torch.randn(1, 5, 16)
        w = m(x, return_weights=True)[1]
    torch.testing.assert_close(w[0, 0], torch.full((5, 5), 0.2))  # constant scores: uniform weights
    report = check(m, causal=True)
    assert report.ok, str(report)
    assert "every head but [0] (constant scores: scale not determined)" in report["softmax_sanity"].detail
    from tests.checks.check_gallery import ScaleOverDHead

    torch.manual_seed(0)
    wrong = ScaleOverDHead()  # the live heads' wrong scale is still caught
    with torch.no_grad():
        wrong.q_proj.weight[:8].zero_()
        wrong.q_proj.bias[:8].zero_()
    report = check(wrong)
    assert report.failed == ["softmax_sanity"], str(report)
    assert "head 1 scales scores by 0.125 = 1/d_head" in report["softmax_sanity"].counterexample["summary"]


def test_hf_llama_with_a_scale_off_by_half_a_percent_is_caught():
    layer = _llama()
    layer.scaling = layer.head_dim ** -0.5 * 1.005
    report = check(layer)
    assert report.failed == ["softmax_sanity"], str(report)
    assert report["softmax_sanity"].counterexample["fitted_scale"] == pytest.approx(layer.scaling, rel=1e-4)


def test_hf_llama_with_peaked_attention_passes():
    layer = _llama(n_heads=4, n_kv_heads=2)
    with torch.no_grad():  # logit ranges of ~100s: its float32 softmax underflows to 0 and subnormals
        layer.q_proj.weight.mul_(60)
        layer.k_proj.weight.mul_(60)
        x = torch.randn(3, 8, 48, generator=torch.Generator().manual_seed(0))
        q = (x @ layer.q_proj.weight.T).view(3, 8, 4, -1).transpose(1, 2)
        k = (x @ layer.k_proj.weight.T).view(3, 8, 2, -1).transpose(1, 2).repeat_interleave(2, 1)
        scores = q.double() @ k.double().transpose(-2, -1) * layer.scaling
    assert float((scores.amax(-1) - scores.amin(-1)).max()) > 100
    report = check(layer, causal=False)
    assert report.ok, str(report)


class _DroppedHead(nn.Module):
    """Plain attention whose head 1 drops its values (its context is always zero): not attention."""

    def __init__(self, d: int = 16, h: int = 4) -> None:
        super().__init__()
        self.d_model, self.n_heads = d, h
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, mask=None, causal=False, return_weights=False):  # type: ignore[no-untyped-def]
        b, s, d = x.shape
        h = self.n_heads
        q, k, v = (p(x).view(b, s, h, d // h).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        v = v.clone()
        v[:, 1] = 0
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // h)
        if causal:
            scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        w = scores.softmax(-1)
        y = self.out_proj((w @ v).transpose(1, 2).reshape(b, s, d))
        return (y, w) if return_weights else y


def test_a_head_that_drops_its_values_fails_head_independence():
    torch.manual_seed(0)
    report = check(_DroppedHead())
    assert not report.ok and "head_independence" in report.failed


def test_a_wrong_scale_on_small_scores_fails():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=16,
                                   num_hidden_layers=1, vocab_size=16, initializer_range=0.005)
    torch.manual_seed(0)
    attn = transformers.LlamaForCausalLM(cfg).model.layers[0].self_attn  # scores of order 1e-4
    attn.scaling = 1.0 / attn.head_dim  # the classic wrong scale
    result = check(attn, properties=["softmax_sanity"])["softmax_sanity"]
    assert result.failed and result.counterexample["expected_scale"] == 0.5


def test_check_seeds_only_its_own_cpu_generator(monkeypatch):
    # torch.manual_seed would also seed every CUDA device (lazily, beyond fork_rng's reach)
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeded.append(seed))
    attn = MultiHeadAttention(16, 4)
    before = torch.random.get_rng_state()
    check(attn, causal=True, seed=7)
    assert seeded == [] and torch.equal(torch.random.get_rng_state(), before)


def test_hooks_on_a_parametrization_do_not_fire_during_the_check():
    from torch.nn.utils.parametrizations import orthogonal, weight_norm

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, n_kv_heads=2)
    weight_norm(attn.q_proj)
    orthogonal(attn.out_proj)
    calls = []
    for sub in attn.modules():
        sub.register_forward_hook(lambda *args: calls.append(1))
    report = check(attn, causal=True)
    assert report.ok and calls == []
