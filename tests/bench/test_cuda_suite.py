"""The GPU benchmark's machinery, run on the CPU at tiny sizes (``benchmarks.cuda.CPU_CHECK``): every group
builds, its peers compute what headwise computes (the honest-peer check), and every CUDA goal finds its entries.
The figures come only from a GPU run (docs/gpu.md); nothing here is timed."""

from __future__ import annotations

import pytest
import torch

from benchmarks import cuda
from benchmarks.cuda import CPU_CHECK, CUDA, CUDA_GOALS, cuda_groups, generate_group
from benchmarks.report import evaluate
from benchmarks.timing import run_group

pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("bench")


@pytest.fixture(scope="module")
def groups() -> list[dict]:
    torch._dynamo.reset()
    return [run_group(factory()) for factory in cuda_groups(setup=CPU_CHECK)]


def test_every_group_runs_and_every_peer_matches_headwise(groups):
    keys = [g["key"] for g in groups]
    assert len(keys) == len(set(keys)) == 2 * len(CPU_CHECK.forwards) + 4 + 2 + 4 + 1 + 1
    mismatched = [(g["key"], e["name"], e["max_abs_diff"]) for g in groups for e in g["entries"]
                  if e["matches"] is False]
    assert not mismatched


def test_every_cuda_goal_finds_its_entries_at_the_gpu_sizes():
    # The GPU groups' keys at the GPU sizes: built from the same factories' names, without running them.
    keys = [f"cuda forward b{b} s{s} d{d} h{h}" + (f"/{k}" if k != h else "") for b, s, d, h, k in CUDA.forwards]
    assert all(any(k in (g.key if isinstance(g.key, tuple) else (g.key,)) for g in CUDA_GOALS) for k in keys)


def test_the_goals_evaluate_on_the_cpu_check_groups(groups):
    # CPU_CHECK names its groups by its own shapes, so shape-keyed goals are "not run"; the others evaluate.
    by_goal = {g["goal"]: g for g in evaluate(groups, CUDA_GOALS)}
    for label in ("eager decode step vs the fastest plain loop, seen positions",
                  "compiled step vs the faster of gpt-fast-style and the plain loop",
                  "patched Llama generate vs unpatched, seen lengths", "every head's result vs a plain forward",
                  "lse, entropy and max_weight vs a plain forward", "all four statistics vs a plain forward"):
        assert by_goal[label]["ratio"] is not None and by_goal[label]["status"] != "output mismatch", by_goal[label]


def test_an_unknown_subset_is_refused():
    with pytest.raises(ValueError, match="--only with --device cuda takes forward, backward.*statistics"):
        cuda_groups(["sweep"])


def test_fresh_generate_gives_headwise_the_longer_fresh_prompt_in_every_round():
    plain, patched = cuda._llama_pair(CPU_CHECK)
    seen: dict[str, list[int]] = {"headwise": [], "HF": []}
    for tag, model in (("headwise", patched), ("HF", plain)):
        def recording(ids, *args, _generate=model.generate, _tag=tag, **kwargs):
            seen[_tag].append(ids.shape[1])
            return _generate(ids, *args, **kwargs)
        model.generate = recording
    res = run_group(generate_group(CPU_CHECK, 1, True, (plain, patched)))
    calls = 1 + len(res["entries"][0]["round_s"][0])  # the warm-up, then one generation per round
    assert len(seen["headwise"]) == len(seen["HF"]) == calls
    new, step = CPU_CHECK.new_tokens, CPU_CHECK.new_tokens + 4
    # the k-th call of each (warm-up, then round k): headwise one step longer, so the bias is against it
    assert [a - b for a, b in zip(seen["headwise"], seen["HF"])] == [step] * calls
    # fresh: no two calls' decode lengths (prompt .. prompt + new) meet
    starts = sorted(seen["headwise"] + seen["HF"])
    assert all(b - a > new for a, b in zip(starts, starts[1:]))
