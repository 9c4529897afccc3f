"""Every bad input to the layer's forward gets a clear error naming expected and received."""

from __future__ import annotations

import warnings

import pytest
import torch
import numpy as np
import torch.nn.functional as F

from headwise import AttentionConfig, MultiHeadAttention
from headwise import AttentionConfig, AttentionHead, KVCache, MaterializationWarning, MultiHeadAttention
from headwise import RotaryEmbedding
from headwise import functional as hwf
from headwise import masks as hwm


ATTN = MultiHeadAttention(16, 4, 2)
X = torch.randn(2, 3, 16)

CASES = [
    ("width", lambda: ATTN(torch.randn(2, 3, 12)), ValueError,
     r"x must have shape \(b, s, d_model=16\) or \(s, d_model=16\), got \(2, 3, 12\)"),
    ("rank", lambda: ATTN(torch.randn(16)), ValueError, r"got \(16,\)"),
    ("not a tensor", lambda: ATTN([[1.0] * 16]), TypeError, "x must be a torch.Tensor, got list"),
    ("dtype", lambda: ATTN(X.double()), TypeError, "x has dtype torch.float64 but the weights are torch.float32"),
    ("context batch", lambda: ATTN(X, torch.randn(3, 4, 16)), ValueError,
     "batch mismatch: x has b=2, key/context has b=3"),
    ("context width", lambda: ATTN(X, torch.randn(2, 4, 8)), ValueError,
     r"context must have shape \(b, s, kdim=16\)"),
    ("context unbatched", lambda: ATTN(X, torch.randn(4, 16)), ValueError,
     r"context must be batched \(b, s, width\) like the query input, got \(4, 16\)"),
    ("mask shape", lambda: ATTN(X, mask=torch.ones(3, 3, 3, dtype=torch.bool)), ValueError,
     r"mask of shape \(3, 3, 3\) does not broadcast to \(b, h, s_q, s_kv\) = \(2, 4, 3, 3\)"),
    ("mask dtype", lambda: ATTN(X, mask=torch.ones(3, 3, dtype=torch.int64)), TypeError,
     r"mask must be bool \(True = may attend\) or floating \(added to the scores\), got torch.int64"),
    ("key without value", lambda: ATTN(X, key=X), ValueError, "pass both key= and value="),
    ("positions", lambda: MultiHeadAttention(16, 4, rotary=__import__("headwise").RotaryEmbedding(4))(
        X, positions=torch.arange(5)), ValueError, r"positions must have shape \(s_q=3,\) or \(b=2, s_q=3\)"),
    ("backend", lambda: MultiHeadAttention(16, 4, backend="flash"), ValueError,
     r"backend must be one of \['eager', 'sdpa'\], got 'flash'"),
    ("rotary width", lambda: MultiHeadAttention(16, 4, rotary=__import__("headwise").RotaryEmbedding(8)),
     ValueError, "rotary was built for d_head=8, the layer has d_head=4"),
    ("config type", lambda: MultiHeadAttention.from_config({"d_model": 8}), TypeError,
     "config must be an AttentionConfig, got dict"),
    ("kdim != vdim with context", lambda: MultiHeadAttention.from_config(
        AttentionConfig(d_model=16, n_heads=4, kdim=8, vdim=6))(X, torch.randn(2, 3, 8)), ValueError,
     r"kdim=8 != vdim=6: pass key= and value= separately"),
    ("cache with context", lambda: ATTN(X, torch.randn(2, 3, 16), cache=ATTN.new_cache(2, 4)), ValueError,
     "cache= is for self-attention decoding"),
]


