"""The "baseline" case (benchmarks.baseline): the old package is really the old code, imported beside the new
one; both compute the same outputs on the same weights; the goal reads exactly the old-vs-new pairs."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks.baseline import BASE, BASELINE_REV, load_baseline
from benchmarks.report import evaluate_goals, paired_ratio

from .tiny import run_tiny

pytestmark = pytest.mark.xdist_group("bench")


@pytest.fixture(scope="module")
def old():
    mod = load_baseline()
    if isinstance(mod, str):  # an exported tree or shallow clone: the case says why and has no groups
        pytest.skip(mod)
    return mod


def test_the_old_package_is_the_old_code_not_the_new(old):
    import headwise

    assert old.__name__ == f"headwise_{BASELINE_REV[:7]}" and old is not headwise
    assert old.MultiHeadAttention is not headwise.MultiHeadAttention
    # the old code still had the packed-GEMM module issue 14 removed; the new one has not
    assert hasattr(old, "packed_gemm") and not hasattr(headwise, "packed_gemm")
    assert "headwise" in sys.modules and sys.modules["headwise"] is headwise


def test_old_and_new_layers_agree_on_shared_weights(old):
    import headwise

    torch.manual_seed(0)
    new = headwise.MultiHeadAttention(32, 4, 2).eval()
    base = old.MultiHeadAttention(32, 4, 2).eval()
    base.load_state_dict(new.state_dict())
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(base(x, causal=True), new(x, causal=True))


def test_an_unknown_commit_is_a_reason_not_an_exception():
    got = load_baseline("0" * 40)
    assert isinstance(got, str) and "0000000" in got


def test_case_groups_and_goal_rows(old):
    groups = run_tiny("baseline")
    cases = {g["case"] for g in groups}
    assert {"baseline 1 forward", "baseline 1 fwd+bwd", "baseline 2 GQA/MQA", "baseline 3 per-head weights",
            "baseline 4 decode", "baseline 7 patched"} <= cases
    pairs = 0
    for g in groups:
        for e in g["entries"]:
            if e["name"].startswith(BASE):
                assert e["vs"] and e["matches_headwise"], (g["group"], e)  # same outputs as the new layer
                pairs += 1
    goals = {g["goal"]: g for g in evaluate_goals(groups, [])}
    main = next(v for k, v in goals.items() if k.startswith(f"headwise vs {BASE}"))
    worst = max(paired_ratio(next(x for x in g["entries"] if x["name"] == e["vs"]), e)
                for g in groups for e in g["entries"]
                if e["name"].startswith(BASE) and not e["name"].endswith("use_packed_gemm"))
    assert main["measured"].startswith(f"worst {worst:.3f}")
    assert main["detail"].count(": ") >= pairs - sum(1 for g in groups for e in g["entries"]
                                                     if e["name"].endswith("use_packed_gemm"))


def test_the_faults_script_times_both_layers_and_counts_their_page_faults(old, capsys):
    """benchmarks.faults: both layers timed, ratio = the median per-round ratio, faults counted per call (a
    tiny shape allocates nothing fresh after warm-up, so a large count would be a bookkeeping error)."""
    from benchmarks import faults

    m = faults.measure(1, 8, 32, 4, causal=True, rounds=3)
    assert m["new_ms"] > 0 and m["old_ms"] > 0 and 0 < m["ratio"] < 100
    assert 0 <= m["new_faults"] < 50 and 0 <= m["old_faults"] < 50
    assert faults.main(["1", "8", "32", "4", "--rope", "--rounds", "2", "--processes", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "b1 s8 d32 h4 --rope" and out[1].startswith("process 1: new ") and "page faults" in out[1]
