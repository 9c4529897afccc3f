"""AttentionHead: views share storage with the layer, gradients reach it, from_heads packs and refuses."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from headwise import AttentionHead, MultiHeadAttention
from tests.reference import head_reference


def test_head_weights_are_views_in_the_seeds_orientation():
    attn = MultiHeadAttention(d_model=768, n_heads=12, n_kv_heads=4)
    head = attn.head(3)
    assert head.w_q.shape == head.w_k.shape == head.w_v.shape == (768, 64)
    assert head.w_o.shape == (64, 768)
    # No copy: the head's W_Q is a window onto rows 192..255 of the packed q_proj weight.
    assert head.w_q.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(head.w_q, attn.q_proj.weight[192:256].T)
    assert head.kv_index == 1 and torch.equal(head.w_k, attn.k_proj.weight[64:128].T)


def test_writing_to_a_head_changes_the_layer():
    attn = MultiHeadAttention(16, 4, bias=True)
    x = torch.randn(2, 5, 16)
    before = attn(x).detach()
    with torch.no_grad():
        attn.head(2).w_q.mul_(3.0)
    assert torch.equal(attn.q_proj.weight[8:12], (attn.head(2).w_q).T)
    assert not torch.allclose(attn(x), before)
    new = torch.randn(16, 4)
    attn.head(1).w_v = new  # the setter copies into the layer's storage
    assert torch.equal(attn.v_proj.weight[4:8].T, new)
    with pytest.raises(ValueError, match=r"w_v must have shape \(16, 4\), got \(4, 16\)"):
        attn.head(1).w_v = new.T


def test_gradients_through_a_head_reach_the_layer_parameters():
    attn = MultiHeadAttention(16, 4, 2)
    x = torch.randn(2, 5, 16)
    attn.head(3)(x).pow(2).sum().backward()
    g = attn.q_proj.weight.grad
    assert g[12:16].abs().sum() > 0 and g[:12].abs().sum() == 0  # only head 3's W_Q rows
    gk = attn.k_proj.weight.grad
    assert gk[4:8].abs().sum() > 0 and gk[:4].abs().sum() == 0  # its K/V group (head 3 -> kv head 1)


def test_a_head_alone_matches_the_single_head_formula():
    attn = MultiHeadAttention(24, 3, bias=False, dtype=torch.float64)
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    for i, head in enumerate(attn.heads()):
        torch.testing.assert_close(head(x), head_reference(head.w_q, head.w_k, head.w_v, x))
    z, w = attn.head(0)(x[0], return_weights=True)
    assert z.shape == (6, 8) and w.shape == (6, 6)


def test_from_heads_round_trips_exactly():
    for n_kv in (6, 3, 1):
        attn = MultiHeadAttention(24, 6, n_kv, bias=True)
        again = MultiHeadAttention.from_heads(attn.heads(), out_proj=attn.out_proj)
        assert again.n_kv_heads == n_kv
        for (name, a), (_, b) in zip(attn.state_dict().items(), again.state_dict().items()):
            assert torch.equal(a, b), name
        x = torch.randn(2, 4, 24)
        torch.testing.assert_close(again(x), attn(x), rtol=0, atol=0)
        # Packed copies: changing the new layer leaves the old one alone.
        with torch.no_grad():
            again.q_proj.weight.zero_()
        assert attn.q_proj.weight.abs().sum() > 0


def test_from_heads_of_one_layer_brings_its_dropout_and_backend():
    attn = MultiHeadAttention(16, 4, 2, dropout=0.2, backend="eager")
    again = MultiHeadAttention.from_heads(attn.heads(), out_proj=attn.out_proj)
    assert again.config == attn.config and again.backend == "eager"
    assert MultiHeadAttention.from_heads(attn.heads(), out_proj=attn.out_proj, backend="sdpa").backend == "sdpa"
    other = MultiHeadAttention(16, 4, 2, dropout=0.2)
    mixed = MultiHeadAttention.from_heads(attn.heads()[:2] + other.heads()[2:], out_proj=attn.out_proj)
    assert mixed.config.dropout == 0.0 and mixed.backend == "sdpa"  # heads of two layers: neither layer's


def test_from_heads_packs_standalone_heads():
    heads = [AttentionHead(torch.randn(10, 3), torch.randn(10, 3), torch.randn(10, 3)) for _ in range(4)]
    out = nn.Linear(12, 10)
    attn = MultiHeadAttention.from_heads(heads, out_proj=out)
    assert attn.n_heads == 4 and attn.n_kv_heads == 4 and attn.d_head == 3 and attn.q_proj.bias is None
    x = torch.randn(2, 5, 10)
    torch.testing.assert_close(attn(x), out(torch.cat([h(x) for h in heads], dim=-1)))


def test_from_heads_refuses_a_group_whose_kv_differ():
    attn = MultiHeadAttention(24, 6, 2)
    heads = [h.detach_copy() for h in attn.heads()]
    with pytest.raises(ValueError, match="heads 0 and 2 share K/V head 0"):
        with torch.no_grad():
            heads[2]._w_k.add_(1.0)
        MultiHeadAttention.from_heads(heads, out_proj=attn.out_proj, n_kv_heads=2)
    # The same heads with one K/V head each are fine.
    attn2 = MultiHeadAttention.from_heads(heads, out_proj=attn.out_proj, n_kv_heads=6)
    assert attn2.n_kv_heads == 6


def test_from_heads_checks_out_proj_shape():
    attn = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=r"out_proj must map h \* d_head = 16 -> d_model = 16"):
        MultiHeadAttention.from_heads(attn.heads(), out_proj=nn.Linear(8, 16))
    with pytest.raises(TypeError, match="out_proj must be an nn.Linear"):
        MultiHeadAttention.from_heads(attn.heads(), out_proj=attn.out_proj.weight)


def test_from_heads_refusals_name_what_they_received_and_where():
    attn = MultiHeadAttention(16, 4)
    expected = "from_heads needs a non-empty sequence of AttentionHead"
    cases = [([], "got an empty list"), ((), "got an empty tuple"), ("abc", "got str$"), (3, "got int$"),
             (attn.head(0), r"got AttentionHead; pass a list: \[head\]"),
             ([attn.head(0), nn.Linear(2, 2)], "got Linear at position 1$")]
    for heads, received in cases:
        with pytest.raises(TypeError, match=f"^{expected}, {received}"):
            MultiHeadAttention.from_heads(heads, out_proj=attn.out_proj)


def test_head_index_errors():
    attn = MultiHeadAttention(16, 4)
    with pytest.raises(IndexError, match=r"head index must be in \[0, 4\), got 4"):
        attn.head(4)
    with pytest.raises(TypeError, match="head index must be an int"):
        attn.head(1.0)
    assert attn.head(-1).index == 3


def test_head_takes_its_row_of_a_per_head_mask():
    attn = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    mask = torch.rand(2, 4, 5, 5) > 0.4
    mask[..., 0] = True
    y = attn(x, mask=mask)
    alone = torch.cat([attn.head(i)(x, mask=mask) for i in range(4)], -1)
    torch.testing.assert_close(attn.out_proj(alone), y)


@pytest.mark.parametrize("shape", [(1, 2, 4, 5, 5), (2, 4, 5, 7), (4, 6, 5)])
def test_a_refused_mask_is_named_by_the_shape_the_caller_passed(shape):
    attn = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    mask = torch.ones(shape, dtype=torch.bool)
    want = rf"mask of shape \({', '.join(map(str, shape))}\) does not broadcast to \(b, h, s_q, s_kv\) = \(2, 4, 5, 5\)"
    for call in (lambda: attn(x, mask=mask), lambda: attn.head(1)(x, mask=mask)):
        with pytest.raises(ValueError, match=want):
            call()


def test_head_takes_its_row_of_a_3d_per_head_float_mask():
    attn = MultiHeadAttention(16, 4, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    bias = torch.randn(4, 5, 5, dtype=torch.float64)  # (h, s_q, s_kv), ALiBi-like
    alone = torch.cat([attn.head(i)(x, mask=bias) for i in range(4)], -1)
    torch.testing.assert_close(attn.out_proj(alone), attn(x, mask=bias))
    with pytest.raises(ValueError, match="a per-head mask must have h=4 heads on its head axis, got 3"):
        attn.head(0)(x, mask=bias[:3])
    with pytest.raises(ValueError, match="a standalone head takes masks without a head axis"):
        attn.head(0).detach_copy()(x, mask=bias)


# -- projections whose weight is recomputed on use, or packed -------------------------------------------------------
class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


def _norm_rows(g, v):  # weight_norm's formula (dim=0): every row of v scaled to the norm g
    return g * v / v.norm(dim=1, keepdim=True)


# how -> (put it on a projection, its effective weight from the tensors it keeps, take it off, the refusal)
RECOMPUTED = {
    "parametrizations.weight_norm": (
        torch.nn.utils.parametrizations.weight_norm,
        lambda m: _norm_rows(m.parametrizations.weight.original0, m.parametrizations.weight.original1),
        lambda m: torch.nn.utils.parametrize.remove_parametrizations(m, "weight"),
        r"weight is parametrized by _WeightNorm \(remove it with torch\.nn\.utils\.parametrize\.remove_parametrizations"
        r", or write parametrizations\.weight\.original0, parametrizations\.weight\.original1\)"),
    "register_parametrization": (
        lambda m: torch.nn.utils.parametrize.register_parametrization(m, "weight", _Doubled()),
        lambda m: 2 * m.parametrizations.weight.original,
        lambda m: torch.nn.utils.parametrize.remove_parametrizations(m, "weight"),
        r"weight is parametrized by _Doubled .*write parametrizations\.weight\.original\)"),
    "weight_norm hook": (
        torch.nn.utils.weight_norm, lambda m: _norm_rows(m.weight_g, m.weight_v), torch.nn.utils.remove_weight_norm,
        r"weight is recomputed by a WeightNorm hook \(remove it with torch\.nn\.utils\.remove_weight_norm"),
}


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("how", list(RECOMPUTED))
@pytest.mark.parametrize("proj, name", [("q_proj", "w_q"), ("out_proj", "w_o")])
def test_a_head_reads_a_recomputed_weight_and_refuses_to_write_it_changing_nothing(how, proj, name):
    # A write into a weight recomputed on every use would land in a temporary: refused, naming the projection,
    # what recomputes it and how to take it off. Reading gives the weight the layer computes with.
    put, effective, remove, refusal = RECOMPUTED[how]
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, bias=True).eval()
    module = getattr(attn, proj)
    put(module)
    x = torch.randn(2, 5, 16)
    want = attn(x).detach()  # (the hook computes its weight in this first call)
    head = attn.head(1)

    def of(w):  # head 1's part of a whole (out, in) weight, as the head holds it
        return (w[4:8] if name == "w_q" else w[:, 4:8]).T

    torch.testing.assert_close(getattr(head, name), of(effective(module).detach()))
    before = {k: v.clone() for k, v in attn.state_dict().items()}
    with pytest.raises(TypeError, match=rf"cannot write {name} of head 1: {proj} holds a weight recomputed from other "
                                        rf"tensors on every use: {refusal}.*a write into it would be lost"):
        setattr(head, name, torch.zeros_like(getattr(head, name)))
    after = attn.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
    torch.testing.assert_close(attn(x), want, rtol=0, atol=0)
    if proj == "q_proj":  # its bias is stored as it is: written
        head.b_q = torch.zeros(4)
        torch.testing.assert_close(module.bias[4:8], torch.zeros(4), rtol=0, atol=0)
    remove(module)  # the remedy: a plain weight again, which the write reaches
    new = torch.randn(getattr(head, name).shape)
    setattr(head, name, new)
    torch.testing.assert_close(of(module.weight), new, rtol=0, atol=0)


def test_a_head_writes_a_weight_that_views_another_modules_tensor():
    # FSDP's flat parameters: a projection's weight is a plain view of a tensor another module holds, recomputed by
    # nothing; the write lands in that tensor, and the layer computes with it.
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4)
    flat = nn.Parameter(torch.cat([p.detach().flatten() for p in attn.parameters()]))
    holder = nn.Module()
    holder.flat = flat
    del attn.q_proj.weight
    attn.q_proj.weight = flat[:256].view(16, 16)  # q_proj's weight is the first 256 entries of the flat tensor
    new = torch.randn(16, 4)
    attn.head(1).w_q = new
    torch.testing.assert_close(flat.detach()[:256].view(16, 16)[4:8].T, new, rtol=0, atol=0)


def test_a_head_of_a_quantized_layer_refuses_naming_the_packed_module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization and qint8 tensors announce their move to torchao
        quantization = pytest.importorskip("torch.ao.quantization")
        attn = quantization.quantize_dynamic(MultiHeadAttention(16, 4, bias=True), {nn.Linear}, dtype=torch.qint8)
    head = attn.head(0)
    for name, proj in (("w_q", "q_proj"), ("b_k", "k_proj"), ("w_o", "out_proj")):
        with pytest.raises(TypeError, match=rf"{proj} is a torch\.ao\.nn\.quantized\.dynamic\.[\w.]*Linear, whose weight "
                                            r"is packed \(quantized\), not a float tensor: headwise reads float weights"):
            getattr(head, name)
