"""Per-head reads and writes of the real all-MiniLM-L6-v2 against a float64 reference written from the
formula (with the Hugging Face module's own weights) and against the Hugging Face layer's output."""

from __future__ import annotations

import pytest
import torch

from headwise import MultiHeadAttention
from headwise.interop import layers, unpatch
from headwise.viz.maps import HeadMaps, head_maps, model_layers, text_head_maps

LAYER = 2
RTOL, ATOL = 1.3e-6, 1e-5  # float32 defaults


def _inputs(minilm, text: str):
    """The hidden states entering LAYER and that layer's attention output (W_O(context) + b_O), computed by
    the original Hugging Face modules: the model is unpatched for the run and patched back after."""
    tokenizer, model = minilm
    was_patched = bool(layers(model))
    unpatch(model)
    enc = tokenizer(text, return_tensors="pt")
    captured = {}
    dense = model.encoder.layer[LAYER].attention.output.dense
    hook = dense.register_forward_hook(lambda mod, inp, out: captured.setdefault("out", out.detach()))
    try:
        with torch.no_grad():
            hidden = model(**enc, output_hidden_states=True).hidden_states
            x = hidden[LAYER][0]  # (s, d)
            reference = _reference(model, x)
            query_ptr = model.encoder.layer[LAYER].attention.self.query.weight.data_ptr()
    finally:
        hook.remove()
        if was_patched:
            model_layers(model)
    return model, x, captured["out"][0], reference, query_ptr


def _reference(model, x: torch.Tensor):
    """float64 softmax(q k^T / sqrt(d_h)) and ||v_j W_O^h|| from the (unpatched) Hugging Face modules'
    weights, head by head."""
    sa, dense = model.encoder.layer[LAYER].attention.self, model.encoder.layer[LAYER].attention.output.dense
    h = model.config.num_attention_heads
    d_h = x.shape[-1] // h
    x = x.double()
    q, k, v = (torch.nn.functional.linear(x, lin.weight.double(), lin.bias.double())
               for lin in (sa.query, sa.key, sa.value))
    w_o = dense.weight.double()  # (d, h * d_h)
    weights, norms, vectors = [], [], []
    for i in range(h):
        cols = slice(i * d_h, (i + 1) * d_h)
        a = torch.softmax(q[:, cols] @ k[:, cols].T / d_h ** 0.5, dim=-1)  # (s, s)
        u = v[:, cols] @ w_o[:, cols].T  # (s, d): v_j W_O^h
        weights.append(a)
        norms.append(u.norm(dim=-1))
        vectors.append(a @ u)  # (s, d): sum_j a_ij v_j W_O^h
    return torch.stack(weights), torch.stack(norms), torch.stack(vectors)


