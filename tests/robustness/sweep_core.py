"""Sweep cases of the core API: the layer's constructor and forward, heads, from_heads, the KV cache, the
functional entry points, masks, rotary, the config and DecodeStep (see sweep_harness for the outcomes)."""

from __future__ import annotations

import math

import numpy as np
import torch

from headwise import AttentionConfig, DecodeStep, KVCache, MultiHeadAttention, RotaryEmbedding
from headwise import functional as hwf
from tests.reference import reference_heads, reference_mha
from tests.robustness.sweep_harness import Case, Setup, close

D, H, HKV, DH = 16, 4, 2, 4
CASES: list[Case] = []


def layer(**kw) -> MultiHeadAttention:
    torch.manual_seed(0)
    if "rotary" in kw and kw["rotary"] is True:
        kw["rotary"] = RotaryEmbedding(DH)
    return MultiHeadAttention(D, kw.pop("n_heads", H), kw.pop("n_kv_heads", HKV), **kw)


def xs(b: int = 2, s: int = 3, d: int = D, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(b, s, d, generator=torch.Generator().manual_seed(b * 100 + s), dtype=dtype)


def refuse(id: str, build, xfail: str | None = None) -> None:
    CASES.append(Case(id, build, works=False, xfail=xfail))


def works(id: str, build, xfail: str | None = None) -> None:
    CASES.append(Case(id, build, works=True, xfail=xfail))


# -- MultiHeadAttention(...) ---------------------------------------------------------------------------------
BAD_INIT = {
    "d_model=0": dict(d_model=0), "d_model=-1": dict(d_model=-1), "d_model=1.5": dict(d_model=1.5),
    "d_model='16'": dict(d_model="16"), "d_model=True": dict(d_model=True), "d_model=None": dict(d_model=None),
    "d_model=10**400": dict(d_model=10**400), "n_heads=5": dict(n_heads=5), "n_heads=0": dict(n_heads=0),
    "n_kv_heads=3": dict(n_kv_heads=3), "d_head=0": dict(d_head=0), "dropout=1.0": dict(dropout=1.0),
    "dropout=nan": dict(dropout=math.nan), "dropout='0.1'": dict(dropout="0.1"), "scale=nan": dict(scale=math.nan),
    "scale=inf": dict(scale=math.inf), "scale=0": dict(scale=0.0), "scale=-1": dict(scale=-1.0),
    "scale='0.5'": dict(scale="0.5"), "scale=True": dict(scale=True), "scale=10**400": dict(scale=10**400),
    "backend=flash": dict(backend="flash"), "backend=None": dict(backend=None), "dtype=int32": dict(dtype=torch.int32),
    "dtype='float32'": dict(dtype="float32"), "device='nonsense'": dict(device="nonsense"),
    "device='cuda:99'": dict(device="cuda:99"), "bias='yes'": dict(bias="yes"), "out_bias=1": dict(out_bias=1),
    "kdim=0": dict(kdim=0), "rotary='x'": dict(rotary="x"), "rotary of d_head 8": dict(rotary=RotaryEmbedding(8)),
    "config='x'": dict(config="x"), "config and d_model": dict(config=AttentionConfig(16, 4), d_model=16),
    "d_model=2**40 n_heads=1": dict(d_model=2**40, n_heads=1),
}
INIT_XFAIL: dict[str, str] = {}
for name, kw in BAD_INIT.items():
    def build(tmp, kw=kw):
        kw = dict(kw)
        if "config" in kw:
            return Setup(lambda: MultiHeadAttention(**kw))
        args = dict(d_model=D, n_heads=H)
        args.update(kw)
        return Setup(lambda: MultiHeadAttention(**args))
    refuse(f"mha.init {name}", build, INIT_XFAIL.get(name))


def _setter(attr, value):
    def build(tmp):
        a = layer()
        return Setup(lambda: setattr(a, attr, value), [a])
    return build


for attr, value in (("backend", "flash"), ("backend", 3), ("chunk_queries", 0), ("chunk_queries", "yes")):
    refuse(f"mha.set {attr}={value!r}", _setter(attr, value))


# -- MultiHeadAttention.forward: bad inputs -------------------------------------------------------------------
def fwd(make, layer_kw=None, cache_first=0):
    """``make(attn, x) -> (args, kwargs)``; the layer, x, and every tensor / cache passed are watched."""
    def build(tmp):
        a = layer(**(layer_kw or {}))
        x = xs()
        args, kwargs = make(a, x)
        watch = [a, x] + [v for v in list(args) + list(kwargs.values()) if isinstance(v, (torch.Tensor, KVCache))]
        return Setup(lambda: a(*args, **kwargs), watch)
    return build


def other_cache(a, x):
    return layer().new_cache(2, 8)


def full_cache(a, x):
    c = a.new_cache(2, 4)  # 2 cached + 3 new > 4
    a(x[:, :2], cache=c)
    return c


BAD_FORWARD = {
    "x list": lambda a, x: ((x.tolist(),), {}), "x numpy": lambda a, x: ((x.numpy(),), {}),
    "x int64": lambda a, x: ((x.long(),), {}), "x float64": lambda a, x: ((x.double(),), {}),
    "x complex64": lambda a, x: ((x.to(torch.complex64),), {}), "x width 15": lambda a, x: ((x[..., :15],), {}),
    "x 1-D": lambda a, x: ((x[0, 0],), {}), "x 4-D": lambda a, x: ((x[None],), {}),
    "x meta": lambda a, x: ((x.to("meta"),), {}), "x None": lambda a, x: ((None,), {}),
    "context width 15": lambda a, x: ((x, x[..., :15]), {}), "context batch 1": lambda a, x: ((x, x[:1]), {}),
    "context unbatched": lambda a, x: ((x, x[0]), {}), "context float64": lambda a, x: ((x, x.double()), {}),
    "key without value": lambda a, x: ((x,), {"key": x}), "value without key": lambda a, x: ((x,), {"value": x}),
    "key and context": lambda a, x: ((x, x), {"key": x, "value": x}),
    "key s 3 value s 2": lambda a, x: ((x,), {"key": x, "value": x[:, :2]}),
    "mask int64": lambda a, x: ((x,), {"mask": torch.ones(3, 3, dtype=torch.long)}),
    "mask uint8": lambda a, x: ((x,), {"mask": torch.ones(3, 3, dtype=torch.uint8)}),
    "mask 5-D": lambda a, x: ((x,), {"mask": torch.ones(1, 2, 4, 3, 3, dtype=torch.bool)}),
    "mask s_kv 4": lambda a, x: ((x,), {"mask": torch.ones(3, 4, dtype=torch.bool)}),
    "mask 1-D length 4": lambda a, x: ((x,), {"mask": torch.ones(4, dtype=torch.bool)}),
    "mask 3 heads": lambda a, x: ((x,), {"mask": torch.ones(1, 3, 3, 3, dtype=torch.bool)}),
    "mask complex": lambda a, x: ((x,), {"mask": torch.zeros(3, 3, dtype=torch.complex64)}),
    "mask list": lambda a, x: ((x,), {"mask": [[True] * 3] * 3}),
    "mask numpy": lambda a, x: ((x,), {"mask": np.ones((3, 3), dtype=bool)}),
    "mask meta": lambda a, x: ((x,), {"mask": torch.ones(3, 3, dtype=torch.bool, device="meta")}),
    "causal='yes'": lambda a, x: ((x,), {"causal": "yes"}), "causal=1": lambda a, x: ((x,), {"causal": 1}),
    "causal=None": lambda a, x: ((x,), {"causal": None}),
    "causal=np.bool_": lambda a, x: ((x,), {"causal": np.bool_(True)}),
    "causal=tensor(True)": lambda a, x: ((x,), {"causal": torch.tensor(True)}),
    "return_weights='no'": lambda a, x: ((x,), {"return_weights": "no"}),
    "return_weights=1": lambda a, x: ((x,), {"return_weights": 1}),
    "positions without rotary": lambda a, x: ((x,), {"positions": torch.arange(3)}),
    "unknown keyword": lambda a, x: ((x,), {"foo": 1}),
    "cache='x'": lambda a, x: ((x,), {"cache": "x"}),
    "cache of another layer": lambda a, x: ((x,), {"cache": other_cache(a, x)}),
    "cache overflow": lambda a, x: ((x,), {"cache": full_cache(a, x)}),
    "cache float64 unowned": lambda a, x: ((x,), {"cache": KVCache(2, 8, HKV, DH, dtype=torch.float64)}),
    "cache batch 3 unowned": lambda a, x: ((x,), {"cache": KVCache(3, 8, HKV, DH)}),
    "cache 4 kv heads unowned": lambda a, x: ((x,), {"cache": KVCache(2, 8, 4, DH)}),
    "cache with context": lambda a, x: ((x, x), {"cache": a.new_cache(2, 8)}),
    "cache with mask of s_kv 3": lambda a, x: ((x,), {"cache": full_cache(a, x), "mask": torch.ones(3, 3).bool()}),
}
for name, make in BAD_FORWARD.items():
    refuse(f"mha.forward {name}", fwd(make))

BAD_ROTARY = {
    "positions float": lambda a, x: ((x,), {"positions": torch.arange(3.0)}),
    "positions length 4": lambda a, x: ((x,), {"positions": torch.arange(4)}),
    "positions bool": lambda a, x: ((x,), {"positions": torch.ones(3, dtype=torch.bool)}),
    "positions list": lambda a, x: ((x,), {"positions": [0, 1, 2]}),
    "positions 3-D": lambda a, x: ((x,), {"positions": torch.zeros(1, 2, 3, dtype=torch.long)}),
    "rotary with context": lambda a, x: ((x, x), {}),
}
for name, make in BAD_ROTARY.items():
    refuse(f"mha.forward rotary {name}", fwd(make, {"rotary": True}))


def _head_index(index):
    def build(tmp):
        a = layer()
        return Setup(lambda: a.head(index), [a])
    return build


for index in (4, -5, "0", True, 1.0):
    refuse(f"mha.head({index!r})", _head_index(index))


def _new_cache(*args, **kw):
    def build(tmp):
        a = layer()
        return Setup(lambda: a.new_cache(*args, **kw), [a])
    return build


refuse("mha.new_cache max_len 0", _new_cache(2, 0))
refuse("mha.new_cache batch '2'", _new_cache("2", 4))
refuse("mha.new_cache dtype int64", _new_cache(2, 4, dtype=torch.int64))


def _load_other(tmp):
    a, b = layer(), MultiHeadAttention(D, H, 1)
    sd = b.state_dict()
    return Setup(lambda: a.load_state_dict(sd), [a])


refuse("mha.load_state_dict of another config", _load_other)


# -- MultiHeadAttention.forward: inputs that simply work -----------------------------------------------------
def ok_forward(make, layer_kw=None, ref_kw=None):
    """``make(attn, x) -> (x, kwargs)``; the answer is checked against tests/reference.py's float64 formula."""
    def build(tmp):
        a = layer(**(layer_kw or {}))
        x, kwargs = make(a, xs())
        rkw = {k: v for k, v in kwargs.items() if k in ("context", "mask", "causal", "positions", "key", "value")}
        xr = x if x.dim() == 3 else x[None]
        if "context" in rkw and rkw["context"].dim() == 2:
            rkw["context"] = rkw["context"][None]

        def check(out):
            y = out[0] if kwargs.get("return_weights") else out
            ref, weights = reference_mha(a, xr, **rkw)
            close(y, ref if x.dim() == 3 else ref[0])
            if kwargs.get("return_weights"):
                close(out[1], weights)
        return Setup(lambda: a(x, **kwargs), [], check)
    return build


def _mask(shape, seed=1, dtype=torch.bool):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g)
    return m > 0.3 if dtype == torch.bool else (m * 2 - 1).to(dtype)


