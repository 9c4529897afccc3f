"""`headwise explain` and `headwise compare` through main(): output, --json, exit codes on bad input."""

from __future__ import annotations

import json

import pytest
import torch

from headwise import AttentionConfig, MultiHeadAttention
from headwise.analysis import forward_flops, kv_cache_bytes, param_count
from headwise.cli import main


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch) -> None:
    # rich wraps tables to the terminal width; assertions look for whole cells
    monkeypatch.setenv("COLUMNS", "300")
from headwise.presets import get_preset


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _bad(capsys, *argv: str) -> str:
    code, out, err = _run(capsys, *argv)
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    return err


def test_explain_custom_layer_text(capsys) -> None:
    code, out, _ = _run(capsys, "explain", "--d-model", "768", "--n-heads", "12", "--seq", "64")
    assert code == 0
    assert "d_head=64" in out and "real CPU tensors" in out
    assert "(1, 12, 64, 64)" in out  # the scores step of the shape walk
    assert f"{param_count(AttentionConfig(d_model=768, n_heads=12)).total:,}" in out
    for label in ("parameters", "FLOPs, attention", "KV cache per token", "probabilities, fused"):
        assert label in out


def test_explain_preset_json_uses_meta_for_huge_sizes(capsys) -> None:
    code, out, _ = _run(capsys, "explain", "--preset", "llama-3-70b", "--seq", "8192", "--dtype", "bf16", "--json")
    assert code == 0
    r = json.loads(out)
    cfg = get_preset("llama-3-70b").config
    assert r["walk_device"] == "meta" and r["n_layers"] == 80 and r["dtype"] == "bfloat16"
    assert r["params"]["layer"]["total"] == param_count(cfg).total
    assert r["flops"]["layer"]["total"] == forward_flops(cfg, 8192).total
    assert r["kv_cache"]["context_bytes"] == kv_cache_bytes(cfg, 8192, dtype="bf16", n_layers=80)
    scores = next(s for s in r["steps"] if s["name"].startswith("scores"))
    assert scores["shape"] == [1, 64, 8192, 8192]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_explain_eager_probabilities_are_what_the_layer_materialises(capsys, dtype: str) -> None:
    code, out, _ = _run(capsys, "explain", "--d-model", "64", "--n-heads", "4", "--seq", "32", "--batch", "2",
                        "--dtype", dtype, "--json")
    assert code == 0
    attn = MultiHeadAttention(64, 4, dtype=getattr(torch, dtype))
    info = attn.explain_dispatch(torch.randn(2, 32, 64, dtype=getattr(torch, dtype)), return_weights=True)
    assert json.loads(out)["probabilities"]["materialised"] == info.probability_bytes


def test_explain_overrides_preset(capsys) -> None:
    code, out, _ = _run(capsys, "explain", "--preset", "llama-2-7b", "--n-kv-heads", "8", "--seq", "16", "--json")
    assert code == 0 and json.loads(out)["config"]["kind"] == "GQA"


@pytest.mark.parametrize("argv,message", [
    (["--d-model", "100", "--n-heads", "7"], "does not divide d_model=100"),
    (["--d-model", "64", "--n-heads", "8", "--n-kv-heads", "3"], "valid n_kv_heads"),
    (["--preset", "llama3-8b"], "did you mean: llama-3-8b"),
    (["--d-model", "64", "--n-heads", "8", "--dtype", "float17"], "dtype must be"),
    (["--d-model", "64", "--n-heads", "8", "--seq", "0"], "--seq must be a positive"),
    (["--d-model", "-4", "--n-heads", "8"], "--d-model must be a positive"),
    (["--n-heads", "8"], "give --preset NAME"),
    (["--d-model", "x"], "invalid int value: 'x'"),
])
def test_explain_bad_input(capsys, argv: list[str], message: str) -> None:
    assert message in _bad(capsys, "explain", *argv)


def test_explain_invalid_heads_lists_valid_neighbours(capsys) -> None:
    import re

    err = _bad(capsys, "explain", "--d-model", "100", "--n-heads", "7")
    near = [int(n) for n in re.search(r"near 7: \[([\d, ]+)\]", err).group(1).split(",")]
    assert near and all(100 % n == 0 for n in near) and {5, 10} <= set(near)


def test_compare_text_and_json(capsys) -> None:
    code, out, _ = _run(capsys, "compare", "llama-2-7b", "llama-3-8b", "--seq", "1024")
    assert code == 0
    assert "KV cache / 1k tokens" in out and "500.0 MiB" in out and "125.0 MiB" in out  # MHA vs GQA, fp16
    assert "https://huggingface.co/meta-llama/Llama-2-7b-hf" in out
    code, out, _ = _run(capsys, "compare", "llama-2-7b", "llama-3-8b", "--json")
    rows = json.loads(out)
    assert [r["preset"]["name"] for r in rows] == ["llama-2-7b", "llama-3-8b"]
    assert rows[0]["kv_cache"]["per_1k_tokens_bytes"] == 4 * rows[1]["kv_cache"]["per_1k_tokens_bytes"]


def test_compare_list(capsys) -> None:
    code, out, _ = _run(capsys, "compare", "--list", "--json")
    assert code == 0 and "gpt3-175b" in {p["name"] for p in json.loads(out)}
    code, out, _ = _run(capsys, "compare", "--list")
    assert code == 0 and "arxiv.org/abs/2005.14165" in out


@pytest.mark.parametrize("argv,message", [
    (["gpt2-smal"], "did you mean: gpt2-small"),
    ([], "name at least one preset"),
    (["gpt2-small", "--seq", "-1"], "--seq must be a positive"),
    (["gpt2-small", "--dtype", "int3"], "dtype must be"),
])
def test_compare_bad_input(capsys, argv: list[str], message: str) -> None:
    assert message in _bad(capsys, "compare", *argv)


@pytest.mark.parametrize("argv,named", [
    (["--list", "llama-2-7b"], "llama-2-7b"),
    (["--list", "--seq", "8"], "--seq"),
    (["--list", "--json", "--batch", "2", "--dtype", "bf16"], "--batch, --dtype"),
])
def test_compare_list_refuses_what_the_listing_would_ignore(capsys, argv: list[str], named: str) -> None:
    err = _bad(capsys, "compare", *argv)
    assert err.strip().splitlines() == [
        f"headwise compare: error: --list lists every preset and takes no presets, --seq, --batch or --dtype, got "
        f"{named}; drop --list to compare the presets named"]
    code, out, _ = _run(capsys, "compare", "llama-2-7b", "--seq", "4096", "--json")
    default_code, default_out, _ = _run(capsys, "compare", "llama-2-7b", "--json")  # the defaults are unchanged
    assert code == default_code == 0 and out == default_out
