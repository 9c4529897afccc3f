"""The benchmark suite's machinery on tiny shapes: every case builds and times its groups, every peer
computes what headwise computes (the honest-peer check), every goal finds its entries, and the command line
writes RESULTS.md with the shared environment. Never a timing assertion (speed goals live in benchmarks/)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks.cases import QUICK
from benchmarks.hf import FAMILIES, GENERATE_ROUNDS, family_model, llama_model, sharing_weights
from benchmarks.report import GOALS, Goal, evaluate, held_checks, write_results
from benchmarks.suite import CASES, ROOT, main, resolve_only, run_cases
from benchmarks.suite import _show as show_group
from benchmarks.timing import Entry, Group, run_group

pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("bench")  # the command-line test spawns processes

TINY = replace(QUICK, rounds=2, decode_rounds=2, sweep_rounds=2, block_s=0.0, stats_rounds=2)
HAS = {m: importlib.util.find_spec(m) is not None for m in ("transformer_lens", "nnsight", "pyvene")}


@pytest.fixture(scope="module")
def groups() -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_cases(TINY, list(CASES))
    finally:
        torch.set_num_threads(threads)


def test_every_case_times_its_groups(groups):
    families = [f"patched {name} {mode}" for name, *_ in FAMILIES.values() for mode in ("forward", "generate")]
    assert [g["key"] for g in groups] == [
        "forward", "forward causal", "fwd+bwd", "gqa", "decode", "decode step", "trace result", "trace pattern+z",
        "trace statistics", "sweep",
        "patched BERT forward", "patched Llama forward", "patched Llama generate", *families, "surgery prune",
        "surgery kv"]
    for g in groups:
        assert any(e["name"] == g["base"] for e in g["entries"]), g["key"]
        refused = any("patch refused it" in n for n in g["notes"])
        for e in g["entries"]:
            (rounds,) = e["round_s"]  # one process
            assert len(rounds) == (1 if refused else TINY.decode_rounds if g["key"].startswith("decode") else
                                   TINY.sweep_rounds if g["key"] == "sweep" else
                                   TINY.stats_rounds if g["key"] == "trace statistics" else
                                   GENERATE_ROUNDS * TINY.rounds if g["key"].endswith("generate") else TINY.rounds)
            assert all(t > 0 for t in rounds) and e["calls"] >= 1


def test_every_family_is_patched_and_equal_or_says_why_not(groups):
    for g in groups:
        if g["key"].startswith("patched"):
            names = [e["name"] for e in g["entries"]]
            if "headwise (patched)" in names:
                assert g["entries"][1]["matches"] is True, g["key"]
            else:
                assert len(names) == 1 and any("patch refused it: " in n for n in g["notes"]), g


def test_every_peer_computes_what_headwise_computes(groups):
    checked = {(g["key"], e["name"]): e for g in groups for e in g["entries"] if e["matches"] is not None}
    assert all(e["matches"] for e in checked.values()), {k: e["max_abs_diff"] for k, e in checked.items()}
    expected = {("forward", "packed SDPA"), ("forward", "nn.MultiheadAttention fast path"),
                ("forward causal", "packed SDPA"), ("forward causal", "nn.MultiheadAttention fast path"),
                ("fwd+bwd", "packed SDPA"), ("gqa", "packed SDPA enable_gqa"), ("gqa", "packed SDPA repeat K/V"),
                ("decode", "x @ W preallocated loop"), ("decode step", "x @ W preallocated loop"),
                ("trace result", "hooks + einsum"),
                ("trace result", "headwise patched, no trace"), ("trace pattern+z", "hooks"),
                ("patched BERT forward", "HF BERT (unpatched)"), ("patched Llama forward", "HF Llama (unpatched)"),
                ("patched Llama generate", "HF Llama (unpatched)"), ("patched GPT-2 forward", "HF GPT-2 (unpatched)"),
                ("patched GPT-2 generate", "HF GPT-2 (unpatched)"), ("sweep", "hooks, a batch per layer"),
                ("surgery prune", "packed SDPA, half the heads"), ("surgery kv", "headwise, to_mha"),
                ("surgery kv", "headwise, checkpoint"), ("surgery kv", "HF Llama (unpatched), 1 K/V head")}
    if HAS["transformer_lens"]:
        expected |= {("trace result", "TransformerLens run_with_cache"), ("trace result", "TransformerLens forward"),
                     ("trace pattern+z", "TransformerLens run_with_cache"), ("sweep", "TransformerLens run_with_hooks")}
    if HAS["nnsight"]:
        expected |= {("trace result", "nnsight"), ("trace pattern+z", "nnsight"), ("sweep", "nnsight")}
    if HAS["pyvene"]:
        expected |= {("trace result", "pyvene"), ("sweep", "pyvene")}
    assert expected <= set(checked)
    # the trace and sweep groups measured every entry's peak memory (the sweep's on its warm-up call)
    assert all(e["peak_bytes"] is not None for g in groups if g["key"].startswith(("trace", "sweep"))
               for e in g["entries"])


def test_surgery_case_counts_parameters_and_cache_bytes(groups):
    by_key = {g["key"]: g for g in groups}
    b, s, d, h = TINY.forward
    d_h = d // h
    for e in by_key["surgery prune"]["entries"]:
        kept = h // 2 if e["name"].startswith("packed") else int(e["note"].split(" of ")[0])
        assert f"{4 * d * kept * d_h + 3 * kept * d_h + d:,} parameters" in e["note"], e  # Q, K, V, O; biases
    d, h, h_kv, layers, _, _ = TINY.llama
    kv = by_key["surgery kv"]["entries"]
    assert [e["held"][1] for e in kv] == [h, h_kv, 1, h_kv, 1]  # h_kv / 2 is 1 at these sizes: one entry
    b, s = TINY.prefill
    for e in kv:  # keys and values, float32
        assert e["held"][0] == 2 * layers * b * e["held"][1] * s * (d // h) * 4, e
    checks = held_checks(groups)
    assert [(c["entry"], c["of"], c["holds"]) for c in checks] == [(e["name"], "headwise, to_mha", True) for e in kv]
    rows = {r["goal"]: r for r in evaluate(groups)}
    assert rows["surgery: forward with half the heads removed vs unpruned"]["vs"] == "headwise, every head"
    assert not any("K/V cache" in label for label in rows)  # an exact check, not beside the timed goals


def test_a_cache_of_other_bytes_than_its_share_fails_its_check(tmp_path):
    def group(held: list[tuple[int, int]]) -> dict:
        return {"key": "kv", "title": "kv", "base": "a", "threads": 1, "notes": [], "entries": [
            {"name": n, "note": "", "round_s": [[1.0]], "median_s": 1.0, "checked_against": None,
             "max_abs_diff": None, "matches": None, "held": list(x)} for n, x in zip("abc", held)]}

    good = held_checks([group([(1600, 16), (400, 4), (100, 1)])])
    assert [(c["entry"], c["units"], c["holds"]) for c in good] == [("a", "16/16", True), ("b", "4/16", True),
                                                                    ("c", "1/16", True)]
    bad = held_checks([group([(1600, 16), (400, 4), (101, 1)])])  # a byte more: no spread excuses it
    assert [c["holds"] for c in bad] == [True, True, False] and bad[2]["expected"] == 100
    path = write_results(tmp_path / "R.md", [group([(1600, 16), (404, 4)])], [], command="c",
                         env={}, processes=1)
    assert "| kv | b | 404 | 4/16 of `a`'s | FAILS: 400 expected |" in path.read_text()


def test_a_missed_goal_says_by_how_much_above_its_target():
    rounds = {"mine": [1.1, 2.2, 3.3], "other": [1.0, 2.0, 3.0]}
    group = {"key": "g", "entries": [{"name": n, "round_s": [r], "matches": None} for n, r in rounds.items()]}
    for target, status in ((1.05, "missed by 4.8 %"), (1.20, "met"), (1.00, "missed by 10.0 %")):
        [row] = evaluate([group], (Goal("mine vs other", "g", "mine", ("other",), target),))
        assert row["status"] == status, row


def test_surgery_case_times_what_it_names():
    from benchmarks.surgery import kv_group, prune_group
    from tests.reference import reference_heads

    prune = {e.name: e for e in prune_group(TINY).entries}
    full, x = prune["headwise, every head"].fn.args
    b, s, d, h = TINY.forward
    d_h, kept = d // h, h // 2

    def heads(lin: torch.nn.Linear) -> torch.Tensor:  # (b, h, s, d_h), float64
        return (x.double() @ lin.weight.double().T + lin.bias.double()).view(b, s, h, d_h).transpose(1, 2)

    z, _ = reference_heads(heads(full.q_proj), heads(full.k_proj), heads(full.v_proj))
    z[:, kept:] = 0  # the half-pruned layer is the full one with its last heads removed
    w_o = full.out_proj
    want = z.transpose(1, 2).reshape(b, s, d) @ w_o.weight.double().T + w_o.bias.double()
    for name in ("headwise, half the heads", "packed SDPA, half the heads"):
        torch.testing.assert_close(prune[name].fn().double(), want, rtol=1e-4, atol=1e-5)
    kv = {e.name: e for e in kv_group(TINY).entries}
    ids = kv["headwise, checkpoint"].fn.args[1]
    with torch.no_grad():  # the checkpoint computes what a fresh, never patched model of the same seed computes
        torch.testing.assert_close(kv["headwise, checkpoint"].fn(), llama_model(*TINY.llama)(ids).logits,
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv["headwise, to_mha"].fn(), kv["headwise, checkpoint"].fn(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv["HF Llama (unpatched), 1 K/V head"].fn(), kv["headwise, to_gqa, 1 K/V head"].fn())


def test_a_peer_that_computes_something_else_is_caught():
    x = torch.randn(3, 4)
    group = Group("g", "g", [Entry("headwise", lambda: x * 2), Entry("peer", lambda: x * 2 + 1e-3)],
                  base="peer", rounds=1, block_s=0.0)
    res = run_group(group)
    assert res["entries"][1]["matches"] is False and res["entries"][1]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    goal = replace(GOALS[0], key="g", entry="headwise", others=("peer",))
    assert evaluate([res], (goal,))[0]["status"] == "output mismatch"


@pytest.mark.parametrize("on_warmup", [True, False])
def test_memory_is_measured_on_the_warm_up_call_or_one_extra_call(on_warmup):
    calls = []

    def fn() -> torch.Tensor:
        calls.append(1)
        return torch.ones(1 << 22)  # 16 MiB, resident while the call's output lives

    group = Group("g", "g", [Entry("a", fn, number=1)], base="a", rounds=2, block_s=0.0, memory=True,
                  memory_on_warmup=on_warmup)
    peak = run_group(group)["entries"][0]["peak_bytes"]
    assert len(calls) == 1 + 2 + (0 if on_warmup else 1)
    if sys.platform.startswith("linux"):
        assert peak >= 15 << 20


def test_every_goal_finds_its_entries(groups, tmp_path):
    goals = evaluate(groups)
    assert [g["goal"] for g in goals] == [g.label for g in GOALS]
    assert all(g["status"].startswith(("met", "missed")) for g in goals), goals
    path = write_results(tmp_path / "RESULTS.md", groups, goals, command="pytest", env={"THP_MEM_ALLOC_ENABLE": "1"},
                         processes=1, quick=True)
    text = path.read_text()
    assert "## Goals" in text and "| THP_MEM_ALLOC_ENABLE | 1 |" in text
    assert all(f"## {g['title']}" in text for g in groups)


def test_the_patched_entry_shares_the_unpatched_models_weights_and_only_them():
    from headwise.interop import layers, patch

    plain = family_model("opt", *QUICK.family)
    twin = patch(sharing_weights(plain))
    mine = dict(plain.named_parameters())
    assert all(t is mine[n] for n, t in twin.named_parameters())  # the same memory: no placement in the ratio
    assert all(t is b for (_, t), (_, b) in zip(twin.named_buffers(), plain.named_buffers()))
    assert not layers(plain) and layers(twin)  # modules are the copy's own: patching it left the original alone
    assert not any(m is p for m in twin.modules() for p in plain.modules())
    ids = torch.randint(3, plain.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, plain(ids).logits)


def test_only_takes_case_names():
    assert resolve_only("decode,forward") == ["forward", "decode"]
    assert resolve_only(" decode , forward ") == ["forward", "decode"]
    assert resolve_only(None) == list(CASES)
    with pytest.raises(ValueError, match="--only takes case names"):
        resolve_only("forward,nope")
    for typo in ("decode,", "surgery,,", ",forward", "forward, ,decode"):
        with pytest.raises(ValueError, match=f"got an empty name in {typo!r}"):
            resolve_only(typo)
    for blank in ("", ",", " , "):
        with pytest.raises(ValueError, match="got no name in"):
            resolve_only(blank)


RESULTS = ROOT / "benchmarks" / "RESULTS.md"


@pytest.mark.parametrize("argv, bad", [
    (["--only", ","], "got no name in ','"),
    (["--only", ""], "got no name in ''"),
    (["--only", "surgery,,"], "got an empty name in 'surgery,,'"),
    (["--only", "forward,bogus"], "got bogus"),
    (["--threads", "-1"], "--threads: takes a whole number >= 1, got -1"),
    (["--threads", "0"], "--threads: takes a whole number >= 1, got 0"),
    (["--processes", "0"], "--processes: takes a whole number >= 1, got 0"),
    (["--device", "cuda", "--only", "bogus"], "got bogus (--device cuda)"),
    (["--device", "cuda", "--only", "forward,sweep"], "got sweep (--device cuda)"),
    (["--device", "cuda", "--only", ","], "got no name in ','"),
    (["--device", "cuda", "--only", "forward,"], "got an empty name in 'forward,'"),
    (["--device", "cuda", "--quick"], "it takes no --quick"),
    (["--device", "cuda", "--processes", "2"], "it takes no --processes"),
    (["--device", "cuda", "--threads", "2"], "it takes no --threads"),
])
def test_command_line_refuses_bad_input_before_running_anything(argv, bad, capsys, tmp_path):
    # Refused in argument parsing, before any group (or the CUDA device check): nothing is written.
    before = RESULTS.stat().st_mtime_ns
    out = tmp_path / "R.md"
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(out)])
    errors = capsys.readouterr().err.splitlines()  # one line, argparse's usage lines left to --help
    assert exc.value.code == 2 and len(errors) == 1 and errors[0].startswith("benchmarks: error: "), errors
    assert bad in errors[0], errors
    assert not out.exists() and RESULTS.stat().st_mtime_ns == before


def test_command_line_refuses_an_out_it_cannot_write_as_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    for out, bad in ((tmp_path, f"--out takes a file path, got the directory {tmp_path}"),
                     (tmp_path / "f" / "R.md", f"(under the file {tmp_path / 'f'})")):
        with pytest.raises(SystemExit) as exc:
            main(["--quick", "--only", "gqa", "--out", str(out)])
        errors = capsys.readouterr().err.splitlines()
        assert exc.value.code == 2 and len(errors) == 1 and bad in errors[0], errors


def test_a_subset_run_leaves_the_whole_runs_results_in_place(monkeypatch, capsys, tmp_path):
    import tempfile

    import benchmarks.cases
    import benchmarks.suite

    recorded = tmp_path / "repo" / "benchmarks" / "RESULTS.md"
    recorded.parent.mkdir(parents=True)
    recorded.write_text("the last whole run")
    monkeypatch.setattr(benchmarks.suite, "ROOT", tmp_path / "repo")
    monkeypatch.setattr(benchmarks.cases, "FULL", TINY)  # a subset at tiny sizes, not --quick
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    threads = torch.get_num_threads()
    try:
        assert main(["--only", "gqa", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert recorded.read_text() == "the last whole run"
    wrote = tmp_path / "tmp" / "headwise-bench-subset" / "RESULTS.md"
    assert f"wrote {wrote} (a subset" in capsys.readouterr().out
    assert "## GQA forward" in wrote.read_text()


def test_console_tables_show_every_column(capsys):
    group = Group("g", "g", [Entry("a", lambda: torch.ones(2), note="the a note"),
                             Entry("b", lambda: torch.ones(2), note="the b note")], base="b", rounds=1, block_s=0.0)
    show_group(run_group(group))
    printed = capsys.readouterr().out
    assert "note" in printed.splitlines()[2] and "the a note" in printed and "the b note" in printed


def test_command_line_sets_huge_pages_and_pools_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    out = tmp_path / "R.md"
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "decode", "--processes", "2",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert "| THP_MEM_ALLOC_ENABLE | 1 |" in text and "| processes | 2 |" in text
    assert "| decode vs the x @ W preallocated loop | <= 1.05 |" in text
    bad = subprocess.run([sys.executable, "-m", "benchmarks", "--only", "nope"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("benchmarks: error: --only takes case names")
    assert len(bad.stderr.splitlines()) == 1, bad.stderr
