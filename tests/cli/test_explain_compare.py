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


def _walked_on(monkeypatch, capsys, *argv: str) -> tuple[str, torch.dtype]:
    """(device, dtype) explain walks on, the walk itself stubbed out (nothing allocated)."""
    import headwise.walkthrough

    seen = []
    monkeypatch.setattr(headwise.walkthrough, "walk", lambda config, **kw: seen.append(kw) or [])
    code, out, _ = _run(capsys, "explain", *argv, "--json")
    assert code == 0 and json.loads(out)["walk_device"] == seen[0]["device"]
    return seen[0]["device"], seen[0]["dtype"]


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "float16", "float32", "float64"])
def test_explain_walks_real_tensors_only_within_the_limit_counted_in_the_walks_float32(monkeypatch, capsys,
                                                                                     dtype: str) -> None:
    from headwise.cli.explain import REAL_TENSOR_LIMIT

    cfg = AttentionConfig(d_model=512, n_heads=64)

    def float32_bytes(s: int) -> int:  # weights, six (b, s, d) activations, scores and probabilities (b, h, s, s)
        return 4 * (param_count(cfg).total + 6 * s * 512 + 2 * 64 * s * s)

    assert float32_bytes(706) <= REAL_TENSOR_LIMIT < float32_bytes(707)
    sizes = ["--d-model", "512", "--n-heads", "64", "--dtype", dtype]
    assert _walked_on(monkeypatch, capsys, *sizes, "--seq", "706") == ("cpu", torch.float32)
    assert _walked_on(monkeypatch, capsys, *sizes, "--seq", "707")[0] == "meta"


@pytest.mark.parametrize("argv,said", [
    (["--seq", "64", "--dtype", "float32"], "64x less"),  # eager 2 x 64^2 x 4 B, fused 2 x 64 x 4 B
    (["--seq", "1", "--dtype", "float32"], "the same"),  # 2 x 1 x 4 B both
    (["--seq", "2", "--dtype", "fp8"], "2x more"),  # eager 2 x 2^2 x 1 B = 8 B, fused 2 x 2 x 4 B = 16 B
    (["--seq", "3", "--dtype", "float32"], "3x less"),
    (["--seq", "6", "--dtype", "fp8"], "1.5x less"),  # 2 x 36 x 1 = 72 B vs 48 B
])
def test_explain_says_how_the_fused_path_compares_with_the_eager_one(capsys, argv: list[str], said: str) -> None:
    code, out, _ = _run(capsys, "explain", "--d-model", "8", "--n-heads", "2", *argv)
    row = next(ln for ln in out.splitlines() if "fused (SDPA" in ln)
    assert code == 0 and row.rstrip().endswith(f"per (b, h, query); {said}"), row


