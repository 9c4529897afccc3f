"""Sweep cases of the pure functions and small objects: functional, masks, RotaryEmbedding, AttentionConfig
and DecodeStep (see sweep_harness for the outcomes)."""

from __future__ import annotations

import math

import numpy as np
import torch

from headwise import AttentionConfig, DecodeStep, KVCache, RotaryEmbedding
from headwise import functional as hwf
from headwise import masks
from headwise.config import valid_head_counts
from headwise.plan import plan_attention
from tests.reference import reference_heads, rope64
from tests.robustness.sweep_core import DH, HKV, layer, xs
from tests.robustness.sweep_harness import Case, Setup, close

CASES: list[Case] = []
g = torch.Generator().manual_seed(3)
Q, K, V = torch.randn(2, 4, 3, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g)


def refuse(id, fn, *watch, xfail=None):
    CASES.append(Case(id, lambda tmp: Setup(fn, [Q, K, V, *watch]), xfail=xfail))


def works(id, fn, check, xfail=None):
    CASES.append(Case(id, lambda tmp: Setup(fn, [], check), works=True, xfail=xfail))


# -- functional.attention / attend / split_heads / merge_heads -----------------------------------------------
A = hwf.attention
BAD_ATTENTION = {
    "q list": lambda: A(Q.tolist(), K, V), "q 3-D": lambda: A(Q[0], K, V), "k 3-D": lambda: A(Q, K[0], V),
    "d_h mismatch": lambda: A(Q, K[..., :3], V), "h 3 over h_kv 2": lambda: A(Q[:, :3], K, V),
    "batch mismatch": lambda: A(Q[:1], K, V), "k/v s differ": lambda: A(Q, K, V[:, :, :4]),
    "v float64": lambda: A(Q, K, V.double()), "int q k v": lambda: A(Q.long(), K.long(), V.long()),
    "q meta": lambda: A(Q.to("meta"), K, V), "scale nan": lambda: A(Q, K, V, scale=math.nan),
    "scale inf": lambda: A(Q, K, V, scale=math.inf), "scale 0": lambda: A(Q, K, V, scale=0.0),
    "scale -1": lambda: A(Q, K, V, scale=-1.0), "scale 'x'": lambda: A(Q, K, V, scale="x"),
    "scale True": lambda: A(Q, K, V, scale=True), "scale 10**400": lambda: A(Q, K, V, scale=10**400),
    "dropout 1.0": lambda: A(Q, K, V, dropout_p=1.0), "dropout nan": lambda: A(Q, K, V, dropout_p=math.nan),
    "dropout '0.1'": lambda: A(Q, K, V, dropout_p="0.1"), "causal 'x'": lambda: A(Q, K, V, causal="x"),
    "causal 1": lambda: A(Q, K, V, causal=1), "backend 'flash'": lambda: A(Q, K, V, backend="flash"),
    "return_weights 'yes'": lambda: A(Q, K, V, return_weights="yes"),
    "mask int": lambda: A(Q, K, V, mask=torch.ones(3, 5, dtype=torch.int64)),
    "mask shape (3, 4)": lambda: A(Q, K, V, mask=torch.ones(3, 4).bool()), "mask list": lambda: A(Q, K, V, mask=[True] * 5),
    "softcap nan": lambda: A(Q, K, V, softcap=math.nan), "softcap 0": lambda: A(Q, K, V, softcap=0.0),
    "softcap 'x'": lambda: A(Q, K, V, softcap="x"), "sinks (3,)": lambda: A(Q, K, V, sinks=torch.zeros(3)),
    "sinks int": lambda: A(Q, K, V, sinks=torch.zeros(4, dtype=torch.long)), "sinks list": lambda: A(Q, K, V, sinks=[0.0] * 4),
    "sinks meta": lambda: A(Q, K, V, sinks=torch.zeros(4, device="meta")),
}
for name, fn in BAD_ATTENTION.items():
    refuse(f"functional.attention {name}", fn,
           xfail=None)

PLAN = plan_attention(h=4, h_kv=2, d_h=4, scale=0.5, b=2, s_q=3, s_kv=5, dtype=torch.float32,
                      device=torch.device("cpu"), backend="eager", has_mask=True)
