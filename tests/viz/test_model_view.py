"""The all-layers HTML page of 512 tokens of all-MiniLM-L6-v2 (6 layers x 12 heads x 512 x 512 weights), made
by `headwise heads --all-layers`, in headless Chromium: it is drawn within 10 s of starting the browser,
and hovering a cell of a head shows that cell's weight, equal to the unpatched model's own
`output_attentions` to the quantisation step. The file size is printed and recorded."""

from __future__ import annotations

import re
import time

import pytest
import torch

from headwise.cli import main

from .test_html import STEP, hover_cell, shown_weight, wait_rendered

WORDS = ("the cat sat on a mat because it was tired and the dog that chased it all day long ran off into the "
         "woods where nobody could find him until the evening when everyone came home").split()


def long_text(n_words: int = 700) -> str:
    return " ".join(WORDS[(i * 7 + i // len(WORDS)) % len(WORDS)] for i in range(n_words))


@pytest.fixture(scope="module")
def reference():
    """(tokens, attentions (layers, h, 512, 512)) of the unpatched model's eager forward."""
    pytest.importorskip("transformers")
    from transformers import AutoModel, AutoTokenizer

    from headwise.viz.maps import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    model = AutoModel.from_pretrained(minilm_path(), local_files_only=True, attn_implementation="eager").eval()
    enc = tok(long_text(), return_tensors="pt", truncation=True, max_length=512)
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    return tok.convert_ids_to_tokens(enc["input_ids"][0].tolist()), torch.cat(out.attentions)


@pytest.mark.xdist_group("chromium")
def test_512_tokens_all_layers_render_and_hover(minilm, reference, chromium, tmp_path, monkeypatch, capsys,
                                                record_property) -> None:
    import headwise.viz.maps as vmaps

    tokens, ref = reference
    assert ref.shape == (6, 12, 512, 512)
    monkeypatch.setattr(vmaps, "load_minilm", lambda: minilm)  # the session's copy: loaded once
    path = tmp_path / "model.html"
    assert main(["heads", long_text(), "--all-layers", "--max-tokens", "512", "--out", str(path)]) == 0
    err = capsys.readouterr().err
    assert re.search(r"note: the text has \d+ tokens; only the first 512 are drawn", err), err
    size = path.stat().st_size
    record_property("model_view_html_bytes", size)
    assert size < 8e6

    start = time.monotonic()
    page = chromium(path)
    wait_rendered(page)
    elapsed = time.monotonic() - start
    record_property("model_view_render_s", round(elapsed, 2))
    with capsys.disabled():
        print(f"\n[model view] 512 tokens x 6 layers x 12 heads of all-MiniLM-L6-v2: {path.name} is "
              f"{size / 1e6:.2f} MB (plain uint8 would be {ref.numel() / 1e6:.1f} MB); drawn {elapsed:.1f} s "
              "after starting Chromium")
    assert elapsed < 10, f"the page took {elapsed:.1f} s to draw (browser start included)"
    assert page.js("document.querySelectorAll('canvas.thumb').length") == 72
    assert page.js("document.getElementById('status').textContent") == ""

    layer, head = 4, 9
    page.js(f"headwise.open({layer}, {head})")
    row = ref[layer, head, 300]
    for i, j in [(300, int(row.argmax())), (300, int(row.argmin())), (511, 0)]:
        tip = hover_cell(page, "weights", i, j)
        assert tip["shown"] == "block" and tip["data"]["query"] == str(i) and tip["data"]["key"] == str(j)
        assert f'-> key {j} "{tokens[j]}"' in tip["text"]
        assert abs(shown_weight(tip) - float(ref[layer, head, i, j])) <= STEP + 5e-5
    page.js("(function(){var z=document.getElementById('zoom'); z.value='3'; z.dispatchEvent(new Event('change'));})()")
    i, j = 100, int(ref[layer, head, 100].argmax())  # zoomed, the pointer still maps to the right cell
    tip = hover_cell(page, "weights", i, j)
    assert (tip["data"]["query"], tip["data"]["key"]) == (str(i), str(j))
    assert abs(shown_weight(tip) - float(ref[layer, head, i, j])) <= STEP + 5e-5