GOOD_FORWARD = {
    "plain": lambda a, x: (x, {}),
    "causal": lambda a, x: (x, {"causal": True}),
    "bool mask (b, 1, s, s)": lambda a, x: (x, {"mask": _mask((2, 1, 3, 3))}),
    "bool mask per head": lambda a, x: (x, {"mask": _mask((2, H, 3, 3))}),
    "float mask": lambda a, x: (x, {"mask": _mask((3, 3), dtype=torch.float32)}),
    "float64 mask on float32": lambda a, x: (x, {"mask": _mask((3, 3), dtype=torch.float64)}),
    "float16 mask on float32": lambda a, x: (x, {"mask": _mask((3, 3), dtype=torch.float16)}),
    "mask (s_kv,)": lambda a, x: (x, {"mask": torch.tensor([True, False, True])}),
    "mask 0-d": lambda a, x: (x, {"mask": torch.tensor(True)}),
    "fully masked row": lambda a, x: (x, {"mask": torch.tensor([[True] * 3, [False] * 3, [True] * 3])}),
    "-inf row": lambda a, x: (x, {"mask": torch.tensor([[0.0] * 3, [-math.inf] * 3, [0.0] * 3])}),
    "unbatched": lambda a, x: (x[0], {}),
    "empty batch": lambda a, x: (x[:0], {}),
    "empty sequence": lambda a, x: (x[:, :0], {}),
    "context": lambda a, x: (x, {"context": xs(2, 5)}),
    "unbatched context": lambda a, x: (x[0], {"context": xs(2, 5)[0]}),
    "return_weights": lambda a, x: (x, {"return_weights": True, "causal": True}),
    "causal with mask": lambda a, x: (x, {"causal": True, "mask": _mask((2, 1, 3, 3))}),
}
for name, make in GOOD_FORWARD.items():
    works(f"mha.forward ok {name}", ok_forward(make))