refuse("functional.attend int mask", lambda: hwf.attend(PLAN, Q, K, V, torch.ones(1, 1, 3, 5, dtype=torch.long)))
refuse("functional.attend plan 'x'", lambda: hwf.attend("x", Q, K, V))
for name, fn in {"split_heads list": lambda: hwf.split_heads([1.0], 2), "split_heads 2-D": lambda: hwf.split_heads(Q[0, 0], 2),
                 "split_heads n 0": lambda: hwf.split_heads(xs(), 0), "split_heads n True": lambda: hwf.split_heads(xs(), True),
                 "split_heads n 3": lambda: hwf.split_heads(xs(), 3), "split_heads n '2'": lambda: hwf.split_heads(xs(), "2"),
                 "split_heads n 2.0": lambda: hwf.split_heads(xs(), 2.0), "merge_heads 3-D": lambda: hwf.merge_heads(Q[0]),
                 "merge_heads list": lambda: hwf.merge_heads([1.0]), "split_qkv n_kv 0": lambda: hwf.split_qkv(xs(), 2, 0),
                 "split_qkv width": lambda: hwf.split_qkv(xs(), 2, 2)}.items():
    refuse(f"functional.{name}", fn)

MASK = torch.rand(2, 1, 3, 5, generator=g) > 0.3
GOOD_ATTENTION = {
    "sdpa": ({}, {}), "eager": ({"backend": "eager"}, {}), "causal s_q < s_kv": ({"causal": True}, {"causal": True}),
    "bool mask": ({"mask": MASK}, {"mask": MASK}), "float mask": ({"mask": MASK.float() - 1}, {"mask": MASK.float() - 1}),
    "scale int 1": ({"scale": 1}, {"scale": 1.0}), "softcap": ({"softcap": 0.5, "backend": "eager"}, {"softcap": 0.5}),
    "sinks": ({"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0]), "backend": "eager"},
              {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}),
    "fully masked rows": ({"mask": torch.zeros(3, 5).bool()}, {"mask": torch.zeros(3, 5).bool()}),
}
for name, (kw, rkw) in GOOD_ATTENTION.items():
    works(f"functional.attention ok {name}", lambda kw=kw: A(Q, K, V, **kw)[0],
          lambda z, rkw=rkw: close(z, reference_heads(Q, K, V, **rkw)[0]))
works("functional.attention ok d_v 6", lambda: A(Q, K, torch.randn(2, 2, 5, 6, generator=torch.Generator().manual_seed(1)))[0],
      lambda z: close(z, reference_heads(Q, K, torch.randn(2, 2, 5, 6, generator=torch.Generator().manual_seed(1)))[0]))
works("functional.attention ok empty keys", lambda: A(Q, K[:, :, :0], V[:, :, :0])[0],
      lambda z: close(z, torch.zeros(2, 4, 3, 4, dtype=torch.float64)))
works("functional.split/merge ok round trip", lambda: hwf.merge_heads(hwf.split_heads(xs(), 4)),
      lambda y: close(y, xs().double(), atol=0, rtol=0))

# -- masks --------------------------------------------------------------------------------------------------
for name, fn in {
    "causal_mask -1": lambda: masks.causal_mask(-1), "causal_mask '3'": lambda: masks.causal_mask("3"),
    "causal_mask 3.0": lambda: masks.causal_mask(3.0), "causal_mask align": lambda: masks.causal_mask(3, align="middle"),
    "sliding window 0": lambda: masks.sliding_window_mask(3, window=0),
    "sliding window 1.5": lambda: masks.sliding_window_mask(3, window=1.5),
    "padding neither": lambda: masks.padding_mask(), "padding both": lambda: masks.padding_mask(MASK[0, 0], lengths=[1]),
    "padding keep int": lambda: masks.padding_mask(torch.ones(2, 3, dtype=torch.long)),
    "padding keep 1-D": lambda: masks.padding_mask(torch.ones(3).bool()),
    "padding lengths float": lambda: masks.padding_mask(lengths=[1.5], s_kv=3),
    "padding lengths > s_kv": lambda: masks.padding_mask(lengths=[4], s_kv=3),
    "padding lengths -1": lambda: masks.padding_mask(lengths=[-1], s_kv=3),
    "padding lengths 'ab'": lambda: masks.padding_mask(lengths="ab", s_kv=3),
    "padding lengths 2-D": lambda: masks.padding_mask(lengths=[[1]], s_kv=3),
    "padding s_kv -1": lambda: masks.padding_mask(lengths=[1], s_kv=-1),
    "combine int mask": lambda: masks.combine_masks(torch.ones(3, 3, dtype=torch.long)),
    "combine not broadcasting": lambda: masks.combine_masks(torch.ones(2, 3).bool(), torch.ones(4).bool()),
    "combine dtype int32": lambda: masks.combine_masks(torch.ones(3).float(), dtype=torch.int32),
    "combine list": lambda: masks.combine_masks([True]),
}.items():
    refuse(f"masks.{name}", fn)


def _causal_ref(s_q, s_kv, offset):
    return torch.arange(s_kv)[None, :] <= torch.arange(s_q)[:, None] + offset


def _bool_eq(expected):
    def check(m):
        assert m.dtype == torch.bool and torch.equal(m, expected), f"{m.int().tolist()} != {expected.int().tolist()}"
    return check


works("masks.causal_mask ok bottom right", lambda: masks.causal_mask(2, 4), _bool_eq(_causal_ref(2, 4, 2)))
works("masks.causal_mask ok top left", lambda: masks.causal_mask(2, 4, align="top_left"), _bool_eq(_causal_ref(2, 4, 0)))
works("masks.sliding_window ok", lambda: masks.sliding_window_mask(4, window=2),
      _bool_eq(_causal_ref(4, 4, 0) & ~_causal_ref(4, 4, -2)))
works("masks.padding ok left", lambda: masks.padding_mask(lengths=[1, 3], s_kv=3, left=True)[:, 0, 0],
      _bool_eq(torch.tensor([[False, False, True], [True, True, True]])))
works("masks.combine ok bool and float", lambda: masks.combine_masks(torch.tensor([True, False]), torch.zeros(2)),
      lambda m: close(m, torch.tensor([0.0, -math.inf], dtype=torch.float64)))

# -- RotaryEmbedding ----------------------------------------------------------------------------------------
R = RotaryEmbedding
for name, fn in {
    "d_head 0": lambda: R(0), "d_head 1.5": lambda: R(1.5), "d_head '8'": lambda: R("8"), "rotary_dim 3": lambda: R(8, rotary_dim=3),
    "rotary_dim 10": lambda: R(8, rotary_dim=10), "base 0": lambda: R(8, base=0.0), "base nan": lambda: R(8, base=math.nan),
    "base inf": lambda: R(8, base=math.inf), "base 'x'": lambda: R(8, base="x"),
    "inv_freq numpy": lambda: R(8, inv_freq=np.ones(4, dtype=np.float32)), "inv_freq list": lambda: R(8, inv_freq=[1.0] * 4),
    "inv_freq int": lambda: R(8, inv_freq=torch.ones(4, dtype=torch.long)), "inv_freq shape": lambda: R(8, inv_freq=torch.ones(3)),
    "inv_freq nan": lambda: R(8, inv_freq=torch.full((4,), math.nan)),
    "attention_scaling nan": lambda: R(8, attention_scaling=math.nan), "attention_scaling 0": lambda: R(8, attention_scaling=0),
    "attention_scaling True": lambda: R(8, attention_scaling=True),
    "positions float": lambda: R(8)(torch.arange(3.0)), "positions 3-D": lambda: R(8)(torch.zeros(1, 1, 3).long()),
    "positions list": lambda: R(8)([0, 1]), "rotate q 3-D": lambda: R(4).rotate(Q[0], K[0], torch.arange(3)),
    "rotate positions length": lambda: R(4).rotate(Q, K[:, :, :3], torch.arange(4)),
}.items():
    refuse(f"rotary.{name}", fn)

POS = torch.tensor([[0, 1, 2], [5, 9, 4]])
for name, rot in {"full": R(4), "partial rotary_dim 2": R(4, rotary_dim=2)}.items():
    def check(qk, rot=rot):
        for t, out in zip((Q, K[:, :, :3]), qk):
            ref = torch.stack([rope64(t[:, i].double(), POS, rot.inv_freq) for i in range(t.shape[1])], 1)
            close(out, ref)
    works(f"rotary.rotate ok {name}", lambda rot=rot: rot.rotate(Q, K[:, :, :3], POS), check)

# -- AttentionConfig ----------------------------------------------------------------------------------------
C = AttentionConfig
for name, kw in {
    "d_model 0": dict(d_model=0), "d_model 1.5": dict(d_model=1.5), "d_model '16'": dict(d_model="16"),
    "d_model True": dict(d_model=True), "d_model 10**400": dict(d_model=10**400), "n_heads 5": dict(n_heads=5),
    "n_heads -4": dict(n_heads=-4), "n_kv_heads 3": dict(n_kv_heads=3), "n_kv_heads 0": dict(n_kv_heads=0),
    "d_head 0": dict(d_head=0), "bias 'yes'": dict(bias="yes"), "bias None": dict(bias=None), "out_bias 1": dict(out_bias=1),
    "dropout nan": dict(dropout=math.nan), "dropout -0.1": dict(dropout=-0.1), "scale nan": dict(scale=math.nan),
    "scale '1'": dict(scale="1"), "scale -inf": dict(scale=-math.inf), "kdim 0": dict(kdim=0), "vdim '8'": dict(vdim="8"),
}.items():
    refuse(f"config.init {name}", lambda kw=kw: C(**{"d_model": 16, "n_heads": 4, **kw}))
refuse("config.replace unknown field", lambda: C(16, 4).replace(foo=1))
refuse("config.kv_head_of 4", lambda: C(16, 4).kv_head_of(4))
refuse("config.kv_head_of '1'", lambda: C(16, 4).kv_head_of("1"))
refuse("config.kv_head_of 1.5", lambda: C(16, 4).kv_head_of(1.5))
refuse("config.valid_head_counts 0", lambda: valid_head_counts(0))
works("config ok resolved fields", lambda: C(16, 4, n_kv_heads=2).replace(n_heads=8),
      lambda c: _eq((c.d_head, c.n_kv_heads, c.kdim, c.out_bias, c.scale), (2, 2, 16, True, 1 / math.sqrt(2))))


def _eq(a, b):
    assert a == b, f"{a!r} != {b!r}"


# -- DecodeStep ---------------------------------------------------------------------------------------------
def step_case(make):
    def build(tmp):
        a = layer()
        fn, watch = make(a)
        return Setup(fn, [a, *watch])
    return build


for name, make in {
    "layer 5": lambda a: ((lambda: DecodeStep(5, a.new_cache(2, 4))), []),
    "cache 5": lambda a: ((lambda: DecodeStep(a, 5)), []),
    "cross-attention layer": lambda a: ((lambda: DecodeStep(layer(kdim=8), KVCache(2, 4, HKV, DH))), []),
    "cache of 4 kv heads": lambda a: ((lambda: DecodeStep(a, KVCache(2, 4, 4, DH))), []),
}.items():
    CASES.append(Case(f"decode_step.{name}", step_case(make)))


def _step_call(x_of, fill=0, max_len=4):
    def make(a):
        cache = a.new_cache(2, max_len)
        if fill:
            a(xs(2, fill), cache=cache)
        step, x = DecodeStep(a, cache), x_of()
        return (lambda: step(x)), [cache, x]
    return make


for name, make in {"another layer's cache": lambda a: ((lambda c=layer().new_cache(2, 4): DecodeStep(a, c)), []),
                   "step x batch 3": _step_call(lambda: xs(3, 1)), "step x float64": _step_call(lambda: xs(2, 1).double()),
                   "step overflow": _step_call(lambda: xs(2, 2), fill=3), "step x width 8": _step_call(lambda: xs(2, 1, 8))}.items():
    CASES.append(Case(f"decode_step.{name}", step_case(make)))
