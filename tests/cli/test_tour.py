"""`headwise tour` with --preset and size options through main()."""

from __future__ import annotations

import json

import pytest

from headwise.cli import main


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch) -> None:
    # rich wraps tables to the terminal width; assertions look for whole cells
    monkeypatch.setenv("COLUMNS", "300")


def test_tour_preset_json(capsys) -> None:
    code = main(["tour", "--preset", "all-minilm-l6-v2", "--seq", "8", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["head_by_head_equal"]
    assert r["config"]["d_model"] == 384 and r["config"]["d_head"] == 32
    assert r["parameters_without_bias"] == r["four_d_model_squared"] == 4 * 384 ** 2


def test_tour_sizes_text(capsys) -> None:
    code = main(["tour", "--d-model", "64", "--n-heads", "8", "--n-kv-heads", "2", "--seq", "4"])
    out = capsys.readouterr().out
    assert code == 0 and "(GQA)" in out and "equal (rounding only)" in out


@pytest.mark.parametrize("argv,message", [
    (["--preset", "gpt3-175b"], "headwise explain"),  # too big for real tensors: points to explain
    (["--preset", "nope"], "unknown preset"),
    (["--d-model", "30", "--n-heads", "7"], "does not divide"),
    (["--seq", "0"], "--seq must be a positive"),
])
def test_tour_bad_input(capsys, argv: list[str], message: str) -> None:
    code = main(["tour", *argv])
    _, err = capsys.readouterr()
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("d_head", [None, 8, 4, 16])
def test_tour_header_states_d_head_as_the_layer_has_it(capsys, d_head) -> None:
    import headwise

    extra = [] if d_head is None else ["--d-head", str(d_head)]
    code = main(["tour", "--d-model", "64", "--n-heads", "8", "--seq", "4", *extra])
    header = capsys.readouterr().out.splitlines()[0]
    # the reference: the head width of the layer these sizes build, read off its W_Q
    layer = headwise.MultiHeadAttention(64, 8, d_head=d_head)
    width = layer.q_proj.weight.shape[0] // 8
    assert code == 0 and width == (d_head or 8)
    if width * 8 == 64:
        assert f"d_head = 64 / 8 = {width}," in header
    else:
        assert f"d_head = {width} (given, not d_model / n_heads)," in header and "64 / 8" not in header


@pytest.mark.parametrize("n_kv, d_head, reasons", [
    (4, 32, ["n_heads x d_head = 4 x 32 = 128, not d_model"]),
    (2, 16, ["GQA shrinks W_K, W_V to 2 of 4 heads"]),
    (1, 8, ["n_heads x d_head = 4 x 8 = 32, not d_model", "MQA shrinks W_K, W_V to 1 of 4 heads"]),
    (4, 16, []),
])
def test_tour_names_why_the_parameters_are_not_four_d_squared(capsys, monkeypatch, n_kv, d_head, reasons) -> None:
    import headwise

    monkeypatch.setenv("COLUMNS", "300")
    code = main(["tour", "--d-model", "64", "--n-heads", "4", "--n-kv-heads", str(n_kv), "--d-head", str(d_head),
                 "--seq", "3"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Parameters"))
    # the reference: the weights of the layer these sizes build, bias off
    layer = headwise.MultiHeadAttention(64, 4, n_kv_heads=n_kv, d_head=d_head, bias=False)
    count = sum(p.numel() for p in layer.parameters())
    assert code == 0 and f": {count:,}" in line
    if reasons:
        assert line.endswith(f"(not 4 x 64^2: {'; '.join(reasons)})") and count != 4 * 64 ** 2
    else:
        assert line.endswith("= 4 x 64^2") and count == 4 * 64 ** 2


def test_a_preset_resized_gets_d_head_from_the_new_sizes(capsys) -> None:
    code = main(["tour", "--preset", "gpt3-175b", "--d-model", "768", "--n-heads", "12", "--seq", "4"])
    first = capsys.readouterr().out.splitlines()[0]
    assert code == 0 and "d_head = 768 / 12 = 64," in first and "given" not in first
