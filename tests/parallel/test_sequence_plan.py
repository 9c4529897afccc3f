"""The sequence-parallel head arithmetic, exhaustively over small (n_heads, n_kv_heads, sp, tp), no process
groups. The reference is brute force: deal the shard's query heads out in rank order (the first h % sp ranks
one more), collect the K/V heads they read by the GQA rule, and count what every other rank receives."""

from __future__ import annotations

import pytest

from headwise.parallel import plan_sequence_parallel, valid_sequence_layouts, valid_world_sizes

CASES = [(h, h_kv, sp, tp) for h in range(1, 13) for h_kv in range(1, h + 1) if h % h_kv == 0
         for sp in range(1, 9) for tp in (1, 2, 4)]


def _brute(h: int, h_kv: int, sp: int, tp: int):
    if h % tp or not (h_kv % tp == 0 or tp % h_kv == 0):
        return None
    hs, kvs = h // tp, max(1, h_kv // tp)
    if sp > hs:
        return None
    heads = [[] for _ in range(sp)]
    for i in range(hs):  # deal: rank r gets the r-th run of ceil / floor(hs / sp) heads
        r = next(r for r in range(sp) if i < sum(hs // sp + (k < hs % sp) for k in range(r + 1)))
        heads[r].append(i)
    return [(q, sorted({i // (hs // kvs) for i in q})) for q in heads]


@pytest.mark.parametrize("h,h_kv,sp,tp", CASES)
def test_plan_matches_brute_force(h, h_kv, sp, tp):
    want = _brute(h, h_kv, sp, tp)
    if want is None:
        with pytest.raises(ValueError) as err:
            plan_sequence_parallel(h, h_kv, sp=sp, tp=tp)
        valid = [(s, t) for t in range(1, h + 1) for s in range(1, h + 1)
                 if s * t == sp * tp and _brute(h, h_kv, s, t) is not None]
        assert sorted(valid_sequence_layouts(h, h_kv, sp * tp)) == sorted(valid)
        assert (str(sorted(valid, key=lambda v: -v[1])) in str(err.value)) if valid else "no (sp, tp)" in str(err.value)
        return
    plan = plan_sequence_parallel(h, h_kv, sp=sp, tp=tp)
    hs = h // tp
    for r, (q, kv) in enumerate(want):
        part = plan.rank(r)
        assert (list(part.q_heads), list(part.kv_heads)) == (q, kv)
        g = hs // max(1, h_kv // tp)
        assert [part.kv_heads[j] for j in part.kv_index] == [i // g for i in q]  # local index -> right K/V head
        assert plan.global_q_heads(r, tp - 1) == tuple((tp - 1) * hs + i for i in q)
    for bad in (tp, -1, True):  # a tensor-parallel rank the layout lacks names no heads
        with pytest.raises(ValueError, match=rf"tp rank must be an int in \[0, {tp}\), got {bad!r}"):
            plan.global_q_heads(0, bad)
    assert plan.kv_replicated == (len({k for _, kv in want for k in kv}) < sum(len(kv) for _, kv in want))
    b, s_q, s_kv, d_h, item = 2, 5, 3, 4, 2
    row_q, row_kv = b * s_q * d_h * item, b * s_kv * d_h * item
    # sent[(r, j)]: bytes rank r sends rank j in the forward: j's heads of r's slice (Q, K, V), r's heads of
    # j's slice (the output); a backward sends the gradient of each of these back, from j to r.
    sent = {}
    for r in range(sp):
        for j in range(sp):
            if j != r:
                sent[r, j] = (len(want[j][0]) * row_q, len(want[j][1]) * row_kv, len(want[r][0]) * row_q)
    for r in range(sp):
        q, kv, out = (sum(sent[r, j][i] for j in range(sp) if j != r) for i in range(3))
        back = sum(sum(sent[j, r][i] * (2 if i == 1 else 1) for i in range(3)) for j in range(sp) if j != r)
        got = plan.all_to_all_bytes(batch=b, s_q=s_q, s_kv=s_kv, d_head=d_h, itemsize=item, sp_rank=r)
        assert got == {"q": q, "k": kv, "v": kv, "out": out, "forward": q + 2 * kv + out, "backward": back}


def test_layouts_and_bad_arguments():
    assert valid_sequence_layouts(8, 2, 4) == [(1, 4), (2, 2), (4, 1)]
    assert all(t in valid_world_sizes(12, 4) for _, t in valid_sequence_layouts(12, 4, 12))
    with pytest.raises(TypeError, match="sp must be a positive int"):
        plan_sequence_parallel(8, 2, sp=2.0)
    with pytest.raises(ValueError, match="does not divide"):
        plan_sequence_parallel(8, 3, sp=2)
    with pytest.raises(ValueError, match="sp rank must be"):
        plan_sequence_parallel(8, 2, sp=2).rank(2)
    text = str(plan_sequence_parallel(6, 2, sp=4))
    assert "2 or 1 query heads per rank" in text and "uneven" in text and "sp rank 3: query heads [5], K/V heads [1]" in text


@pytest.mark.parametrize("name, value", [("batch", -1), ("batch", 0), ("s_q", 2.5), ("d_head", True),
                                         ("itemsize", 4.0), ("s_kv", -3)])
def test_all_to_all_bytes_takes_only_positive_int_sizes(name, value):
    sizes = dict(batch=1, s_q=4, d_head=2, itemsize=4) | {name: value}
    exc = TypeError if isinstance(value, (bool, float)) else ValueError
    with pytest.raises(exc, match=rf"^{name} must be a positive int, got {value!r}"):
        plan_sequence_parallel(8, 8, sp=2).all_to_all_bytes(**sizes)


def test_the_documented_closed_form_holds_exactly_where_the_docs_say():
    """docs/parallel.md: with P dividing h and the K/V heads splitting evenly (h_kv % P == 0, or P % h_kv == 0),
    every rank sends (P - 1) / P * b s d_h * i * (2 h + 2 max(h_kv, P)) forward; elsewhere some rank sends more."""
    b, s, d_h, item = 2, 5, 4, 2
    for h, h_kv, sp, tp in CASES:
        if tp != 1 or _brute(h, h_kv, sp, tp) is None or h % sp:
            continue
        plan = plan_sequence_parallel(h, h_kv, sp=sp)
        sent = [plan.all_to_all_bytes(batch=b, s_q=s, d_head=d_h, itemsize=item, sp_rank=r) for r in range(sp)]
        closed = (sp - 1) * b * s * d_h * item * (2 * h + 2 * max(h_kv, sp)) // sp
        if h_kv % sp == 0 or sp % h_kv == 0:
            assert all(n["forward"] == n["backward"] == closed for n in sent), (h, h_kv, sp)
        else:
            assert max(n["forward"] for n in sent) > closed, (h, h_kv, sp)


@pytest.mark.parametrize("first", ["headwise.parallel.tensor", "headwise.parallel.sequence",
                                   "headwise.parallel.agreement", "headwise.parallel"])
def test_package_names_are_the_functions_whatever_is_imported_first_and_plans_need_no_torch(first):
    import subprocess
    import sys

    code = (f"import sys, importlib\n"
            f"from headwise.parallel.sequence_plan import plan_sequence_parallel\n"
            f"assert 'torch' not in sys.modules\n"
            f"importlib.import_module({first!r})\n"
            f"from headwise.parallel import sequence_parallel, tensor_parallel, CollectiveTimeoutError\n"
            f"import headwise.parallel as p\n"
            f"assert callable(sequence_parallel) and callable(tensor_parallel), (sequence_parallel, tensor_parallel)\n"
            f"assert p.sequence_parallel is sequence_parallel and p.tensor_parallel is tensor_parallel\n"
            f"import types\n"
            f"assert type(p) is types.ModuleType, type(p)  # a plain module: nothing replaces its class\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
