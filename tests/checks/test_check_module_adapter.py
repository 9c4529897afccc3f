"""How headwise.check reads heads off a module with headwise's calling convention (ModuleAdapter): the K/V head count
where the module does not spell it ``n_kv_heads``, projections whose widths do not fit, and the queries and keys the
scale is fitted on (headwise's own projection steps, QK-norms included; rebuilt from q_proj / k_proj elsewhere)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headwise import MultiHeadAttention
from headwise.checks import ModuleAdapter, check
from headwise.interop.hf.qk_norm import QKNormAttention

from tests.checks.check_gallery import QKNormRef, RefAttention

transformers = pytest.importorskip("transformers")


class GQAByWidth(RefAttention):
    """Correct GQA (4 query heads, 2 K/V heads) whose forward reads the head counts off the projections' widths."""

    def __init__(self) -> None:
        super().__init__(32, 4, 2)

    def project(self, x):
        q, k, v = (self.split(p(x), p.out_features // self.d_head) for p in (self.q_proj, self.k_proj, self.v_proj))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # query head h reads K/V head h // g
        return q, k, v


class NumKVHeads(GQAByWidth):
    """Its K/V head count attribute is spelled num_kv_heads."""

    def __init__(self) -> None:
        super().__init__()
        self.num_kv_heads = self.n_kv_heads
        del self.n_kv_heads


class MisDeclared(GQAByWidth):
    """Declares 4 K/V heads, while k_proj and v_proj hold 2 heads' rows (its forward reads the widths)."""

    def __init__(self) -> None:
        super().__init__()
        self.n_kv_heads = 4


def test_a_gqa_layer_without_an_n_kv_heads_attribute_gets_its_count_from_k_proj():
    torch.manual_seed(0)
    layer = NumKVHeads()
    ad = ModuleAdapter(layer)
    # the reference: k_proj's width over one query head's width
    assert (ad.n_heads, ad.n_kv_heads, ad.d_head) == (4, layer.k_proj.out_features // 8, 8) == (4, 2, 8)
    report = check(layer)
    assert report.ok, str(report)
    assert "4 query heads, 2 K/V heads" in report["head_independence"].detail


def test_projections_that_do_not_fit_the_declared_head_counts_expose_no_heads_saying_why():
    torch.manual_seed(0)
    report = check(MisDeclared())
    assert report.failed == [], str(report)
    why = report["head_independence"].detail
    assert "k_proj has 16 outputs, not n_kv_heads * d_head = 4 * 8" in why and "raised" not in why
    assert "scale not checked" in report["softmax_sanity"].detail


def _qk_norm_attention() -> QKNormAttention:
    torch.manual_seed(0)
    attn = QKNormAttention(d_model=16, n_heads=4, n_kv_heads=2, q_norm=nn.LayerNorm(4), k_norm=nn.LayerNorm(4))
    with torch.no_grad():  # norms that are not the identity
        for p in attn.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return attn


def test_a_headwise_layer_is_fitted_on_its_own_normalised_queries_and_keys():
    attn = _qk_norm_attention()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():  # the reference: the norms over each head's d_h features, written out here
        q = attn.q_norm(attn.q_proj(x).view(2, 5, 4, 4).transpose(1, 2))
        k = attn.k_norm(attn.k_proj(x).view(2, 5, 2, 4).transpose(1, 2))
        got_q, got_k = ModuleAdapter(attn).qk(x)
    torch.testing.assert_close(got_q, q)
    torch.testing.assert_close(got_k, k)
    for causal in (False, True):
        report = check(attn, causal=causal)
        assert report.ok, str(report)
        assert "scale 1/sqrt(4) fitted on every head" in report["softmax_sanity"].detail


class DoubledQueries(QKNormAttention):
    """A QK-norm layer that doubles its normalised queries before the scores: they are scaled by 2/sqrt(d_head) = 1
    (d_head 4) instead of the declared 1/sqrt(d_head)."""

    def attend(self, q, k, v, **kw):
        return super().attend(q * 2, k, v, **kw)


def test_a_headwise_qk_norm_layer_with_a_wrong_scale_still_fails():
    torch.manual_seed(0)
    attn = DoubledQueries(d_model=16, n_heads=4, n_kv_heads=2, q_norm=nn.LayerNorm(4), k_norm=nn.LayerNorm(4))
    report = check(attn)
    assert report.failed == ["softmax_sanity"], str(report)
    assert "scales scores by 1 = 1 (no scale), expected 0.5" in report["softmax_sanity"].counterexample["summary"]


def test_from_hf_qwen3_passes_as_the_hugging_face_module_does():
    from headwise.interop.hf.convert import from_hf

    cfg = transformers.AutoConfig.for_model("qwen3", vocab_size=32, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=4, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf = model.model.layers[0].self_attn
    assert check(hf).ok  # the reference: the unpatched module, read at transformers' interface
    report = check(from_hf(hf), causal=True)
    assert report.ok, str(report)
    assert "fitted on every head" in report["softmax_sanity"].detail


class UserQKNorm(QKNormRef):
    """A correct layer of the user's own with per-head LayerNorms on q and k (no project_q to read them from)."""

    def __init__(self) -> None:
        super().__init__(nn.LayerNorm)


def test_a_users_qk_norm_layer_has_its_scale_reported_not_checked_never_failed_nor_passed():
    torch.manual_seed(0)
    report = check(UserQKNorm())
    assert report.failed == [] and report.not_verified == ["softmax_sanity"], str(report)
    detail = report["softmax_sanity"].detail
    assert "scale not checked" in detail and "q_proj and k_proj" in detail and "q_norm, k_norm" in detail


def test_a_headwise_layer_with_rotary_is_fitted_on_its_rotated_queries_and_keys():
    from headwise import RotaryEmbedding

    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, n_kv_heads=2, rotary=RotaryEmbedding(4))
    report = check(attn, causal=True)
    assert report.ok and "fitted on every head" in report["softmax_sanity"].detail, str(report)
