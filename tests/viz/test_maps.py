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