def test_weights_and_writes_match_float64_reference(minilm, maps: HeadMaps) -> None:
    _, _, _, (w_ref, n_ref, _), _ = _inputs(minilm, "The cat sat on the mat because it was tired.")
    torch.testing.assert_close(maps.weights.double(), w_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(maps.value_norms.double(), n_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(maps.writes.double(), w_ref * n_ref[:, None, :], rtol=RTOL, atol=ATOL)


def test_heads_sum_to_the_hugging_face_layer_output(minilm, maps: HeadMaps) -> None:
    # What the heads write, as vectors, summed over heads and sources, plus b_O, is the real layer's
    # attention output (before dropout and LayerNorm), computed by transformers' own (SDPA) path.
    model, x, hf_out, _, query_ptr = _inputs(minilm, "The cat sat on the mat because it was tired.")
    name, attn = model_layers(model)[LAYER]
    assert name == f"encoder.layer.{LAYER}.attention.self"
    assert attn.q_proj.weight.data_ptr() == query_ptr  # the model's own weights, no copy
    with torch.no_grad():
        total = attn.out_proj.bias.clone()
        for head in attn.heads():
            _, _, v = head.project(x)  # (s, d_h)
            total = total + maps.weights[head.index] @ (v @ head.w_o)  # (s, d)
    torch.testing.assert_close(total, hf_out)


def test_runs_through_headwise(minilm, maps: HeadMaps) -> None:
    # text_head_maps patched the model: its attention now runs in headwise, with unchanged hidden states
    tokenizer, model = minilm
    assert len(layers(model)) == 6
    _, x_hf, _, _, _ = _inputs(minilm, "The cat sat on the mat because it was tired.")
    with torch.no_grad():
        x_hw = model(**tokenizer("The cat sat on the mat because it was tired.", return_tensors="pt"),
                     output_hidden_states=True).hidden_states[LAYER][0]
    torch.testing.assert_close(x_hw, x_hf)


def test_heads_differ(maps: HeadMaps) -> None:
    h = maps.n_heads
    assert h == 12 and maps.weights.shape == (12, 13, 13)
    for a in range(h):
        for b in range(a + 1, h):
            assert (maps.weights[a] - maps.weights[b]).abs().max() > 1e-2, (a, b)
            assert (maps.writes[a] - maps.writes[b]).abs().max() > 1e-2, (a, b)


def test_large_weight_on_small_value_writes_little(maps: HeadMaps) -> None:
    # Seed 004 on the real model: [CLS] (index 0) draws most of the attention in this layer, but its
    # value vectors are tiny, so what heads write from it is a small share.
    summary = maps.summary()
    reads_cls = [s for s in summary if s["reads_most_index"] == 0]
    assert len(reads_cls) >= 6
    small = [s for s in reads_cls if s["weight_on_reads_most_share_of_writes"] < 0.5 * s["reads_most_weight"]]
    assert len(small) >= 6
    assert all(s["writes_most_index"] != 0 for s in small)


def test_generic_layer_gqa_rows_sum_to_one() -> None:
    attn = MultiHeadAttention(32, 8, 2)
    m = head_maps(attn, torch.randn(1, 6, 32), tokens=list("abcdef"), layer=3)
    torch.testing.assert_close(m.weights.sum(-1), torch.ones(8, 6))
    assert m.layer == 3 and m.tokens == list("abcdef")
    # heads of one K/V group share values, so their value norms differ only through W_O^h
    assert not torch.equal(m.value_norms[0], m.value_norms[1])


def test_bad_inputs(minilm) -> None:
    tokenizer, model = minilm
    with pytest.raises(ValueError, match=r"layer must be an int in \[-6, 6\)"):
        text_head_maps("hello", layer=6, tokenizer=tokenizer, model=model)
    with pytest.raises(ValueError, match="non-empty"):
        text_head_maps("   ", tokenizer=tokenizer, model=model)
    attn = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match="one sequence"):
        head_maps(attn, torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="d_model=16"):
        head_maps(attn, torch.randn(3, 8))
    with pytest.raises(ValueError, match="3 tokens"):
        head_maps(attn, torch.randn(4, 16), tokens=["a", "b", "c"])
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        head_maps(torch.nn.Linear(2, 2), torch.randn(3, 2))


def test_text_head_maps_refuses_text_that_is_not_unicode_before_tokenizing(minilm) -> None:
    tokenizer, _ = minilm
    mine = _small_bert()

    class Untouched:  # the tokenizer must not be called
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, *a, **k):
            raise AssertionError("tokenized a text that is not Unicode")

    with pytest.raises(ValueError, match=r"text must be valid Unicode \(encodable as UTF-8\), got '\\udce9' at "
                                         r"character 3"):
        text_head_maps("caf\udce9 au lait", tokenizer=Untouched(), model=mine)
    assert not layers(mine)  # refused before patching


def _small_bert(positions: int = 64):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=64,
                                vocab_size=30522, max_position_embeddings=positions,
                                attn_implementation="eager")).eval()


def test_text_head_maps_draws_the_model_given_or_refuses_half_a_pair(minilm, monkeypatch) -> None:
    import headwise.viz.maps as vmaps

    tokenizer, _ = minilm
    mine = _small_bert()
    monkeypatch.setattr(vmaps, "load_minilm", lambda: pytest.fail("the bundled model replaced the one given"))
    with pytest.raises(ValueError, match="got a model but no tokenizer"):
        text_head_maps("the cat sat", model=mine)
    with pytest.raises(ValueError, match="got a tokenizer but no model"):
        text_head_maps("the cat sat", tokenizer=tokenizer)
    assert not layers(mine)  # refused before patching
    m = text_head_maps("the cat sat", tokenizer=tokenizer, model=mine, layer=1)
    unpatch(mine)
    enc = tokenizer("the cat sat", return_tensors="pt")
    with torch.no_grad():
        reference = mine(**enc, output_attentions=True).attentions[1][0]  # (2, s, s) from the unpatched model
    assert m.n_heads == 2
    torch.testing.assert_close(m.weights, reference)


