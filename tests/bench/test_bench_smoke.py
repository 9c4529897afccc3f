"""Smoke test of the benchmark machinery on tiny shapes: result structure and that headwise and every peer
compute the same outputs on the same inputs. Never a timing assertion (speed goals live in benchmarks/)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from benchmarks import QUICK, resolve_only, run_suite
from benchmarks.report import evaluate_goals, machine_info, paired_ratio, write_results

pytestmark = pytest.mark.xdist_group("bench")  # it spawns a process for the memory case

TINY = replace(QUICK, rounds=1, heavy_rounds=1, decode_tokens=2, block_s=0.0, memory=(2, 8, (64,)))


@pytest.fixture(scope="module")
def suite() -> tuple[list[dict], list[dict]]:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops on 2 threads of a busy machine mostly measure thread wake-ups
    try:
        # the baseline case (the old package against the new) has its own test: test_baseline_bench.py
        yield run_suite(TINY, [c for c in resolve_only(None) if c != "baseline"], show=False)
    finally:
        torch.set_num_threads(threads)


def test_every_case_produces_groups(suite):
    groups, memory = suite
    cases = {g["case"] for g in groups}
    expected = {"1 forward", "1 fwd+bwd", "1 causal step", "2 GQA/MQA", "3 per-head weights", "4 decode",
                "5 long forward", "6 matmul peak", "trace", "7 patched", "8 surgery"}
    if torch.cuda.is_available():  # the optional GPU case runs only there
        expected |= {"gpu forward", "gpu attention step"}
    assert cases == expected
    for g in groups:
        assert g["threads"] == 1
        assert g["entries"], g["group"]
        for e in g["entries"]:
            assert 0 < e["min_s"] <= e["median_s"] <= e["max_s"], (g["group"], e)
            assert e["rounds"] >= 1 and e["calls_per_round"] >= 1 and len(e["round_s"]) == e["rounds"]
    assert [m["impl"] for m in memory] == ["headwise", "headwise one pass"]
    assert all(m["forward_peak_above_inputs"] >= 0 and "error" not in m for m in memory)


def test_peers_compute_what_headwise_computes(suite):
    groups, _ = suite
    checked = 0
    for g in groups:
        for e in g["entries"]:
            if e["max_abs_diff_vs_headwise"] is not None:
                assert e["matches_headwise"], (g["group"], e["name"], e["max_abs_diff_vs_headwise"])
                checked += 1
    names = {e["name"] for g in groups for e in g["entries"] if e["matches_headwise"]}
    # the limit and each kind of peer was really compared (not skipped)
    for peer in ("packed SDPA (limit)", "nn.MHA fast path", "nn.MHA default call", "HF BERT sdpa", "HF BERT eager",
                 "HF Llama sdpa", "HF Llama eager", "packed SDPA repeat K/V", "nn.MHA need_weights, per head",
                 "minimal prealloc cache (limit)", "torch.cat cache", "HF Llama DynamicCache",
                 "HF Llama StaticCache", "SDPA + explicit s x s mask", "repeat_interleave K/V + SDPA",
                 "headwise one pass", "x @ W preallocated loop"):
        assert peer in names, peer
    assert checked >= 20


def test_decode_goal_rows_read_their_own_entries(suite):
    # Each decode goal's worst ratio is the worst paired ratio of exactly the entries it names.
    groups, memory = suite
    goals = {g["goal"]: g for g in evaluate_goals(groups, memory)}
    dec = [g for g in groups if g["case"] == "4 decode"]
    pick = lambda g, name: next((e for e in g["entries"] if e["name"] == name), None)  # noqa: E731
    for goal, peer in (("decode vs minimal preallocated cache", "minimal prealloc cache (limit)"),
                       ("decode vs x @ W preallocated loop (d 2048, h 16, context 2048)", "x @ W preallocated loop")):
        worst = max(paired_ratio(pick(g, "headwise"), pick(g, peer)) for g in dec if pick(g, peer) is not None)
        assert goals[goal]["measured"].startswith(f"worst {worst:.3f}"), (goal, goals[goal]["measured"])
    (xw,) = [g for g in dec if g["meta"].get("peer") == "x @ W"]
    assert (xw["meta"]["d"], xw["meta"]["h"], xw["meta"]["h_kv"]) == (*TINY.decode_xw[:2], TINY.decode_xw[1])
    assert not any("packed GEMM" in e["name"] for g in groups for e in g["entries"])


def test_goals_and_files(suite, tmp_path):
    groups, memory = suite
    goals = evaluate_goals(groups, memory)
    assert all({"goal", "target", "status"} <= set(g) for g in goals)
    md, js = write_results(tmp_path, machine_info("pytest", quick=True), groups, memory, goals)
    data = json.loads(js.read_text())
    assert data["machine"]["torch"] == torch.__version__ and data["machine"]["threads"] >= 1
    assert len(data["groups"]) == len(groups)
    text = md.read_text()
    assert "## Goals" in text and "packed SDPA (limit)" in text


def test_only_resolves_names_and_numbers():
    assert resolve_only(["4"]) == ["decode"]
    assert resolve_only(["gqa,5"]) == ["gqa", "long", "memory"]
    assert resolve_only(["gpu"]) == ["gpu"]
    with pytest.raises(ValueError, match="--only"):
        resolve_only(["nope"])


def test_gpu_case_machinery_on_cpu():
    # The GPU case's groups, built on the CPU in bfloat16: headwise, the packed limit and SDPA must agree.
    from benchmarks.gpu import gpu_groups
    from benchmarks.timing import run_group

    factories = gpu_groups(TINY, device="cpu")
    assert len(factories) == 2 * len(TINY.forward) + 2 * len(TINY.gpu_step)
    for factory in factories:
        group = factory()
        res = run_group(group)
        compared = [e for e in res["entries"] if e["max_abs_diff_vs_headwise"] is not None]
        assert compared and all(e["matches_headwise"] for e in compared), res
        if res["case"] == "gpu attention step":  # flash-attn is CUDA-only: said, not silently dropped
            assert any("flash_attn_func not timed" in n for n in res["notes"])


def test_gpu_goal_says_not_run_without_cuda(suite):
    groups, memory = suite
    goal = next(g for g in evaluate_goals(groups, memory) if g["goal"].startswith("GPU"))
    if torch.cuda.is_available():
        assert "worst" in goal["measured"]
    else:
        assert goal["status"].startswith("not run: no CUDA")


def test_cold_python_prints_both_costs(capsys):
    from benchmarks import cold_python

    cold_python.main(["--stream-mib", "1", "--rounds", "2"])
    out = capsys.readouterr().out
    assert "us back to back" in out and "after a 1 MiB stream" in out
