"""Sweep cases of the core's parts: AttentionHead, from_heads, KVCache, functional, masks, RotaryEmbedding,
AttentionConfig and DecodeStep (see sweep_harness for the outcomes)."""

from __future__ import annotations

import math

import torch
from torch import nn

from headwise import AttentionHead, KVCache, MultiHeadAttention, RotaryEmbedding
from headwise import functional as hwf
from tests.reference import reference_heads, reference_mha
from tests.robustness.sweep_core import D, DH, H, HKV, layer, xs
from tests.robustness.sweep_harness import Case, Setup, close

CASES: list[Case] = []


def refuse(id, fn, *watch, xfail=None):
    """A call that must be refused; ``fn`` and ``watch`` are made fresh by ``lambda: (fn, watch)`` callers."""
    CASES.append(Case(id, lambda tmp: Setup(*_made(fn, watch)), works=False, xfail=xfail))


def _made(fn, watch):
    if getattr(fn, "fresh", False):  # a factory: build the objects now, per run
        return fn()
    return fn, list(watch)


def fresh(factory):
    factory.fresh = True
    return factory


def works(id, build, xfail=None):
    CASES.append(Case(id, build, works=True, xfail=xfail))


g = torch.Generator().manual_seed(7)
W = torch.randn(D, DH, generator=g)
B = torch.randn(DH, generator=g)

# -- AttentionHead ------------------------------------------------------------------------------------------
HEAD_INIT = {
    "w_q 1-D": lambda: AttentionHead(W[:, 0], W, W), "int weights": lambda: AttentionHead(*(W.long(),) * 3),
    "d_head mismatch": lambda: AttentionHead(W, W[:, :3], W), "list weight": lambda: AttentionHead(W.tolist(), W, W),
    "only b_q": lambda: AttentionHead(W, W, W, B), "b_q shape": lambda: AttentionHead(W, W, W, B[:3], B, B),
    "b_q list": lambda: AttentionHead(W, W, W, B.tolist(), B, B),
    "w_k float64": lambda: AttentionHead(W, W.double(), W), "scale nan": lambda: AttentionHead(W, W, W, scale=math.nan),
    "scale -1": lambda: AttentionHead(W, W, W, scale=-1.0), "scale 'x'": lambda: AttentionHead(W, W, W, scale="x"),
}
HEAD_XFAIL: dict[str, str] = {}
for name, fn in HEAD_INIT.items():
    refuse(f"head.init {name}", fn, xfail=HEAD_XFAIL.get(name))


def _view_set(attr, value, **kw):
    @fresh
    def make():
        a = layer(**kw)
        return (lambda: setattr(a.head(1), attr, value)), [a]
    return make


refuse("head.set w_q wrong shape", _view_set("w_q", torch.zeros(D, DH + 1)))
refuse("head.set b_q without bias", _view_set("b_q", torch.zeros(DH), bias=False))
refuse("head.set w_q='x'", _view_set("w_q", "x"))
refuse("head.w_o standalone", lambda: AttentionHead(W, W, W).w_o)


def _head_call(make_args, **kw):
    @fresh
    def make():
        a = layer(**kw)
        args, kwargs = make_args()
        return (lambda: a.head(1)(*args, **kwargs)), [a]
    return make


HEAD_CALL = {
    "x width 15": lambda: ((xs()[..., :15],), {}), "x int": lambda: ((xs().long(),), {}),
    "context batch 1": lambda: ((xs(), xs(1, 5)), {}), "mask 3 heads": lambda: ((xs(),), {"mask": torch.ones(1, 3, 3, 3).bool()}),
    "mask int": lambda: ((xs(),), {"mask": torch.ones(3, 3, dtype=torch.long)}),
    "mask 'x'": lambda: ((xs(),), {"mask": "x"}), "causal 'yes'": lambda: ((xs(),), {"causal": "yes"}),
}
for name, make_args in HEAD_CALL.items():
    refuse(f"head.forward {name}", _head_call(make_args),
           xfail=None)
