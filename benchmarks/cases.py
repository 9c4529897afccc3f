"""The benchmark cases (issue 5, cases 1-6) as groups of entries that share their inputs.

Every builder takes a :class:`Sizes` (``FULL`` or ``QUICK``) and returns :class:`~benchmarks.timing.Group`
objects; nothing runs until :func:`~benchmarks.timing.run_group` times them. Peers get the headwise
layer's weights, so each group's outputs must agree (checked on the warm-up call).

Shapes:
    b: batch, s: sequence, d: d_model, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from headwise import MultiHeadAttention
from headwise import RotaryEmbedding
from . import peers
from .patched import patched_groups
from .surgery import surgery_groups
from .timing import Entry, Group, forward_flops as _fwd_flops, refresh_memory

__all__ = ["Sizes", "FULL", "QUICK", "CASES", "build"]

Shape = tuple[int, int, int, int]  # (b, s, d, h)


@dataclass(frozen=True)
class Sizes:
    forward: tuple[Shape, ...]
    backward: tuple[Shape, ...]
    backward_full_peers: tuple[Shape, ...]  # shapes whose fwd+bwd runs every peer (others: the limit only)
    backward_causal: tuple[Shape, ...]  # shapes whose fwd+bwd also runs causal
    hf_eager: tuple[Shape, ...]  # shapes that also run HF's eager layers and nn.MHA's default call
    gqa: tuple[int, int, int, tuple[int, ...]]  # (s, d, h, h_kv values)
    weights: tuple[Shape, ...]
    causal_step: tuple[int, int, int, int]  # (b, h, s, d_h) for the attention step alone
    decode: tuple[int, int, tuple[int, ...], tuple[int, ...]]  # (d, h, h_kv values, contexts)
    decode_tokens: int
    decode_xw: tuple[int, int, int]  # (d, h, context): decode against the x @ W preallocated loop (MHA, b 1)
    memory: tuple[int, int, tuple[int, ...]]  # (h, d_h, s values)
    memory_peers_upto: int  # packed SDPA and eager math also run up to this s
    long: tuple[Shape, ...]  # timed long-context forwards (queries chunked), non-causal and causal
    long_rounds: int
    gpu_step: tuple[tuple[int, int, int, int, int], ...]  # (b, h, h_kv, s, d_h): GPU attention steps (CUDA only)
    rounds: int
    heavy_rounds: int  # for groups whose single call takes seconds
    heavy_flops: float
    heavier_flops: float  # above this, 2 rounds
    block_s: float
    compile: bool


FULL = Sizes(
    forward=((8, 512, 768, 12), (4, 128, 4096, 32), (1, 2048, 4096, 32)),
    backward=((8, 512, 768, 12), (4, 128, 4096, 32), (1, 2048, 4096, 32)),
    backward_full_peers=((8, 512, 768, 12),),
    backward_causal=((8, 512, 768, 12), (4, 128, 4096, 32)),
    hf_eager=((8, 512, 768, 12), (4, 128, 4096, 32)),
    gqa=(2048, 4096, 32, (8, 1)),
    weights=((8, 512, 768, 12), (4, 128, 4096, 32)),
    causal_step=(1, 32, 2048, 128),
    decode=(4096, 32, (32, 8), (128, 1024, 4096)),
    decode_tokens=8,
    decode_xw=(2048, 16, 2048),
    memory=(32, 128, (4096, 8192, 16384)),
    memory_peers_upto=4096,
    long=((1, 16384, 4096, 32),),
    long_rounds=2,
    gpu_step=((4, 32, 32, 2048, 128), (1, 32, 8, 16384, 128)),
    rounds=5,
    heavy_rounds=4,
    heavy_flops=50e9,
    heavier_flops=200e9,
    block_s=0.25,
    compile=True,
)

QUICK = Sizes(
    forward=((2, 32, 64, 4),),
    backward=((2, 32, 64, 4),),
    backward_full_peers=((2, 32, 64, 4),),
    backward_causal=((2, 32, 64, 4),),
    hf_eager=((2, 32, 64, 4),),
    gqa=(64, 128, 8, (2,)),
    weights=((2, 32, 64, 4),),
    causal_step=(1, 4, 64, 16),
    decode=(128, 8, (2,), (16,)),
    decode_tokens=4,
    decode_xw=(64, 4, 16),
    memory=(4, 16, (256,)),
    memory_peers_upto=0,
    long=((1, 64, 16, 2),),
    long_rounds=1,
    gpu_step=((1, 4, 2, 32, 16),),
    rounds=2,
    heavy_rounds=2,
    heavy_flops=1e12,
    heavier_flops=1e12,
    block_s=0.01,
    compile=False,
)


def _rounds(sz: Sizes, flops: float) -> int:
    if flops >= sz.heavier_flops:
        return min(3, sz.heavy_rounds)
    return sz.heavy_rounds if flops >= sz.heavy_flops else sz.rounds


def _layers(d: int, h: int, h_kv: int | None = None, seed: int = 0) -> tuple[MultiHeadAttention, MultiHeadAttention]:
    """The plain layer (biases, no RoPE: BERT/MHA-shaped) and the Llama-shaped one (RoPE, no biases)."""
    torch.manual_seed(seed)
    plain = MultiHeadAttention(d, h, h_kv).eval()
    rope = MultiHeadAttention(d, h, h_kv, bias=False, rotary=RotaryEmbedding(d // h)).eval()
    return plain, rope


def _no_grad(f: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def g() -> torch.Tensor:
        with torch.no_grad():
            return f()
    return g


def _train(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list[torch.Tensor],
           grad: torch.Tensor) -> Callable[[], tuple[torch.Tensor, ...]]:
    """Forward + backward to the input and every parameter (no accumulation into ``.grad``)."""
    def g() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(f(x), [x, *params], grad)
    return g


def _causal_bool(s: int) -> torch.Tensor:
    """SDPA convention: True = may attend."""
    return torch.ones(s, s, dtype=torch.bool).tril()


def _mha_causal(s: int) -> torch.Tensor:
    """nn.MultiheadAttention's convention is the opposite: True = may NOT attend."""
    return ~_causal_bool(s)


