"""MultiHeadAttention.use_packed_gemm: MKL-packed projections for float32 CPU inference at a fixed row count.

Every test checks the output against the float64 per-head reference (or the same layer's ordinary path) and
records which GEMM ran (a TorchDispatchMode sees ``mkl._mkl_linear`` only on the packed path), so a test
cannot pass by silently taking the ordinary path or by using a stale packed copy.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from headwise import MultiHeadAttention, packed_gemm
from tests.reference import reference_mha

needs_mkl = pytest.mark.skipif(not packed_gemm.available(), reason="this PyTorch build has no MKL packed GEMM")
TOL = dict(rtol=1e-4, atol=1e-5)  # float32 vs float64 reference: see tests/TOLERANCES.md


class _PackedCalls(TorchDispatchMode):
    """Counts packed-GEMM calls (``mkl._mkl_linear``) made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name().startswith("mkl::_mkl_linear"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _layer(**kw) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(48, 6, kw.pop("n_kv_heads", 2), **kw).eval()


def _decode(attn: MultiHeadAttention, x: torch.Tensor, prompt: int) -> tuple[torch.Tensor, int]:
    """Prefill ``prompt`` positions, then decode the rest one token at a time; returns (outputs, packed calls)."""
    cache = attn.new_cache(x.shape[0], x.shape[1])
    with torch.no_grad(), _PackedCalls() as calls:
        outs = [attn(x[:, :prompt], cache=cache)]
        outs += [attn(x[:, t:t + 1], cache=cache) for t in range(prompt, x.shape[1])]
    return torch.cat(outs, dim=1), calls.count


@needs_mkl
@pytest.mark.parametrize("n_kv_heads", [6, 2, 1])
def test_decode_on_packed_gemm_matches_the_float64_reference(n_kv_heads):
    attn = _layer(n_kv_heads=n_kv_heads).use_packed_gemm(rows=1)
    x = torch.randn(1, 7, 48)
    y, calls = _decode(attn, x, prompt=3)
    assert calls == 4 * 4  # four decode steps x (q, k, v, out): the prefill (3 rows) ran the ordinary GEMM
    torch.testing.assert_close(y.double(), reference_mha(attn, x, causal=True)[0], **TOL)
    assert attn.packed_gemm_rows == 1 and sorted(attn._packed) == ["k_proj", "out_proj", "q_proj", "v_proj"]


@needs_mkl
def test_rows_select_the_calls_and_bias_free_layers_work():
    attn = _layer(bias=False).use_packed_gemm(rows=2 * 3)  # b 2 x s_q 3
    x = torch.randn(2, 3, 48)
    with torch.no_grad(), _PackedCalls() as calls:
        y = attn(x)
        y5 = attn(torch.randn(1, 5, 48))
    assert calls.count == 4 and y5.shape == (1, 5, 48)  # the 5-row call ran the ordinary GEMM
    torch.testing.assert_close(y.double(), reference_mha(attn, x)[0], **TOL)


@needs_mkl
@pytest.mark.parametrize("change", ["optimizer step", "load_state_dict", "head view write", ".data replaced"])
def test_a_changed_weight_is_repacked_never_read_stale(change):
    attn = _layer().use_packed_gemm(rows=1)
    x = torch.randn(1, 5, 48)
    before, _ = _decode(attn, x, prompt=2)
    if change == "optimizer step":
        attn.q_proj.weight.grad = torch.randn_like(attn.q_proj.weight)
        torch.optim.SGD(attn.parameters(), lr=0.5).step()
    elif change == "load_state_dict":
        other = _layer()
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(-1.5)
        attn.load_state_dict(other.state_dict())
    elif change == "head view write":
        with torch.no_grad():
            attn.head(2).w_v.mul_(3.0)  # a view of v_proj.weight's rows for head 2's K/V group
    else:
        attn.out_proj.weight.data = attn.out_proj.weight.data * 2  # new storage, same version counter value
    after, calls = _decode(attn, x, prompt=2)
    assert calls == 3 * 4  # every decode step ran packed, on a copy of the changed weights
    assert not torch.allclose(after[:, 2:], before[:, 2:])
    torch.testing.assert_close(after.double(), reference_mha(attn, x, causal=True)[0], **TOL)


@needs_mkl
def test_training_calls_take_the_ordinary_path_and_get_gradients():
    attn = _layer().use_packed_gemm(rows=1)
    plain = _layer()
    x = torch.randn(1, 1, 48)
    with _PackedCalls() as calls:
        attn(x).sum().backward()
    plain(x).sum().backward()
    assert calls.count == 0
    for (name, p), q in zip(attn.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@needs_mkl
def test_hooks_still_fire_and_compiled_calls_trace_the_ordinary_path():
    attn = _layer().use_packed_gemm(rows=1)
    x = torch.randn(1, 1, 48)
    seen = []
    handle = attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad(), _PackedCalls() as calls:
        y = attn(x)
    handle.remove()
    assert seen == [(1, 1, 48)] and calls.count == 3  # q_proj ran as a module (its hook fired); k, v, out packed
    torch.testing.assert_close(y.double(), reference_mha(attn, x)[0], **TOL)
    torch._dynamo.reset()
    compiled = torch.compile(attn, backend="eager", fullgraph=True)  # fullgraph: a graph break would raise
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), y)