refuse("head.forward rotary positions float", _head_call(lambda: ((xs(),), {"positions": torch.arange(3.0)}),
                                                         rotary=RotaryEmbedding(DH)))
refuse("head.forward standalone per-head mask", lambda: AttentionHead(W, W, W)(xs(), mask=torch.ones(2, 4, 3, 3).bool()))


def _head_ok(mask=None, causal=False):
    def build(tmp):
        a, x = layer(), xs()
        def check(z):
            q, k, v = (hwf.split_heads(p(x).double(), n) for p, n in ((a.q_proj, H), (a.k_proj, HKV), (a.v_proj, HKV)))
            ref, _ = reference_heads(q, k, v, mask=mask, causal=causal)
            close(z, ref[:, 2])
        return Setup(lambda: a.head(2)(x, mask=mask, causal=causal), [], check)
    return build


works("head.forward ok view", _head_ok())
works("head.forward ok causal", _head_ok(causal=True))
works("head.forward ok per-head mask", _head_ok(mask=torch.rand(2, H, 3, 3, generator=g) > 0.4))

# -- from_heads ---------------------------------------------------------------------------------------------
OUT = nn.Linear(H * DH, D)


def _from_heads(heads, **kw):
    @fresh
    def make():
        return (lambda: MultiHeadAttention.from_heads(heads() if callable(heads) else heads, **kw)), []
    return make


refuse("from_heads []", _from_heads([], out_proj=OUT))
refuse("from_heads [5]", _from_heads([5], out_proj=OUT))
refuse("from_heads out_proj shape", _from_heads(lambda: layer().heads(), out_proj=nn.Linear(8, D)))
refuse("from_heads out_proj 'x'", _from_heads(lambda: layer().heads(), out_proj="x"))
refuse("from_heads n_kv_heads 3", _from_heads(lambda: layer().heads(), out_proj=OUT, n_kv_heads=3))
refuse("from_heads group with different K", _from_heads(
    lambda: [AttentionHead(W, W + i, W) for i in range(4)], out_proj=OUT, n_kv_heads=2))
refuse("from_heads mixed dtypes", _from_heads(
    lambda: [AttentionHead(W, W, W), AttentionHead(W.double(), W.double(), W.double())], out_proj=nn.Linear(8, D)))
refuse("from_heads backend 'x'", _from_heads(lambda: layer().heads(), out_proj=OUT, backend="x"))


def _from_heads_ok(tmp):
    a, x = layer(), xs()
    return Setup(lambda: MultiHeadAttention.from_heads(a.heads(), out_proj=a.out_proj)(x, causal=True), [],
                 lambda y: close(y, reference_mha(a, x, causal=True)[0]))


works("from_heads ok round trip", _from_heads_ok)

# -- KVCache ------------------------------------------------------------------------------------------------
CACHE_INIT = {
    "batch -1": (-1, 4, 2, 4), "max_len 0": (2, 0, 2, 4), "max_len 1.5": (2, 1.5, 2, 4), "max_len '4'": (2, "4", 2, 4),
    "max_len True": (2, True, 2, 4), "n_kv_heads 0": (2, 4, 0, 4), "d_head 0": (2, 4, 2, 0),
    "max_len 2**62": (2, 2**62, 2, 4), "max_len 2**70": (2, 2**70, 2, 4),
}
for name, args in CACHE_INIT.items():
    refuse(f"cache.init {name}", lambda args=args: KVCache(*args))
for name, kw in {"dtype int64": dict(dtype=torch.int64), "dtype 'float32'": dict(dtype="float32"),
                 "device 'nonsense'": dict(device="nonsense"), "device 'cuda'": dict(device="cuda")}.items():
    refuse(f"cache.init {name}", lambda kw=kw: KVCache(2, 4, 2, 4, **kw))


