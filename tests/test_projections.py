"""Packed projections: W_Q, W_K, W_V stored as blocks of one (d_in, total) matrix, one product without autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from headwise import MultiHeadAttention
from headwise.functional import split_heads
from headwise.projections import packed_weight
from tests.reference import reference_mha


class LinearCalls(torch.overrides.TorchFunctionMode):
    """Counts F.linear calls (one per projection product)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _qkv(attn):
    return attn.q_proj, attn.k_proj, attn.v_proj


@pytest.mark.parametrize("n_kv_heads, bias", [(8, True), (2, False), (1, True)])
def test_packed_product_equals_the_three_products_and_the_float64_reference(n_kv_heads, bias):
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 8, n_kv_heads, bias=bias).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad(), LinearCalls() as calls:
        packed = attn(x, causal=True)
    assert calls.n == 2  # Q, K, V in one product, then W_O
    with LinearCalls() as calls:
        three = attn(x, causal=True)  # autograd records: three products
    assert calls.n == 4
    torch.testing.assert_close(packed, three.detach())
    torch.testing.assert_close(packed, reference_mha(attn, x, causal=True)[0].float(), rtol=1e-4, atol=1e-5)


def test_state_dict_is_the_ordinary_one():
    attn = MultiHeadAttention(16, 4, 2)
    sd = attn.state_dict()
    assert list(sd) == ["q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
                        "v_proj.bias", "out_proj.weight", "out_proj.bias"]
    assert [tuple(sd[k].shape) for k in ("q_proj.weight", "k_proj.weight", "out_proj.weight")] == \
        [(16, 16), (8, 16), (16, 16)]
    plain = nn.Linear(16, 8)
    plain.load_state_dict({"weight": sd["k_proj.weight"], "bias": sd["k_proj.bias"]})
    x = torch.randn(3, 16)
    torch.testing.assert_close(plain(x), attn.k_proj(x))


def test_packing_survives_deepcopy_and_load_state_dict_and_both_stay_correct():
    torch.manual_seed(1)
    a, b = MultiHeadAttention(16, 4, 2).eval(), MultiHeadAttention(16, 4, 2).eval()
    b.load_state_dict(a.state_dict())
    c = copy.deepcopy(a)
    x = torch.randn(2, 3, 16)
    for m in (b, c):
        assert packed_weight(_qkv(m)) is not None and m.out_proj.weight.stride() == (1, 16)
        with torch.no_grad():
            torch.testing.assert_close(m(x), a(x).detach())


@pytest.mark.parametrize("how", ["to float64", "replaced weight", "hook", "subclass"])
def test_anything_that_breaks_the_packing_falls_back_to_three_products(how):
    torch.manual_seed(2)
    attn = MultiHeadAttention(16, 4, 2).eval()
    x = torch.randn(2, 3, 16)
    seen = []
    if how == "to float64":
        attn, x = attn.double(), x.double()
    elif how == "replaced weight":
        attn.k_proj.weight = nn.Parameter(attn.k_proj.weight.detach().clone())
    elif how == "hook":
        attn.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    else:
        class Wrapped(nn.Linear):
            pass
        w = Wrapped(16, 8)
        w.load_state_dict(attn.k_proj.state_dict())
        attn.k_proj = w
    packed = packed_weight(_qkv(attn))
    if how == "to float64":  # .to() converts each parameter on its own; the layer packs them again
        assert packed is not None and packed[0].dtype == torch.float64
    else:
        assert packed is None
    with torch.no_grad():
        y = attn(x)
    torch.testing.assert_close(y, attn(x).detach())
    torch.testing.assert_close(y, reference_mha(attn, x)[0].to(y.dtype), rtol=1e-4, atol=1e-5)
    if how == "hook":
        assert seen == [(2, 3, 8), (2, 3, 8)]  # the hook ran on both calls


def test_a_write_through_a_head_view_reaches_the_packed_product():
    attn = MultiHeadAttention(16, 4).eval()
    with torch.no_grad():
        attn.head(2).w_v = torch.zeros(16, 4)
        attn.v_proj.bias[8:12] = 0
        z = attn.project_qkv(torch.randn(1, 3, 16))[2]
    assert torch.equal(z[:, 2], torch.zeros(1, 3, 4))


def test_checkpoints_round_trip_through_torch_save_and_safetensors(tmp_path):
    torch.manual_seed(3)
    attn = MultiHeadAttention(16, 4, 2)
    x = torch.randn(1, 3, 16)
    torch.save(attn.state_dict(), tmp_path / "a.pt")
    other = MultiHeadAttention(16, 4, 2)
    other.load_state_dict(torch.load(tmp_path / "a.pt", weights_only=True))
    torch.testing.assert_close(other(x), attn(x))
    safetensors = pytest.importorskip("safetensors.torch")
    # safetensors stores contiguous tensors only (its documented rule): pass contiguous copies
    safetensors.save_file({k: v.contiguous() for k, v in attn.state_dict().items()}, tmp_path / "a.safetensors")
    third = MultiHeadAttention(16, 4, 2)
    third.load_state_dict(safetensors.load_file(tmp_path / "a.safetensors"))
    torch.testing.assert_close(third(x), attn(x))
    assert packed_weight(_qkv(third)) is not None  # loading copies into the packed storage