works("mha.forward ok rotary positions (b, s)",
      ok_forward(lambda a, x: (x, {"positions": torch.tensor([[3, 4, 5], [0, 2, 7]])}), {"rotary": True}))
works("mha.forward ok MQA eager", ok_forward(lambda a, x: (x, {"causal": True}), {"n_kv_heads": 1, "backend": "eager"}))
works("mha.forward ok d_head 6", ok_forward(lambda a, x: (x, {}), {"d_head": 6}))
works("mha.forward ok kdim/vdim key/value",
      ok_forward(lambda a, x: (x, {"key": xs(2, 5, 8), "value": xs(2, 5, 12)}), {"kdim": 8, "vdim": 12}))


def _decode(tmp):
    a, x = layer(rotary=RotaryEmbedding(DH)), xs(2, 5)
    cache = a.new_cache(2, 8)
    ref = reference_mha(a, x, causal=True)[0]
    return Setup(lambda: torch.cat([a(x[:, :3], cache=cache), a(x[:, 3:4], cache=cache),
                                    DecodeStep(a, cache)(x[:, 4:])], 1), [], lambda y: close(y, ref))


works("mha.forward ok prefill then decode (rotary)", _decode)


def _dead_row_grad(tmp):
    """Hugging Face pads with rows entirely at finfo.min: dW_Q must match float64 autograd of the formula."""
    a, x = layer(), xs()
    mask = torch.zeros(2, 1, 3, 3)
    mask[1, :, 1] = torch.finfo(torch.float32).min  # one query row that may read nothing, HF style

    def run():
        a.zero_grad()
        a(x, mask=mask).square().sum().backward()
        return a.q_proj.weight.grad.clone()

    def check(grad):
        wq, wk, wv, wo = (p.weight.detach().double().requires_grad_(i == 0)
                          for i, p in enumerate((a.q_proj, a.k_proj, a.v_proj, a.out_proj)))
        bq, bk, bv, bo = (p.bias.detach().double() for p in (a.q_proj, a.k_proj, a.v_proj, a.out_proj))
        x64 = x.double()
        q = hwf.split_heads(x64 @ wq.T + bq, H)
        k, v = hwf.split_heads(x64 @ wk.T + bk, HKV), hwf.split_heads(x64 @ wv.T + bv, HKV)
        z, _ = reference_heads(q, k, v, mask=mask.double())
        y = z.transpose(1, 2).reshape(2, 3, H * DH) @ wo.T + bo
        close(grad, torch.autograd.grad(y.square().sum(), wq)[0], atol=1e-4)
    return Setup(run, [], check)


works("mha.backward ok finfo.min padding row", _dead_row_grad)