def _shape_name(b: int, s: int, d: int, h: int) -> str:
    return f"b{b} s{s} d{d} h{h}"


# -- case 1 (and 6): forward / fwd+bwd, self-attention -------------------------------------------------
# Builders return zero-argument factories: a group's layers and inputs exist only while it runs.
Factory = Callable[[], Group]


def _forward_group(sz: Sizes, shape: Shape, causal: bool, hf_note: str | None) -> Group:
    b, s, d, h = shape
    plain, rope = _layers(d, h)
    x = torch.randn(b, s, d)
    packed = peers.PackedSDPA(plain).eval()
    mha = peers.mha_peer(plain).eval()
    mods = [plain, rope, packed, mha]
    mask = _mha_causal(s) if causal else None
    flops = _fwd_flops(b, s, d, plain.config.inner_dim, plain.config.kv_dim, causal)
    es = [
        Entry("headwise", _no_grad(lambda: plain(x, causal=causal)), role="headwise"),
        Entry("packed SDPA (limit)", _no_grad(lambda: packed(x, causal=causal)), role="limit"),
        Entry("nn.MHA fast path", _no_grad(lambda: mha(x, x, x, need_weights=False, attn_mask=mask,
                                                       is_causal=causal)[0]),
              note="eval + no_grad + need_weights=False"),
    ]
    lean = shape not in sz.hf_eager
    if not lean:
        es.append(Entry("nn.MHA default call", _no_grad(lambda: mha(x, x, x, attn_mask=mask, is_causal=causal)[0]),
                        note="need_weights=True (averaged)"))
    notes = ["time budget: nn.MHA's default call and HF eager run at b8 s512 d768 only; HF BERT is not timed "
             "causal here"] if lean else []
    if hf_note is None:
        impls = ("sdpa",) if lean else ("sdpa", "eager")
        es.append(Entry("headwise (RoPE, no bias)", _no_grad(lambda: rope(x, causal=causal)), role="headwise2",
                        note="Llama-shaped layer, the reference for the HF Llama rows"))
        for impl in impls if not (lean and causal) else ():
            bert = peers.bert_peer(plain, impl)
            mods += bert.modules
            es.append(Entry(f"HF BERT {impl}", _no_grad(partial(bert, x, causal)),
                            note="BertSelfAttention + output dense"))
        for impl in impls:
            llama = peers.llama_peer(rope, impl)
            mods += llama.modules
            es.append(Entry(f"HF Llama {impl}", _no_grad(partial(llama, x, causal)), ref="headwise (RoPE, no bias)"))
    else:
        notes.append(f"Hugging Face peers skipped: {hf_note}")
    refresh_memory(*mods)
    return Group("1 forward", f"fwd {_shape_name(*shape)} {'causal' if causal else 'full'}", es,
                 rounds=_rounds(sz, flops), block_s=sz.block_s, tol=(2e-4, 2e-5), flops=flops,
                 meta={"b": b, "s": s, "d": d, "h": h, "causal": causal, "mode": "forward"}, notes=notes)