@needs_mkl
def test_copies_pickles_and_dtype_changes_drop_packed_copies():
    attn = _layer().use_packed_gemm(rows=1)
    x = torch.randn(1, 1, 48)
    with torch.no_grad():
        y = attn(x)
    for twin in (copy.deepcopy(attn), pickle.loads(pickle.dumps(attn))):
        assert twin._packed == {} and twin.packed_gemm_rows == 1
        with torch.no_grad(), _PackedCalls() as calls:
            torch.testing.assert_close(twin(x), y)
        assert calls.count == 4 and all(p.source.data_ptr() == getattr(twin, n).weight.data_ptr()
                                        for n, p in twin._packed.items())  # packed from its own weights
    attn.double()
    assert attn._packed == {}
    with torch.no_grad(), _PackedCalls() as calls:
        y64 = attn(x.double())
    assert calls.count == 0
    torch.testing.assert_close(y64, reference_mha(attn, x)[0])


@needs_mkl
def test_turning_it_off_frees_the_copies():
    attn = _layer().use_packed_gemm(rows=1)
    assert attn.use_packed_gemm(None) is attn
    assert attn.packed_gemm_rows is None and attn._packed == {}
    with torch.no_grad(), _PackedCalls() as calls:
        attn(torch.randn(1, 1, 48))
    assert calls.count == 0


@needs_mkl
def test_inference_mode_decoding_and_inference_weights():
    attn = _layer()
    x = torch.randn(1, 4, 48)
    with torch.inference_mode():
        attn.use_packed_gemm(rows=1)  # packed inside inference mode, then used under no_grad
    y, calls = _decode(attn, x, prompt=2)
    assert calls == 2 * 4  # the 2-row prefill ran the ordinary GEMM
    torch.testing.assert_close(y.double(), reference_mha(attn, x, causal=True)[0], **TOL)
    with torch.inference_mode():
        made_there = _layer()  # its parameters are inference tensors: no version counter to detect writes
    with pytest.raises(ValueError, match="q_proj.weight is an inference tensor"):
        made_there.use_packed_gemm(rows=1)


@needs_mkl
def test_explain_dispatch_says_which_gemm_the_projections_run():
    attn = _layer().use_packed_gemm(rows=1)
    one = attn.explain_dispatch(torch.randn(1, 1, 48), cache=attn.new_cache(1, 4))
    four = attn.explain_dispatch(torch.randn(2, 2, 48))
    assert any("rows run MKL's packed GEMM" in r for r in one.reasons)
    assert any("b*s_q = 4 rows run the ordinary GEMM" in r for r in four.reasons)
    assert not any("GEMM" in r for r in _layer().explain_dispatch(torch.randn(1, 1, 48)).reasons)


@pytest.mark.parametrize("rows", [0, -1, True, 1.0, "1"])
def test_bad_rows_are_refused(rows):
    with pytest.raises(ValueError, match=f"rows must be a positive int.*got {rows!r}"):
        _layer().use_packed_gemm(rows=rows)


@needs_mkl
def test_non_float32_weights_are_refused_naming_the_dtype():
    attn = _layer().to(torch.float64)
    with pytest.raises(TypeError, match=r"float32 weights on the CPU; q_proj.weight is torch.float64 on cpu"):
        attn.use_packed_gemm(rows=1)
    assert attn.packed_gemm_rows is None


def test_a_build_without_mkl_says_so(monkeypatch):
    monkeypatch.setattr(packed_gemm, "available", lambda: False)
    attn = _layer()
    with pytest.raises(RuntimeError, match="no MKL packed GEMM"):
        attn.use_packed_gemm(rows=1)
    assert attn.packed_gemm_rows is None and attn._packed == {}