@pytest.mark.parametrize("how", ["data reassigned", "replaced weight", "hook", "module swapped", "values edited"])
def test_the_remembered_packing_follows_changes_made_after_a_first_call(how):
    # The layer remembers its packed weight between calls; every change after the first call must reach
    # the next output (reference: the float64 formula on the layer's current weights).
    torch.manual_seed(4)
    attn = MultiHeadAttention(16, 4, 2).eval()
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        attn(x)  # remembers the packing
        new = torch.randn(8, 16)
        if how == "data reassigned":
            attn.k_proj.weight.data = new.clone()  # the same Parameter, somewhere else in memory
        elif how == "replaced weight":
            attn.k_proj.weight = nn.Parameter(new.clone())
        elif how == "hook":
            attn.k_proj.register_forward_hook(lambda m, i, o: o * 2)
        elif how == "module swapped":
            swapped = nn.Linear(16, 8)
            swapped.weight.copy_(new)
            attn.k_proj = swapped
        else:
            attn.k_proj.weight.copy_(new)  # in place: the packed view sees it
        y = attn(x)
    want = reference_mha(attn, x)[0].to(y.dtype)
    if how == "hook":  # the reference reads weights, not hooks: build it from the module calls (hook included)
        with torch.no_grad():
            q, (k, v) = attn.project_q(x), attn.project_kv(x)  # the hook doubles k
            want = attn.project_out(torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_kv_heads, bias", [(4, True), (2, False)])
def test_a_large_packed_product_on_fresh_pages_equals_the_three_products(monkeypatch, n_kv_heads, bias):
    """Every size takes the mapped path (a long prompt's Q/K/V): the same values as the three products with
    autograd, the float64 reference, in inference mode and for a non-contiguous input."""
    from headwise import buffers

    monkeypatch.setattr(buffers, "HUGE_BYTES", 0)
    monkeypatch.setattr(buffers, "MAPPED_BYTES", 0)
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, n_kv_heads, bias=bias).eval()
    x = torch.randn(5, 2, 32).transpose(0, 1)  # (b, s, d), not contiguous
    three = attn(x, causal=True).detach()
    with torch.no_grad():
        q, k, v = attn.project_qkv(x)
        packed = attn(x, causal=True)
    with torch.inference_mode():
        inference = attn(x, causal=True)
    want = [attn.project_q(x), *attn.project_kv(x)]
    for got, ref in zip((q, k, v), want):
        torch.testing.assert_close(got, ref.detach())
    torch.testing.assert_close(packed, three)
    torch.testing.assert_close(inference, three)
    torch.testing.assert_close(packed, reference_mha(attn, x, causal=True)[0].float(), rtol=1e-4, atol=1e-5)


def test_a_packed_product_under_autocast_is_f_linear_s(monkeypatch):
    """Autocast decides the product's dtype: the mapped path (which writes in the input's dtype) stays out."""
    from headwise import buffers

    monkeypatch.setattr(buffers, "MAPPED_BYTES", 0)
    monkeypatch.setattr(buffers, "HUGE_BYTES", 0)
    attn = MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        q, _, _ = attn.project_qkv(x)
        want = attn.q_proj(x)
    assert q.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(q, split_heads(want, 4))


def test_a_jit_trace_of_a_long_prompt_does_not_keep_one_output_buffer(monkeypatch):
    """A trace records tensors it did not see made as constants: the mapped output would be one buffer that
    every call of the traced function overwrites (the first call's queries would change under the second).
    Traced, the product is F.linear's."""
    from headwise import buffers

    monkeypatch.setattr(buffers, "MAPPED_BYTES", 0)
    monkeypatch.setattr(buffers, "HUGE_BYTES", 0)
    class Queries(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = MultiHeadAttention(32, 4).eval()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn.project_qkv(x)[0]

    torch.manual_seed(0)
    queries = Queries()
    attn = queries.attn
    x1, x2 = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    with torch.no_grad():
        traced = torch.jit.trace(queries, (x1,), check_trace=False)
        first = traced(x1)
        second = traced(x2)
        torch.testing.assert_close(first, attn.project_q(x1))
        torch.testing.assert_close(second, attn.project_q(x2))


class SDPAInputs(torch.overrides.TorchFunctionMode):
    """Records the k, v that reach F.scaled_dot_product_attention."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.kv.append((args[1], args[2]))
        return func(*args, **(kwargs or {}))


def test_a_grouped_layer_s_kernel_reads_k_v_rows_of_their_own_width_and_the_cache_in_place():
    """GQA without a cache: K/V reach SDPA laid out (b, s_kv, h_kv, d_h), not as views into the packed
    product (whose rows are h + 2 h_kv heads wide); with a cache, SDPA reads the cache itself, uncopied.
    The values are the float64 reference's either way."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 8, 2).eval()  # rows: packed 48 wide, K/V 8 wide each
    x = torch.randn(2, 5, 32)
    with torch.no_grad(), SDPAInputs() as seen:
        y = attn(x, causal=True)
    (k, v), = seen.kv
    assert k.stride() == v.stride() == (5 * 8, 4, 8, 1)
    torch.testing.assert_close(y, reference_mha(attn, x, causal=True)[0].float(), rtol=1e-4, atol=1e-5)
    cache = attn.new_cache(2, 8)
    with torch.no_grad(), SDPAInputs() as seen:
        steps = [attn(x[:, :4], cache=cache), attn(x[:, 4:], cache=cache)]
    assert all(k.data_ptr() == cache.keys.data_ptr() and v.data_ptr() == cache.values.data_ptr()
               for k, v in seen.kv)
    torch.testing.assert_close(torch.cat(steps, 1), reference_mha(attn, x, causal=True)[0].float(),
                               rtol=1e-4, atol=1e-5)
