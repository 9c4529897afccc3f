"""The surgery case's machinery on tiny shapes: its groups, parameter counts and cache bytes against the
arithmetic, the limit computing what the pruned layer computes, and its goal rows. Never a timing assertion."""

from __future__ import annotations

import pytest

from benchmarks.report import evaluate_goals
from tests.bench.tiny import run_tiny

pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def groups() -> list[dict]:
    return run_tiny("surgery")


def test_surgery_groups_counts_and_peers(groups):
    prune, kv = groups
    assert (prune["group"], kv["group"]) == ("surgery prune forward b1 s16 d64 h4", "surgery kv Llama prefill b1 s8 h4")
    d, h, d_h = 64, 4, 16
    for e in prune["entries"][:4]:
        kept = round(e["kept"] * h)
        assert e["name"] == f"headwise {kept} of {h} heads"
        assert e["params"] == 4 * d * kept * d_h + 3 * kept * d_h + d  # Q, K, V, O weights; biases
    limit = prune["entries"][4]
    assert limit["matches_headwise"] and limit["params"] == prune["entries"][2]["params"]
    # QUICK_LLAMA: d 64, h 4, h_kv 2, 2 layers; cache = 2 (K, V) * layers * b * h_kv * s * d_h * 4 bytes
    for e in kv["entries"]:
        assert e["kv_cache_bytes"] == 2 * 2 * 1 * e["n_kv_heads"] * 8 * 16 * 4, e["name"]
    assert [e["n_kv_heads"] for e in kv["entries"]] == [4, 2, 1, 1]
    assert kv["entries"][-1]["matches_headwise"]  # plain transformers computes what the regrouped model does


def test_surgery_goal_rows(groups):
    rows = {g["goal"]: g for g in evaluate_goals(groups, [])}
    half = rows["surgery: attention forward with half the heads removed vs unpruned"]
    assert half["target"] == "<= 0.6" and half["status"] != "not measured" and "parameters" in half["detail"]
    (kv,) = [r for name, r in rows.items() if name.startswith("surgery: KV-cache bytes")]
    assert kv["met"] and "h_kv 1: 0.0 MiB" in kv["measured"]