def forward_groups(sz: Sizes, *, hf: bool = True) -> list[Factory]:
    hf_note = peers.hf_available() if hf else "Hugging Face peers disabled"
    return [partial(_forward_group, sz, shape, causal, hf_note) for shape in sz.forward for causal in (False, True)]


def _backward_group(sz: Sizes, shape: Shape, causal: bool, hf_note: str | None) -> Group:
    b, s, d, h = shape
    plain, rope = _layers(d, h)
    plain.train(), rope.train()
    x = torch.randn(b, s, d, requires_grad=True)
    grad = torch.randn(b, s, d)
    packed = peers.PackedSDPA(plain).train()
    mods = [plain, rope, packed]
    flops = 3 * _fwd_flops(b, s, d, plain.config.inner_dim, plain.config.kv_dim, causal)
    es = [
        Entry("headwise", _train(lambda t: plain(t, causal=causal), x, list(plain.parameters()), grad),
              role="headwise"),
        Entry("packed SDPA (limit)", _train(lambda t: packed(t, causal=causal), x, list(packed.parameters()), grad),
              role="limit"),
    ]
    notes = []
    if shape in sz.backward_full_peers:
        mha = peers.mha_peer(plain).train()
        mods.append(mha)
        mask = _mha_causal(s) if causal else None
        es.append(Entry("nn.MHA", _train(lambda t: mha(t, t, t, need_weights=False, attn_mask=mask,
                                                      is_causal=causal)[0], x, list(mha.parameters()), grad),
                        note="training mode, need_weights=False"))
        if hf_note is None:
            es.append(Entry("headwise (RoPE, no bias)", _train(lambda t: rope(t, causal=causal), x,
                                                               list(rope.parameters()), grad), role="headwise2"))
            bert = peers.bert_peer(plain, "sdpa")
            mods += bert.modules
            es.append(Entry("HF BERT sdpa", _train(lambda t: bert(t, causal), x,
                                                   [p for m in bert.modules for p in m.parameters()], grad)))
            llama = peers.llama_peer(rope, "sdpa")
            mods += llama.modules
            es.append(Entry("HF Llama sdpa", _train(lambda t: llama(t, causal), x,
                                                    [p for m in llama.modules for p in m.parameters()], grad),
                            ref="headwise (RoPE, no bias)"))
        else:
            notes.append(f"Hugging Face peers skipped: {hf_note}")
    else:
        notes.append("at this size fwd+bwd runs headwise and the limit only (time budget)")
    refresh_memory(*mods)
    return Group("1 fwd+bwd", f"fwd+bwd {_shape_name(*shape)} {'causal' if causal else 'full'}", es,
                 rounds=_rounds(sz, flops), block_s=sz.block_s, tol=(5e-4, 5e-5), flops=flops,
                 meta={"b": b, "s": s, "d": d, "h": h, "causal": causal, "mode": "fwd+bwd"}, notes=notes)


def backward_groups(sz: Sizes, *, hf: bool = True) -> list[Factory]:
    hf_note = peers.hf_available() if hf else "Hugging Face peers disabled"
    return [partial(_backward_group, sz, shape, causal, hf_note) for shape in sz.backward for causal in (False, True)
            if not causal or shape in sz.backward_causal]


