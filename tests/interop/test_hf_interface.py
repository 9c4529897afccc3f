"""headwise registered as a transformers attention implementation ("headwise"): the function against a float64
reference written from the formula (under autocast, torch's own sdpa), and whole tiny models against their own
eager or sdpa implementation.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise.interop  # noqa: E402,F401  (registers "headwise")
from headwise.interop import patch  # noqa: E402
from headwise.interop.hf.attention_function import attention_forward, mask  # noqa: E402

from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402


def reference(q, k, v, mask=None, scale=None, causal=False, bias=None):
    """softmax(q k^T * scale + bias + mask) v per head in float64; query head i reads K/V head i // g."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias.double()
    s_q, s_kv = scores.shape[-2:]
    if causal:
        scores = scores.masked_fill(~torch.ones(s_q, s_kv, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)  # (b, s_q, h, d_v)


class Module(torch.nn.Module):
    def __init__(self, causal: bool, family: str = "llama") -> None:
        super().__init__()
        self.is_causal = causal
        self.config = transformers.AutoConfig.for_model(family)


def qkv(b=2, h=4, h_kv=2, s_q=5, s_kv=5, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, s_q, d, generator=g), torch.randn(b, h_kv, s_kv, d, generator=g),
            torch.randn(b, h_kv, s_kv, d, generator=g))


def test_importing_headwise_interop_registers_the_function_and_its_mask():
    assert ALL_ATTENTION_FUNCTIONS["headwise"] is attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["headwise"] is mask


def test_import_headwise_alone_does_not_import_transformers():
    code = "import sys, headwise; headwise.MultiHeadAttention; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("causal", [True, False])
def test_no_mask_follows_the_module_is_causal_flag(causal):
    q, k, v = qkv()
    out, weights = attention_forward(Module(causal), q, k, v, None, scaling=0.3)
    torch.testing.assert_close(out, reference(q, k, v, scale=0.3, causal=causal).float())
    assert weights is None


def test_without_a_mask_the_is_causal_keyword_wins_over_the_module_flag():
    q, k, v = qkv()
    out, _ = attention_forward(Module(False), q, k, v, None, is_causal=True)
    torch.testing.assert_close(out, reference(q, k, v, causal=True).float())
    out, _ = attention_forward(Module(True), q, k, v, None, is_causal=False)
    torch.testing.assert_close(out, reference(q, k, v).float())


def test_sinks_per_query_row_take_part_in_the_softmax_and_s_aux_with_them_is_refused():
    from tests.reference import reference_heads

    q, k, v = qkv(s_q=3, s_kv=7)
    sinks = torch.randn(2, 4, 3, 1, generator=torch.Generator().manual_seed(5))  # (b, h, s_q, 1), Inkling 2's
    out, weights = attention_forward(Module(False), q, k, v, None, sinks=sinks, output_attentions=True)
    ref_z, ref_w = reference_heads(q, k, v, sinks=sinks)
    torch.testing.assert_close(out, ref_z.transpose(1, 2).float())
    torch.testing.assert_close(weights, ref_w.float())
    with pytest.raises(ValueError, match=r"both s_aux \(a sink per head\) and sinks \(a sink per query row\)"):
        attention_forward(Module(False), q, k, v, None, sinks=sinks, s_aux=torch.zeros(4))


@pytest.mark.parametrize("name", ["indices", "block_indices"])
def test_a_sparse_selection_is_refused_never_ignored(name):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=rf"Module handed headwise a sparse attention selection \({name}=\.\.\.\)"):
        attention_forward(Module(True), q, k, v, None, **{name: torch.zeros(2, 5, 3, dtype=torch.long)})
    out, _ = attention_forward(Module(True), q, k, v, None, **{name: None})  # a family's None is no selection
    torch.testing.assert_close(out, reference(q, k, v, causal=True).float())


def test_a_bool_mask_and_output_attentions_give_the_weights():
    q, k, v = qkv(s_q=3, s_kv=7)
    mask = torch.rand(2, 1, 3, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    out, weights = attention_forward(Module(True), q, k, v, mask, output_attentions=True)
    torch.testing.assert_close(out, reference(q, k, v, mask=mask).float())
    assert weights.shape == (2, 4, 3, 7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 3))


def test_an_empty_static_cache_prefill_crops_to_the_queries_like_sdpa():
    q, k, v = qkv(s_q=4, s_kv=9)
    out, _ = attention_forward(Module(True), q, k, v, None)
    torch.testing.assert_close(out, reference(q, k[:, :, :4], v[:, :, :4], causal=True).float())


def test_a_position_bias_is_added_to_the_scores():
    q, k, v = qkv(h=3, h_kv=3)
    bias = torch.randn(1, 3, 5, 5, generator=torch.Generator().manual_seed(2))
    out, _ = attention_forward(Module(False), q, k, v, None, position_bias=bias)
    torch.testing.assert_close(out, reference(q, k, v, bias=bias).float())
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[1, ..., :2] = False
    out, _ = attention_forward(Module(False), q, k, v, mask, position_bias=bias)
    torch.testing.assert_close(out, reference(q, k, v, bias=bias, mask=mask).float())


def test_value_heads_wider_than_query_heads():
    q, k, _ = qkv(d=6)
    v = torch.randn(2, 2, 5, 10)
    out, _ = attention_forward(Module(True), q, k, v, None)
    assert out.shape == (2, 5, 4, 10)
    torch.testing.assert_close(out, reference(q, k, v, causal=True).float())


