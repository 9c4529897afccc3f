"""`headwise check MODULE:FACTORY`: table and JSON output, exit codes 0 (ok) / 1 (a property failed) /
2 (bad input, one line, no traceback)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from headwise.cli import main

ROOT = Path(__file__).resolve().parents[2]
GALLERY = "tests.checks.check_gallery"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # MODULE is imported relative to the current directory, as with python -m


def test_correct_layer_exits_0_with_a_table(capsys):
    assert main(["check", f"{GALLERY}:reference"]) == 0
    out = capsys.readouterr().out
    assert "RefAttention" in out and "OK" in out
    for name in ("permutation_equivariance", "head_independence", "dtype_stability"):
        assert name in out


def test_broken_layer_exits_1_naming_the_failures(capsys):
    assert main(["check", f"{GALLERY}:flatten_bug"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # the table wraps long lines
    assert "FAILED: permutation_equivariance, padding_invariance, softmax_sanity, head_independence" in out


def test_a_property_named_twice_runs_once(capsys):
    argv = ["check", f"{GALLERY}:reference", "--json"]
    assert main([*argv, "--property", "causality", "--property", "softmax_sanity", "--property", "causality"]) == 0
    twice = json.loads(capsys.readouterr().out)
    assert main([*argv, "--property", "causality", "--property", "softmax_sanity"]) == 0
    once = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in twice["results"]] == ["causality", "softmax_sanity"]
    assert twice["results"] == once["results"]


def test_json_output(capsys):
    assert main(["check", f"{GALLERY}:FlattenNoTranspose", "--json", "--seed", "1"]) == 1  # a class is a factory
    payload = json.loads(capsys.readouterr().out)
    assert payload["ok"] is False and payload["seed"] == 1
    assert payload["failed"] == ["permutation_equivariance", "padding_invariance", "softmax_sanity",
                                 "head_independence"]
    failed = [r for r in payload["results"] if r["verdict"] == "fail"]
    assert all(r["counterexample"]["summary"] for r in failed)


def test_options_causal_property_and_plain_function(capsys):
    assert main(["check", f"{GALLERY}:LAYER", "--causal", "--property", "causality", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in payload["results"]] == ["causality"] and payload["ok"]
    # a plain function passes what it can, but exposes no weights and no heads: not verified, exit 1
    assert main(["check", f"{GALLERY}:plain_callable", "--d-model", "16", "--seq", "6", "--batch", "2"]) == 1
    out, err = capsys.readouterr()
    assert "plain_callable" in out and "7 properties: 3 ran (3 passed, 0 failed), 4 skipped" in out
    assert err.startswith("headwise check: NOT VERIFIED: core properties could not run: softmax_sanity")
    assert len(err.strip().splitlines()) == 1


def test_the_docs_property_example_runs(capsys):
    # docs/check.md: `headwise check mypkg.layers:layer --causal --property causality --seed 3 --seq 12 --batch 4`
    argv = [f"{GALLERY}:LAYER", "--causal", "--property", "causality", "--seed", "3", "--seq", "12", "--batch", "4"]
    assert main(["check", *argv]) == 0
    out = capsys.readouterr().out
    assert "causality" in out and "OK. 1 property: 1 ran (1 passed, 0 failed), 0 skipped" in out
    # without --causal the layer claims nothing: the one property asked for is skipped, and that is said
    assert main(["check", *argv[:1], *argv[2:]]) == 1
    out, err = capsys.readouterr()
    assert "does not claim causality" in out and "NOTHING CHECKED" in err


def test_not_attention_is_not_ok(capsys):
    assert main(["check", "torch.nn:Identity", "--d-model", "16"]) == 1
    out, err = capsys.readouterr()
    assert "OK" not in out.replace("NOT VERIFIED", "")
    assert "NOT VERIFIED: core properties could not run: softmax_sanity" in err and "head_independence" in err


def test_a_layer_calling_sys_exit_fails_the_properties_it_ran(capsys):
    assert main(["check", f"{GALLERY}:exits_after_first_call", "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    failed = [r for r in payload["results"] if r["verdict"] == "fail"]
    assert failed and not payload["ok"]
    assert all("SystemExit" in r["counterexample"]["summary"] for r in failed)


@pytest.mark.parametrize("argv,message", [
    ([f"{GALLERY}:plain_callable"], "d_model"),
    ([f"{GALLERY}:failing_factory"], "broken on purpose"),
    ([f"{GALLERY}:NOT_A_LAYER"], "not a layer"),
    ([f"{GALLERY}:missing"], "no attribute"),
    (["no_such_module_xyz:f"], "cannot import module"),
    (["no_colon"], "MODULE:FACTORY"),
    ([f"{GALLERY}:reference", "--property", "nope"], "invalid choice: 'nope'"),
    ([f"{GALLERY}:ExitsAlways", "--d-model", "8"], "SystemExit"),
    ([f"{GALLERY}:reference", "--d-model", "0"], "--d-model must be a positive integer, got 0"),
    ([f"{GALLERY}:reference", "--d-model", str(10 ** 12)], "over the limit of 256 MiB"),
    ([f"{GALLERY}:reference", "--d-model", "8"], "d_model=8"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_json_output_is_strict_json_with_null_for_non_finite_numbers(capsys, tmp_path, monkeypatch):
    import math

    from headwise.checks import check

    (tmp_path / "inf_layer_mod.py").write_text("def inf_layer(x):\n    return x * float('inf')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "inf_layer_mod:inf_layer", "--d-model", "8", "--json"]) == 1

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    payload = json.loads(capsys.readouterr().out, parse_constant=refuse)  # RFC 8259: no NaN, no Infinity

    def finite(value):  # the reference: the library's own report with every non-finite float as null
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value

    from inf_layer_mod import inf_layer

    report = check(inf_layer, d_model=8).to_dict()
    assert json.dumps(report, default=str).count("Infinity") + json.dumps(report, default=str).count("NaN") > 0
    report.pop("seconds", None), payload.pop("seconds", None)
    assert payload == json.loads(json.dumps(finite(report), default=str))


def _probability_bytes(b: int, h: int, s: int) -> int:
    """The reference: what torch itself says a float64 (b, h, s, s) tensor takes (meta: nothing allocated)."""
    import torch

    return torch.empty(b, h, s, s, dtype=torch.float64, device="meta").nbytes


def test_the_size_guard_counts_the_attention_probabilities_not_only_x():
    from headwise.checks.sizes import MAX_INPUT_BYTES, check_input_size

    # largest s whose one-head (1, 1, s, s) float64 probabilities fit the limit, found from torch's own count
    s = 1
    while _probability_bytes(1, 1, s + 1) <= MAX_INPUT_BYTES:
        s += 1 if s < 1000 else 256
    while _probability_bytes(1, 1, s) > MAX_INPUT_BYTES:
        s -= 1
    check_input_size(1, s, 32)  # x is 32 * s * 8 bytes, far under the limit: the probabilities decide
    with pytest.raises(ValueError, match=r"attention probabilities \(batch, heads, seq_len, seq_len\) = "
                                         rf"\(1, 1, {s + 1}, {s + 1}\).*over the limit of 256 MiB"):
        check_input_size(1, s + 1, 32)
    # with the head count known it is counted: 4 heads at s // 2 tokens take about what 1 head at s does
    assert _probability_bytes(1, 4, s // 2 + 1) > MAX_INPUT_BYTES >= _probability_bytes(1, 4, s // 2 - 1)
    check_input_size(1, s // 2 - 1, 32, 4)
    with pytest.raises(ValueError, match="over the limit of 256 MiB"):
        check_input_size(1, s // 2 + 1, 32, 4)


@pytest.mark.parametrize("extra", [["--d-model", "32"], []])
def test_a_sequence_whose_probabilities_are_too_large_is_refused_before_the_layer_runs(capsys, tmp_path,
                                                                                      monkeypatch, extra):
    import time

    (tmp_path / "never_run_mod.py").write_text(
        "import headwise\n"
        "class Layer(headwise.MultiHeadAttention):\n"
        "    def forward(self, *a, **k):\n"
        "        raise AssertionError('the layer must not run')\n"
        "def good():\n"
        "    return Layer(32, 4, n_kv_heads=2)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    start = time.perf_counter()
    code = main(["check", "never_run_mod:good", "--seq", "100000", "--batch", "1", *extra])
    err = capsys.readouterr().err
    assert code == 2 and time.perf_counter() - start < 30
    assert f"= (1, 1, 100000, 100000) in float64 would take {_probability_bytes(1, 1, 100000):.1e} bytes" in err
    assert "over the limit of 256 MiB" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # 4 heads at 3000 tokens: one head would fit, the layer's four do not (judged once it is imported)
    assert _probability_bytes(1, 1, 3000) <= 256 * 2 ** 20 < _probability_bytes(1, 4, 3000)
    assert main(["check", "never_run_mod:good", "--seq", "3000", "--batch", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert f"(1, 4, 3000, 3000) in float64 would take {_probability_bytes(1, 4, 3000):.1e} bytes" in err
    assert len(err.strip().splitlines()) == 1


def test_the_python_api_counts_the_layers_heads_as_the_command_line_does():
    import headwise
    from headwise.checks import check

    class NeverRun(headwise.MultiHeadAttention):
        def forward(self, *a, **k):
            raise AssertionError("the layer must not run")

    # 4 heads at 3000 tokens: one head would fit, the layer's four do not (torch's own count is the reference)
    assert _probability_bytes(1, 1, 3000) <= 256 * 2 ** 20 < _probability_bytes(1, 4, 3000)
    said = f"(1, 4, 3000, 3000) in float64 would take {_probability_bytes(1, 4, 3000):.1e} bytes, over the limit"
    with pytest.raises(ValueError, match=re.escape(said)):
        check(NeverRun(32, 4, n_kv_heads=2), batch=1, seq_len=3000)


def test_a_seed_out_of_range_exits_2_before_importing_anything(capsys):
    for seed in (str(2 ** 64 - 2), "-1"):
        assert main(["check", f"{GALLERY}:reference", "--seed", seed]) == 2
        err = capsys.readouterr().err
        assert f"--seed must be an int in [0, 2**63 - 1], got {seed}" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1


def test_a_causal_layer_at_the_shortest_sequence_exits_0(capsys):
    assert main(["check", f"{GALLERY}:reference", "--seq", "2", "--causal"]) == 0
    assert "fitted on every head" in capsys.readouterr().out


def test_a_width_that_cannot_be_inferred_is_asked_for_as_the_option(capsys, tmp_path, monkeypatch):
    # headwise.check asks for its keyword d_model=; the command line has --d-model
    (tmp_path / "widthless_layers.py").write_text("import torch\n\ndef linear():\n    return torch.nn.Linear(5, 5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for target, said in ((f"{GALLERY}:plain_callable", "a plain callable needs --d-model"),
                         ("widthless_layers:linear", "cannot infer d_model of Linear: pass --d-model")):
        assert main(["check", target]) == 2
        err = capsys.readouterr().err
        assert said in err and "d_model=" not in err, err
        assert len(err.strip().splitlines()) == 1
    assert main(["check", f"{GALLERY}:reference", "--d-model", "8"]) == 2  # a value stays as it is
    assert "d_model=8 but RefAttention has d_model=32" in capsys.readouterr().err
