"""`headwise explain --ranks P`: per-rank memory and communication of tensor vs sequence parallelism.

The figures are checked against the closed forms written out here from the shapes each rank holds (not taken
from headwise.analysis.parallel); the sequence-parallel byte counts themselves are checked against bytes
counted around real all-to-alls in tests/parallel/test_sequence_parallel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from headwise.cli import main
from headwise.presets import get_preset

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_figures_equal_the_closed_forms(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = _run(capsys, "explain", "--preset", "llama-3-8b", "--seq", "1000", "--batch", "2",
                        "--dtype", "bf16", "--ranks", "8", "--json")
    assert code == 0
    par = json.loads(out)["parallel"]
    c = get_preset("llama-3-8b").config
    b, s, p, i, d, h, h_kv, d_h = 2, 1000, 8, 2, c.d_model, c.n_heads, c.n_kv_heads, c.d_head
    tp, sp = par["tp"], par["sp"]
    # tensor parallel: h/P query heads and h_kv/P K/V heads per rank; the whole sequence everywhere
    assert (tp["heads"], tp["kv_heads"]) == (h // p, h_kv // p)
    assert tp["weights"] == (2 * d * (h // p) * d_h + 2 * d * (h_kv // p) * d_h) * i  # llama: no biases
    assert tp["input_output"] == 2 * b * s * d * i
    assert tp["sent_forward"] == tp["sent_backward"] == 2 * (p - 1) * b * s * d * i // p  # ring all-reduce of y
    assert tp["kv_cache"] == 2 * b * s * (h_kv // p) * d_h * i
    # sequence parallel: 125 tokens per rank; all weights; Q in and out back for all heads, K/V per rank
    s_loc = 125
    assert sp["weights"] == (2 * d * h * d_h + 2 * d * h_kv * d_h) * i
    assert sp["input_output"] == 2 * b * s_loc * d * i
    row = b * s_loc * d_h * i
    assert sp["sent_forward"] == sp["sent_backward"] == (2 * h + 2 * h_kv) * row * (p - 1) // p
    assert sp["weight_grad_all_reduce"] == 2 * (p - 1) * sp["weights"] // p
    # 4 query heads per rank; bf16 probabilities are computed (and held) in float32 by the eager path: 4 bytes
    assert sp["kv_cache"] is None and sp["probabilities_eager"] == tp["probabilities_eager"] == b * 4 * s * s * 4


def test_sp_bytes_per_rank_do_not_grow_with_p_at_fixed_tokens_per_rank(capsys) -> None:
    sent = []
    for p in (2, 4, 8):
        code, out, _ = _run(capsys, "explain", "--preset", "llama-2-7b", "--seq", str(512 * p), "--ranks", str(p),
                            "--json")
        assert code == 0
        sent.append(json.loads(out)["parallel"]["sp"]["sent_forward"])
    c = get_preset("llama-2-7b").config  # MHA: 4 all-to-alls of all heads of a 512-token slice
    bound = 4 * 512 * c.n_heads * c.d_head * 2
    assert sent == [bound * (p - 1) // p for p in (2, 4, 8)] and max(sent) < bound


def test_text_table_fits_80_columns_and_names_both_plans(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = _run(capsys, "explain", "--d-model", "48", "--n-heads", "6", "--n-kv-heads", "2",
                        "--seq", "64", "--ranks", "4")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "Per rank over 4 ranks" in out
    assert "impossible" in out  # 6 heads do not split over 4 ranks by tensor parallelism
    assert "valid world sizes for n_heads=6, n_kv_heads=2: [1, 2, 6]" in out.replace("\n    ", " ")
    assert "sp: sequence parallel over 4 ranks" in out


@pytest.mark.parametrize("argv,message", [
    (["--preset", "llama-3-8b", "--ranks", "64"],
     "neither split works over --ranks 64: tensor parallel needs one of [1, 2, 4, 8, 16, 32] ranks, sequence "
     "parallel at most n_heads=32"),
    (["--preset", "llama-3-8b", "--ranks", "0"], "must be a positive integer, got 0"),
    (["--d-model", "1", "--n-heads", "9223372036854775783", "--d-head", "1", "--seq", "1", "--dtype", "fp8",
      "--ranks", "9223372036854775807"],  # a prime head count: the valid world sizes are 1 and itself
     "tensor parallel needs one of [1, 9223372036854775783] ranks, sequence parallel at most "
     "n_heads=9223372036854775783"),
])
def test_bad_ranks_fail_in_one_line_before_anything_heavy(argv: list[str], message: str) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "headwise", "explain", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=100)
    seconds = time.perf_counter() - start
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert seconds < 2.0, f"{seconds:.2f} s"  # the CLI's bound for bad input (tests/cli/test_failures.py)


@pytest.mark.timeout(60)
def test_a_head_count_past_any_layer_gets_its_per_rank_figures(capsys) -> None:
    """2**40 heads over 2 ranks: closed forms, no list of heads (fp8, one token, d_model = d_head = 1)."""
    h = 2 ** 40
    code, out, err = _run(capsys, "explain", "--d-model", "1", "--n-heads", str(h), "--d-head", "1", "--seq", "1",
                          "--ranks", "2", "--dtype", "fp8", "--json")
    assert code == 0, err
    par = json.loads(out)["parallel"]
    for key in ("tp", "sp"):  # half the heads per rank: Q, K, V and the context of one token each
        assert (par[key]["heads"], par[key]["kv_heads"], par[key]["qkv_context"]) == (h // 2, h // 2, 2 * h)
    assert par["sp"]["sent_forward"] == 2 * h  # the other rank's half of Q, K, V, and this rank's output half


def test_readme_names_tensor_parallels_own_parameters() -> None:
    import inspect
    import re

    from headwise.parallel import tensor_parallel

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    calls = re.findall(r"tensor_parallel\(attn, (\w+)\)", readme)
    assert calls, "README.md no longer shows tensor_parallel(attn, ...)"
    params = list(inspect.signature(tensor_parallel).parameters)
    assert all(name == params[1] for name in calls), (calls, params)