@pytest.mark.parametrize("max_tokens, error, match", [
    (0, ValueError, r"at least 3 \(this tokenizer adds 2 special tokens"),
    (2, ValueError, "at least 3"),
    (-5, ValueError, "at least 3"),
    (65, ValueError, r"at most 64 \(the model's position embeddings\), got 65"),
    (2.5, TypeError, "max_tokens must be an int, got float"),
    (True, TypeError, "max_tokens must be an int, got bool"),
])
def test_text_head_maps_checks_max_tokens_as_the_command_does(minilm, max_tokens, error, match) -> None:
    tokenizer, _ = minilm
    mine = _small_bert()
    with pytest.raises(error, match=match):
        text_head_maps("the cat sat " * 40, tokenizer=tokenizer, model=mine, max_tokens=max_tokens)
    assert not layers(mine)


def test_text_head_maps_cuts_at_max_tokens_with_one_text_token(minilm) -> None:
    tokenizer, _ = minilm
    m = text_head_maps("the cat sat " * 40, tokenizer=tokenizer, model=_small_bert(), max_tokens=3)
    assert m.tokens == ["[CLS]", "the", "[SEP]"]
    m = text_head_maps("the cat sat " * 40, tokenizer=tokenizer, model=_small_bert(), max_tokens=64)
    assert len(m.tokens) == 64


