"""headwise.check holds a Hugging Face module to what its family declares in its config: Gemma 2's
query_pre_attn_scalar (scale) and attn_logit_softcapping (softcap), gpt-oss's sinks; a module that breaks its
declaration still fails. A module on the meta device is refused in one line; Gemma 3 (whose rotary takes the
layer's type) is checked like any other."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from headwise import check  # noqa: E402
from headwise.interop import layers, patch  # noqa: E402

ALL = {"permutation_equivariance", "batch_independence", "causality", "padding_invariance", "softmax_sanity",
       "head_independence", "dtype_stability"}
BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, pad_token_id=0, max_position_embeddings=64)


def gemma(model_type: str, **kw) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **kw})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # scores large enough that the softcap bends them
    return model


def _ran(report) -> set[str]:
    return {r.name for r in report.results if r.verdict != "skipped"}


@pytest.mark.parametrize("scalar", [256, 144])
def test_gemma2_passes_with_its_declared_scale_and_softcap(scalar):
    model = gemma("gemma2", query_pre_attn_scalar=scalar, attn_logit_softcapping=5.0)
    for layer in (model.model.layers[1].self_attn, layers(patch(model))[1][1]):
        report = check(layer)
        assert report.ok and _ran(report) == ALL, str(report)
        detail = report["softmax_sanity"].detail
        assert f"scale query_pre_attn_scalar**-0.5 = {scalar}**-0.5 (the config's) fitted on every head" in detail
        assert "softcap 5" in detail


def test_gemma2_breaking_its_declared_scale_or_softcap_fails():
    model = gemma("gemma2", query_pre_attn_scalar=144, attn_logit_softcapping=5.0)
    module = model.model.layers[1].self_attn
    module.scaling = 8 ** -0.5  # the usual 1/sqrt(d_head), not what the config declares
    report = check(module)
    assert report.failed == ["softmax_sanity"], str(report)
    assert "expected 0.0833333 = query_pre_attn_scalar**-0.5 = 144**-0.5" in report["softmax_sanity"].counterexample[
        "summary"]
    module.scaling = 144 ** -0.5
    module.attn_logit_softcapping = None  # the module no longer caps what the config says it caps
    report = check(module)
    assert report.failed == ["softmax_sanity"], str(report)
    assert "capped at 5" in report["softmax_sanity"].counterexample["summary"]


def test_gemma3_is_checked_with_its_per_layer_type_rotary():
    model = gemma("gemma3_text", query_pre_attn_scalar=8, sliding_window=3,
                  layer_types=["sliding_attention", "full_attention"])
    for i, window in ((0, "sliding window 3"), (1, "")):
        report = check(model.model.layers[i].self_attn)
        assert report.ok and _ran(report) == ALL, str(report)
        assert window in report["causality"].detail


def test_a_module_on_the_meta_device_is_refused_in_one_line():
    cfg = transformers.LlamaConfig(**{**BASE, "head_dim": 4})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    for layer in (model.model.layers[0].self_attn, layers(patch(model))[0][1]):
        with pytest.raises(ValueError, match=r"^headwise.check: (LlamaAttention|HFView) has its weights on the meta "
                                             r"device \(q_proj.weight holds no data\); load or materialise them first"):
            check(layer)


def test_gpt2_scaled_by_inverse_layer_index_passes_and_a_layer_ignoring_it_fails():
    cfg = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=3, vocab_size=32, bos_token_id=0, eos_token_id=0,
                                  scale_attn_by_inverse_layer_idx=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").eval()
    attn64 = model.transformer.h[2].attn.double()
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    future = torch.ones(5, 5, dtype=torch.bool).triu(1)
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.float64).masked_fill(future, torch.finfo(torch.float64).min)
    with torch.no_grad():  # layer 2 computes softmax(q . k / sqrt(8) / 3): the scale its config declares
        w = attn64(x, attention_mask=mask, output_attentions=True)[1]
        q, k, _ = attn64.c_attn(x).split(32, dim=-1)
        q, k = (t.view(1, 5, 4, 8).transpose(1, 2) for t in (q, k))
        ref = (q @ k.transpose(-2, -1) / (8 ** 0.5 * 3)).masked_fill(future, -torch.inf).softmax(-1)
    torch.testing.assert_close(w, ref)
    model.float()
    for i in range(3):
        report = check(model.transformer.h[i].attn)
        assert report.ok, str(report)
        assert "scale_attn_by_inverse_layer_idx" in report["softmax_sanity"].detail
    attn = model.transformer.h[2].attn
    attn.scaling = 8 ** -0.5  # layer 2 ignoring its config: 1/sqrt(d_head), not 1/(3 sqrt(d_head))
    report = check(attn)
    assert report.failed == ["softmax_sanity"]
    cex = report["softmax_sanity"].counterexample
    assert abs(cex["expected_scale"] - 8 ** -0.5 / 3) < 1e-12 and "1/sqrt(d_head)" in cex["summary"]


def test_a_softcap_the_scores_never_reach_is_reported_not_checked():
    cfg = transformers.AutoConfig.for_model("gemma2", **{**BASE, "attn_logit_softcapping": 5.0,
                                                         "query_pre_attn_scalar": 8})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    module = model.model.layers[1].self_attn  # its initial weights: scores of ~1e-2, where tanh is linear
    x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q = module.q_proj(x).view(3, 8, 4, 8).transpose(1, 2).double()
        k = module.k_proj(x).view(3, 8, 2, 8).transpose(1, 2).repeat_interleave(2, 1).double()
    scores = q @ k.transpose(-2, -1) * module.scaling
    torch.testing.assert_close(5.0 * torch.tanh(scores / 5.0), scores, rtol=1e-4, atol=1e-9)  # cap invisible
    for cap in (5.0, None, 50.0):  # declared 5; the module's own cap as declared, removed, changed
        module.attn_logit_softcapping = cap
        report = check(module)
        assert report.ok, str(report)
        detail = report["softmax_sanity"].detail
        assert "softcap 5 not checked (the scores never reach its nonlinear range)" in detail, detail
        assert "fitted on every head, softcap" not in detail


def test_deepseek_yarn_mscale_all_dim_is_the_declared_scale_and_a_layer_ignoring_it_fails():
    import math

    factor, mscale_all_dim = 4.0, 0.7
    cfg = transformers.AutoConfig.for_model(
        "deepseek_v3", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        first_k_dense_replace=1, max_position_embeddings=64, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "factor": factor, "mscale": mscale_all_dim,
                         "mscale_all_dim": mscale_all_dim, "original_max_position_embeddings": 16,
                         "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1})
    torch.manual_seed(0)
    module = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval() \
        .model.layers[0].self_attn
    # YaRN's attention factor 0.1 * mscale_all_dim * ln(factor) + 1, squared, on 1/sqrt(nope 4 + rope 4)
    want = (0.1 * mscale_all_dim * math.log(factor) + 1) ** 2 / math.sqrt(8)
    report = check(module)
    assert report.failed == [] and "head_independence" not in _ran(report), str(report)  # latent: NOT VERIFIED
    assert "yarn_apply_mscale" in report["softmax_sanity"].detail
    module.scaling = 8 ** -0.5  # the plain 1/sqrt(d_qk), without the mscale its config declares
    report = check(module)
    assert report.failed == ["softmax_sanity"], str(report)
    cex = report["softmax_sanity"].counterexample
    torch.testing.assert_close(cex["expected_scale"], want, rtol=1e-12, atol=0)
    torch.testing.assert_close(cex["fitted_scale"], 8 ** -0.5, rtol=1e-4, atol=0)
