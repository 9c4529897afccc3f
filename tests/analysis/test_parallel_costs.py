"""parallel_costs against the per-rank sizes of layers actually split by heads, and its answer time for head and
rank counts no layer could be built with.

The reference splits the heads the way the layers do (``tensor_split`` of the head indices: the first ranks take
one more), slices a real layer's weights (on the meta device: sizes, no memory) and sums the ``nbytes`` of the
tensors each rank holds or sends; only the split's description is taken from the plans themselves.
"""

from __future__ import annotations

import pytest
import torch

from headwise import AttentionConfig, MultiHeadAttention
from headwise.analysis.parallel import parallel_costs
from headwise.parallel.plan import plan_heads
from headwise.parallel.sequence_plan import plan_sequence_parallel


def _nbytes(*shapes: tuple[int, ...], dtype: torch.dtype) -> int:
    return sum(torch.empty(shape, dtype=dtype, device="meta").nbytes for shape in shapes)


def _rows(w: torch.Tensor, heads: torch.Tensor, d_h: int) -> torch.Tensor:
    """The rows of a packed projection weight (or bias) that belong to ``heads``."""
    return w.unflatten(0, (-1, d_h))[heads]


def _tensor_parallel(attn: MultiHeadAttention, b: int, s: int, p: int, dtype: torch.dtype) -> dict:
    c = attn.config
    h, h_kv, d_h, g = c.n_heads, c.n_kv_heads, c.d_head, c.n_heads // c.n_kv_heads
    ranks = []
    for heads in torch.arange(h).tensor_split(p):
        kv = (heads // g).unique()
        held = [_rows(attn.q_proj.weight, heads, d_h), _rows(attn.k_proj.weight, kv, d_h),
                _rows(attn.v_proj.weight, kv, d_h), attn.out_proj.weight.unflatten(1, (h, d_h))[:, heads]]
        if c.bias:
            held += [_rows(attn.q_proj.bias, heads, d_h), _rows(attn.k_proj.bias, kv, d_h),
                     _rows(attn.v_proj.bias, kv, d_h)]
        if c.out_bias:
            held.append(attn.out_proj.bias)
        ranks.append(dict(heads=len(heads), kv_heads=len(kv), weights=sum(t.nbytes for t in held)))
    r = ranks[0]
    assert all(x == r for x in ranks)  # whole heads: every rank holds as much
    replicated = h_kv < p  # a K/V head on several ranks: its gradients are summed across them
    kv_grads = sum(t.nbytes for m in (attn.k_proj, attn.v_proj) for t in m.parameters()) if replicated else 0
    y = _nbytes((b, s, c.d_model), dtype=dtype)
    ring = lambda n: 2 * (p - 1) * n // p  # noqa: E731  (a ring all-reduce sends 2 (P - 1) / P of the buffer)
    probs = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    lse = torch.float64 if dtype == torch.float64 else torch.float32
    return r | dict(
        input_output=2 * y,
        qkv_context=_nbytes(*[(b, r["heads"], s, d_h)] * 2, *[(b, r["kv_heads"], s, d_h)] * 2, dtype=dtype),
        probabilities_eager=_nbytes((b, r["heads"], s, s), dtype=probs),
        lse_fused=_nbytes((b, r["heads"], s), dtype=lse),
        kv_cache=_nbytes(*[(b, r["kv_heads"], s, d_h)] * 2, dtype=dtype),
        sent_forward=ring(y), sent_backward=ring(y), weight_grad_all_reduce=ring(kv_grads),
        plan=plan_heads(h, h_kv, p).describe().splitlines()[0])


def _sequence_parallel(attn: MultiHeadAttention, b: int, s: int, p: int, dtype: torch.dtype) -> dict:
    c = attn.config
    h, h_kv, d_h, g = c.n_heads, c.n_kv_heads, c.d_head, c.n_heads // c.n_kv_heads
    s_loc = max(len(t) for t in torch.arange(s).tensor_split(p))  # slices padded to the longest
    ranks = []
    for heads in torch.arange(h).tensor_split(p):
        n, kv = len(heads), (heads // g).unique()
        read = heads // g - kv[0]  # which of its K/V heads each query head reads
        grouped = n % len(kv) == 0 and torch.equal(read, torch.arange(n) // (n // len(kv)))
        attended = [(b, n, s, d_h)] * 2 + [(b, len(kv) if grouped else n, s, d_h)] * 2  # Q, context, K, V
        ranks.append(dict(n=n, k=len(kv), held=_nbytes(*attended, dtype=dtype)))
    chunk = lambda heads: _nbytes((b, s_loc, heads, d_h), dtype=dtype)  # noqa: E731  (one all-to-all chunk)
    forward, backward = [], []
    for r, me in enumerate(ranks):
        others = [o for j, o in enumerate(ranks) if j != r]
        # forward: the others' heads of my slice for Q, K, V; my heads of their slices for the output
        forward.append(sum(chunk(o["n"]) + 2 * chunk(o["k"]) for o in others) + (p - 1) * chunk(me["n"]))
        # backward: each of those the other way
        backward.append((p - 1) * (chunk(me["n"]) + 2 * chunk(me["k"])) + sum(chunk(o["n"]) for o in others))
    weights = sum(t.nbytes for t in attn.parameters())
    n = max(r["n"] for r in ranks)
    probs = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    lse = torch.float64 if dtype == torch.float64 else torch.float32
    return dict(heads=n, kv_heads=max(r["k"] for r in ranks), weights=weights,
                input_output=2 * _nbytes((b, s_loc, c.d_model), dtype=dtype),
                qkv_context=max(r["held"] for r in ranks),
                probabilities_eager=_nbytes((b, n, s, s), dtype=probs), lse_fused=_nbytes((b, n, s), dtype=lse),
                kv_cache=None, sent_forward=max(forward), sent_backward=max(backward),
                weight_grad_all_reduce=2 * (p - 1) * weights // p,
                plan=plan_sequence_parallel(h, h_kv, sp=p).describe().splitlines()[0])


def _refusal(build, *args, **kwargs) -> dict:
    with pytest.raises(ValueError) as err:
        build(*args, **kwargs)
    return {"error": str(err.value)}


HEADS = [(h, h_kv) for h in (1, 2, 3, 4, 6, 8, 12, 16, 24) for h_kv in range(1, h + 1) if h % h_kv == 0]


@pytest.mark.parametrize("h,h_kv", HEADS, ids=[f"h{h}-kv{k}" for h, k in HEADS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_figures_are_the_sizes_each_rank_of_a_split_layer_holds_and_sends(h: int, h_kv: int,
                                                                          dtype: torch.dtype) -> None:
    cfg = AttentionConfig(d_model=2 * h, n_heads=h, n_kv_heads=h_kv, d_head=3, bias=h % 2 == 0)
    attn = MultiHeadAttention.from_config(cfg, device="meta", dtype=dtype)
    for p in range(1, h + 3):
        tp_ok = h % p == 0 and (h_kv % p == 0 or p % h_kv == 0)
        for s, b in ((1, 1), (5, 2), (2 * p + 1, 1)):  # fewer tokens than ranks, and uneven slices
            got = parallel_costs(cfg, s, p, batch=b, dtype=dtype)
            tp = _tensor_parallel(attn, b, s, p, dtype) if tp_ok else _refusal(plan_heads, h, h_kv, p)
            sp = (_sequence_parallel(attn, b, s, p, dtype) if p <= h else
                  _refusal(plan_sequence_parallel, h, h_kv, sp=p))
            assert got["tp"] == tp, (p, s, b)
            assert got["sp"] == sp, (p, s, b)


@pytest.mark.timeout(30)
def test_head_and_rank_counts_past_any_layer_answer_at_once() -> None:
    """Closed forms: 2**40 heads over 2 ranks, or over as many ranks, answer without a list of heads or ranks
    (the figures written out by hand: fp8, one token, d_model = d_head = 1, so a rank's bytes are its heads)."""
    big = 2 ** 40
    mha = parallel_costs(AttentionConfig(d_model=1, n_heads=big, d_head=1), 1, 2, dtype="fp8")
    for key in ("tp", "sp"):  # big / 2 query and K/V heads per rank: Q, K, V, context of 1 token each
        assert (mha[key]["heads"], mha[key]["kv_heads"], mha[key]["qkv_context"]) == (big // 2, big // 2, 2 * big)
        assert mha[key]["lse_fused"] == big // 2 * 4
    assert mha["tp"]["sent_forward"] == 1  # the all-reduce of a 1-byte output over 2 ranks
    assert mha["sp"]["sent_forward"] == mha["sp"]["sent_backward"] == 4 * big // 2  # the other half of 4 tensors
    mqa = parallel_costs(AttentionConfig(d_model=1, n_heads=big, n_kv_heads=1, d_head=1), 1, big, dtype="fp8")
    for key in ("tp", "sp"):  # one query head per rank, each with a copy of the one K/V head
        assert (mqa[key]["heads"], mqa[key]["kv_heads"]) == (1, 1) and "replicated" in mqa[key]["plan"]
    # every other rank's query head and K/V copy come in (Q, K, V); this rank's output goes to all others
    assert mqa["sp"]["sent_forward"] == mqa["sp"]["sent_backward"] == 4 * (big - 1)
    uneven = parallel_costs(AttentionConfig(d_model=1, n_heads=3 * big, n_kv_heads=3, d_head=1), 5, big + 1,
                            dtype="fp8")
    assert uneven["sp"]["heads"] == 3 and "uneven" in uneven["sp"]["plan"] and "error" in uneven["tp"]