def test_text_head_maps_default_cut_fits_a_model_with_fewer_positions_than_64(minilm) -> None:
    tokenizer, _ = minilm
    text = "the cat sat " * 40
    mine = _small_bert(positions=16)
    m = text_head_maps(text, tokenizer=tokenizer, model=mine)  # no max_tokens: the model's 16, not 64
    unpatch(mine)
    enc = tokenizer(text, return_tensors="pt", truncation=True, max_length=16)
    with torch.no_grad():
        reference = mine(**enc, output_attentions=True).attentions[0][0]
    assert len(m.tokens) == 16
    torch.testing.assert_close(m.weights, reference)
    with pytest.raises(ValueError, match=r"at most 16 \(the model's position embeddings\), got 64"):
        text_head_maps(text, tokenizer=tokenizer, model=_small_bert(positions=16), max_tokens=64)  # given: checked


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_writes_under_a_lora_adapter_are_the_merged_models(family) -> None:
    import copy

    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

    from headwise.viz.maps import model_layers_head_maps

    torch.manual_seed(0)
    if family == "llama":
        base = LlamaModel(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=1, intermediate_size=64, vocab_size=50,
                                      attn_implementation="eager"))
        targets = ["o_proj", "v_proj"]
    else:
        base = GPT2Model(GPT2Config(n_embd=32, n_head=4, n_layer=1, vocab_size=50, n_positions=16,
                                    attn_implementation="eager"))
        targets = ["attn.c_proj", "attn.c_attn"]
    pm = peft.get_peft_model(base.eval(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                          init_lora_weights=False, lora_dropout=0.5))
    merged = copy.deepcopy(pm).merge_and_unload().eval()  # the reference: the same model, the adapter merged
    ids = torch.randint(0, 50, (1, 6))
    # the V entering W_O (per head) and W_O itself, from the merged model's own modules, by plain hooks
    if family == "llama":
        at = merged.layers[0].self_attn
        v_mod, w_o, h_kv = at.v_proj, at.o_proj.weight, 2
    else:
        at = merged.h[0].attn
        v_mod, w_o, h_kv = at.c_attn, at.c_proj.weight.T, 4
    got = {}
    hook = v_mod.register_forward_hook(lambda mod, inp, out: got.setdefault("v", out.detach()))
    with torch.no_grad():
        attn_ref = merged(ids, output_attentions=True).attentions[0][0]
    hook.remove()
    v = got["v"][0].double()[:, -32:] if family == "gpt2" else got["v"][0].double()  # (s, h_kv * 8)
    v = v.view(6, h_kv, 8).transpose(0, 1)
    norms = torch.stack([(v[i * h_kv // 4] @ w_o.double()[:, i * 8:(i + 1) * 8].T).norm(dim=-1) for i in range(4)])
    pm.train()  # the drawing runs in eval mode (no adapter dropout) and gives the modes back
    lora_before = {k: t.clone() for k, t in pm.state_dict().items()}
    m = model_layers_head_maps(pm, ids)[0]
    assert m.writes_missing == ""
    torch.testing.assert_close(m.weights, attn_ref)
    torch.testing.assert_close(m.value_norms.double(), norms, rtol=1e-5, atol=1e-5)
    assert pm.training and all(mod.training for mod in pm.modules())
    for k, t in pm.state_dict().items():
        torch.testing.assert_close(t, lora_before[k], rtol=0, atol=0)


def test_head_maps_labels_tokens_with_their_str_as_model_head_maps_does() -> None:
    from headwise.viz.maps import model_head_maps

    attn = MultiHeadAttention(8, 2)
    x = torch.randn(3, 8)
    m = head_maps(attn, x, tokens=[10, 20.5, None])
    assert m.tokens == ["10", "20.5", "None"]
    assert m.tokens == model_head_maps(attn, x[None], layer=0, tokens=[10, 20.5, None]).tokens
    assert [row["reads_most"] for row in m.summary()] == [m.tokens[int(m.weights[h].mean(0).argmax())]
                                                         for h in range(2)]


def test_head_maps_repr_is_one_line_naming_layer_heads_tokens_and_shapes() -> None:
    torch.manual_seed(0)
    m = head_maps(MultiHeadAttention(16, 4), torch.randn(7, 16), layer=3)
    assert repr(m) == "HeadMaps(layer=3, heads=[0-3], 7 tokens, weights (4, 7, 7), writes (4, 7, 7))"
    assert repr(m.subset([2, 0])) == "HeadMaps(layer=3, heads=[2, 0], 7 tokens, weights (2, 7, 7), writes (2, 7, 7))"
    assert "tensor" not in repr(m) and repr(m) == str(m)


def test_model_layers_head_maps_takes_lists_naming_each_head_once() -> None:
    from headwise.viz import model_layers_head_maps

    torch.manual_seed(0)
    attn, x = MultiHeadAttention(8, 2), torch.randn(1, 3, 8)
    with pytest.raises(TypeError, match=r"heads must be a list of ints \(or None\), got int 1"):
        model_layers_head_maps(attn, x, heads=1)
    with pytest.raises(TypeError, match=r"layers must be a list of ints \(or None\), got int 0"):
        model_layers_head_maps(attn, x, layers=0)
    with pytest.raises(ValueError, match=r"heads must name each head once, got \[1, 0, 1\]"):
        model_layers_head_maps(attn, x, heads=[1, 0, 1])
    (m,) = model_layers_head_maps(attn, x, heads=(1, 0))
    with torch.no_grad():
        _, weights = attn(x, return_weights=True)  # (1, h, s, s): the layer's own weights
    torch.testing.assert_close(m.weights, weights[0, [1, 0]])
    # any iterable of ints names heads and layers: a set, a generator, dict keys
    (m,) = model_layers_head_maps(attn, x, heads={1}, layers=(i for i in [0]))
    torch.testing.assert_close(m.weights, weights[0, [1]])
    (m,) = model_layers_head_maps(attn, x, heads={0: "a", 1: "b"}.keys())
    torch.testing.assert_close(m.weights, weights[0])


def test_model_layers_head_maps_refuses_attention_whose_queries_and_keys_differ() -> None:
    from headwise.viz import model_layers_head_maps

    class Cross(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = MultiHeadAttention(8, 2)
            self.memory = torch.nn.Parameter(torch.randn(1, 5, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, context=self.memory)

    torch.manual_seed(0)
    model, x = Cross(), torch.randn(1, 3, 8)
    with torch.no_grad():
        _, weights = model.attn(x, context=model.memory, return_weights=True)
    assert weights.shape[-2:] == (3, 5)  # the layer itself does run cross-attention
    with pytest.raises(ValueError, match=r"self-attention over one sequence.*\(s_q, s_kv\) = \(3, 5\)"):
        model_layers_head_maps(model, x)