def test_a_preset_override_rescales_d_head_as_the_help_says(capsys) -> None:
    from headwise.presets import PRESETS

    for p in PRESETS.values():  # every preset's numbers are its source's
        cited = dict(p.cited)
        d_model = cited.get("hidden_size", cited.get("n_embd", cited.get("d_model")))
        n_heads = cited.get("num_attention_heads", cited.get("n_head", cited.get("n_heads")))
        assert (p.config.d_model, p.config.n_heads) == (d_model, n_heads)
        assert p.config.d_head == cited.get("head_dim", cited.get("d_head", d_model // n_heads)), p.name
    for preset in ("gpt3-175b", "gpt2-xl"):  # both cite d_head = d_model / n_heads
        c = get_preset(preset).config
        code, out, _ = _run(capsys, "explain", "--preset", preset, "--n-heads", str(c.n_heads * 2), "--seq", "8",
                            "--json")
        assert code == 0 and json.loads(out)["config"]["d_head"] == c.d_model // (c.n_heads * 2)
    code, out, _ = _run(capsys, "explain", "--preset", "gpt3-175b", "--d-head", "64", "--seq", "8", "--json")
    assert code == 0 and json.loads(out)["config"]["d_head"] == 64  # given: kept


def test_sizes_that_round_up_to_the_next_unit_are_written_in_it() -> None:
    from headwise.cli._sizes import human_bytes, human_count

    assert [human_bytes(n) for n in (1023, 2 ** 20 - 1, 2 ** 20 - 52, 2 ** 30 - 1, 1536)] == [
        "1023 B", "1.0 MiB", "1023.9 KiB", "1.0 GiB", "1.5 KiB"]
    assert [human_count(n, "FLOP") for n in (999, 999_994_999, 999_999_999, 10 ** 21 - 1, 2_362_368)] == [
        "999 FLOP", "999.99 MFLOP", "1.00 GFLOP", "1.00e+21 FLOP", "2.36 MFLOP"]


@pytest.mark.parametrize("command", ["compare --list", "compare llama-2-7b llama-3-8b mistral-7b gpt3-175b --seq 1024"])
def test_the_compare_examples_of_the_docs_are_the_commands_output_at_80_columns(capsys, monkeypatch,
                                                                                 command: str) -> None:
    import re
    from pathlib import Path

    pytest.importorskip("rich")  # the docs show rich's tables
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    shown = re.search(rf"^\$ headwise {re.escape(command)}\n(.*?)^```", docs, re.S | re.M).group(1).splitlines()
    if shown[-1] == "...":  # the example stops there
        shown = shown[:-1]
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = _run(capsys, *command.split())
    assert code == 0 and out.splitlines()[:len(shown)] == shown


def test_a_sliding_window_presets_kv_cache_holds_only_the_window(capsys) -> None:
    """mistral-7b records sliding_window=4096: past it the cache holds 4096 positions per layer (the formula
    2 x h_kv x d_h x itemsize x layers x positions), in compare and explain, and the text says "window 4096"."""
    p = get_preset("mistral-7b")
    c, window = p.config, p.sliding_window
    for seq in (1024, window, 32768):
        held = min(seq, window)
        want = 2 * c.n_kv_heads * c.d_head * 2 * p.n_layers * held  # float16
        code, out, _ = _run(capsys, "compare", "mistral-7b", "--seq", str(seq), "--json")
        assert code == 0
        kv = json.loads(out)[0]["kv_cache"]
        assert (kv["context_bytes"], kv["positions"], kv["sliding_window"]) == (want, held, window)
        code, out, _ = _run(capsys, "explain", "--preset", "mistral-7b", "--seq", str(seq), "--json")
        assert code == 0 and json.loads(out)["kv_cache"]["context_bytes"] == want
    code, out, _ = _run(capsys, "compare", "mistral-7b", "llama-3-8b", "--seq", "32768")
    row = next(line for line in out.splitlines() if line.lstrip().startswith("KV cache, seq x batch"))
    assert "512.0 MiB (window 4096)" in row and "4.0 GiB" in row and row.count("window") == 1
    code, out, _ = _run(capsys, "explain", "--preset", "mistral-7b", "--seq", "32768")
    assert "KV cache, 32768 tokens x batch 1, window 4096" in out
    code, out, _ = _run(capsys, "explain", "--preset", "llama-3-8b", "--seq", "8192")
    assert "window" not in out
    # the same layer without its window counts every token
    code, out, _ = _run(capsys, "explain", "--d-model", "4096", "--n-heads", "32", "--n-kv-heads", "8",
                        "--n-layers", "32", "--seq", "32768", "--json")
    assert json.loads(out)["kv_cache"]["context_bytes"] == kv_cache_bytes(c, 32768, n_layers=32)


def test_a_sliding_window_presets_kv_cache_per_rank_holds_only_the_window(capsys) -> None:
    """Over tensor-parallel ranks each rank caches its K/V heads for the window's positions, not every token."""
    p = get_preset("mistral-7b")
    c, window, ranks = p.config, p.sliding_window, 2
    for seq in (1024, 32768):
        code, out, _ = _run(capsys, "explain", "--preset", "mistral-7b", "--seq", str(seq), "--ranks", str(ranks),
                            "--json")
        assert code == 0
        want = 2 * min(seq, window) * (c.n_kv_heads // ranks) * c.d_head * 2  # b=1, float16, one layer
        assert json.loads(out)["parallel"]["tp"]["kv_cache"] == want
    code, out, _ = _run(capsys, "explain", "--preset", "mistral-7b", "--seq", "32768", "--ranks", "2")
    assert "KV cache, last 4096 tokens" in out and "KV cache, all tokens" not in out


def test_the_window_is_the_number_of_keys_a_transformers_decode_step_reads() -> None:
    """The positions summarize counts for a sliding window are what a Mistral decode step of transformers
    attends to (its eager attention weights), before the window fills and after."""
    transformers = pytest.importorskip("transformers")
    from headwise.analysis import summarize

    cfg = transformers.MistralConfig(vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MistralModel(cfg).eval()
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, 50, (1, 12))
    config = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2)
    for seq in (3, 4, 12):  # tokens after the step
        with torch.no_grad():
            past = model(input_ids=ids[:, :seq - 1], use_cache=True).past_key_values
            step = model(input_ids=ids[:, seq - 1:seq], past_key_values=past, use_cache=True, output_attentions=True)
        read = step.attentions[0].shape[-1]
        assert summarize(config, seq, sliding_window=4)["kv_cache"]["positions"] == read == min(seq, 4)


def test_a_length_past_the_presets_position_limit_gets_a_note_not_a_refusal(capsys) -> None:
    limit = get_preset("llama-3-8b").max_positions
    for argv in (["compare", "llama-3-8b"], ["explain", "--preset", "llama-3-8b"]):
        code, out, err = _run(capsys, *argv, "--seq", str(limit + 1), "--json")
        assert code == 0 and json.loads(out)  # stdout stays JSON
        assert f"note: {limit + 1} tokens is past the {limit} positions llama-3-8b takes" in err, err
        code, out, err = _run(capsys, *argv, "--seq", str(limit), "--json")
        assert code == 0 and "note" not in err


@pytest.mark.parametrize("command,preset,n_heads", [
    ("explain", "llama-2-7b", 64), ("explain", "llama-2-7b", 16), ("explain", "gpt2-small", 6),
    ("explain", "llama-3-8b", 64), ("explain", "llama-2-70b", 16), ("tour", "llama-2-7b", 16)])
def test_a_preset_overridden_with_other_n_heads_is_the_config_built_by_hand(capsys, command: str, preset: str,
                                                                             n_heads: int) -> None:
    """An MHA preset stays MHA with the new head count (the help's `--n-kv-heads` default: n_heads), whether or
    not its source cites num_key_value_heads; a GQA preset keeps its K/V heads."""
    p = get_preset(preset)
    cited_kv = p.cited.get("num_key_value_heads")
    kv = None if cited_kv in (None, p.cited.get("num_attention_heads")) else cited_kv  # GQA: the cited count
    by_hand = AttentionConfig(d_model=p.config.d_model, n_heads=n_heads, n_kv_heads=kv, bias=p.config.bias)
    code, out, err = _run(capsys, command, "--preset", preset, "--n-heads", str(n_heads), "--seq", "8", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert {k: r["config"][k] for k in by_hand.to_dict()} == by_hand.to_dict()
    if command == "explain":
        assert r["config"]["kind"] == by_hand.kind
        assert r["kv_cache"]["per_token_bytes"] == kv_cache_bytes(by_hand, 1, dtype="float16", n_layers=p.n_layers)
