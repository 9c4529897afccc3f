"""`headwise check MODULE:FACTORY`: table and JSON output, exit codes 0 (ok) / 1 (a property failed) /
2 (bad input, one line, no traceback)."""

from __future__ import annotations

import json
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
    out = capsys.readouterr().out
    assert "FAILED: permutation_equivariance, padding_invariance, head_independence" in out


def test_json_output(capsys):
    assert main(["check", f"{GALLERY}:FlattenNoTranspose", "--json", "--seed", "1"]) == 1  # a class is a factory
    payload = json.loads(capsys.readouterr().out)
    assert payload["ok"] is False and payload["seed"] == 1
    assert payload["failed"] == ["permutation_equivariance", "padding_invariance", "head_independence"]
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
    assert "causality" in out and "OK. 1 properties: 1 ran (1 passed, 0 failed), 0 skipped" in out
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
