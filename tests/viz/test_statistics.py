"""headwise.viz.model_statistics on a GPT-2 with a planted sink head and a planted sharp head: the per-position
statistics equal float64 statistics of the unpatched eager model's own `output_attentions`, the grid finds the
planted heads, and both pictures draw them."""

from __future__ import annotations

import copy
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import headwise  # noqa: E402
from headwise.viz import model_statistics, render_statistics_html  # noqa: E402

D_H = 8


def planted(n_positions: int = 512) -> torch.nn.Module:
    """GPT-2 (d32, 4 heads, 2 layers): layer 0 head 1 reads token 0 only (a sink); layer 1 head 2 has scores
    40 x 40 times larger than the others' (sharp)."""
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_head=4, n_layer=2, n_positions=n_positions,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        model.transformer.wte.weight[0] = 0.0
        model.transformer.wte.weight[0, 5] = 4.0  # token 0 stands out along feature 5
        w, b = model.transformer.h[0].attn.c_attn.weight, model.transformer.h[0].attn.c_attn.bias
        w[:, D_H:2 * D_H] = 0.0
        b[D_H:2 * D_H] = 3.0  # every query of head 1 the same...
        w[:, 32 + D_H:32 + 2 * D_H] = 0.0
        w[5, 32 + D_H:32 + 2 * D_H] = 3.0  # ...and its keys large only on token 0
        w1 = model.transformer.h[1].attn.c_attn.weight
        w1[:, 2 * D_H:3 * D_H] *= 40.0
        w1[:, 32 + 2 * D_H:32 + 3 * D_H] *= 40.0
    return model