@pytest.mark.parametrize("name, call, exc, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_a_clear_message(name, call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_layer_constructor_validates_through_the_config():
    with pytest.raises(ValueError, match=r"n_heads=5 does not divide d_model=16; head counts that do near 5"):
        MultiHeadAttention(16, 5)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        MultiHeadAttention(16, 4, dropout=1.5)


_PLAN_FORWARD = MultiHeadAttention.forward.__globals__["plan_forward"]
PLAN = _PLAN_FORWARD.__globals__["plan_attention"].__globals__


@pytest.mark.parametrize("name, call, exc, message", [
    ("return_weights string", lambda: MultiHeadAttention(16, 4)(torch.randn(1, 2, 16), return_weights="no"),
     TypeError, "return_weights must be a bool, got 'no'"),
    ("scale bool", lambda: AttentionConfig(16, 4, scale=True), TypeError, "scale"),
    ("scale nan", lambda: AttentionConfig(16, 4, scale=float("nan")), ValueError, "nan"),
    ("scale negative", lambda: MultiHeadAttention(16, 4, scale=-0.5), ValueError, "-0.5"),
    ("bias None", lambda: MultiHeadAttention(16, 4, bias=None), TypeError, "bias must be a bool"),
    ("positions without rotary", lambda: MultiHeadAttention(16, 4)(torch.randn(1, 2, 16), positions=torch.arange(2)),
     ValueError, "positions= is for rotary layers"),
    ("from_heads n_kv_heads 0", lambda: MultiHeadAttention.from_heads(
        MultiHeadAttention(16, 4).heads(), out_proj=MultiHeadAttention(16, 4).out_proj, n_kv_heads=0),
     ValueError, "n_kv_heads must be a positive int dividing the 4 heads given, got 0"),
    ("int dtype", lambda: MultiHeadAttention(16, 4, dtype=torch.int64), TypeError,
     "dtype must be a floating torch.dtype"),
    ("head of mixed dtypes", lambda: AttentionHead(torch.randn(8, 4), torch.randn(8, 4, dtype=torch.float64),
                                                   torch.randn(8, 4)), TypeError, "w_k is torch.float64"),
    ("config and fields", lambda: MultiHeadAttention(16, 4, config=AttentionConfig(16, 4)), ValueError,
     "either config= or the individual fields"),
    ("chunk_queries zero", lambda: setattr(MultiHeadAttention(16, 4), "chunk_queries", 0), TypeError,
     "chunk_queries must be True, False or a positive int"),
])
def test_bad_flags_and_types_are_refused(name, call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def _numpy_calls():
    attn = MultiHeadAttention(16, 4)
    rot = MultiHeadAttention(16, 4, rotary=RotaryEmbedding(4))
    x = torch.randn(1, 3, 16)
    a = np.zeros((1, 3, 16), dtype=np.float32)
    q = torch.randn(1, 4, 3, 4)
    return [
        ("x", lambda: attn(a)),
        ("context", lambda: attn(x, a)),
        ("mask", lambda: attn(x, mask=np.ones((3, 3), dtype=bool))),
        ("positions", lambda: rot(x, positions=np.arange(3))),
        ("head x", lambda: attn.head(0)(a)),
        ("split_heads", lambda: hwf.split_heads(a, 4)),
        ("merge_heads", lambda: hwf.merge_heads(np.zeros((1, 4, 3, 4)))),
        ("attention q", lambda: hwf.attention(np.zeros((1, 4, 3, 4)), q, q)),
        ("head weights", lambda: AttentionHead(np.zeros((8, 4)), torch.randn(8, 4), torch.randn(8, 4))),
    ]


@pytest.mark.parametrize("index", range(len(_numpy_calls())), ids=[n for n, _ in _numpy_calls()])
def test_numpy_arrays_where_tensors_belong_get_a_type_error(index):
    name, call = _numpy_calls()[index]
    with pytest.raises(TypeError, match="ndarray"):
        call()


@pytest.mark.parametrize("kw, exc, message", [
    (dict(device="nonsense"), ValueError, "device must name an available device .*got 'nonsense'"),
    (dict(device=3.5), TypeError, "device must be a torch.device, a str .*got float"),
    (dict(d_model=2**40, n_heads=1), ValueError, r"q_proj.weight of shape \(1099511627776, 1099511627776\).*2\*\*63"),
    (dict(d_model=2**28, n_heads=1), ValueError, r"bytes of memory cpu has"),
] + ([] if torch.cuda.is_available() else [
    (dict(device="cuda:0"), ValueError, "device must name an available device .*got 'cuda:0'")]))
def test_constructor_refuses_devices_and_sizes_before_allocating(kw, exc, message, monkeypatch):
    def allocate(*args, **kwargs):  # reaching nn.Linear means the check came too late
        raise AssertionError("nn.Linear was built before the refusal")
    args = dict(d_model=16, n_heads=4)
    args.update(kw)
    monkeypatch.setattr(torch.nn.Linear, "__init__", allocate)
    with pytest.raises(exc, match=message):
        MultiHeadAttention(**args)


def test_constructor_accepts_real_devices():
    assert MultiHeadAttention(16, 4, device="meta").q_proj.weight.device.type == "meta"
    assert MultiHeadAttention(16, 4, device=torch.device("cpu")).q_proj.weight.device.type == "cpu"