def test_a_dtype_mix_is_computed_in_the_autocast_dtype_under_autocast_and_refused_outside():
    # Llama-style rotary hands over float32 q, k beside an autocast (bfloat16) v: transformers' sdpa casts all three.
    q, k, v = qkv(s_q=3, s_kv=7)
    v = v.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention_forward(Module(False), q, k, v, None)
        want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want.transpose(1, 2))
    with pytest.raises(TypeError, match=r"^q, k, v must share a dtype; got torch.float32, torch.float32, "
                                        r"torch.bfloat16$"):
        attention_forward(Module(False), q, k, v, None)


def tiny(model_type: str, impl: str, **kw) -> torch.nn.Module:
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = transformers.AutoConfig.for_model(model_type, **{**base, **kw})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()


IDS = torch.tensor([[1, 5, 7, 3, 9], [2, 4, 6, 8, 10]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])  # left padding


@pytest.mark.parametrize("model_type", ["llama", "phi3", "gpt_neox", "mixtral"])
def test_attn_implementation_headwise_at_load_equals_eager(model_type):
    kw = dict(num_local_experts=2, num_experts_per_tok=1) if model_type == "mixtral" else {}
    eager, ours = tiny(model_type, "eager", **kw), tiny(model_type, "headwise", **kw)
    assert ours.config._attn_implementation == "headwise"
    with torch.no_grad():
        want, got = eager(IDS, attention_mask=MASK).logits, ours(IDS, attention_mask=MASK).logits
    # The padded query (row 1, position 0) may read nothing: eager averages every key, headwise gives zeros.
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1, 1:], want[1, 1:])


def test_set_attn_implementation_headwise_and_back():
    model = tiny("llama", "sdpa")
    with torch.no_grad():
        want = model(IDS).logits
        model.set_attn_implementation("headwise")
        got = model(IDS).logits
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(got, want)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("model_type", ["llama", "gpt_neox"])
def test_config_output_attentions_keeps_transformers_rule_and_the_call_gives_eagers_weights(model_type):
    eager, ours = tiny(model_type, "eager"), tiny(model_type, "headwise")
    eager.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions"):  # transformers' rule for every implementation but eager
        ours.config.output_attentions = True
    assert ours.config.output_attentions is False
    with torch.no_grad():
        want, got = eager(IDS).attentions, ours(IDS, output_attentions=True).attentions
    assert len(got) == len(want) == eager.config.num_hidden_layers
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_weights_are_computed_exactly_when_the_call_asks_for_them(monkeypatch):
    """The eager path (the only one that materialises weights) runs for a call whose output_attentions reaches the
    attention function, and for no other."""
    import headwise.functional as hwf

    eager, ours = tiny("phi3", "eager"), tiny("phi3", "headwise")
    softmax_calls = []
    real = hwf.softmax_attention
    monkeypatch.setattr(hwf, "softmax_attention", lambda *a, **k: softmax_calls.append(1) or real(*a, **k))
    with torch.no_grad():
        out = ours(IDS, output_attentions=True)
        want = eager(IDS, output_attentions=True)
        assert softmax_calls and len(out.attentions) == 1
        torch.testing.assert_close(out.attentions[0], want.attentions[0])
        softmax_calls.clear()
        out = ours(IDS)  # the fused path
        assert not softmax_calls and out.attentions is None
        torch.testing.assert_close(out.logits, want.logits)


def test_the_mask_is_materialised_for_every_prefill_and_skipped_only_for_one_query():
    config = transformers.AutoConfig.for_model("llama")
    causal = mask(batch_size=1, q_length=4, kv_length=4, config=config)
    torch.testing.assert_close(causal, torch.ones(1, 1, 4, 4, dtype=torch.bool).tril())
    from transformers.masking_utils import bidirectional_mask_function

    both = mask(batch_size=1, q_length=4, kv_length=4, config=config, mask_function=bidirectional_mask_function,
                allow_is_bidirectional_skip=True)
    torch.testing.assert_close(both, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    assert mask(batch_size=1, q_length=1, kv_length=4, kv_offset=0, q_offset=3, config=config) is None


def test_an_eager_only_family_whose_decoder_says_is_causal_false_equals_eager():
    cfg = transformers.AutoConfig.for_model("bigbird_pegasus", vocab_size=64, d_model=16, encoder_layers=1,
                                            decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                                            encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BigBirdPegasusForCausalLM(cfg).eval()
    assert model.model.decoder.layers[0].self_attn.is_causal is False  # what its sdpa path would trust
    with torch.no_grad():
        want = model(IDS).logits
        model.set_attn_implementation("headwise")
        got = model(IDS).logits
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("how", ["patch from sdpa", "patch from eager", "attn_implementation"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_rotary_families_under_autocast_equal_the_unpatched_model(model_type, how):
    plain = tiny(model_type, "eager" if how == "patch from eager" else "sdpa", head_dim=4)
    ours = copy.deepcopy(plain)
    if how == "attn_implementation":
        ours.set_attn_implementation("headwise")
    else:
        patch(ours)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(IDS, attention_mask=MASK, output_attentions=how == "patch from eager")
        got = ours(IDS, attention_mask=MASK, output_attentions=how == "patch from eager")
    assert got.logits.dtype == want.logits.dtype == torch.bfloat16
    torch.testing.assert_close(got.logits, want.logits)  # every position, the padded one included
    if how == "patch from eager":  # weights in the dtype transformers' eager returns them in
        for w, g in zip(want.attentions, got.attentions):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, atol=4e-3, rtol=0)  # bfloat16 products apart