def _cache_op(op, prefill=1):
    @fresh
    def make():
        c = KVCache(2, 4, HKV, DH)
        if prefill:
            c.update(torch.randn(2, HKV, prefill, DH), torch.randn(2, HKV, prefill, DH))
        return (lambda: op(c)), [c]
    return make


KV = torch.randn(2, HKV, 2, DH)
CACHE_OPS = {
    "update list": lambda c: c.update(KV.tolist(), KV), "update 3-D": lambda c: c.update(KV[0], KV[0]),
    "update 3 heads": lambda c: c.update(torch.randn(2, 3, 2, DH), torch.randn(2, 3, 2, DH)),
    "update d_head 5": lambda c: c.update(torch.randn(2, HKV, 2, 5), torch.randn(2, HKV, 2, 5)),
    "update int": lambda c: c.update(KV.long(), KV.long()), "update float64": lambda c: c.update(KV.double(), KV.double()),
    "update k/v lengths differ": lambda c: c.update(KV, KV[:, :, :1]), "update overflow": lambda c: c.update(KV.repeat(1, 1, 2, 1), KV.repeat(1, 1, 2, 1)),
    "update meta": lambda c: c.update(KV.to("meta"), KV.to("meta")),
    "checkpoint -1": lambda c: c.checkpoint(-1), "checkpoint '2'": lambda c: c.checkpoint("2"),
    "checkpoint True": lambda c: c.checkpoint(True), "checkpoint 1.5": lambda c: c.checkpoint(1.5),
    "restore 5": lambda c: c.restore(5), "restore another cache's": lambda c: c.restore(KVCache(2, 4, HKV, DH).checkpoint(1)),
    "crop -1": lambda c: c.crop(-1), "crop 1.5": lambda c: c.crop(1.5), "crop '1'": lambda c: c.crop("1"),
}
for name, op in CACHE_OPS.items():
    refuse(f"cache.{name}", _cache_op(op))


def _restore_after(write_n, reset):
    @fresh
    def make():
        c = KVCache(2, 4, HKV, DH)
        c.update(KV[:, :, :1], KV[:, :, :1])
        saved = c.checkpoint(1)
        c.update(KV[:, :, :write_n], KV[:, :, :write_n])
        if reset:
            c.reset()
        return (lambda: c.restore(saved)), [c]
    return make


refuse("cache.restore after writing more than saved", _restore_after(2, False))
refuse("cache.restore after reset", _restore_after(1, True))


def _claim_other(tmp):
    a = layer()
    c = a.new_cache(2, 4)
    return Setup(lambda: c.claim(layer()), [c])


refuse("cache.claim by another layer", _claim_other)


def _roundtrip(tmp):
    c = KVCache(2, 4, HKV, DH)
    c.update(KV[:, :, :1], KV[:, :, :1])
    keys, values = c.keys.clone(), c.values.clone()

    def run():
        saved = c.checkpoint(2)
        c.update(KV + 1, KV + 1)
        c.restore(saved)
        return c
    return Setup(run, [], lambda c: (close(c.keys, keys.double(), atol=0, rtol=0),
                                     close(c.values, values.double(), atol=0, rtol=0), _eq(c.length, 1)))


def _eq(a, b):
    assert a == b, f"{a!r} != {b!r}"


works("cache.checkpoint/restore ok bitwise", _roundtrip)


def _update_ok(tmp):
    c = KVCache(2, 4, HKV, DH)
    return Setup(lambda: (c.update(KV[:, :, :1], KV[:, :, :1]), c.update(KV + 1, KV + 2))[1], [],
                 lambda kv: (close(kv[0], torch.cat([KV[:, :, :1], KV + 1], 2).double(), atol=0, rtol=0),
                             close(kv[1], torch.cat([KV[:, :, :1], KV + 2], 2).double(), atol=0, rtol=0)))


works("cache.update ok views", _update_ok)