def _peak_group(sz: Sizes, shape: Shape) -> Group:
    b, s, d, h = shape
    torch.manual_seed(0)
    a = torch.randn(b * s, d)
    w = torch.randn(d, d)
    w3 = torch.randn(3 * d, d)
    f1 = 2.0 * b * s * d * d
    es = [Entry("matmul (b*s, d) x (d, d)", _no_grad(lambda: a @ w.t()), role="peak", compare=False,
                extra={"flops": f1}),
          Entry("matmul (b*s, d) x (d, 3d)", _no_grad(lambda: a @ w3.t()), role="peak", compare=False,
                extra={"flops": 3 * f1})]
    return Group("6 matmul peak", f"peak {_shape_name(*shape)}", es, rounds=_rounds(sz, 8 * f1), block_s=sz.block_s,
                 tol=None, meta={"b": b, "s": s, "d": d, "h": h})


def peak_groups(sz: Sizes) -> list[Factory]:
    """Case 6: the machine's fp32 matmul throughput at each forward shape's projection sizes."""
    return [partial(_peak_group, sz, shape) for shape in sz.forward]


def _causal_step_group(sz: Sizes) -> Group:
    b, h, s, d_h = sz.causal_step
    attn = MultiHeadAttention(h * d_h, h).eval()
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d_h) for _ in range(3))
    mask = _causal_bool(s)
    es = [
        Entry("attend(causal=True)", _no_grad(lambda: attn.attend(q, k, v, causal=True)[0]), role="headwise",
              extra={"flops": 2.0 * b * s * (s + 1) * h * d_h}),  # the kernel skips the masked half
        Entry("attend() non-causal", _no_grad(lambda: attn.attend(q, k, v)[0]), compare=False),
        Entry("SDPA + explicit s x s mask", _no_grad(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
              note="what a materialised causal mask costs"),
    ]
    flops = 4.0 * b * s * s * h * d_h
    notes = ["'headwise / this' is here causal time / other time; GFLOP/s of the causal row count the computed "
             "half only"]
    try:  # how forward dispatches causal=True and a prefill into an empty cache (headwise.dispatch)
        x = torch.randn(b, s, h * d_h)
        via = attn.explain_dispatch(x, causal=True).causal_via
        via_cache = attn.explain_dispatch(x, cache=attn.new_cache(b, s)).causal_via
        notes.append(f"forward(causal=True) dispatches via: {via}; cache prefill via: {via_cache}")
    except Exception as exc:  # pragma: no cover - dispatch introspection is optional here
        notes.append(f"dispatch not introspected: {type(exc).__name__}: {exc}")
    return Group("1 causal step", f"attention step b{b} h{h} s{s} d_h{d_h}", es, rounds=_rounds(sz, flops) + 2,
                 block_s=sz.block_s, tol=(1e-4, 1e-5), flops=flops, meta={"b": b, "h": h, "s": s, "d_h": d_h},
                 notes=notes)


def causal_step_groups(sz: Sizes) -> list[Factory]:
    """The attention step alone, causal vs not: the kernel's causal path must skip the masked half."""
    return [partial(_causal_step_group, sz)]


# -- case 2: GQA / MQA ------------------------------------------------------------------------------------
def _gqa_forward_group(sz: Sizes, h_kv: int) -> Group:
    s, d, h, _ = sz.gqa
    plain, _ = _layers(d, h, h_kv)
    x = torch.randn(1, s, d)
    native = peers.PackedSDPA(plain).eval()
    repeat = peers.PackedSDPA(plain, repeat_kv=True).eval()
    refresh_memory(plain, native, repeat)
    flops = _fwd_flops(1, s, d, plain.config.inner_dim, plain.config.kv_dim)
    es = [Entry("headwise", _no_grad(lambda: plain(x)), role="headwise"),
          Entry("packed SDPA enable_gqa (limit)", _no_grad(lambda: native(x)), role="limit"),
          Entry("packed SDPA repeat K/V", _no_grad(lambda: repeat(x)))]
    meta = {"s": s, "d": d, "h": h, "h_kv": h_kv, "kind": plain.config.kind,
            "kv_bytes_headwise": 2 * s * plain.config.kv_dim * 4, "kv_bytes_repeated": 2 * s * d * 4}
    return Group("2 GQA/MQA", f"{plain.config.kind} forward s{s} d{d} h{h} h_kv{h_kv}", es,
                 rounds=_rounds(sz, flops), block_s=sz.block_s, tol=(2e-4, 2e-5), flops=flops, meta=meta)


def _gqa_step_group(sz: Sizes, h_kv: int) -> Group:
    s, d, h, _ = sz.gqa
    plain, _ = _layers(d, h, h_kv)
    d_h, g = d // h, h // h_kv
    q = torch.randn(1, h, s, d_h)
    k, v = torch.randn(1, h_kv, s, d_h), torch.randn(1, h_kv, s, d_h)

    def repeated() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))

    flops = 4.0 * s * s * h * d_h
    es = [Entry("headwise attend", _no_grad(lambda: plain.attend(q, k, v)[0]), role="headwise"),
          Entry("repeat_interleave K/V + SDPA", _no_grad(repeated))]
    return Group("2 GQA/MQA", f"{plain.config.kind} attention step s{s} h{h} h_kv{h_kv}", es,
                 rounds=_rounds(sz, flops) + 2, block_s=sz.block_s, tol=(1e-4, 1e-5), flops=flops,
                 meta={"s": s, "h": h, "h_kv": h_kv, "kind": plain.config.kind})


