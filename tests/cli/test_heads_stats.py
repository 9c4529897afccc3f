"""`headwise heads --stats`: every layer x head from per-head statistics, at any length the model takes. The
numbers are checked against the unpatched model's own `output_attentions` (float64 means of its patterns), the
pictures are written and named, and the arguments are checked before anything loads (one line, exit 2)."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from headwise.cli import main  # noqa: E402
from tests.cli.test_heads_models import TEXT, save_checkpoint  # noqa: E402

LONG = " ".join(["The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire."] * 14)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["heads", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def grid_from_attentions(attentions: tuple[torch.Tensor, ...], causal: bool = False) -> dict[str, torch.Tensor]:
    """(L, h) means of each head's pattern, float64, over every query row (none is padding here); the
    first-token share of a causal model over the rows after the first (which may read only that token)."""
    p = torch.stack([a[0].double() for a in attentions])  # (L, h, s, s)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return {"mean entropy": entropy.mean(-1), "mean max weight": p.amax(-1).mean(-1),
            "first-token share": p[..., 1 if causal else 0:, 0].mean(-1)}


def test_minilm_grid_equals_its_own_output_attentions(capsys):
    from transformers import AutoModel, AutoTokenizer

    from headwise.viz import minilm_path

    code, out, err = run(capsys, LONG, "--stats", "--max-tokens", "200", "--json")
    assert code == 0, err
    r = json.loads(out)
    tok = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    model = AutoModel.from_pretrained(minilm_path(), local_files_only=True, attn_implementation="eager").eval()
    enc = tok(LONG, return_tensors="pt", truncation=True, max_length=200)
    with torch.no_grad():
        want = grid_from_attentions(model(**enc, output_attentions=True).attentions)
    assert (r["layers"], r["heads"], len(r["tokens"])) == (6, 12, 200)
    for name, ref in want.items():
        torch.testing.assert_close(torch.tensor(r["grid"][name], dtype=torch.float64), ref, rtol=1e-4, atol=1e-5)
    assert r["kinds"]["sink"] and all(r["grid"]["first-token share"][a][b] >= 0.5 for a, b in r["kinds"]["sink"])


def test_a_length_the_pattern_drawing_refuses_is_served(capsys, tmp_path):
    path = save_checkpoint("llama", tmp_path / "llama")  # 2 layers x 6 heads
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (path / "config.json").write_text(json.dumps(config))
    text = " ".join(TEXT.split() * 1024)  # 8192 tokens
    code, _, err = run(capsys, text, "--model", str(path), "--all-layers", "--max-tokens", "8192", "--json")
    assert code == 2 and "over the limit" in err  # the patterns: 2 x 6 x 8192 x 8192 floats, held twice
    code, out, err = run(capsys, text, "--model", str(path), "--stats", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert len(r["tokens"]) == 8192 and len(r["key_weight"][1][5]) == 8192
    kw = torch.tensor(r["key_weight"])  # (L, h, s): each head's weights of every query sum to 1
    torch.testing.assert_close(kw.sum(-1), torch.full((2, 6), 8192.0), rtol=1e-4, atol=0)
    entropy = torch.tensor(r["entropy"])
    assert float(entropy[..., 0].abs().max()) < 1e-6  # the first query reads one key
    assert bool((entropy <= torch.log(torch.arange(1, 8193, dtype=torch.float32)) + 1e-3).all())


def test_stats_json_reports_a_cut_text_as_heads_json_does(capsys, tmp_path):
    from tests.cli.test_heads_models import reference_attentions

    path = save_checkpoint("gpt2", tmp_path / "gpt2")  # 64 positions
    text = " ".join(f"w{i % 30 + 3}" for i in range(100))
    code, out, err = run(capsys, text, "--model", str(path), "--stats", "--json")
    assert code == 0 and "only the first 64 are drawn" in err
    r = json.loads(out)
    assert (r["truncated"], r["text_tokens"], len(r["tokens"])) == (True, 100, 64)
    _, ref = reference_attentions(path, text, 64)  # (L, h, s, s): the cut text's own weights
    torch.testing.assert_close(torch.tensor(r["key_weight"], dtype=torch.float64), ref.double().sum(-2),
                               rtol=1e-4, atol=1e-4)
    code, out, err = run(capsys, TEXT, "--model", str(path), "--stats", "--json")
    r = json.loads(out)
    assert code == 0 and r["truncated"] is False and r["text_tokens"] == len(r["tokens"]) == 8


def test_the_pictures_are_written_and_name_the_heads(capsys, tmp_path):
    import matplotlib.image

    png, page = tmp_path / "stats.png", tmp_path / "stats.html"
    code, out, err = run(capsys, LONG, "--stats", "--curves", "1.11,4.5", "--out", str(png))
    said = "".join(out.split())  # the terminal line wraps, long paths too
    assert code == 0 and said.startswith(f"Wrote{png}(") and "per-headstatistics" in said, err
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 500 and image.shape[1] > 1000
    code, out, err = run(capsys, LONG, "--stats", "--curves", "1.11,4.5", "--out", str(page))
    assert code == 0, err
    html = page.read_text()
    assert "mean entropy" in html and "first-token share" in html and "<svg" in html and "<script" not in html
    assert "L1 H11" in html and "L4 H5" in html and "sink heads" in html


def test_the_table_names_sink_and_sharp_heads(capsys):
    code, out, err = run(capsys, LONG, "--stats", "--max-tokens", "64")
    assert code == 0, err
    assert "first-token share" in out and "Sink heads: " in out and "Sharp heads: " in out
    rows = [ln for ln in out.splitlines() if re.match(r"\s*\d\.\d+ +\d+\.\d{3} +\d\.\d{3} +\d\.\d{3}", ln)]
    assert len(rows) == 72  # one per layer x head


@pytest.mark.parametrize("argv, message", [
    (["--curves", "1.2"], "--curves draws per-position statistics: it needs --stats"),
    (["--stats", "--layer", "1"], "--stats draws every layer and head"),
    (["--stats", "--heads", "0,1"], "--stats draws every layer and head"),
    (["--stats", "--curves", "6.0"], "--curves: layer must be in [0, 6)"),
    (["--stats", "--curves", "1.12"], "--curves: layer 1 has 12 heads, got 1.12"),
    (["--stats", "--curves", "1-2"], "must be layer.head pairs"),
    (["--stats", "--curves", "0.-1"], "error: --curves must be layer.head pairs of non-negative numbers such as "
                                      "0.3,5.7, got '0.-1' (see"),
    (["--stats", "--curves", "1.2,-1.0"], "error: --curves must be layer.head pairs of non-negative numbers "
                                          "such as 0.3,5.7, got '-1.0' in '1.2,-1.0' (see"),
    (["--stats", "--max-tokens", "513"], "--max-tokens must be at most 512"),
    (["--stats", "--out", "x.svg"], "x.svg"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "some text", *argv)
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def pruned_reference(path, plain, layers: int = 2) -> tuple[list[list[int]], list[torch.Tensor], torch.Tensor]:
    """(each layer's original head numbers from the sidecar, the pruned model's own eager patterns per layer in
    its heads' order now (h_l, s, s), float64, and the unpruned twin's patterns (L, h, s, s))."""
    from headwise.surgery import load_pretrained
    from tests.cli.test_heads_models import TEXT as WORDS_TEXT, WORDS

    side = json.loads((path / "headwise_surgery.json").read_text())["modules"]
    numbers = [m["original_heads"] for m in side.values()]
    ids = torch.tensor([[WORDS.index(w) for w in WORDS_TEXT.split()]])
    ref = load_pretrained(path, type(plain), attn_implementation="eager")
    plain.set_attn_implementation("eager")
    with torch.no_grad():
        own = [a[0].double() for a in ref(input_ids=ids, output_attentions=True).attentions]
        twin = torch.stack([a[0].double() for a in plain(input_ids=ids, output_attentions=True).attentions])
    return numbers, own[:layers], twin


def test_a_pruned_checkpoint_shows_every_kept_head_under_its_number_before_surgery(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # the table's lines unwrapped
    from tests.cli.test_heads_models import TEXT as WORDS_TEXT
    from tests.cli.test_heads_summary import checkpoint

    path, plain, _ = checkpoint(tmp_path, {0: [0, 2], 1: [3]})  # GPT-2 of 4 heads: layer 0 keeps 2, layer 1 keeps 3
    numbers, own, twin = pruned_reference(path, plain)
    assert numbers == [[1, 3], [0, 1, 2]]
    code, out, err = run(capsys, WORDS_TEXT, "--model", str(path), "--stats", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["original_heads"] == numbers and [len(x) for x in r["entropy"]] == [2, 3]
    for layer, p in enumerate(own):  # every kept head of every layer, in the layer's order now
        want = grid_from_attentions((p[None],), causal=True)
        for name, ref in want.items():
            torch.testing.assert_close(torch.tensor([r["grid"][name][layer]], dtype=torch.float64), ref,
                                       rtol=1e-4, atol=1e-5)
    # layer 0 reads the unpruned layer 0's input: its heads are the twin's heads of the same original numbers
    torch.testing.assert_close(torch.tensor(r["max_weight"][0], dtype=torch.float64),
                               twin[0, [1, 3]].amax(-1), rtol=1e-4, atol=1e-5)
    assert all(h in numbers[a] for a, h in r["kinds"]["sink"] + r["kinds"]["sharp"])
    code, out, err = run(capsys, WORDS_TEXT, "--model", str(path), "--all-layers", "--json")
    assert [m["original_heads"] for m in json.loads(out)["layers"]] == numbers  # the pattern table's numbers
    code, out, err = run(capsys, WORDS_TEXT, "--model", str(path), "--stats")
    rows = [ln.split()[0] for ln in out.splitlines() if re.match(r"\s*\d\.\d+ +\d+\.\d{3} +\d\.\d{3}", ln)]
    assert code == 0 and rows == ["0.1", "0.3", "1.0", "1.1", "1.2"], out
    assert "numbered as in the model before head surgery" in out
    code, out, err = run(capsys, WORDS_TEXT, "--model", str(path), "--stats", "--curves", "0.3,1.2",
                         "--out", str(tmp_path / "s.html"))
    assert code == 0 and "L0 H3" in (tmp_path / "s.html").read_text(), err
    code, out, err = run(capsys, WORDS_TEXT, "--model", str(path), "--stats", "--curves", "0.0")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--curves: layer 0 has no head 0: head surgery left its heads 1, 3 (numbered as before surgery)" in err


def test_a_layer_whose_every_head_was_removed_is_drawn_empty(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # the table's lines unwrapped
    from tests.cli.test_heads_models import TEXT as WORDS_TEXT
    from tests.cli.test_heads_summary import checkpoint

    path, plain, _ = checkpoint(tmp_path, {0: [1], 1: [0, 1, 2, 3]})  # layer 1 keeps a placeholder only
    numbers, own, twin = pruned_reference(path, plain, layers=1)
    assert numbers == [[0, 2, 3], []]
    code, out, err = run(capsys, WORDS_TEXT, "--model", str(path), "--layer", "0", "--heads", "2", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["original_heads"] == [2] and r["heads"] == [1]  # selected by its number before surgery
    torch.testing.assert_close(torch.tensor(r["weights"], dtype=torch.float64), twin[0, [2]], rtol=1e-5, atol=1e-6)
    for argv, message in ((["--layer", "0", "--heads", "1"],
                           "--heads: layer 0 has no head 1: head surgery left its heads 0, 2-3"),
                          (["--layer", "1", "--heads", "0"],
                           "--heads: layer 1 has no head 0: head surgery removed every head of it"),
                          (["--layer", "1", "--out", str(tmp_path / "p.png")],
                           "head surgery removed every head of layer 1"),
                          (["--stats", "--curves", "1.0"],
                           "--curves: layer 1 has no head 0: head surgery removed every head of it")):
        code, out, err = run(capsys, WORDS_TEXT, "--model", str(path), *argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
    code, out, err = run(capsys, WORDS_TEXT, "--model", str(path), "--layer", "1", "--json")
    r = json.loads(out)
    assert code == 0 and (r["heads"], r["original_heads"], r["weights"]) == ([], [], [])
    code, out, err = run(capsys, WORDS_TEXT, "--model", str(path), "--all-layers")
    assert code == 0 and "Head surgery removed every head of layer 1 (the placeholder" in out, out
    code, out, err = run(capsys, WORDS_TEXT, "--model", str(path), "--stats", "--json")
    r = json.loads(out)
    assert code == 0 and r["original_heads"] == numbers and [len(x) for x in r["entropy"]] == [3, 0]
    torch.testing.assert_close(torch.tensor(r["grid"]["mean max weight"][0], dtype=torch.float64),
                               own[0].amax(-1).mean(-1), rtol=1e-4, atol=1e-5)