def ids(s: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.cat([torch.zeros(1, 1, dtype=torch.long), torch.randint(1, 64, (1, s - 1), generator=g)], 1)


def test_per_position_statistics_equal_the_unpatched_models_own_weights():
    model = planted()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    x = ids(300)
    with torch.no_grad():
        p = torch.stack([a[0].double() for a in eager(x, output_attentions=True).attentions])  # (L, h, s, s)
    st = model_statistics(model, {"input_ids": x})
    torch.testing.assert_close(st.entropy.double(), -(p * p.clamp_min(1e-300).log()).sum(-1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.max_weight.double(), p.amax(-1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(st.key_weight.double(), p.sum(-2), rtol=1e-4, atol=1e-4)
    assert st.kinds() == {"sink": [(0, 1)], "sharp": [(1, 2)]}
    assert st.chosen()[:2] == [(0, 1), (1, 2)]


def test_the_pictures_draw_the_planted_heads(tmp_path):
    pytest.importorskip("matplotlib")
    from headwise.viz import save_statistics_png

    st = model_statistics(headwise.interop.patch(planted()), {"input_ids": ids(200)}, name="planted GPT-2")
    page = render_statistics_html(st)
    assert "L0 H1" in page and "L1 H2" in page and "planted GPT-2" in page
    path = save_statistics_png(st, tmp_path / "planted.png")
    assert path.stat().st_size > 20_000
    with pytest.raises(ValueError, match="writes a .png file"):
        save_statistics_png(st, tmp_path / "planted.jpg")


def test_first_token_share_reads_the_first_real_token_under_left_padding():
    model = planted()
    x = ids(6)
    plain = model_statistics(model, {"input_ids": x})
    padded_ids = torch.cat([torch.full((1, 3), 7), x], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    padded = model_statistics(model, {"input_ids": padded_ids, "attention_mask": mask})
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        p = torch.stack([a[0].double() for a in eager(padded_ids, attention_mask=mask,
                                                      output_attentions=True).attentions])  # (L, h, s, s)
    want = p[:, :, 4:, 3].sum(-1) / 5  # real rows' weight on the first real token (after the one reading only it)
    torch.testing.assert_close(padded.grid()["first-token share"].double(), want, rtol=1e-4, atol=1e-5)
    assert padded.kinds()["sink"][0] == plain.kinds()["sink"][0] == (0, 1)  # the planted sink, found again


def test_model_statistics_refuses_wrong_tokens_rows_and_empty_inputs():
    model = planted()
    with pytest.raises(ValueError, match="got 2 tokens for a sequence of 5 positions"):
        model_statistics(model, {"input_ids": ids(5)}, tokens=["a", "b"])
    with pytest.raises(ValueError, match=r"row must be an int in \[-1, 1\)"):
        model_statistics(model, {"input_ids": ids(5)}, row=1)
    with pytest.raises(ValueError, match="0 tokens"):
        model_statistics(model, {"input_ids": torch.zeros(1, 0, dtype=torch.long)})
    with pytest.raises(ValueError, match="0 tokens"):
        headwise.viz.head_maps(headwise.MultiHeadAttention(16, 4), torch.randn(0, 16))


def test_a_failed_model_statistics_call_leaves_the_model_unpatched():
    model = planted()
    before = [type(m) for m in model.modules()]
    with pytest.raises(IndexError):
        model_statistics(model, {"input_ids": torch.full((1, 4), 10_000)})  # past the vocabulary
    assert [type(m) for m in model.modules()] == before
    assert not any(isinstance(m, headwise.MultiHeadAttention) for m in model.modules())


def test_statistics_png_draws_a_name_with_dollar_signs_as_text(tmp_path):
    from headwise.viz import save_statistics_png

    st = model_statistics(planted(), {"input_ids": ids(8)}, name=r"ckpt $\frac{1}$ v2")
    path = save_statistics_png(st, tmp_path / "s.png")
    assert path.stat().st_size > 0


def test_every_head_kept_by_surgery_is_shown_under_its_number_before_it(tmp_path):
    """Layers of different head counts: every head each layer kept, in the column of its original number (NaN
    where the layer has no such head); an emptied layer holds none. Layer 0 reads the unpruned model's layer 0
    input, so its heads equal the unpruned, unpatched eager model's heads of the same numbers, in float64."""
    pytest.importorskip("matplotlib")
    from headwise.surgery import prune_heads
    from headwise.viz import save_statistics_png

    model = planted()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    x = ids(12)
    with torch.no_grad():
        p = eager(x, output_attentions=True).attentions[0][0].double()  # layer 0: (4, s, s)
    prune_heads(headwise.interop.patch(model), {0: [0, 2], 1: [0, 1, 2, 3]})
    st = model_statistics(model, {"input_ids": x})
    assert st.heads == ((1, 3), ()) and st.pairs() == [(0, 1), (0, 3)] and st.n_heads == 4
    torch.testing.assert_close(st.entropy[0, [1, 3]].double(), -(p[[1, 3]] * p[[1, 3]].clamp_min(1e-300).log()).sum(-1),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.max_weight[0, [1, 3]].double(), p[[1, 3]].amax(-1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(st.key_weight[0, [1, 3]].double(), p[[1, 3]].sum(-2), rtol=1e-4, atol=1e-4)
    assert bool(st.entropy[0, [0, 2]].isnan().all()) and bool(st.key_weight[1].isnan().all())
    assert st.kinds()["sink"] == [(0, 1)]  # the planted sink, original head 1, now the layer's head 0
    assert set(st.chosen()) <= {(0, 1), (0, 3)}
    d = st.to_dict()
    assert d["original_heads"] == [[1, 3], []] and [len(x) for x in d["entropy"]] == [2, 0]
    assert "L0 H3" in render_statistics_html(st, heads=[(0, 3)])
    assert save_statistics_png(st, tmp_path / "s.png").stat().st_size > 0
    with pytest.raises(ValueError, match="layer 1 has no head 0: its heads are none"):
        render_statistics_html(st, heads=[(1, 0)])


def _real_rows_reference(model, kw, row):
    """float64 statistics of the unpatched eager model's own weights, over the real query rows of ``row`` only."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        p = torch.stack([a[row].double() for a in eager(**kw, output_attentions=True).attentions])  # (L, h, s, s)
    real = kw["attention_mask"][row].bool()
    p = p[:, :, real]  # (L, h, real rows, s)
    return p.sum(-2), -(p * p.clamp_min(1e-300).log()).sum(-1), p.amax(-1), real


@pytest.mark.parametrize("family, implementation", [("llama", "eager"), ("llama", "sdpa"), ("bert", "eager"),
                                                    ("bert", "sdpa")])
def test_padding_query_rows_add_nothing_to_key_weight(family, implementation):
    """Left padding (a decoder) and right padding (an encoder): key_weight sums the real query rows' weights only,
    so the first-token share is a share of the real rows' attention (at most 1) and equals the unpadded text's."""
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaModel(transformers.LlamaConfig(
            hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64,
            vocab_size=50, attn_implementation=implementation)).eval()
        mask = torch.tensor([[1] * 7, [0, 0, 0, 0, 0, 1, 1]])  # row 1: 5 pads on the left, then 2 tokens
    else:
        model = transformers.BertModel(transformers.BertConfig(
            hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, vocab_size=50,
            attn_implementation=implementation)).eval()
        mask = torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0]])  # row 1: 3 tokens, then 4 pads on the right
    kw = {"input_ids": torch.randint(1, 50, (2, 7)), "attention_mask": mask}
    key_weight, entropy, max_weight, real = _real_rows_reference(model, kw, 1)
    st = model_statistics(model, kw, row=1)
    torch.testing.assert_close(st.key_weight.double(), key_weight, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.entropy[..., real].double(), entropy, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.max_weight[..., real].double(), max_weight, rtol=1e-4, atol=1e-6)
    alone_ids = kw["input_ids"][1:, real]
    alone = model_statistics(model, {"input_ids": alone_ids, "attention_mask": torch.ones_like(alone_ids)})
    share = st.grid()["first-token share"]
    torch.testing.assert_close(share, alone.grid()["first-token share"], rtol=1e-4, atol=1e-5)
    assert bool((share <= 1 + 1e-5).all())
    found = headwise.interop.layers(model)  # patched by the first call, and kept so
    assert found and not any("attend" in layer.__dict__ for _, layer in found)  # the calls' wrapping is gone
    from headwise.viz.statistics import padding_reads_nothing

    with torch.no_grad():
        plain = model(**kw).last_hidden_state
        with padding_reads_nothing([layer for _, layer in found], mask):
            kept_out = model(**kw).last_hidden_state
    torch.testing.assert_close(kept_out[mask.bool()], plain[mask.bool()], rtol=0, atol=0)  # no real row changes


def test_a_refused_model_statistics_call_leaves_the_model_unpatched():
    model = planted()
    x = ids(5)
    with torch.no_grad():
        before = model(x).logits
    modules, implementation = [type(m) for m in model.modules()], model.config._attn_implementation
    with pytest.raises(ValueError, match="got 1 token for a sequence of 5 positions"):
        model_statistics(model, {"input_ids": x}, tokens=["only-one"])
    assert [type(m) for m in model.modules()] == modules and model.config._attn_implementation == implementation
    assert not headwise.interop.layers(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, before, rtol=0, atol=0)


def uniform_decoder() -> torch.nn.Module:
    """GPT-2 whose query and key projections are zero: every score 0, each row uniform over the keys it may read."""
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_head=4, n_layer=2, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, :64] = 0.0
            block.attn.c_attn.bias[:64] = 0.0
    return model


@pytest.mark.parametrize("s", [2, 3, 4, 8])
def test_a_decoder_reading_uniformly_is_neither_sink_nor_sharp_at_any_length(s):
    model = uniform_decoder()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    x = ids(s)
    with torch.no_grad():
        p = torch.stack([a[0].double() for a in eager(x, output_attentions=True).attentions])  # (L, h, s, s)
    st = model_statistics(model, {"input_ids": x})
    # the first query may read only token 0: left out, as the pattern table leaves it out
    torch.testing.assert_close(st.grid()["first-token share"].double(), p[:, :, 1:, 0].mean(-1), rtol=1e-4, atol=1e-5)
    harmonic = sum(1 / (i + 1) for i in range(s))
    u = st.uniform()
    torch.testing.assert_close(u["first-token share"].double(), torch.full((2,), (harmonic - 1) / (s - 1),
                                                                             dtype=torch.float64))
    torch.testing.assert_close(u["mean max weight"].double(), torch.full((2,), harmonic / s, dtype=torch.float64))
    assert st.kinds() == {"sink": [], "sharp": []}


def test_a_planted_sink_is_found_at_three_tokens():
    st = model_statistics(planted(), {"input_ids": ids(3)})
    assert (0, 1) in st.kinds()["sink"] and float(st.grid()["first-token share"][0, 1]) > 0.99


def test_a_one_token_decoder_text_has_no_first_token_share():
    st = model_statistics(planted(), {"input_ids": ids(1)})
    assert bool(st.grid()["first-token share"].isnan().all()) and st.kinds()["sink"] == []


def test_the_png_footer_naming_the_heads_is_wrapped_inside_the_figure(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from headwise.viz import HeadStatistics, save_statistics_png

    L, h, s = 4, 12, 4
    key_weight = torch.ones(L, h, s)  # layers 2, 3: each row reads its own token only (sharp)
    key_weight[:2] = 0.0
    key_weight[:2, :, 0] = s  # layers 0, 1: every row reads the first token only (sinks)
    st = HeadStatistics([f"t{i}" for i in range(s)], torch.zeros(L, h, s), torch.ones(L, h, s), key_weight,
                        torch.ones(s, dtype=torch.bool), "m")
    assert len(st.kinds()["sink"]) == len(st.kinds()["sharp"]) == 2 * h  # 48 heads to name
    spans = []
    savefig = Figure.savefig

    def measured(fig, *a, **k):
        renderer = fig.canvas.get_renderer()
        spans.extend((t.get_window_extent(renderer), fig.bbox) for t in fig.texts)
        return savefig(fig, *a, **k)

    monkeypatch.setattr(Figure, "savefig", measured)
    save_statistics_png(st, tmp_path / "many.png")
    assert spans
    for box, figure in spans:
        assert figure.x0 <= box.x0 and box.x1 <= figure.x1 and figure.y0 <= box.y0 and box.y1 <= figure.y1


def test_head_statistics_repr_is_one_line_without_the_arrays():
    st = model_statistics(planted(), {"input_ids": ids(5)}, name="planted")
    assert repr(st) == "HeadStatistics(model='planted', 2 layers x 4 heads, 5 tokens (5 reading), arrays (L, h, s) (2, 4, 5))"


class HeadwiseStack(torch.nn.Module):
    """Two headwise layers, each reading the real keys only (``attention_mask`` given as a mask over keys)."""

    def __init__(self, causal: bool, additive: bool):
        super().__init__()
        torch.manual_seed(0)
        self.attn = torch.nn.ModuleList([headwise.MultiHeadAttention(16, 4), headwise.MultiHeadAttention(16, 4)])
        self.causal, self.additive = causal, additive

    def forward(self, x, attention_mask):
        keys = attention_mask.bool()[:, None, None, :]  # (b, 1, 1, s)
        if self.additive:
            keys = torch.zeros(keys.shape).masked_fill(~keys, torch.finfo(torch.float32).min)
        for a in self.attn:
            x = x + a(x, mask=keys, causal=self.causal)
        return x


@pytest.mark.parametrize("causal, additive, mask", [(False, False, [1, 1, 1, 0, 0, 0, 0, 0]),
                                                    (True, True, [0, 0, 0, 0, 0, 1, 1, 1])])
def test_padding_query_rows_of_headwise_layers_add_nothing_to_key_weight(causal, additive, mask):
    """Layers whose forward plans each call on its own mask: the statistics are float64 statistics of the real
    query rows only, from each layer's input in a plain run (no real row reads a padding key, so the real rows'
    inputs are the same there), and the first-token share equals the unpadded text's."""
    model = HeadwiseStack(causal, additive).eval()
    x, am = torch.randn(1, 8, 16), torch.tensor([mask])
    inputs = []
    handles = [a.register_forward_pre_hook(lambda m, args: inputs.append(args[0][0].double())) for a in model.attn]
    with torch.no_grad():
        model(x, am)
    for handle in handles:
        handle.remove()
    real = am[0].bool()
    allowed = real[None, :].expand(8, 8)
    if causal:
        allowed = allowed & torch.ones(8, 8, dtype=torch.bool).tril()
    p = []
    for a, xi in zip(model.attn, inputs):
        q = (xi @ a.q_proj.weight.double().T + a.q_proj.bias.double()).view(8, 4, 4).transpose(0, 1)  # (h, s, d_h)
        k = (xi @ a.k_proj.weight.double().T + a.k_proj.bias.double()).view(8, 4, 4).transpose(0, 1)
        scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~allowed, float("-inf"))  # d_h 4: scale 1/2
        p.append(scores[:, real].softmax(-1))  # (h, real rows, s)
    p = torch.stack(p)  # (L, h, real rows, s)
    import headwise.attention as attention_module

    backends, real_attend = [], attention_module.attend_with_statistics

    def seen(plan, *args, **kwargs):
        backends.append(plan.backend)
        return real_attend(plan, *args, **kwargs)

    attention_module.attend_with_statistics = seen
    try:
        st = model_statistics(model, {"x": x, "attention_mask": am})
    finally:
        attention_module.attend_with_statistics = real_attend
    # the padded calls keep the statistics path: no (b, h, s, s) pattern is materialised for them
    assert backends == ["statistics"] * len(model.attn), backends
    torch.testing.assert_close(st.key_weight.double(), p.sum(-2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.entropy[..., real].double(), -(p * p.clamp_min(1e-300).log()).sum(-1),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.max_weight[..., real].double(), p.amax(-1), rtol=1e-4, atol=1e-6)
    alone = model_statistics(model, {"x": x[:, real], "attention_mask": am[:, real]})
    torch.testing.assert_close(st.grid()["first-token share"], alone.grid()["first-token share"], rtol=1e-4,
                               atol=1e-5)


def _png_texts(monkeypatch, tmp_path, st):
    """The texts of every axes of the statistics PNG, and the figure's own (the title among them)."""
    from matplotlib.figure import Figure

    from headwise.viz import save_statistics_png

    seen = {}
    savefig = Figure.savefig

    def kept(fig, *a, **k):
        seen["texts"] = [t.get_text() for ax in fig.axes for t in ax.texts]
        seen["figure"] = [t.get_text() for t in fig.texts]
        return savefig(fig, *a, **k)

    monkeypatch.setattr(Figure, "savefig", kept)
    save_statistics_png(st, tmp_path / "s.png")
    return seen["texts"], seen["figure"]


def test_an_undefined_share_is_labelled_undefined_and_a_removed_head_missing(tmp_path, monkeypatch):
    """One decoder token after head surgery: each held head's first-token share is NaN (no row may read another
    key), which the page and the PNG say; the heads surgery removed are 'not in this layer'."""
    pytest.importorskip("matplotlib")
    from headwise.surgery import prune_heads

    model = planted()
    prune_heads(headwise.interop.patch(model), {0: [0, 2], 1: [0, 1, 2, 3]})
    st = model_statistics(model, {"input_ids": ids(1)})
    share = st.grid()["first-token share"]
    undefined = [(layer, head) for layer, head in st.pairs() if bool(share[layer, head].isnan())]
    assert undefined == [(0, 1), (0, 3)]
    page = render_statistics_html(st)
    for layer in range(st.n_layers):
        for head in range(st.n_heads):
            missing = f"layer {layer} head {head}: not in this layer"
            na = f"layer {layer} head {head}: first-token share n/a: no query may read a key other than the first"
            assert (missing in page) == ((layer, head) not in st.pairs())
            assert (na in page) == ((layer, head) in undefined)
    texts, _ = _png_texts(monkeypatch, tmp_path, st)
    assert texts.count("n/a") == len(undefined)


@pytest.mark.parametrize("name, prefix", [("", ""), ("gpt", "gpt: ")])
def test_the_default_statistics_title_names_the_model_only_when_it_has_a_name(tmp_path, monkeypatch, name, prefix):
    pytest.importorskip("matplotlib")
    st = model_statistics(planted(), {"input_ids": ids(5)}, name=name)
    page = render_statistics_html(st)
    assert page.split("<title>")[1].split("</title>")[0] == f"{prefix}every head, 5 tokens"
    assert f"{prefix}every head, 5 tokens" in _png_texts(monkeypatch, tmp_path, st)[1]


@pytest.mark.parametrize("pair", [(0, 1.0), (0.0, 1), 0, (0,), (0, 1, 2), (True, 1), [0, 1]])
def test_statistics_pictures_refuse_heads_that_are_not_pairs_of_ints(tmp_path, pair):
    pytest.importorskip("matplotlib")
    from headwise.viz import save_statistics_png

    st = model_statistics(planted(), {"input_ids": ids(5)})
    message = rf"heads must be \(layer, head\) pairs of ints, got {re.escape(repr(pair))}"
    with pytest.raises(TypeError, match=message):
        render_statistics_html(st, heads=[(0, 1), pair])
    with pytest.raises(TypeError, match=message):
        save_statistics_png(st, tmp_path / "s.png", heads=[pair])
    assert not (tmp_path / "s.png").exists()


def test_statistics_pictures_take_numpy_integer_pairs_as_ints():
    np = pytest.importorskip("numpy")
    st = model_statistics(planted(), {"input_ids": ids(5)})
    # the pair a user gets from np.argwhere over a grid draws the same page as plain ints
    assert render_statistics_html(st, heads=[(np.int64(0), np.int64(1))]) == render_statistics_html(st, heads=[(0, 1)])


def test_a_layer_shared_by_several_blocks_is_refused_naming_its_runs_and_the_way_to_read_them():
    cfg = transformers.AlbertConfig(vocab_size=40, embedding_size=16, hidden_size=24, num_attention_heads=4,
                                    num_hidden_layers=3, intermediate_size=32, max_position_embeddings=64,
                                    attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.AlbertModel(cfg).eval()  # one attention layer, run by all 3 blocks
    x = torch.randint(3, 40, (1, 7))
    modules = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"layer 0 \('encoder\.albert_layer_groups\.0\.albert_layers\.0\.attention'\) "
                                         r"ran 3 times in one forward .*ALBERT.*t\[0\]\.calls\[j\]\['entropy'\]$"):
        model_statistics(model, {"input_ids": x})
    assert [type(m) for m in model.modules()] == modules  # refused inside the call: the model left unpatched
    # the way the message gives: each run's own statistics, one (b, h, s) row set per block
    headwise.interop.patch(model)
    with torch.no_grad(), headwise.trace(model, capture=headwise.statistics.STATISTICS) as t:
        model(input_ids=x)
    assert [tuple(c["entropy"].shape) for c in t[0].calls] == [(1, 4, 7)] * 3