def gqa_groups(sz: Sizes) -> list[Factory]:
    # The whole forward for the first h_kv only: the projections are the same work either way, the difference
    # between native GQA and repeated K/V is in the attention step, measured alone for every h_kv.
    out: list[Factory] = [partial(_gqa_forward_group, sz, sz.gqa[3][0])]
    out += [partial(_gqa_step_group, sz, h_kv) for h_kv in sz.gqa[3]]
    return out


# -- case 3: per-head weights --------------------------------------------------------------------------------
def _weights_group(sz: Sizes, shape: Shape) -> Group:
    b, s, d, h = shape
    plain, _ = _layers(d, h)
    mha = peers.mha_peer(plain).eval()
    refresh_memory(plain, mha)
    x = torch.randn(b, s, d)
    es = [Entry("headwise return_weights=True", _no_grad(lambda: plain(x, return_weights=True)), role="headwise"),
          Entry("nn.MHA need_weights, per head", _no_grad(lambda: mha(
              x, x, x, need_weights=True, average_attn_weights=False)), note="average_attn_weights=False")]
    flops = _fwd_flops(b, s, d, plain.config.inner_dim, plain.config.kv_dim)
    return Group("3 per-head weights", f"weights {_shape_name(*shape)}", es, rounds=_rounds(sz, flops),
                 block_s=sz.block_s, tol=(2e-4, 2e-5), flops=flops,
                 meta={"b": b, "s": s, "d": d, "h": h, "weights_bytes": b * h * s * s * 4})


def weights_groups(sz: Sizes) -> list[Factory]:
    return [partial(_weights_group, sz, shape) for shape in sz.weights]


from .decode import decode_groups  # noqa: E402  (decode builds on the helpers above)
from .gpu import gpu_groups  # noqa: E402
from .long import long_groups  # noqa: E402
from .trace import trace_groups  # noqa: E402
from .baseline import baseline_groups  # noqa: E402

CASES: dict[str, Callable[..., list[Factory]]] = {
    "forward": forward_groups,
    "backward": backward_groups,
    "causal": causal_step_groups,
    "gqa": gqa_groups,
    "weights": weights_groups,
    "decode": decode_groups,
    "peak": peak_groups,
    "long": long_groups,
    "gpu": gpu_groups,
    "trace": trace_groups,
    "patched": patched_groups,
    "surgery": surgery_groups,
    "baseline": baseline_groups,
}


def build(name: str, sz: Sizes, **kw) -> list[Factory]:
    """Group factories of case ``name`` (a key of :data:`CASES`) at sizes ``sz``."""
    fn = CASES[name]
    return fn(sz, **kw) if name in ("forward", "backward", "decode") else fn(sz)
