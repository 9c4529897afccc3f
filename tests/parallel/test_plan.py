"""The head-partition arithmetic, exhaustively over small (n_heads, n_kv_heads, world_size), no process groups.

The independent reference is brute force: give rank r the query heads [r * h / w, (r + 1) * h / w), collect
the K/V heads they read by the GQA rule (head i reads K/V head i // (h / h_kv)), and call the split valid
exactly when every rank needs the same number of K/V heads and any two ranks need either the same K/V heads
or disjoint ones (otherwise some rank would hold part of a K/V group that another rank also holds in part).
"""

from __future__ import annotations

import re

import pytest

from headwise.parallel import HeadPartition, TensorParallelPlan, plan_heads, valid_world_sizes

CASES = [(h, h_kv, w) for h in range(1, 17) for h_kv in range(1, h + 1) if h % h_kv == 0 for w in range(1, 19)]


def _brute_force(h: int, h_kv: int, w: int) -> list[tuple[list[int], list[int]]] | None:
    if h % w:
        return None
    per_rank, group = h // w, h // h_kv
    ranks = []
    for r in range(w):
        q = list(range(r * per_rank, (r + 1) * per_rank))
        ranks.append((q, sorted({i // group for i in q})))
    sizes = {len(kv) for _, kv in ranks}
    for _, a in ranks:
        for _, b in ranks:
            if a != b and set(a) & set(b):
                return None
    return ranks if len(sizes) == 1 else None


@pytest.mark.parametrize("h", range(1, 17))
def test_plan_matches_brute_force_for_every_small_split(h):
    for hh, h_kv, w in CASES:
        if hh != h:
            continue
        want = _brute_force(h, h_kv, w)
        if want is None:
            with pytest.raises(ValueError) as err:
                plan_heads(h, h_kv, w)
            listed = [int(v) for v in re.search(r"valid world sizes[^\[]*\[([\d, ]*)\]", str(err.value))
                      .group(1).split(",")]
            assert listed == [v for v in range(1, h + 1) if _brute_force(h, h_kv, v) is not None]
            assert w not in valid_world_sizes(h, h_kv)
            continue
        assert w in valid_world_sizes(h, h_kv)
        plan = plan_heads(h, h_kv, w)
        assert isinstance(plan, TensorParallelPlan) and len(plan.partitions) == w
        assert plan.kv_replicated == (h_kv < w)
        holders = {k: 0 for k in range(h_kv)}
        for r, (q, kv) in enumerate(want):
            p = plan.partition(r)
            assert isinstance(p, HeadPartition)
            assert (list(p.q_heads), list(p.kv_heads)) == (q, kv), (h, h_kv, w, r)
            assert p.kv_replicated == plan.kv_replicated
            for j in range(len(q)):
                # Local query head j is global head r * h_local + j and reads global K/V head (that) // g.
                assert p.q_heads[j] == r * (h // w) + j
                assert p.global_kv_head_of_local(j) == (r * (h // w) + j) // (h // h_kv)
                # The local layer's own GQA rule picks the right local K/V head.
                assert p.kv_heads[j // p.local_group_size] == (r * (h // w) + j) // (h // h_kv)
                assert plan.owner_of(q[j]) == r and p.local_index(q[j]) == j
            for k in kv:
                holders[k] += 1
        assert set(holders.values()) == {max(1, w // h_kv)} == {plan.kv_replicas}
        for k in range(h_kv):
            assert len(plan.ranks_holding_kv(k)) == plan.kv_replicas


def test_replication_is_described():
    plan = plan_heads(8, 2, 4)
    text = plan.describe()
    assert "replicated" in text and "held by 2 ranks" in text
    assert "rank 1: query heads [2, 3], K/V heads [0]" in text
    assert "partitioned" in plan_heads(8, 2, 2).describe()
    assert "MQA" in plan_heads(4, 1, 4).describe()


@pytest.mark.parametrize("h, h_kv, w, needle", [
    (6, 2, 4, "6 % 4 != 0"),       # query heads do not divide
    (12, 4, 6, "4 % 6 != 0"),      # K/V groups would straddle ranks
    (12, 6, 4, "6 % 4 != 0"),
])
def test_invalid_split_names_the_valid_world_sizes(h, h_kv, w, needle):
    valid = valid_world_sizes(h, h_kv)
    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        plan_heads(h, h_kv, w)
    assert f"valid world sizes for n_heads={h}, n_kv_heads={h_kv}: {valid}" in str(err.value)


def test_head_lookup_names_the_owner():
    p = plan_heads(8, 8, 4).partition(1)
    with pytest.raises(ValueError, match="rank 3 owns it"):
        p.local_index(7)
    with pytest.raises(IndexError):
        plan_heads(8, 8, 4).owner_of(8)


@pytest.mark.parametrize("bad", [0.5, 1.0, True, "1", None])
def test_head_lookups_take_only_int_indices(bad):
    # 1.0 and True compare equal to 1: accepted, they would return float indices or another head's ranks.
    plan = plan_heads(8, 2, 4)
    part = plan.partition(2)
    for name, lookup in (("K/V head index", plan.ranks_holding_kv), ("query head", part.local_index),
                         ("local head index", part.global_kv_head_of_local), ("query head", part.owns)):
        with pytest.raises(TypeError, match=rf"^{name} must be an int, got {re.escape(repr(bad))} "
                                            rf"\({type(bad).__name__}\)$"):
            lookup(bad)
    assert (plan.ranks_holding_kv(1), part.local_index(5), part.global_kv_head_of_local(1)) == ([2, 3], 1, 1)
    assert part.owns(5) and not part.owns(1)


@pytest.mark.parametrize("args, exc", [((0, 1, 1), ValueError), ((4, 1, 0), ValueError), ((4, 3, 1), ValueError),
                                       ((4.0, 1, 1), TypeError), ((4, 1, True), TypeError)])
def test_bad_counts_are_rejected(args, exc):
    with pytest.raises(exc):
        plan_heads(*args)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(8, 3), (8, 0), (8, 2.0), (0, 1), (True, 1), (12, 5)])
def test_plans_refuse_head_counts_exactly_as_a_layer_config_does(n_heads, n_kv_heads):
    from headwise import AttentionConfig
    from headwise.parallel import plan_sequence_parallel

    with pytest.raises((TypeError, ValueError)) as want:
        AttentionConfig(d_model=64, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=8)
    for plan in (lambda: plan_heads(n_heads, n_kv_heads, 2), lambda: valid_world_sizes(n_heads, n_kv_heads),
                 lambda: plan_sequence_parallel(n_heads, n_kv_heads, sp=2)):
        with pytest.raises(want.type) as got:
            plan()
        assert str(got.value) == str(want.value)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(8, 8), (8, 2), (8, 1), (6, 3), (1, 1)])
def test_plans_name_the_layer_kind_as_its_config_does(n_heads, n_kv_heads):
    from headwise import AttentionConfig
    from headwise.parallel import plan_sequence_parallel

    cfg = AttentionConfig(d_model=8 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads)
    plan = plan_heads(n_heads, n_kv_heads, 1)
    assert plan.kind == plan_sequence_parallel(n_heads, n_kv_heads, sp=1).kind == cfg.kind
    assert plan.partition(0).group_size == cfg.group_size
    assert f"({cfg.kind}, group size {cfg.group_size})" in plan.describe()
